"""The GPU check's summary: every result JSON of the run merged into OUT/results.json, and a
markdown table of the figures (plus each step's status) in OUT/summary.md and on stdout.

    python benchmarks/gpu_summary.py RESULTS_DIR STEPS_TSV OUT_DIR CUDA(0|1) ELAPSED_S
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def f(value, digits=1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def table(header: str, rows) -> list[str]:
    """A markdown table: the header row, its rule, then `rows`."""
    return [header, "|" + "---|" * (header.count("|") - 1), *rows]


def bench_rows(results: dict) -> list[str]:
    def row(name: str, r: dict) -> str:
        ov = r.get("overlap") or {}
        compared = r.get("compare_sync") or {}
        cmp, drift = compared.get("async_speedup"), compared.get("sync_drift")
        return (
            f"| {name} | {f(r.get('output_throughput'))} | {f(cmp, 3)} "
            f"{'' if drift is None else f'(sync drift {drift:.3f})'} | "
            f"{f(r.get('avg_latency'), 3)} | {f(ov.get('mean_forward_ms'), 2)} | "
            f"{f(ov.get('mean_device_forward_ms'), 2)} | "
            f"{f(ov.get('mean_launch_interval_ms'), 2)} | {f(ov.get('device_busy_share'), 3)} | "
            f"{f(ov.get('overlap_efficiency'), 3)} | {ov.get('triton_compiles', '-')} |"
        )

    return table(
        "| run | output tok/s | async / sync | avg latency (s) | forward (ms) | "
        "device span (ms) | launch interval (ms) | span / interval | overlap eff. | compiles |",
        (row(n, r) for n, r in results.items() if n.startswith(("tput_", "lat_"))),
    )


def roofline_rows(results: dict) -> list[str]:
    return table(
        "| batch-1 decode | copy GB/s | weight MB | floor (ms) | step median (ms) | step / floor |",
        (
            f"| {name} | {f(r['copy_bandwidth_gbs'])} | "
            f"{f(r['weight_bytes'] / 1e6)} | {f(r['streaming_ms'], 3)} | "
            f"{f(r['step_median_ms'], 3)} | {f(r['ratio'], 2)} |"
            for name, r in results.items()
            if name.startswith("roofline_")
        ),
    )


def equivalence_rows(results: dict) -> list[str]:
    return table(
        "| vs transformers | positions | max abs logprob diff | mean | top-1 agreement | "
        "greedy match lengths |",
        (
            f"| {name} | {r['positions']} | {f(r['max_abs_logprob_diff'], 4)} | "
            f"{f(r['mean_abs_logprob_diff'], 4)} | {f(r['top1_agreement'], 3)} | "
            f"{r['greedy_match_lengths']} of {r['output_len']} |"
            for name, r in results.items()
            if name.startswith("equiv_")
        ),
    )


def kernel_rows(results: dict) -> list[str]:
    return table(
        "| kernel case | equal to reference | max abs diff | kernel (ms) | unsplit (ms) | "
        "torch path (ms) | KV read GB/s | share of copy GB/s |",
        (
            f"| {r['case']} | {r['ok']} | {f(r.get('max_abs_diff'), 4)} | "
            f"{f(r.get('triton_ms', r.get('sampler_ms')), 3)} | {f(r.get('unsplit_ms'), 3)} | "
            f"{f(r.get('torch_backend_ms', r.get('torch_ms')), 3)} | "
            f"{f(r.get('kv_read_gbs'))} | {f(r.get('kv_read_share_of_copy'), 2)} |"
            for r in (results.get("kernels") or {}).get("kernels", [])
        ),
    )


def main() -> None:
    results_dir, steps_tsv, out, cuda, elapsed = sys.argv[1:6]
    results = {p.stem: json.loads(p.read_text()) for p in sorted(Path(results_dir).glob("*.json"))}
    steps = (
        [line.split("\t") for line in Path(steps_tsv).read_text().splitlines()]
        if Path(steps_tsv).is_file()
        else []
    )
    lines = [f"GPU check ({'CUDA' if cuda == '1' else 'CPU dry run'}), {elapsed} s", ""]
    lines += table(
        "| step | status | seconds |", (f"| {n} | {st} | {sec} |" for n, st, sec in steps)
    )
    tables = (equivalence_rows, bench_rows, roofline_rows, kernel_rows)
    for rows in (table(results) for table in tables):
        if len(rows) > 2:
            lines += [""] + rows
    text = "\n".join(lines)
    print(text)
    Path(out, "summary.md").write_text(text + "\n")
    Path(out, "results.json").write_text(
        json.dumps(
            {
                "cuda": cuda == "1",
                "elapsed_s": int(elapsed),
                "steps": [{"name": n, "status": s, "seconds": int(t)} for n, s, t in steps],
                "results": results,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
