"""The Triton kernels of csrc_triton against their torch references on the shapes the GPU
check's models run (Llama-1B: 32 q / 8 kv heads of 64; Gemma-3-270M: 4 q / 1 kv head of 256,
window 512), in bf16: the largest difference, the kernel's time (as launched, split-KV
where it splits, and unsplit), the torch backend's time on the same batch, and the KV bytes a
decode batch reads per second against the device's copy bandwidth.

    python benchmarks/gpu_kernels.py OUT.json [--small]   # --small: interpreter-sized (CPU)
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from pathlib import Path

import torch

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


def paged_batch(q_lens, ctx_lens, heads, kv_heads, head_dim, block_size=16, seed=0):
    """A random bf16 batch in a paged KV cache, on DEVICE: request i holds `ctx_lens[i]` tokens
    after this step, of which the last `q_lens[i]` are queried now (their K/V in key and value,
    for the caller to write); its blocks are drawn in shuffled order. Returns (metadata, query,
    key, value, kv_cache)."""
    from vserve.attention.base import AttentionMetadata

    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-ctx // block_size) for ctx in ctx_lens]
    num_blocks = sum(blocks) + 3
    order = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    tables = torch.zeros(len(ctx_lens), max(blocks), dtype=torch.int32)
    slots, positions = [], []
    for i, (q_len, ctx, n) in enumerate(zip(q_lens, ctx_lens, blocks)):
        tables[i, :n] = order[sum(blocks[:i]) : sum(blocks[: i + 1])]
        pos = torch.arange(ctx - q_len, ctx)
        slots.append(tables[i, pos // block_size].long() * block_size + pos % block_size)
        positions.append(pos)
    qsl = [0, *itertools.accumulate(q_lens)]
    meta = AttentionMetadata(
        num_tokens=qsl[-1],
        positions=torch.cat(positions).to(DEVICE),
        slot_mapping=torch.cat(slots).to(DEVICE),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(ctx_lens, dtype=torch.int32, device=DEVICE),
        block_tables=tables.to(DEVICE),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=list(ctx_lens),
        max_query_len=max(q_lens),
        max_seq_len=max(ctx_lens),
    )

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(torch.bfloat16).to(DEVICE)

    query = randn(qsl[-1], heads, head_dim)
    key, value = randn(qsl[-1], kv_heads, head_dim), randn(qsl[-1], kv_heads, head_dim)
    return meta, query, key, value, randn(2, num_blocks, block_size, kv_heads, head_dim)


def attention_case(
    name, q_lens, ctx_lens, heads, kv_heads, head_dim, window, hint=None, *, repeats, copy_gbs
):
    """The kernel as the backend launches it (split-KV where `choose_splits` splits), and
    unsplit, against the reference and the torch backend; KV bytes read per second, and their
    share of the device's copy bandwidth. `hint`: the longest context the launch is told of
    (a decode graph's: the model's length), else the batch's."""
    from vserve.attention import get_attention_backend
    from vserve.attention.base import AttentionLayerSpec
    from vserve.csrc_triton.kv_write import kv_write_reference
    from vserve.csrc_triton.paged_attention import paged_attention, paged_attention_reference

    meta, query, key, value, kv_cache = paged_batch(q_lens, ctx_lens, heads, kv_heads, head_dim)
    kv_write_reference(key, value, kv_cache, meta.slot_mapping)
    spec = AttentionLayerSpec(heads, kv_heads, head_dim, head_dim**-0.5, window)
    args = (query, kv_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, spec)
    hints = {"max_query_len": meta.max_query_len, "max_seq_len": hint or meta.max_seq_len}
    out = paged_attention(*args, **hints)
    ref = paged_attention_reference(*args, **hints)
    triton_ms = timed_ms(lambda: paged_attention(*args, **hints), repeats)
    unsplit_ms = timed_ms(lambda: paged_attention(*args, **hints, num_splits=1), repeats)
    torch_backend = get_attention_backend("torch", block_size=16)

    def torch_forward():
        meta.backend_data = torch_backend.prepare(meta, {window})
        return torch_backend.forward(spec, query, key, value, kv_cache.clone(), meta)

    torch_ms = timed_ms(torch_forward, repeats)
    kv_bytes = sum(min(c, window or c) for c in ctx_lens) * 2 * kv_heads * head_dim * 2
    kv_gbs = kv_bytes / (triton_ms * 1e-3) / 1e9
    return {
        "case": name,
        "max_abs_diff": float((out.float() - ref.float()).abs().max()),
        "ok": bool(torch.allclose(out.float(), ref.float(), atol=2e-2, rtol=2e-2)),
        "triton_ms": triton_ms,
        "unsplit_ms": unsplit_ms,
        "torch_backend_ms": torch_ms,
        "speedup_vs_torch": torch_ms / triton_ms,
        "kv_read_gbs": kv_gbs,
        "kv_read_share_of_copy": kv_gbs / copy_gbs,
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


def sampler_case(rows, vocab, params, repeats):
    """The Sampler on bf16 logits (the Triton kernels: three passes over a row without filters,
    about twenty over a row with top-k / top-p) against the torch path: the share of equal
    picks, both times, and the logits' bytes per second (for filtered rows, the logits counted
    once: the rate of a one-pass sampler would be this)."""
    from vserve.workers.sampler import Sampler, SamplingMetadata

    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(rows, vocab, generator=gen) * 2).bfloat16().to(DEVICE)

    def column(value):
        return [value] * rows

    meta = SamplingMetadata(
        temperature=column(params.get("temperature", 1.0)),
        top_k=column(params.get("top_k", 0)),
        top_p=column(params.get("top_p", 1.0)),
        min_p=column(0.0),
        seeds=list(range(rows)),
        positions=column(7),
        num_logprobs=column(None),
        logit_bias=column(None),
        masked_ids=column(None),
        presence=column(0.0),
        frequency=column(0.0),
        repetition=column(1.0),
    )
    fast, oracle = Sampler(triton=True), Sampler(use_kernel=False)
    same = (fast(logits, meta).token_ids == oracle(logits, meta).token_ids).double().mean()
    ms = timed_ms(lambda: fast(logits, meta), repeats)
    name = ",".join(f"{k}={v}" for k, v in params.items())
    # all greedy: argmax; top-k / top-p: the filtered kernel; else the plain kernel
    path = "argmax" if meta.all_greedy else "triton filtered" if "top" in name else "triton"
    return {
        "case": f"sampler {rows} x {vocab} {name} ({path})",
        "ok": bool(same >= 0.99),  # a pick may move where u meets a CDF edge within rounding
        "equal_picks": float(same),
        "sampler_ms": ms,
        "torch_ms": timed_ms(lambda: oracle(logits, meta), repeats),
        "logits_gb_s": (3 if path == "triton" else 1) * logits.numel() * 2 / ms / 1e6,
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
            ("gemma decode, as a graph", [1] * 2, [40, 9], 4, 1, 32, None, 4096),
        ]
        repeats, num_reqs = 1, 8
    else:
        cases = [
            ("llama-1b decode x64, ctx 384", [1] * 64, [384] * 64, 32, 8, 64, None),
            ("llama-1b prefill 8 x 256", [256] * 8, [256] * 8, 32, 8, 64, None),
            ("gemma3 sliding decode x64, ctx 1024", [1] * 64, [1024] * 64, 4, 1, 256, 512),
        ]
        # a decode graph is captured for the model's length: short contexts split as long ones
        gemma = (4, 1, 256, None)
        cases.append(("gemma3 decode x8, ctx 256, as a graph", [1] * 8, [256] * 8, *gemma, 4096))
        for reqs, ctx in ((128, 512), (128, 2048), (8, 8192)):  # the KV-read cases
            cases.append(
                (f"llama-1b decode x{reqs}, ctx {ctx}", [1] * reqs, [ctx] * reqs, 32, 8, 64, None)
            )
            cases.append(
                (
                    f"gemma3 global decode x{reqs}, ctx {ctx}",
                    [1] * reqs,
                    [ctx] * reqs,
                    4,
                    1,
                    256,
                    None,
                )
            )
        repeats, num_reqs = 20, 256
    from batch1_roofline import copy_bandwidth

    copy_gbs = copy_bandwidth(mib=64 if args.small else 1024, device=DEVICE)
    print(json.dumps({"copy_bandwidth_gbs": copy_gbs}), flush=True)
    results = []
    for case in cases:  # (a decode graph's case ends with its length hint)
        results.append(attention_case(*case, repeats=repeats, copy_gbs=copy_gbs))
        print(json.dumps(results[-1]), flush=True)
    results.append(prepare_inputs_case(num_reqs, repeats))
    print(json.dumps(results[-1]), flush=True)
    shapes = [(8, 5000)] if args.small else [(128, 262144), (128, 32000)]
    for (rows, vocab), params in itertools.product(
        shapes, [dict(temperature=0.0), dict(temperature=1.0), dict(top_p=0.9), dict(top_k=50)]
    ):
        results.append(sampler_case(rows, vocab, params, repeats))
        print(json.dumps(results[-1]), flush=True)
    out = {"device": DEVICE, "copy_bandwidth_gbs": copy_gbs, "kernels": results}
    Path(args.out).write_text(json.dumps(out, indent=1))
    if not all(r["ok"] for r in results):
        sys.exit("a kernel differs from its reference")


if __name__ == "__main__":
    main()
