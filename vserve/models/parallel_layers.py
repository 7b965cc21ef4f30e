"""Tensor-parallel layers: each rank holds its slice of a weight and loads it by narrowing the
checkpoint tensor (`load_weight`, called by `stage.load_weights`), so the sharding lives in
the layer that owns it.

| layer                   | weight slice on rank r of n        | after the matmul             |
|-------------------------|------------------------------------|------------------------------|
| q/k/v, gate/up (column) | its heads / its 1/n of the rows    | nothing (local heads)        |
| o, down (row)           | its 1/n of the input columns       | all-reduce, then the bias    |
| embedding (vocab)       | rows [r * V/n, (r + 1) * V/n)      | zero foreign ids, all-reduce |
| lm_head (vocab)         | the same rows                      | all-gather, drop the padding |

The vocabulary is padded to a multiple of n (zero rows). Query heads split evenly; KV heads
too when there are at least n of them, else each is replicated on n / num_kv_heads ranks
(rank r keeps KV head r * num_kv_heads // n). With n == 1 the factories below return the
plain layers the models always used, so a single rank runs exactly as before.

GGUF blocks (`QuantBlocks`) narrow the same way and are parked for `quant_linear.install`:
by whole rows (column-parallel, vocabulary; padding rows are zero bytes, which every block
format reads as zeros) and, for o and down, by whole blocks of inputs (`QuantBlocks.cols`:
32 inputs, 256 for the K-quants; the engine arguments refuse a model whose shapes do not
allow it, `gguf_source.check_tp_blocks`, rather than dequantize that weight: memory and
speed stay what the file promises, and the message names the weight and its block).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from vserve.distributed.tp_comm import TPShard
from vserve.models.gguf_source import QuantBlocks
from vserve.models.stage import FusedLinear, check_shape

# checkpoint names of the weights split by their inputs (RowParallelLinear)
ROW_PARALLEL_WEIGHTS = (".o_proj.weight", ".down_proj.weight")


@dataclass(frozen=True)
class HeadSplit:
    num_heads: int  # query heads on this rank
    num_kv_heads: int  # KV heads on this rank
    q_first: int  # its first query head
    kv_first: int  # its first KV head


def check_tp(hf_config, tp_size: int) -> None:
    """ValueError unless the model's heads and MLP split over `tp_size` ranks."""
    heads, kv = hf_config.num_attention_heads, hf_config.num_key_value_heads
    inter = hf_config.intermediate_size
    if heads % tp_size:
        raise ValueError(f"tensor_parallel_size {tp_size} must divide the {heads} attention heads")
    if kv % tp_size and tp_size % kv:
        raise ValueError(
            f"tensor_parallel_size {tp_size} and the {kv} KV heads: one must divide the other"
        )
    if inter % tp_size:
        raise ValueError(
            f"tensor_parallel_size {tp_size} must divide the intermediate size {inter}"
        )


def split_heads(num_heads: int, num_kv_heads: int, tp: TPShard) -> HeadSplit:
    n, r = tp.size, tp.rank
    heads = num_heads // n
    if num_kv_heads >= n:
        kv = num_kv_heads // n
        return HeadSplit(heads, kv, r * heads, r * kv)
    return HeadSplit(heads, 1, r * heads, r * num_kv_heads // n)


def qkv_linear(hidden: int, split: HeadSplit, head_dim: int, bias: bool, tp: TPShard):
    d = head_dim
    sizes = [split.num_heads * d, split.num_kv_heads * d, split.num_kv_heads * d]
    if tp.size == 1:
        return FusedLinear(hidden, sizes, bias=bias)
    offsets = [split.q_first * d, split.kv_first * d, split.kv_first * d]
    return FusedLinear(hidden, sizes, bias=bias, shard_offsets=offsets)


def gate_up_linear(hidden: int, inter: int, bias: bool, tp: TPShard):
    if tp.size == 1:
        return FusedLinear(hidden, [inter, inter], bias=bias)
    local = inter // tp.size
    return FusedLinear(hidden, [local, local], bias=bias, shard_offsets=[tp.rank * local] * 2)


def row_linear(in_features: int, out_features: int, bias: bool, tp: TPShard):
    if tp.size == 1:
        return nn.Linear(in_features, out_features, bias=bias)
    return RowParallelLinear(in_features, out_features, bias, tp)


def embedding(vocab: int, hidden: int, tp: TPShard):
    if tp.size == 1:
        # its table given, so that no random init runs: `normal_` on the meta device (where
        # models are built) goes through torch's reference ops, whose first call imports
        # torch._dynamo, 2.4 s of every worker's start
        return nn.Embedding(vocab, hidden, _weight=torch.empty(vocab, hidden))
    return VocabParallelEmbedding(vocab, hidden, tp)


def lm_head(hidden: int, vocab: int, tp: TPShard):
    if tp.size == 1:
        return nn.Linear(hidden, vocab, bias=False)
    return ParallelLMHead(hidden, vocab, tp)


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_r @ W_r^T) + b: the input's columns split over the ranks. The matmul
    is a plain nn.Linear (`linear`), which the CPU packing may swap for a packed one."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPShard) -> None:
        super().__init__()
        self.tp = tp
        self.in_features = in_features
        self.linear = nn.Linear(in_features // tp.size, out_features, bias=False)
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.comm.all_reduce(self.linear(x))
        return y if self.bias is None else y + self.bias

    def load_weight(self, leaf: str, tensor: torch.Tensor) -> str:
        if leaf == "bias":
            _copy(self.bias, tensor, "bias")
            return "bias"
        local = self.in_features // self.tp.size
        if isinstance(tensor, QuantBlocks):
            check_shape(leaf, tensor.shape, (self.linear.out_features, self.in_features))
            self.linear.quant_weight = tensor.cols(self.tp.rank * local, local)  # parked
        else:
            _copy(self.linear.weight, tensor.narrow(1, self.tp.rank * local, local), leaf)
        return "linear.weight"


class VocabParallelEmbedding(nn.Module):
    """Rows [first, first + rows) of the table; ids outside look up zeros; then all-reduce."""

    def __init__(self, vocab: int, hidden: int, tp: TPShard) -> None:
        super().__init__()
        self.tp, self.vocab = tp, vocab
        self.rows = -(-vocab // tp.size)
        self.first = tp.rank * self.rows
        self.weight = nn.Parameter(torch.empty(self.rows, hidden))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return vocab_lookup(
            ids, self.first, self.rows, lambda i: F.embedding(i, self.weight), self.tp
        )

    def load_weight(self, leaf: str, tensor: torch.Tensor) -> str:
        if isinstance(tensor, QuantBlocks):
            self.quant_weight = _vocab_blocks(tensor, self.first, self.rows, self.vocab, leaf)
        else:
            _copy_vocab_rows(self.weight, tensor, self.first, self.vocab, leaf)
        return "weight"


def vocab_lookup(ids: torch.Tensor, first: int, rows: int, lookup, tp: TPShard) -> torch.Tensor:
    """The embeddings of `ids` from a table holding rows [first, first + rows) (`lookup` of
    local ids), zeros for the other ranks' ids, summed over the ranks."""
    local = ids - first
    outside = (local < 0) | (local >= rows)
    h = lookup(local.masked_fill(outside, 0))
    h = h.masked_fill(outside.unsqueeze(-1), 0)
    return tp.comm.all_reduce(h)


class ParallelLMHead(nn.Module):
    """The logits of rows [first, first + rows) of the vocabulary on each rank, gathered on
    every rank in vocabulary order, the padding dropped."""

    def __init__(self, hidden: int, vocab: int, tp: TPShard) -> None:
        super().__init__()
        self.tp, self.vocab = tp, vocab
        self.rows = -(-vocab // tp.size)
        self.first = tp.rank * self.rows
        self.linear = nn.Linear(hidden, self.rows, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.tp.comm.all_gather_last(self.linear(hidden))[..., : self.vocab]

    def load_weight(self, leaf: str, tensor: torch.Tensor) -> str:
        if isinstance(tensor, QuantBlocks):
            self.linear.quant_weight = _vocab_blocks(
                tensor, self.first, self.rows, self.vocab, leaf
            )
        else:
            _copy_vocab_rows(self.linear.weight, tensor, self.first, self.vocab, leaf)
        return "linear.weight"


def _vocab_blocks(blocks: QuantBlocks, first: int, rows: int, vocab: int, what: str):
    """Rows [first, first + rows) of a [vocab, hidden] weight in blocks; zero bytes (zeros in
    every format) past the end. A view when no padding is needed."""
    check_shape(what, blocks.shape, (vocab, blocks.shape[1]))
    count = max(0, min(rows, vocab - first))
    part = blocks.rows(min(first, vocab), count)  # a rank past a tiny vocabulary: none
    if count == rows:
        return part
    pad = torch.zeros(rows - count, blocks.data.shape[1], dtype=torch.uint8)
    return QuantBlocks(blocks.qtype, torch.cat([part.data, pad]), (rows, blocks.shape[1]))


def _copy_vocab_rows(target, tensor, first: int, vocab: int, what: str) -> None:
    """Rows [first, first + len(target)) of a [vocab, hidden] tensor; zeros past the end."""
    check_shape(what, tensor.shape, (vocab, target.shape[1]))
    count = max(0, min(target.shape[0], vocab - first))
    with torch.no_grad():
        target.zero_()
        target[:count].copy_(tensor[first : first + count])


def _copy(target, tensor, what: str) -> None:
    check_shape(what, tensor.shape, target.shape)
    with torch.no_grad():
        target.copy_(tensor)
