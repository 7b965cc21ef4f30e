"""The GGUF int8 gemv's speed per format (vserve/cpu_ops/quant_gemv.cpp), from cache and from DRAM.

For each format, a weight of random valid blocks with the row length the embedded Gemma 3
270M's GGUF gives it (K = 640 inputs for Q4_0 / Q5_0 / Q8_0, 1024 for Q4_K / Q5_K, 2048 for
Q6_K) is multiplied with M bf16 activation rows by `quant.gemv` on 1 and
2 threads: "cache" is a 4 MB weight (a decode layer's share, L2 / L3-resident after the first
call), "dram" a 256 MB one (read once per call). Reports GB/s of weight bytes (best of the
repeats).

    python benchmarks/quant_gemv_speed.py [--formats Q5_0,Q5_0R,Q4_K] [--m 1,8] [--threads 1,2]
    python benchmarks/quant_gemv_speed.py --compare /work/main /work/wt-x [--pairs 2]
    python benchmarks/quant_gemv_speed.py --compare-isa avx2 avx_vnni [--gemm]
    python benchmarks/quant_gemv_speed.py --gemm [--m 16,64] [--formats ...]

`--gemm` times `quant.matmul` past 8 rows instead (the int8 GEMM this build has: VNNI, AMX
tiles or AVX2; VSERVE_CPU_ISA=avx2 for the AVX2 one on any x86 machine) against the exact path
of the same build (weights dequantized in tiles, `at::mm`), on the 4 MB weights, all threads:
G op/s (2 M N K per call) of each and their ratio.

`--compare A B` runs the measurement in subprocesses with PYTHONPATH=A, B, A, B, ... (each
tree's own kernel build: the cache folder is keyed by the sources) and prints each format's
best GB/s under A and B and their ratio B / A; `--compare-isa A B` does the same with
VSERVE_CPU_ISA=A and B on this tree (`--compare-isa avx2 avx_vnni`: the AVX2 kernels with
and without AVX-VNNI's dots, on a CPU that has it). Either takes `--gemm` too.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np
import torch

FORMATS = {"Q4_0": 2, "Q5_0": 6, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
# block size, block bytes, fp16 fields
LAYOUT = {
    2: (32, 18, [0]),
    6: (32, 22, [0]),
    8: (32, 34, [0]),
    12: (256, 144, [0, 2]),
    13: (256, 176, [0, 2]),
    14: (256, 210, [208]),
}
K = {2: 640, 6: 640, 8: 640, 12: 1024, 13: 1024, 14: 2048}


def random_weight(qtype: int, n: int, k: int, seed: int = 0) -> torch.Tensor:
    from vserve.models.weight_arena import huge_page_buffer

    block, size, halves = LAYOUT[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, k // block, size), dtype=np.uint8)
    for off in halves:
        half = (rng.standard_normal((n, k // block)) * 0.01).astype(np.float16)
        raw[:, :, off : off + 2] = half.view(np.uint8).reshape(n, k // block, 2)
    buf = huge_page_buffer(raw.size)
    buf.copy_(torch.from_numpy(raw.reshape(-1)))
    return buf.view(n, -1)


def measure(formats: list[str], ms: list[int], threads: list[int], repeats: int) -> dict:
    from vserve import cpu_ops
    from vserve.models.gguf_source import Q5_0R  # Q5_0 repacked at load (quant_formats.h)

    quant = cpu_ops.load_quant()
    assert quant is not None, "the quantized kernels failed to build"
    results = {}
    for name in formats:
        if name == "Q5_0R" and not quant.q5_0r_supported():
            print("Q5_0R: this CPU's gemv does not read it (no AVX512 VBMI / BITALG); skipped")
            continue
        source = FORMATS["Q5_0" if name == "Q5_0R" else name]
        qtype = Q5_0R if name == "Q5_0R" else source
        block, size, _ = LAYOUT[source]
        k = K[source]
        row_bytes = k // block * size
        for where, total in (("cache", 4 << 20), ("dram", 256 << 20)):
            w = random_weight(source, total // row_bytes, k)
            if qtype == Q5_0R:  # (the same bytes per row)
                w.copy_(quant.repack_q5_0(w.contiguous(), k))
            for m in ms:
                x = torch.randn(m, k).to(torch.bfloat16)
                for t in threads:
                    torch.set_num_threads(t)
                    inner = 20 if where == "cache" else 1
                    quant.gemv(x, w, qtype, k)
                    best = float("inf")
                    for _ in range(repeats):
                        start = time.perf_counter()
                        for _ in range(inner):
                            quant.gemv(x, w, qtype, k)
                        best = min(best, (time.perf_counter() - start) / inner)
                    results[f"{name} {where} M={m} t={t}"] = w.numel() / best / 1e9
            del w
    return results


def measure_gemm(formats: list[str], ms: list[int], repeats: int) -> dict:
    from vserve import cpu_ops

    quant = cpu_ops.load_quant()
    assert quant is not None, "the quantized kernels failed to build"
    results = {}
    for name in formats:
        qtype = FORMATS[name]
        block, size, _ = LAYOUT[qtype]
        k = K[qtype]
        w = random_weight(qtype, (4 << 20) // (k // block * size), k)
        for m in ms:
            x = torch.randn(m, k).to(torch.bfloat16)
            rates = {}
            for path, exact in (("int8", False), ("exact", True)):
                quant.set_options(exact=exact)
                quant.matmul(x, w, qtype, k)
                best = float("inf")
                for _ in range(repeats):
                    start = time.perf_counter()
                    quant.matmul(x, w, qtype, k)
                    best = min(best, time.perf_counter() - start)
                rates[path] = 2 * m * w.shape[0] * k / best / 1e9
            quant.set_options(exact=False)
            results[f"{name} M={m}"] = rates
    return results


def compare(variants: dict[str, dict[str, str]], pairs: int, argv: list[str]) -> None:
    """Run the measurement `pairs` times under each variant's environment, interleaved, and
    print each case's best under A and B and their ratio."""
    runs: dict[str, list[dict]] = {name: [] for name in variants}
    for _ in range(pairs):
        for name, overrides in variants.items():
            env = dict(os.environ, **overrides)
            out = subprocess.run(
                [sys.executable, __file__, "--json", *argv],
                env=env,
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            runs[name].append(json.loads(out.strip().splitlines()[-1]))
    a, b = variants
    unit = "G op/s (int8 GEMM)" if "--gemm" in argv else "GB/s"
    print(f"| case | A {unit} | B {unit} | B / A |\n|---|---|---|---|")
    print(f"<!-- A = {a}, B = {b}, best of {pairs} runs each, interleaved -->")
    for key in runs[a][0]:
        ga = max(_rate(r[key]) for r in runs[a])
        gb = max(_rate(r[key]) for r in runs[b])
        print(f"| {key} | {ga:.1f} | {gb:.1f} | {gb / ga:.2f} |")


def _rate(value) -> float:
    return value["int8"] if isinstance(value, dict) else value


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--m", default="1,8")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--compare", nargs=2, default=None, metavar=("A", "B"))
    p.add_argument("--compare-isa", nargs=2, default=None, metavar=("A", "B"))
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--json", action="store_true")
    p.add_argument("--gemm", action="store_true")
    args = p.parse_args()
    if args.compare or args.compare_isa:
        argv = ["--formats", args.formats, "--m", args.m, "--threads", args.threads]
        argv += ["--repeats", str(args.repeats)] + (["--gemm"] if args.gemm else [])
        if args.compare:
            variants = {tree: {"PYTHONPATH": tree} for tree in args.compare}
        else:
            variants = {f"VSERVE_CPU_ISA={v}": {"VSERVE_CPU_ISA": v} for v in args.compare_isa}
        compare(variants, args.pairs, argv)
        return
    if args.gemm:
        ms = [int(v) for v in args.m.split(",")] if args.m != "1,8" else [16, 64]
        gemm = measure_gemm(args.formats.split(","), ms, args.repeats)
        if args.json:
            print(json.dumps(gemm))
            return
        print("| format, rows | int8 GEMM G op/s | exact path G op/s | ratio |")
        print("|---|---|---|---|")
        for key, r in gemm.items():
            print(f"| {key} | {r['int8']:.1f} | {r['exact']:.1f} | {r['int8'] / r['exact']:.2f} |")
        return
    results = measure(
        args.formats.split(","),
        [int(v) for v in args.m.split(",")],
        [int(v) for v in args.threads.split(",")],
        args.repeats,
    )
    if args.json:
        print(json.dumps(results))
    else:
        for key, gbs in results.items():
            print(f"{key}: {gbs:.1f} GB/s")


if __name__ == "__main__":
    main()
