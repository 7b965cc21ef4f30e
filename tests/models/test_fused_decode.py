"""FusedDecode's choice between the one-call decode stack and the per-layer calls, on a stub
kernel (no compiler): a layer the stack rejects leaves the per-layer calls on, and a step with
a row of no context (the stack takes lengths >= 1) runs them; every layer call gets the plan's
all-reduce last (None on one rank)."""

import logging

import torch

from vserve.attention.base import AttentionMetadata
from vserve.models.fused_decode import FusedDecode, FusedLayer, LayerConsts


class _Stack:
    reject = False

    def __init__(self) -> None:
        self.runs = 0

    def add_layer(self, *args) -> None:
        if self.reject:
            raise RuntimeError("DecodeStack: a norm has the wrong size or dtype for its style")

    def run(self, h, *args):
        self.runs += 1
        return h


class _Kernel:
    def __init__(self, reject: bool) -> None:
        self.layer_calls = 0
        self.all_reduces: list = []
        self.DecodeStack = type("DecodeStack", (_Stack,), {"reject": reject})

    def decoder_layer_q(self, h, *args):
        self.layer_calls += 1
        self.all_reduces.append(args[-1])
        return h

    decoder_layer = decoder_layer_q


def _layers(n: int, quantized: bool = True) -> list[FusedLayer]:
    consts = LayerConsts(2, 1, 8, -1, 0.35, 0.0, 1e-6, 0, 0)
    parts = [[torch.zeros(4, 34, dtype=torch.uint8)] for _ in range(4)]
    plain = [[8] for _ in range(4)]
    return [FusedLayer(parts, plain, [None] * 4, [], i, 0, consts, quantized) for i in range(n)]


def _meta(seq_lens: list[int]) -> AttentionMetadata:
    n = len(seq_lens)
    return AttentionMetadata(
        num_tokens=n,
        positions=torch.tensor([max(s - 1, 0) for s in seq_lens]),
        slot_mapping=torch.arange(n),
        query_start_loc=torch.arange(n + 1, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.arange(n, dtype=torch.int32).view(n, 1),
        query_start_loc_cpu=list(range(n + 1)),
        seq_lens_cpu=seq_lens,
        max_query_len=1,
        max_seq_len=max(seq_lens),
    )


def _run(fused: FusedDecode, seq_lens: list[int]) -> None:
    h = torch.zeros(len(seq_lens), 16, dtype=torch.bfloat16)
    rope = (torch.zeros(len(seq_lens), 8), torch.zeros(len(seq_lens), 8))
    fused.run(h, [rope], [torch.zeros(1)] * 2, _meta(seq_lens))


def test_a_layer_the_stack_rejects_leaves_the_per_layer_calls(caplog):
    kernel = _Kernel(reject=True)
    with caplog.at_level(logging.WARNING, logger="vserve"):
        fused = FusedDecode(kernel, _layers(2))  # no error: the model still loads
    assert fused.stack is None
    assert "wrong size or dtype" in caplog.text
    _run(fused, [3, 5])
    assert kernel.layer_calls == 2


def test_a_row_of_no_context_runs_the_per_layer_calls():
    kernel = _Kernel(reject=False)
    fused = FusedDecode(kernel, _layers(2))
    _run(fused, [3, 5])
    assert (fused.stack.runs, kernel.layer_calls) == (1, 0)
    _run(fused, [3, 0])
    assert (fused.stack.runs, kernel.layer_calls) == (1, 2)


def test_a_tensor_parallel_plan_passes_its_all_reduce_to_every_layer_call():
    kernel = _Kernel(reject=False)

    def all_reduce(x: torch.Tensor) -> torch.Tensor:
        return x

    fused = FusedDecode(kernel, _layers(2, quantized=False), all_reduce)
    assert fused.stack is None  # the one-call stack has no place for the all-reduces
    _run(fused, [3, 5])
    assert kernel.all_reduces == [all_reduce] * 2


def test_one_rank_passes_no_all_reduce():
    kernel = _Kernel(reject=True)  # no stack: the per-layer calls run
    _run(FusedDecode(kernel, _layers(2, quantized=False)), [3, 5])
    assert kernel.all_reduces == [None] * 2
