"""The Triton experts (csrc_triton/fused_moe.py, the CUDA path of a mixture's sparse layer)
equal the per-pair torch loop, under the Triton interpreter on CPU (tiny shapes): decode
(one token), a few tokens, every pair on one expert, experts no token routes to, and tiles
that a run fills exactly or leaves part empty."""

import os
from functools import partial

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first `import triton`
triton = pytest.importorskip("triton")

from vserve.csrc_triton.fused_moe import (  # noqa: E402
    align,
    fused_experts,
    fused_experts_reference,
)
from vserve.models.layers import act_and_mul  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
silu_and_mul = partial(act_and_mul, act="silu")  # the gated activation the layer hands over
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


def _case(tokens: int, experts: int, top_k: int, hidden: int, inter: int, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) / inter**0.5
    logits = torch.randn(tokens, experts, generator=g)
    weights, ids = torch.topk(torch.softmax(logits, -1), top_k, dim=-1)
    cast = [t.to(DEVICE, dtype) for t in (x, w13, w2, weights)]
    return *cast, ids.to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "tokens,experts,top_k,hidden,inter",
    [(1, 8, 2, 32, 16), (5, 4, 2, 48, 24), (17, 8, 3, 32, 40)],
    ids=["decode", "few", "ragged"],
)
def test_fused_experts_equal_the_loop(tokens, experts, top_k, hidden, inter, dtype):
    x, w13, w2, weights, ids = _case(tokens, experts, top_k, hidden, inter, dtype)
    got = fused_experts(x, w13, w2, weights, ids, silu_and_mul)
    ref = fused_experts_reference(x, w13, w2, weights, ids, silu_and_mul)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


def test_every_pair_on_one_expert_and_idle_experts():
    x, w13, w2, weights, _ = _case(20, 6, 1, 32, 16, torch.float32, seed=3)
    ids = torch.full((20, 1), 4, dtype=torch.int64, device=DEVICE)  # 20 rows: tiles of 16 + 4
    got = fused_experts(x, w13, w2, weights, ids, silu_and_mul)
    ref = fused_experts_reference(x, w13, w2, weights, ids, silu_and_mul)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_align_pads_each_run_to_whole_tiles():
    ids = torch.tensor([[2, 0], [2, 3], [2, 0]])  # expert 0: 2 pairs, 2: 3, 3: 1, 1: none
    plan = align(ids, 4, block_m=4)
    tiles = plan.tile_expert.tolist()
    assert tiles[:3] == [0, 2, 3] and all(t == -1 for t in tiles[3:])
    rows = plan.sorted_pairs.view(-1, 4).tolist()
    assert rows[0] == [1, 5, 6, 6] and rows[1] == [0, 2, 4, 6] and rows[2] == [3, 6, 6, 6]


def test_no_tokens():
    x, w13, w2, weights, ids = _case(0, 4, 2, 32, 16, torch.float32)
    assert fused_experts(x, w13, w2, weights, ids, silu_and_mul).shape == (0, 32)


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen2_moe"])
def test_a_sparse_layer_on_the_triton_path_equals_its_loop(monkeypatch, kind):
    """The layer hands the grouped GEMMs its stacked weights, routing and activation: the
    same output as its per-expert loop (the path taken on CUDA, forced here)."""
    import types

    from vserve.models import moe

    cfg = types.SimpleNamespace(
        model_type=kind,
        hidden_size=32,
        num_experts=6,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
        norm_topk_prob=True,
        hidden_act="silu",
    )
    torch.manual_seed(0)
    layer = moe.SparseMoE(cfg, types.SimpleNamespace(rank=0, size=1))
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
    layer = layer.to(DEVICE)
    x = torch.randn(9, 32, device=DEVICE)
    with torch.no_grad():
        monkeypatch.setattr(moe, "use_triton", lambda x: False)
        loop = layer(x)
        monkeypatch.setattr(moe, "use_triton", lambda x: True)
        fused = layer(x)
    torch.testing.assert_close(fused, loop, atol=1e-5, rtol=1e-5)
