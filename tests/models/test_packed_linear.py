"""Prepacked oneDNN linears (bf16 on CPUs with native bf16) are a speed change only: their
outputs are those of F.linear, layer by layer and end to end: bitwise, except where an AMX
CPU's oneDNN blocks a wide input differently for the packed and the plain weight (then one
bf16 rounding step on a few elements; greedy outputs stay identical)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.support.engines import greedy_with_logprobs, make_llm
from vserve.models import loader
from vserve.models.packed_linear import PackedLinear, can_pack, pack_linears
from vserve.models.stage import FusedLinear

AMX = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
needs_packing = pytest.mark.skipif(
    not can_pack(torch.device("cpu"), torch.bfloat16),
    reason="this CPU has no native bf16 (packing is off there, F.linear runs)",
)


def test_packing_only_for_bf16_on_the_cpu():
    cpu = torch.device("cpu")
    assert not can_pack(cpu, torch.float32)  # fp32 runs MKL: must equal transformers
    assert not can_pack(cpu, torch.float16)
    assert not can_pack(torch.device("cuda"), torch.bfloat16)


@needs_packing
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1536, 64), (64, 200), (4096, 640)])
def test_packed_linear_is_bitwise_f_linear(shape, bias):
    torch.manual_seed(0)
    out_f, in_f = shape
    linear = nn.Linear(in_f, out_f, bias=bias).to(torch.bfloat16)
    packed = PackedLinear(linear)
    for rows in (0, 1, 3, 8, 65, 300):
        x = torch.randn(rows, in_f, dtype=torch.bfloat16)
        got, want = packed(x), F.linear(x, linear.weight, linear.bias)
        if AMX and rows > 8:  # measured: 11-77 of 0.27M-1.2M elements, one step, at 640 x 4096
            torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-5)
            assert (got != want).sum().item() <= 1e-3 * got.numel(), rows
        else:
            assert torch.equal(got, want), rows
    strided = torch.randn(5, 2 * in_f, dtype=torch.bfloat16)[:, :in_f]  # a split's view
    assert torch.equal(packed(strided), F.linear(strided, linear.weight, linear.bias))


def test_pack_linears_replaces_every_linear_and_keeps_shard_sizes():
    model = nn.Module()
    model.inner = nn.Module()
    model.inner.qkv = FusedLinear(16, [8, 4, 4], bias=False).to(torch.bfloat16)
    model.head = nn.Linear(16, 32, bias=False).to(torch.bfloat16)
    model.norm = nn.LayerNorm(16)
    if not can_pack(torch.device("cpu"), torch.bfloat16):
        pytest.skip("no native bf16 on this CPU")
    assert pack_linears(model) == 2
    assert isinstance(model.inner.qkv, PackedLinear) and model.inner.qkv.shard_sizes == [8, 4, 4]
    assert isinstance(model.head, PackedLinear) and isinstance(model.norm, nn.LayerNorm)


def _greedy(model_dir, prompts):
    llm = make_llm(model_dir, dtype="bfloat16", max_model_len=128)
    packed = any(
        isinstance(m, PackedLinear)
        for m in llm.engine.client.core.executor.worker.runner.model.modules()
    )
    result = greedy_with_logprobs(llm, prompts, max_tokens=12)
    llm.shutdown()
    return packed, result


@needs_packing
@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_packed_model_generates_bitwise_the_same(kind, tiny_model_dir, monkeypatch):
    monkeypatch.setattr(loader.cpu_ops, "load", lambda: None)  # packing alone (kernels: their
    prompts = [[5, 17, 99, 3, 42, 7], [8] * 20, list(range(30, 60))]  # own tests)
    packed, with_packing = _greedy(tiny_model_dir(kind), prompts)
    monkeypatch.setattr(loader, "can_pack", lambda device, dtype: False)
    unpacked, without = _greedy(tiny_model_dir(kind), prompts)
    assert packed and not unpacked
    assert with_packing == without  # token ids and every top-3 logprob, exactly
