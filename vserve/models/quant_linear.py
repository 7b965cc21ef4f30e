"""Linear layers and embeddings whose weights stay in GGUF block formats (CPU kernels).

At batch 1 a decode step streams every weight once, so its time is about bytes / bandwidth: the
embedded model's GGUF blocks (Q8_0, Q5_0, Q4_K, Q6_K) are 2.2x fewer bytes than bf16. These
modules keep each weight as it is stored and call the quantized kernels of `vserve/cpu_ops/`
(`quant_api.cpp`), which dequantizes in registers while it streams (`gemv`, up to 8 rows) or
multiplies int8 quants with activations rounded to int8 per block of 32 (`matmul`, larger
batches in bf16; on a CPU with AMX, from 48 rows, bf16 weights dequantized a tile at a time on
the tile unit; the exact fp32 path, and AMX prefills, dequantize tiles for oneDNN), and reads
only the looked-up rows of a quantized embedding table (`embedding`).

`install` swaps them in after loading, for every nn.Linear / FusedLinear / nn.Embedding (or
vocab-parallel embedding) that received `QuantBlocks` (`stage.load_weights` parks them on the
module; under tensor parallel, each layer of `parallel_layers` its slice): a fused projection
whose parts have different formats (Gemma's q/k in Q5_0, v in Q8_0) keeps one part per run of
equal formats and concatenates their outputs. A tied lm_head shares the embedding's blocks.
Where the gemv reads four Q5_0 blocks a step (AVX512 VBMI / BITALG), a linear's Q5_0 rows of
K % 128 == 0 are repacked once, on their way into the arena, into its layout (`Q5_0R`: as many
bytes, reordered; the same weights, bitwise the same outputs; the embedded model's q, k, gate
and up: the M = 1 gemv 19.2 -> 27.8 GB/s from cache on one Zen 4 thread). Where the int8
products are the 256-bit ones (AVX2, AVX-VNNI), Q5_0 rows become Q8_0 instead (the same
values exactly, 34 bytes a block instead of 22: the embedded model's weights grow by 24 MB,
and its batch-1 step is ~0.7 ms shorter on a Zen 3 EPYC). VSERVE_QUANT_REPACK=0 keeps the
GGUF bytes.

`quantize_q8_0` makes Q8_0 blocks from a dense weight (`quantization="int8"`): per 32 inputs
one fp16 scale amax / 127 and 32 int8 values, ggml's own Q8_0 (tested against `gguf`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from vserve.envs import ENV
from vserve.models.gguf_source import Q5_0, Q5_0R, Q8_0, QuantBlocks
from vserve.models.parallel_layers import VocabParallelEmbedding, vocab_lookup
from vserve.models.stage import FusedLinear
from vserve.models.weight_arena import arena_copy

Part = QuantBlocks | torch.Tensor  # a run of rows in one block format, or dense rows
GEMV_MAX_ROWS = 8  # the kernel's register-blocked gemv takes up to 8 activation rows


class QuantLinear(nn.Module):
    def __init__(
        self,
        parts: list[Part],
        in_features: int,
        bias: torch.Tensor | None,
        kernel,
        shard_sizes: list[int] | None = None,  # a fused projection's split of the output
    ):
        super().__init__()
        self.parts = _merged(parts)
        self.in_features = in_features
        self.out_features = sum(_rows(p) for p in self.parts)
        self.bias = bias
        self.qkernel = kernel  # not `kernel`: attach_kernel sets that on every module with one
        self.shard_sizes = shard_sizes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        outs = [self._part(x2, p) for p in self.parts]
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)

    def _part(self, x: torch.Tensor, part: Part) -> torch.Tensor:
        if isinstance(part, torch.Tensor):
            return F.linear(x, part)
        run = self.qkernel.gemv if 0 < x.shape[0] <= GEMV_MAX_ROWS else self.qkernel.matmul
        return run(x.contiguous(), part.data, part.qtype, self.in_features)

    def part_tensors(self) -> list[torch.Tensor]:
        """Each part's bytes (GGUF blocks) or dense rows, for the fused decode layer."""
        return [p.data if isinstance(p, QuantBlocks) else p for p in self.parts]

    def part_types(self) -> list[int]:
        """Each part's GGML type, 0 for dense rows (decode.cpp's quant_linear)."""
        return [p.qtype if isinstance(p, QuantBlocks) else 0 for p in self.parts]

    def extra_repr(self) -> str:
        formats = "+".join(p.name if isinstance(p, QuantBlocks) else "dense" for p in self.parts)
        return f"in_features={self.in_features}, out_features={self.out_features}, {formats}"


class QuantEmbedding(nn.Module):
    def __init__(
        self,
        blocks: QuantBlocks,
        dtype: torch.dtype,
        kernel,
        vocab_shard: VocabParallelEmbedding | None = None,  # tensor parallel: its rows
    ) -> None:
        super().__init__()
        self.blocks, self.dtype, self.qkernel = blocks, dtype, kernel
        self.embedding_dim = blocks.shape[1]
        self.shard = None if vocab_shard is None else (vocab_shard.first, vocab_shard.tp)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.shard is None:
            return self._lookup(ids)
        first, tp = self.shard
        return vocab_lookup(ids, first, self.blocks.shape[0], self._lookup, tp)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        b = self.blocks
        rows = self.qkernel.embedding(b.data, b.qtype, b.shape[1], ids.reshape(-1), self.dtype)
        return rows.reshape(*ids.shape, self.embedding_dim)


def install(model: nn.Module, kernel, dtype: torch.dtype) -> int:
    """Replace every module holding parked QuantBlocks; returns how many were replaced. The
    blocks the linears stream move into one huge-page arena (`weight_arena`)."""
    replaced = 0
    for name, module in list(model.named_modules()):
        install_quant = getattr(module, "install_quant", None)  # a mixture's experts
        if install_quant is not None:
            replaced += install_quant(lambda parts, k: QuantLinear(parts, k, None, kernel))
            continue
        new = _quantized(module, kernel, dtype)
        if new is None:
            continue
        parent_name, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, leaf, new)
        replaced += 1
    _into_arena(model, kernel if ENV.quant_repack else None)
    return replaced


def _into_arena(model: nn.Module, repack_with=None) -> None:
    """Every QuantLinear's blocks, in module order (the order a step streams them), copied
    into one arena, Q5_0 rewritten on the way where `repack_with` (the kernel) reads another
    form faster (`_repacker`);
    an embedding that shares a head's blocks (tied) follows them (its lookup reads either)."""
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    blocks = {_key(p): p for m in linears for p in m.parts if isinstance(p, QuantBlocks)}
    repack = {key: _repacker(p, repack_with) for key, p in blocks.items()}
    data = arena_copy(
        [p.data for p in blocks.values()],
        [r and r.transform for r in repack.values()],
        [r and r.shape for r in repack.values()],
    )
    copies = dict(zip(blocks, data, strict=True))

    done: dict[int, QuantBlocks] = {}  # one moved object per object: sharing stays sharing

    def moved(p: QuantBlocks) -> QuantBlocks:
        key = _key(p)
        if key not in copies:
            return p
        r = repack[key]
        return done.setdefault(id(p), QuantBlocks(r.qtype if r else p.qtype, copies[key], p.shape))

    for m in linears:
        m.parts = [moved(p) if isinstance(p, QuantBlocks) else p for p in m.parts]
    for m in model.modules():
        if isinstance(m, QuantEmbedding):
            m.blocks = moved(m.blocks)


class Repack(NamedTuple):
    """What a format's rows become on their way into the arena."""

    qtype: int
    shape: tuple[int, int]  # of the new bytes
    transform: Callable[[torch.Tensor], torch.Tensor]


# the int8 gemv and GEMM in 256-bit registers (kernel.int8_gemv()): they read Q8_0 faster than
# Q5_0, whose fifth bits they unpack (a Zen 3 EPYC, the embedded model's K = 640, per weight:
# the M = 1 gemv 1.39x from DRAM, the GEMM 1.66x at 16 rows and 1.38x at 32)
Q8_0_FOR_Q5_0 = ("avx2", "avx_vnni")


def _repacker(blocks: QuantBlocks, kernel) -> Repack | None:
    """How Q5_0 rows are rewritten where `kernel` reads another form faster, else None (the
    blocks stay as they are): Q5_0R where the gemv reads four blocks a step (as many bytes,
    reordered); Q8_0 where the int8 products are the 256-bit ones (the same values exactly:
    each d * (q - 16) is the int8 q - 16 under the same d; 34 bytes a block instead of 22)."""
    n, k = blocks.shape
    if kernel is None or blocks.qtype != Q5_0:
        return None
    if k % 128 == 0 and kernel.q5_0r_supported():
        return Repack(Q5_0R, tuple(blocks.data.shape), lambda data: kernel.repack_q5_0(data, k))
    if kernel.int8_gemv() in Q8_0_FOR_Q5_0:
        return Repack(Q8_0, (n, k // 32 * 34), lambda data: kernel.q5_0_as_q8_0(data, k))
    return None


def _quantized(module: nn.Module, kernel, dtype: torch.dtype) -> nn.Module | None:
    if isinstance(module, FusedLinear) and module.quant_shards:
        parts: list[Part] = []
        start = 0
        for i, size in enumerate(module.shard_sizes):
            dense = module.weight[start : start + size].detach()
            parts.append(module.quant_shards.get(i, dense))
            start += size
        return QuantLinear(parts, module.in_features, _bias(module), kernel, module.shard_sizes)
    blocks = getattr(module, "quant_weight", None)
    if blocks is None:
        return None
    if isinstance(module, nn.Embedding):
        return QuantEmbedding(blocks, dtype, kernel)
    if isinstance(module, VocabParallelEmbedding):
        return QuantEmbedding(blocks, dtype, kernel, module)
    if isinstance(module, nn.Linear):
        return QuantLinear([blocks], module.in_features, _bias(module), kernel)
    return None


def _key(p: QuantBlocks) -> tuple[int, tuple[int, ...]]:
    return p.data.data_ptr(), tuple(p.data.shape)


def _bias(module: nn.Linear) -> torch.Tensor | None:
    return None if module.bias is None else module.bias.detach()


def _rows(part: Part) -> int:
    return part.shape[0]


def _merged(parts: list[Part]) -> list[Part]:
    """Consecutive parts in the same block format become one (their rows concatenated)."""
    out: list[Part] = []
    for p in parts:
        last = out[-1] if out else None
        if (
            isinstance(p, QuantBlocks)
            and isinstance(last, QuantBlocks)
            and last.qtype == p.qtype
            and last.shape[1] == p.shape[1]
        ):
            rows = last.shape[0] + p.shape[0]
            out[-1] = QuantBlocks(p.qtype, torch.cat([last.data, p.data]), (rows, p.shape[1]))
        else:
            out.append(p)
    return out


def quantize_q8_0(weight: torch.Tensor) -> QuantBlocks:
    """ggml's Q8_0 blocks of a dense [N, K] weight (K a multiple of 32)."""
    n, k = weight.shape
    w = weight.detach().float().reshape(n, k // 32, 32)
    d = w.abs().amax(dim=-1, keepdim=True) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(w * inv).to(torch.int8)
    scales = d.to(torch.float16).view(torch.uint8).reshape(n, k // 32, 2)
    data = torch.cat([scales, q.view(torch.uint8)], dim=-1).reshape(n, k // 32 * 34)
    return QuantBlocks(Q8_0, data.contiguous(), (n, k))


def park_int8(model: nn.Module) -> int:
    """Q8_0 blocks for every linear weight (and the embedding) whose inputs come in whole
    blocks, parked for `install`; returns how many weights. A tied lm_head takes the
    embedding's blocks (the loader copied one checkpoint table into both). Under tensor
    parallel each rank quantizes its slice: blocks of 32 inputs never straddle two ranks'
    slices when the slice is whole blocks, so they are the one-rank model's blocks."""
    count = 0
    tied_to = _tied_embedding(model)
    head = getattr(model, "lm_head", None)
    head = getattr(head, "linear", head)  # ParallelLMHead's matmul
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not isinstance(module, (nn.Linear, nn.Embedding, VocabParallelEmbedding)):
            continue
        if weight is None or weight.shape[1] % 32:  # under TP: o / down's inputs per rank
            continue
        if module is head and tied_to is not None:  # the same rows (and padding) under TP
            module.quant_weight = tied_to.quant_weight  # quantized just before (modules order)
            continue
        blocks = quantize_q8_0(weight)
        if isinstance(module, FusedLinear):
            start = 0
            for i, size in enumerate(module.shard_sizes):
                module.quant_shards[i] = blocks.rows(start, size)
                start += size
        else:
            module.quant_weight = blocks
        count += 1
    return count


def _tied_embedding(model: nn.Module) -> nn.Module | None:
    """This stage's embedding when the lm_head is tied to it and both are here."""
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if getattr(model, "tie", False) and embed is not None and hasattr(model, "lm_head"):
        return embed
    return None
