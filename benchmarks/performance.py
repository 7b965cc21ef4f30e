"""Produce README's "Performance" table: vserve vs transformers on the embedded model, sync vs
async, side by side in one run (ratios are what to read; absolute numbers drift on a shared
machine).

    python benchmarks/performance.py [--num-prompts 64 --input-len 128 --output-len 128]

Every row is one `vserve bench throughput` run (a fresh process) writing JSON; the script
prints a markdown table and writes benchmarks/results/performance.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROWS = [
    ("vserve, async, fp32", ["--dtype", "float32"]),
    ("vserve, sync, fp32", ["--dtype", "float32", "--no-async-scheduling"]),
    ("vserve, async, bf16", ["--dtype", "bfloat16"]),
    ("vserve, sync, bf16", ["--dtype", "bfloat16", "--no-async-scheduling"]),
    ("vserve, async, bf16, temperature 1.0", ["--dtype", "bfloat16", "--temperature", "1.0"]),
    (
        "vserve, async, bf16, temperature 1.0, top_p 0.9, top_k 50",
        ["--dtype", "bfloat16", "--temperature", "1.0", "--top-p", "0.9", "--top-k", "50"],
    ),
    (
        "transformers generate, fp32, batch 32",
        ["--backend", "hf", "--dtype", "float32", "--hf-max-batch-size", "32"],
    ),
    (
        "transformers generate, bf16, batch 32",
        ["--backend", "hf", "--dtype", "bfloat16", "--hf-max-batch-size", "32"],
    ),
]


def run_row(extra: list[str], common: list[str]) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [
        sys.executable,
        "-m",
        "vserve.entrypoints.cli",
        "bench",
        "throughput",
        *common,
        *extra,
        "--output-json",
        out,
    ]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    return json.loads(Path(out).read_text())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rows", default=None, help="comma-separated row indices to run")
    args = p.parse_args()
    common = [
        "--num-prompts",
        str(args.num_prompts),
        "--input-len",
        str(args.input_len),
        "--output-len",
        str(args.output_len),
        "--temperature",
        "0",
        "--max-model-len",
        str(args.input_len + args.output_len + 16),
    ]
    rows = ROWS if args.rows is None else [ROWS[int(i)] for i in args.rows.split(",")]
    results = [(name, run_row(extra, common)) for name, extra in rows]
    hf = [r["output_throughput"] for n, r in results if n.startswith("transformers")]
    base = max(hf) if hf else None  # transformers' best configuration
    lines = [
        "| configuration | output tok/s | total tok/s | vs transformers' best | "
        "forward (ms) | launch interval (ms) | forward / interval |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in results:
        ov = r.get("overlap") or {}
        ratio = f"{r['output_throughput'] / base:.2f}x" if base else "-"
        lines.append(
            f"| {name} | {r['output_throughput']:.1f} | {r['tokens_per_second']:.1f} "
            f"| {ratio} | {_f(ov.get('mean_forward_ms'))} | "
            f"{_f(ov.get('mean_launch_interval_ms'))} | "
            f"{_f(ov.get('stretched_forward_over_interval'), 3)} |"
        )
    table = "\n".join(lines)
    print(
        f"\n{args.num_prompts} prompts x {args.input_len} in / {args.output_len} out, "
        f"greedy unless the row says otherwise, EOS ignored\n\n{table}"
    )
    out_dir = Path(__file__).parent / "results"
    out_dir.mkdir(exist_ok=True)
    (out_dir / "performance.json").write_text(
        json.dumps({"args": vars(args), "rows": [{"name": n, **r} for n, r in results]}, indent=2)
    )


def _f(value, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


if __name__ == "__main__":
    main()
