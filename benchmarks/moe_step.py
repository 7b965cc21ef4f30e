"""A mixture-of-experts decode step against its floor: one sparse layer of Qwen3-30B-A3B's
shape (hidden 2048, 128 experts, 8 a token, 768 rows each; random weights) at batch 1 and a
few tokens, timed against a dense gated MLP holding exactly the active experts' weights (8 x
768 rows: the bytes a step must read) and against reading every expert (the dense product of
all 128, what a layer that does not route would stream).

The ratio step / floor is the step's bytes read relative to the active parameters' bytes when
both run at the memory's pace (the weights, 1.2 GB in bf16, exceed any cache, so every step
streams them from DRAM): the goal is <= 1.3. `--format Q4_K` keeps the experts in GGUF
blocks, as a Q4_K_M file of the model loads (random blocks, 340 MB; each expert's two
quantized linears), and the floor is one quantized linear pair over the active experts' blocks.

    python benchmarks/moe_step.py [--dtype bfloat16] [--format dense|Q4_K] [--tokens 1,4]
        [--repeats 20] [--json benchmarks/results/moe_step.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
import types

import torch

from vserve import cpu_ops
from vserve.models.gguf_source import QuantBlocks
from vserve.models.moe import SparseMoE
from vserve.models.quant_linear import QuantLinear

Q4_K = 12  # GGML type id
FLOOR_COPIES = 8  # 8 x the active experts' bytes (600 MB in bf16): more than a cache holds
SHAPE = dict(hidden_size=2048, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768)


def _layer(dtype: torch.dtype, blocks: bool) -> SparseMoE:
    cfg = types.SimpleNamespace(
        model_type="qwen3_moe", norm_topk_prob=True, hidden_act="silu", **SHAPE
    )
    layer = SparseMoE(cfg, types.SimpleNamespace(rank=0, size=1))
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.02)
    layer = layer.to(dtype)
    if dtype == torch.bfloat16:  # as a bf16 model loads: the CPU kernels' gemv at one row
        layer.experts.kernel = cpu_ops.load()
    if blocks:  # every expert's projections as Q4_K rows, installed as a GGUF file's are
        hidden, inter = SHAPE["hidden_size"], SHAPE["moe_intermediate_size"]
        for e in range(SHAPE["num_experts"]):
            layer.experts.quant[(e, 0)] = _q4_k(inter, hidden)
            layer.experts.quant[(e, 1)] = _q4_k(inter, hidden)
            layer.experts.quant[(e, 2)] = _q4_k(hidden, inter)
        layer.experts.install_quant(_linear)
    return layer


def _q4_k(rows: int, k: int) -> QuantBlocks:
    """Random Q4_K blocks (144 bytes a 256 inputs), their two fp16 scales small and finite."""
    data = torch.randint(0, 256, (rows, k // 256, 144), dtype=torch.uint8)
    scales = (torch.rand(rows, k // 256, 2) * 1e-3).to(torch.float16)
    data[..., :4] = scales.view(torch.uint8).reshape(rows, k // 256, 4)
    return QuantBlocks(Q4_K, data.reshape(rows, -1).contiguous(), (rows, k))


def _linear(parts, k: int) -> QuantLinear:
    return QuantLinear(parts, k, None, cpu_ops.load_quant())


def _best(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def measure(dtype: torch.dtype, tokens: int, repeats: int, blocks: bool = False) -> dict:
    torch.manual_seed(0)
    layer = _layer(dtype, blocks)
    hidden, k = SHAPE["hidden_size"], SHAPE["num_experts_per_tok"]
    inter = SHAPE["moe_intermediate_size"]
    x = torch.randn(tokens, hidden, dtype=dtype)
    # routed experts differ from step to step, as in decoding: each call draws new tokens
    xs = [torch.randn(tokens, hidden, dtype=dtype) for _ in range(repeats + 1)]
    it = iter(xs * 2)
    with torch.inference_mode():
        routed = {len(torch.topk(layer.gate(v), k, dim=-1).indices.unique()) for v in xs}
        step = _best(lambda: layer(next(it)), repeats)
        active = max(routed)  # distinct experts a step reads (k at one token)
        # copies of the floor's weights, taken in turn, so that it too streams from DRAM
        if blocks:
            copies = [
                (
                    _linear([_q4_k(active * 2 * inter, hidden)], hidden),
                    _linear([_q4_k(hidden, active * inter)], active * inter),
                )
                for _ in range(FLOOR_COPIES)
            ]
        else:
            copies = [
                (
                    _dense(torch.randn(active * 2 * inter, hidden, dtype=dtype) * 0.02),
                    _dense(torch.randn(hidden, active * inter, dtype=dtype) * 0.02),
                )
                for _ in range(FLOOR_COPIES)
            ]
        turn = iter(copies * (repeats + 2))

        def floor():  # one matmul pair over the same bytes
            w13, w2 = next(turn)
            gate, up = w13(x).chunk(2, dim=-1)
            return w2(torch.nn.functional.silu(gate) * up)

        dense = _best(floor, repeats)
    size = 144 / 256 if blocks else torch.tensor([], dtype=dtype).element_size()
    active_bytes = int(active * 3 * hidden * inter * size)
    return {
        "tokens": tokens,
        "distinct_experts": active,
        "active_bytes": active_bytes,
        "all_experts_bytes": int(SHAPE["num_experts"] * 3 * hidden * inter * size),
        "step_ms": step * 1e3,
        "floor_ms": dense * 1e3,
        "step_over_floor": step / dense,
        "step_gb_s": active_bytes / step / 1e9,
    }


def _dense(w: torch.Tensor):
    """A dense linear as a model's runs it: bf16 prepacked for oneDNN, one row through the
    CPU kernels' gemv (packed_linear.py); fp32 through F.linear."""
    kernel = cpu_ops.load() if w.dtype == torch.bfloat16 else None
    if kernel is None:
        return lambda h: h @ w.T
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 1)
    return lambda h: kernel.linear(h, packed, w, None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--format", default="dense", choices=["dense", "Q4_K"])
    ap.add_argument("--tokens", default="1,4")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    blocks = args.format == "Q4_K"
    rows = [measure(dtype, int(t), args.repeats, blocks) for t in args.tokens.split(",")]
    print(f"{'tokens':>6} {'experts':>7} {'step ms':>8} {'floor ms':>8} {'ratio':>6} {'GB/s':>6}")
    for r in rows:
        print(
            f"{r['tokens']:>6} {r['distinct_experts']:>7} {r['step_ms']:>8.2f} "
            f"{r['floor_ms']:>8.2f} {r['step_over_floor']:>6.2f} {r['step_gb_s']:>6.1f}"
        )
    if args.json:
        report = {
            "cpu": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(),
            "dtype": args.dtype,
            "format": args.format,
            "shape": SHAPE,
            "rows": rows,
        }
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
