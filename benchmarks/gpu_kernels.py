"""The Triton kernels of csrc_triton against their torch references on the shapes the GPU
check's models run (Llama-1B: 32 q / 8 kv heads of 64; Gemma-3-270M: 4 q / 1 kv head of 256,
window 512), in bf16: the largest difference, the kernel's time, the torch backend's time on the
same batch, and the bytes a decode batch reads per second.

    python benchmarks/gpu_kernels.py OUT.json [--small]   # --small: interpreter-sized (CPU)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

# the repo root, for tests.support; appended, so an installed vserve still comes first
sys.path.append(str(Path(__file__).resolve().parent.parent))

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":  # before triton is first imported: run the kernels in its interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")


def timed_ms(fn, repeats: int) -> float:
    """Median time of `fn` in ms (CUDA events on a GPU)."""
    fn()
    times = []
    for _ in range(repeats):
        if DEVICE == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def attention_case(name, q_lens, ctx_lens, heads, kv_heads, head_dim, window, repeats):
    from tests.support.attention_reference import make_case
    from vserve.attention import get_attention_backend
    from vserve.attention.base import AttentionLayerSpec
    from vserve.csrc_triton.kv_write import kv_write_reference
    from vserve.csrc_triton.paged_attention import paged_attention, paged_attention_reference

    case = make_case(q_lens, ctx_lens, heads, kv_heads, head_dim, 16, torch.bfloat16, 0)
    meta = case.meta
    for field in ("positions", "slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
        setattr(meta, field, getattr(meta, field).to(DEVICE))
    case.query, case.key, case.value, case.kv_cache = (
        t.to(DEVICE) for t in (case.query, case.key, case.value, case.kv_cache)
    )
    kv_write_reference(case.key, case.value, case.kv_cache, meta.slot_mapping)
    spec = AttentionLayerSpec(heads, kv_heads, head_dim, head_dim**-0.5, window)
    args = (case.query, case.kv_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, spec)
    out = paged_attention(*args, max_query_len=meta.max_query_len)
    ref = paged_attention_reference(*args, max_query_len=meta.max_query_len)
    triton_ms = timed_ms(lambda: paged_attention(*args, max_query_len=meta.max_query_len), repeats)
    torch_backend = get_attention_backend("torch", block_size=16)

    def torch_forward():
        meta.backend_data = torch_backend.prepare(meta, {window})
        return torch_backend.forward(
            spec, case.query, case.key, case.value, case.kv_cache.clone(), meta
        )

    torch_ms = timed_ms(torch_forward, repeats)
    kv_bytes = sum(min(c, window or c) for c in ctx_lens) * 2 * kv_heads * head_dim * 2
    return {
        "case": name,
        "max_abs_diff": float((out.float() - ref.float()).abs().max()),
        "ok": bool(torch.allclose(out.float(), ref.float(), atol=2e-2, rtol=2e-2)),
        "triton_ms": triton_ms,
        "torch_backend_ms": torch_ms,
        "speedup_vs_torch": torch_ms / triton_ms,
        "kv_read_gbs": kv_bytes / (triton_ms * 1e-3) / 1e9,
    }


def prepare_inputs_case(num_reqs, repeats):
    from vserve.csrc_triton.prepare_inputs import prepare_inputs, prepare_inputs_reference

    gen = torch.Generator().manual_seed(0)
    computed = torch.randint(1, 400, (num_reqs,), generator=gen)
    qsl = torch.arange(num_reqs + 1, dtype=torch.int32)
    table = torch.randint(0, 4096, (num_reqs, 32), generator=gen, dtype=torch.int32)
    host = torch.randint(0, 1000, (num_reqs,), generator=gen)
    prev = torch.randint(0, 1000, (num_reqs,), generator=gen)
    prev_index = torch.arange(num_reqs, dtype=torch.int32)
    prev_index[::3] = -1
    offsets = torch.zeros(num_reqs, dtype=torch.int32)
    args = (
        [t.to(DEVICE) for t in (qsl, computed, table)]
        + [16]
        + [t.to(DEVICE) for t in (host, prev, prev_index, offsets)]
    )
    got, want = prepare_inputs(*args), prepare_inputs_reference(*args)
    same = all(torch.equal(a, b) for a, b in zip(got, want))
    return {
        "case": f"prepare_inputs decode x{num_reqs}",
        "ok": same,
        "triton_ms": timed_ms(lambda: prepare_inputs(*args), repeats),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--small", action="store_true")
    args = p.parse_args()
    if args.small:  # the Triton interpreter: exact but ~1000x slower
        cases = [
            ("llama decode", [1] * 2, [20, 33], 4, 2, 16, None),
            ("gemma sliding decode", [1] * 2, [40, 9], 4, 1, 32, 16),
        ]
        repeats, num_reqs = 1, 8
    else:
        cases = [
            ("llama-1b decode x64, ctx 384", [1] * 64, [384] * 64, 32, 8, 64, None),
            ("llama-1b prefill 8 x 256", [256] * 8, [256] * 8, 32, 8, 64, None),
            ("gemma3 global decode x64, ctx 1024", [1] * 64, [1024] * 64, 4, 1, 256, None),
            ("gemma3 sliding decode x64, ctx 1024", [1] * 64, [1024] * 64, 4, 1, 256, 512),
        ]
        repeats, num_reqs = 20, 256
    results = []
    for case in cases:
        results.append(attention_case(*case, repeats=repeats))
        print(json.dumps(results[-1]), flush=True)
    results.append(prepare_inputs_case(num_reqs, repeats))
    print(json.dumps(results[-1]), flush=True)
    Path(args.out).write_text(json.dumps({"device": DEVICE, "kernels": results}, indent=1))
    if not all(r["ok"] for r in results):
        sys.exit("a kernel differs from its reference")


if __name__ == "__main__":
    main()
