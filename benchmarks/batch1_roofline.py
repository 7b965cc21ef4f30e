"""Batch-1 decode against the weight-streaming floor, measured in one run.

At batch 1 a decode step must read every weight once, so its floor is
(weight bytes read per step) / (memory bandwidth). This script measures the bandwidth with a
copy benchmark, counts the weight bytes from the checkpoint, runs one request through
`LLM.generate` (the engine as deployed: engine-core process, async scheduling) and compares the
model step time of its decode steps (the worker's forward through sampling) with the floor.

    python benchmarks/batch1_roofline.py [--model PATH] [--dtype auto] [--quantization Q]
        [--output-len 128]
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


def read_bandwidth(mib: int = 1024, repeats: int = 6, threads: int | None = None) -> float:
    """GB/s of one pass summing a `mib` MiB fp32 buffer (read only: what a gemv streams), on
    `threads` threads (default: torch's). The buffer lies in 2 MB pages, as the quantized
    weights do (vserve/models/weight_arena.py): the prefetchers stop at page boundaries, so
    4 KB pages read slower and would understate the floor."""
    from vserve.models.weight_arena import huge_page_buffer

    if threads is not None:
        torch.set_num_threads(threads)
    x = huge_page_buffer(mib * 2**20).view(torch.float32)
    x.fill_(1.0)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best / 1e9


def weight_bytes(model_path: str, dtype: str, quantization: str = "none") -> int:
    """Bytes one decode step reads: every tensor once; the input embedding only when the head
    is tied to it (an untied table is read one row per token). GGUF blocks as stored; int8:
    34 bytes per 32 weights of every matrix."""
    from vserve.models.gguf_source import gguf_file

    if gguf_file(model_path) is not None:
        return _gguf_bytes(model_path, dtype, quantization)
    from safetensors import safe_open

    from vserve.models.loader import _safetensors_files

    shapes = {}
    for file in _safetensors_files(Path(model_path)):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                shapes[name] = f.get_slice(name).get_shape()
    untied = any(n.endswith("lm_head.weight") for n in shapes)
    kept = [s for n, s in shapes.items() if not (untied and n.endswith("embed_tokens.weight"))]
    return int(sum(_tensor_bytes(s, dtype, quantization) for s in kept))


def _tensor_bytes(shape, dtype: str, quantization: str) -> float:
    if quantization == "int8" and len(shape) == 2 and shape[1] % 32 == 0:
        return _numel(shape) * 34 / 32
    return _numel(shape) * DTYPE_BYTES[dtype]


def _gguf_bytes(model_path: str, dtype: str, quantization: str) -> int:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    from vserve.models.gguf_source import gguf_file, read_tensor_table

    table = read_tensor_table(gguf_file(model_path))
    untied = any(t.name == "output.weight" for t in table.tensors)
    total = 0.0
    for t in table.tensors:
        if untied and t.name == "token_embd.weight":
            continue
        shape = tuple(reversed(t.dims))
        if quantization == "gguf":
            block, size = GGML_QUANT_SIZES[GGMLQuantizationType(t.qtype)]
            total += _numel(shape) // block * size
        else:
            total += _tensor_bytes(shape, dtype, quantization)
    return int(total)


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
        quantization=args.quantization,
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
    p.add_argument("--quantization", default=None, help="gguf, int8, none (default: the model's)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-iters", type=int, default=3)
    p.add_argument("--device", default="auto")
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    bandwidth = copy_bandwidth(device=args.device)  # before the engine owns the cores
    read_bw = read_bandwidth() if args.device == "cpu" else bandwidth
    steps, config = decode_step_times(args)
    wbytes = weight_bytes(config.model, config.dtype, config.quantization)
    floor_ms = wbytes / (bandwidth * 1e9) * 1e3
    read_floor_ms = wbytes / (read_bw * 1e9) * 1e3
    median_ms = statistics.median(steps) * 1e3
    mean_ms = statistics.fmean(steps) * 1e3
    rows = [
        ("copy bandwidth (GB/s, read + write)", f"{bandwidth:.1f}"),
        ("read bandwidth (GB/s, one-pass sum)", f"{read_bw:.1f}"),
        (
            f"weight bytes read per step ({config.dtype}, quantization {config.quantization})",
            f"{wbytes / 1e6:.1f} MB",
        ),
        ("weight-streaming time at copy bandwidth (ms)", f"{floor_ms:.1f}"),
        ("weight-streaming time at read bandwidth (ms)", f"{read_floor_ms:.1f}"),
        (f"decode model step, median of {len(steps)} (ms)", f"{median_ms:.1f}"),
        ("decode model step, mean (ms)", f"{mean_ms:.1f}"),
        ("step / streaming time at copy bandwidth (goal <= 1.3)", f"{median_ms / floor_ms:.2f}"),
        ("step / streaming time at read bandwidth", f"{median_ms / read_floor_ms:.2f}"),
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
                "quantization": config.quantization,
                "copy_bandwidth_gbs": bandwidth,
                "read_bandwidth_gbs": read_bw,
                "read_streaming_ms": read_floor_ms,
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
