"""Batch-1 decode against the weight-streaming floor, measured in one run.

At batch 1 a decode step must read every weight once, so its floor is
(weight bytes read per step) / (memory bandwidth). This script measures the bandwidth with a
copy benchmark, counts the weight bytes from the checkpoint, runs one request through
`LLM.generate` (the engine as deployed: engine-core process, async scheduling) and compares the
model step time of its decode steps (the worker's forward through sampling) with the floor.

    python benchmarks/batch1_roofline.py [--model PATH] [--dtype auto] [--output-len 128]
        [--device auto|cpu|cuda] [--output-json PATH]

On a GPU the bandwidth is the device's (HBM) copy bandwidth. Prints a markdown table and
writes benchmarks/results/batch1_roofline.json (or --output-json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def copy_bandwidth(mib: int = 512, repeats: int = 10, device: str = "cpu") -> float:
    """Best of `repeats` copies of a `mib` MiB buffer, in GB/s counting read and write bytes."""
    src = torch.ones(mib * 2**20 // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    sync = torch.cuda.synchronize if src.is_cuda else (lambda: None)
    for _ in range(3):
        dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        dst.copy_(src)
        sync()
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * src.element_size() / best / 1e9


def weight_bytes(model_path: str, dtype: str) -> int:
    """Bytes one decode step reads: every tensor once; the input embedding only when the head
    is tied to it (an untied table is read one row per token)."""
    from safetensors import safe_open

    from vserve.models.loader import _safetensors_files

    shapes = {}
    for file in _safetensors_files(Path(model_path)):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                shapes[name] = f.get_slice(name).get_shape()
    untied = any(n.endswith("lm_head.weight") for n in shapes)
    numel = sum(
        _numel(s) for n, s in shapes.items() if not (untied and n.endswith("embed_tokens.weight"))
    )
    return numel * DTYPE_BYTES[dtype]


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def decode_step_times(args) -> tuple[list[float], object]:
    from vserve import LLM, SamplingParams

    llm = LLM(
        args.model,
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.input_len + args.output_len + 16,
    )
    prompt = {"prompt_token_ids": list(range(1000, 1000 + args.input_len))}
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate([prompt], params, use_tqdm=False)  # warm up every shape once
    llm.engine.take_step_records()
    for _ in range(args.num_iters):
        llm.generate([prompt], params, use_tqdm=False)
    records = llm.engine.take_step_records()
    config = llm.config.model
    llm.shutdown()
    steps = [
        r.forward_end - r.forward_start for r in records if r.num_tokens == 1 and r.forward_end > 0
    ]
    return steps, config


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None, help="default: the embedded Gemma-3-270M")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-iters", type=int, default=3)
    p.add_argument("--device", default="auto")
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    bandwidth = copy_bandwidth(device=args.device)  # before the engine owns the cores
    steps, config = decode_step_times(args)
    wbytes = weight_bytes(config.model, config.dtype)
    floor_ms = wbytes / (bandwidth * 1e9) * 1e3
    median_ms = statistics.median(steps) * 1e3
    mean_ms = statistics.fmean(steps) * 1e3
    rows = [
        ("copy bandwidth (GB/s, read + write)", f"{bandwidth:.1f}"),
        (f"weight bytes read per step ({config.dtype})", f"{wbytes / 1e6:.1f} MB"),
        ("weight-streaming time (ms)", f"{floor_ms:.1f}"),
        (f"decode model step, median of {len(steps)} (ms)", f"{median_ms:.1f}"),
        ("decode model step, mean (ms)", f"{mean_ms:.1f}"),
        ("step / streaming time (goal <= 1.3)", f"{median_ms / floor_ms:.2f}"),
    ]
    table = "\n".join(["| quantity | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows])
    print(f"\nbatch 1, {args.input_len} in / {args.output_len} out, greedy\n\n{table}")
    out = Path(args.output_json or Path(__file__).parent / "results" / "batch1_roofline.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "args": vars(args),
                "dtype": config.dtype,
                "copy_bandwidth_gbs": bandwidth,
                "weight_bytes": wbytes,
                "streaming_ms": floor_ms,
                "step_median_ms": median_ms,
                "step_mean_ms": mean_ms,
                "ratio": median_ms / floor_ms,
                "num_steps": len(steps),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
