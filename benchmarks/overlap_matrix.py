"""Sync vs async scheduling and PP=1 vs PP=2, at batch 1 and 32, on the embedded model and
on a tiny random Llama (where the host's scheduling work is a large share of each step).

    python benchmarks/overlap_matrix.py [--models embedded,tiny] [--batches 1,32]

For each cell: mean model forward time, mean step launch interval, their ratio, and output
tokens/s, all from `vserve bench throughput` (one fresh process per cell, one batch of
`batch` prompts). Goal: with async scheduling, launch interval <= 1.05 x forward time.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

MODES = [
    ("sync, PP=1", ["--no-async-scheduling", "--distributed-executor-backend", "mp"]),
    ("async, PP=1", ["--async-scheduling"]),
    ("sync, PP=2", ["--no-async-scheduling", "--pipeline-parallel-size", "2"]),
    ("async, PP=2", ["--async-scheduling", "--pipeline-parallel-size", "2"]),
]


def tiny_model(folder: Path) -> str:
    if (folder / "config.json").is_file():
        return str(folder)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from vserve.models.resolve import embedded_model_path

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=262144, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=2048, bos_token_id=2, eos_token_id=1,
                      pad_token_id=0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(str(folder))
    # the embedded model's tokenizer, so prompts look like the real ones
    AutoTokenizer.from_pretrained(str(embedded_model_path())).save_pretrained(str(folder))
    return str(folder)


def run_cell(model_args: list[str], mode_args: list[str], batch: int, in_len: int,
             out_len: int) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [sys.executable, "-m", "vserve.entrypoints.cli", "bench", "throughput", *model_args,
           *mode_args, "--num-prompts", str(batch), "--input-len", str(in_len),
           "--output-len", str(out_len), "--temperature", "0",
           "--max-model-len", str(in_len + out_len + 16), "--output-json", out]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads(Path(out).read_text())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="embedded,tiny")
    p.add_argument("--batches", default="1,32")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    args = p.parse_args()
    models = {"embedded": [],   # the default dtype: bf16 on CPUs with bf16 instructions
              "tiny": ["--model", tiny_model(Path(tempfile.gettempdir()) / "vserve-tiny-llama"),
                       "--dtype", "float32"]}
    lines = ["| model | batch | mode | forward (ms) | launch interval (ms) | interval / forward "
             "| output tok/s |", "|---|---|---|---|---|---|---|"]
    rows = []
    for name in args.models.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            for mode, extra in MODES:
                r = run_cell(models[name], extra, batch, args.input_len, args.output_len)
                ov = r["overlap"]
                ratio = ov["mean_launch_interval_ms"] / max(ov["mean_forward_ms"], 1e-9)
                rows.append({"model": name, "batch": batch, "mode": mode, **r})
                lines.append(f"| {name} | {batch} | {mode} | {ov['mean_forward_ms']:.2f} | "
                             f"{ov['mean_launch_interval_ms']:.2f} | {ratio:.3f} | "
                             f"{r['output_throughput']:.1f} |")
                print(lines[-1], flush=True)
    print("\n" + "\n".join(lines))
    out_dir = Path(__file__).parent / "results"
    out_dir.mkdir(exist_ok=True)
    (out_dir / "overlap_matrix.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
