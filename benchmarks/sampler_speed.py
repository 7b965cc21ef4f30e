"""The sampler alone: the torch path (the oracle) against the fused CPU kernel, in one process.

Logits are 64 rows x 262144 (the embedded Gemma-3-270M's vocabulary) in bf16, normal with
standard deviation 5: a softmax entropy of about 3.8 nats and about 130 tokens in the top-p
0.9 set, like a language model's next-token distribution at temperature 1 (std 3 would spread
the top 0.9 over ~11k tokens, past any candidate set, sending both paths to a full sort).
Each case calls both paths alternately, `--repeats` times, so load from other processes hits
both alike; reported are the median wall time and the median process CPU time per call, and
their ratios.

    python benchmarks/sampler_speed.py [--rows 64] [--vocab 262144] [--repeats 15] [--threads N]

On a machine whose cores are busy with other processes, torch's intra-op threads wait for
each other at every parallel op: compare `--threads 1` before reading a slow row as slow code.

Prints a markdown table and writes benchmarks/results/sampler_speed.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from vserve import cpu_ops
from vserve.workers.sampler import Sampler, SamplingMetadata

CASES = {  # name: (temperature, top_k, top_p, min_p, logprobs)
    "greedy": (0.0, 0, 1.0, 0.0, None),
    "temperature=1": (1.0, 0, 1.0, 0.0, None),
    "top_p=0.9,top_k=50": (1.0, 50, 0.9, 0.0, None),
    "top_p=0.9": (1.0, 0, 0.9, 0.0, None),
    "min_p=0.05": (1.0, 0, 1.0, 0.05, None),
    "temperature=1,logprobs=1": (1.0, 0, 1.0, 0.0, 1),
}


def metadata(rows: int, case: tuple, step: int) -> SamplingMetadata:
    temperature, top_k, top_p, min_p, logprobs = case
    return SamplingMetadata(
        temperature=[temperature] * rows,
        top_k=[top_k] * rows,
        top_p=[top_p] * rows,
        min_p=[min_p] * rows,
        seeds=list(range(rows)),
        positions=[step] * rows,
        num_logprobs=[logprobs] * rows,
        logit_bias=[None] * rows,
        masked_ids=[None] * rows,
        presence=[0.0] * rows,
        frequency=[0.0] * rows,
        repetition=[1.0] * rows,
    )


def timed(sampler: Sampler, logits: torch.Tensor, meta: SamplingMetadata) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    sampler(logits, meta).logprobs  # (resolved: building the deltas counts too)
    return time.perf_counter() - wall, time.process_time() - cpu


def run(rows: int, vocab: int, repeats: int) -> list[dict]:
    logits = (torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) * 5).bfloat16()
    paths = {"torch": Sampler(use_kernel=False), "kernel": Sampler(use_kernel=True)}
    results = []
    for name, case in CASES.items():
        times = {p: ([], []) for p in paths}
        for step in range(repeats + 1):
            meta = metadata(rows, case, step)
            for path, sampler in paths.items():
                wall, cpu = timed(sampler, logits, meta)
                if step:  # the first call of each warms up
                    times[path][0].append(wall)
                    times[path][1].append(cpu)
        row = {"case": name}
        for path in paths:
            row[f"{path}_ms"] = statistics.median(times[path][0]) * 1e3
            row[f"{path}_cpu_ms"] = statistics.median(times[path][1]) * 1e3
        row["ratio"] = row["torch_ms"] / row["kernel_ms"]
        row["cpu_ratio"] = row["torch_cpu_ms"] / row["kernel_cpu_ms"]
        results.append(row)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=262144)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if cpu_ops.load_sampler() is None:
        raise SystemExit("the sampling kernel did not build (see the log)")
    results = run(args.rows, args.vocab, args.repeats)
    print(
        f"{args.rows} rows x {args.vocab} bf16 logits, {torch.get_num_threads()} threads, "
        f"median of {args.repeats} interleaved calls\n"
    )
    print("| case | torch ms | kernel ms | speedup | torch CPU ms | kernel CPU ms | CPU ratio |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['case']} | {r['torch_ms']:.1f} | {r['kernel_ms']:.1f} | {r['ratio']:.1f}x "
            f"| {r['torch_cpu_ms']:.1f} | {r['kernel_cpu_ms']:.1f} | {r['cpu_ratio']:.1f}x |"
        )
    out = Path(__file__).parent / "results" / "sampler_speed.json"
    out.write_text(
        json.dumps(
            {
                "rows": args.rows,
                "vocab": args.vocab,
                "threads": torch.get_num_threads(),
                "repeats": args.repeats,
                "results": results,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
