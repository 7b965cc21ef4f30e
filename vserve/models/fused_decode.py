"""Decode steps through the fused CPU kernels: one `decoder_layer` call per layer.

A step whose rows all decode one token runs each layer as a single call into vserve.cpu_ops
(norms, packed linears, rotary, KV write, paged attention, activation, residuals), instead of
~60 torch ops: `decoder_layer` on packed bf16 weights, `decoder_layer_q` on GGUF blocks
(QuantLinear's parts). It calls the same kernels in the same order as the per-op path the model
takes for every other step, so its outputs are bitwise those of that path
(tests/workers/test_cpu_ops.py).

Under tensor parallel each rank runs its shard (its heads, its MLP columns) through the same
calls, given the model's all-reduce (None on one rank): they call it back after o and after
down, where RowParallelLinear calls it, and add those biases after the sum. The one-call stack
below runs on a single rank only.

On GGUF blocks a step of up to 8 rows runs all the layers in one call instead
(`DecodeStack`, vserve/cpu_ops/stack.cpp): one parallel region for the step, buffers
allocated once, the same kernels in the same order, so the same bits.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from vserve.attention.base import AttentionMetadata
from vserve.models.layers import KERNEL_ACTIVATIONS
from vserve.models.packed_linear import PackedLinear
from vserve.models.parallel_layers import RowParallelLinear
from vserve.models.quant_linear import QuantLinear

logger = logging.getLogger("vserve")


class LayerConsts(NamedTuple):
    """A layer's scalars, in the order `decoder_layer` takes them after its tensors."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    window: int  # sliding window, or -1
    scale: float
    softcap: float  # 0: none
    eps: float
    norm_style: int
    activation: int


@dataclass(frozen=True)
class FusedLayer:
    # packed qkv, o, gate_up, down; or, for GGUF blocks, each one's parts (QuantLinear's)
    weights: list[torch.Tensor] | list[list[torch.Tensor]]
    # the same, row-major (one-row gemv); or each part's GGML type (0: dense)
    plain: list[torch.Tensor] | list[list[int]]
    biases: list[torch.Tensor | None]
    norms: list[torch.Tensor]  # in the order decoder_layer documents per style
    layer_idx: int  # index into the KV cache list
    rope: int  # which of the step's rotary tables
    consts: LayerConsts
    quantized: bool = False


STACK_MAX_ROWS = 8  # DecodeStack's rows: the quantized gemv's


AllReduce = Callable[[torch.Tensor], torch.Tensor]


class FusedDecode:
    def __init__(self, kernel, layers: list[FusedLayer], all_reduce: AllReduce | None = None):
        """`all_reduce`: the TP group's sum of row-parallel partial products (None: one rank)."""
        self.kernel = kernel
        self.layers = layers
        self.all_reduce = all_reduce
        self.stack = None if all_reduce is not None else _decode_stack(kernel, layers)

    @staticmethod
    def can_run(meta: AttentionMetadata, backend) -> bool:
        # one token per request, in request order (decoder_layer pairs token r with row r)
        return (
            meta.max_query_len == 1 and meta.num_tokens == meta.num_reqs and backend.name == "torch"
        )

    def _stack_runs(self, h: torch.Tensor, meta: AttentionMetadata) -> bool:
        # the stack takes 1 to 8 rows, each with a context (the per-layer calls take length 0)
        return (
            self.stack is not None
            and h.shape[0] <= STACK_MAX_ROWS
            and h.dtype == torch.bfloat16
            and min(meta.seq_lens_cpu, default=0) >= 1
        )

    def run(self, h: torch.Tensor, ropes, kv_caches, meta: AttentionMetadata) -> torch.Tensor:
        seq_lens = meta.seq_lens.long()
        full = (meta.slot_mapping, meta.block_tables.long())
        local = (
            full
            if meta.local_block_tables is None
            else (meta.local_slot_mapping, meta.local_block_tables.long())
        )  # sliding-window group
        if self._stack_runs(h, meta):
            return self.stack.run(
                h,
                [c for c, _ in ropes],
                [s for _, s in ropes],
                [kv_caches[f.layer_idx] for f in self.layers],
                *full,
                *local,
                seq_lens,
            )
        dense_fn, quant_fn = self.kernel.decoder_layer, self.kernel.decoder_layer_q
        for f in self.layers:
            cos, sin = ropes[f.rope]
            slots, tables = local if f.consts.window > 0 else full
            h = (quant_fn if f.quantized else dense_fn)(
                h,
                f.weights,
                f.plain,
                f.biases,
                f.norms,
                kv_caches[f.layer_idx],
                slots,
                tables,
                seq_lens,
                cos,
                sin,
                *f.consts,
                self.all_reduce,
            )
        return h


def _decode_stack(kernel, layers: list[FusedLayer]):
    """The one-call stack of `layers` when every linear is GGUF blocks (no dense part), or
    None (the kernel lacks it, bf16 weights, a dense part, a layer the stack rejects: the
    per-layer calls run then)."""
    stack_cls = getattr(kernel, "DecodeStack", None)
    if stack_cls is None or not layers:
        return None
    if not all(f.quantized and all(t > 0 for ts in f.plain for t in ts) for f in layers):
        return None
    if any(b is not None and b.dtype != torch.bfloat16 for f in layers for b in f.biases):
        return None
    stack = stack_cls()
    try:
        for f in layers:
            stack.add_layer(f.weights, f.plain, f.biases, f.norms, *f.consts, f.rope)
    except RuntimeError as e:
        logger.warning("the decode stack rejects a layer (%s): per-layer calls run", e)
        return None
    return stack


def build_fused(model, kernel) -> FusedDecode | None:
    """The fused plan of `model`'s layers, or None when a layer cannot run fused (weights
    not packed, an activation the kernel lacks)."""
    layers = []
    all_reduce = None
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        linears = [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]
        rows = [isinstance(m, RowParallelLinear) for m in linears]
        if rows == [False, True, False, True]:  # tensor parallel: o and down sum over ranks
            all_reduce = attn.o_proj.tp.comm.all_reduce
        elif any(rows):
            return None
        # a row-parallel layer's matmul is its shard's; its own bias is added after the sum
        matmuls = [m.linear if isinstance(m, RowParallelLinear) else m for m in linears]
        quantized = all(isinstance(m, QuantLinear) for m in matmuls)
        packed = all(isinstance(m, PackedLinear) and m.plain is not None for m in matmuls)
        if not (packed or quantized) or layer.act not in KERNEL_ACTIVATIONS:
            return None
        norms, style, rope, eps = model.fused_norms(layer)
        spec = attn.attn.spec
        consts = LayerConsts(
            spec.num_heads,
            spec.num_kv_heads,
            spec.head_dim,
            spec.sliding_window or -1,
            spec.scale,
            spec.logit_softcap or 0.0,
            eps,
            style,
            KERNEL_ACTIVATIONS[layer.act],
        )
        weights, plain = (
            ([m.part_tensors() for m in matmuls], [m.part_types() for m in matmuls])
            if quantized
            else ([m.packed for m in matmuls], [m.plain for m in matmuls])
        )
        layers.append(
            FusedLayer(
                weights,
                plain,
                [m.bias for m in linears],
                norms,
                attn.attn.layer_idx,
                rope,
                consts,
                quantized,
            )
        )
    return FusedDecode(kernel, layers, all_reduce)


def attach_kernel(model, kernel) -> None:
    """Point every module that can use the CPU kernels at them, and plan fused decode where
    `decoder_layer` computes the model's layers (`model.supports_fused_decode`: Llama's or
    Gemma's layer shape)."""
    for module in model.modules():
        if hasattr(module, "kernel"):
            module.kernel = kernel
    model.fused = build_fused(model, kernel) if model.supports_fused_decode else None
