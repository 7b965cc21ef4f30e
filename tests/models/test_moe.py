"""Mixture-of-experts layers (`vserve/models/moe.py`): the experts grouped by token equal a
plain per-token loop over each token's top k; a step reads only the experts it routes to
(every other expert's weights NaN leave the output finite); the router's top-k weights are
renormalized only where the family says so; a checkpoint missing one expert is refused."""

import types

import pytest
import torch

from vserve.models.moe import Experts, MoESpec, SparseMoE, moe_spec

SPEC = MoESpec(num_experts=8, top_k=2, intermediate=16, renormalize=True)


def _experts(spec: MoESpec = SPEC, hidden: int = 12) -> Experts:
    torch.manual_seed(0)
    experts = Experts(spec, hidden, types.SimpleNamespace(rank=0, size=1))
    with torch.no_grad():
        experts.w13.normal_(0, 0.3)
        experts.w2.normal_(0, 0.3)
    return experts


def _per_token(experts: Experts, x, weights, ids):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t], ids[t].tolist()):
            gate, up = (x[t] @ experts.w13[e].T).chunk(2)
            out[t] += w * ((torch.nn.functional.silu(gate) * up) @ experts.w2[e].T)
    return out


def test_grouped_experts_equal_a_per_token_loop():
    experts = _experts()
    x = torch.randn(9, 12)
    ids = torch.randint(0, 8, (9, 2))
    ids[:, 1] = (ids[:, 0] + 1 + torch.randint(0, 7, (9,))) % 8  # two distinct experts
    weights = torch.rand(9, 2)
    torch.testing.assert_close(
        experts(x, weights, ids, "silu"), _per_token(experts, x, weights, ids)
    )


def test_one_token_alone_equals_the_same_token_in_a_batch():
    """Batch 1 takes its own path (no sort, no scatter): the same experts, summed in the same
    order, as the token gets inside a batch (ids given out of order on purpose)."""
    experts = _experts()
    x = torch.randn(5, 12)
    ids = torch.tensor([[6, 1], [2, 3], [1, 0], [7, 4], [5, 2]])
    weights = torch.rand(5, 2)
    batched = experts(x, weights, ids, "silu")
    for t in range(5):
        alone = experts(x[t : t + 1], weights[t : t + 1], ids[t : t + 1], "silu")
        torch.testing.assert_close(alone, batched[t : t + 1], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(alone, _per_token(experts, x, weights, ids)[t : t + 1])


def test_one_bf16_token_streams_its_experts_through_the_gemv():
    """bf16 with the CPU kernels attached (as a bf16 model loads): one token's experts run the
    kernels' one-row gemv on the row-major weights, within bf16 rounding of the loop."""
    from vserve import cpu_ops

    kernel = cpu_ops.load()
    if kernel is None:
        pytest.skip("the CPU kernels cannot be built here")
    experts = _experts(hidden=64).to(torch.bfloat16)
    experts.kernel = counting = _Counting(kernel)
    x = torch.randn(1, 64).to(torch.bfloat16)
    ids, weights = torch.tensor([[5, 2]]), torch.tensor([[0.6, 0.4]], dtype=torch.bfloat16)
    got = experts(x, weights, ids, "silu").float()
    ref = _per_token(_experts(hidden=64), x.float(), weights.float(), ids)
    assert counting.gemv_calls == 4  # gate/up and down of two experts
    torch.testing.assert_close(got, ref, atol=3e-2, rtol=3e-2)


class _Counting:
    def __init__(self, kernel) -> None:
        self.kernel, self.gemv_calls = kernel, 0

    def gemv(self, *args):
        self.gemv_calls += 1
        return self.kernel.gemv(*args)

    def __getattr__(self, name):
        return getattr(self.kernel, name)


def test_a_step_reads_only_the_routed_experts():
    experts = _experts()
    ids = torch.tensor([[1, 6]])
    with torch.no_grad():
        for e in set(range(8)) - {1, 6}:
            experts.w13[e].fill_(float("nan"))
            experts.w2[e].fill_(float("nan"))
    out = experts(torch.randn(1, 12), torch.tensor([[0.7, 0.3]]), ids, "silu")
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("renormalize", [True, False])
def test_the_router_renormalizes_as_the_family_says(renormalize):
    cfg = types.SimpleNamespace(
        model_type="olmoe",
        hidden_size=12,
        num_experts=8,
        num_experts_per_tok=2,
        intermediate_size=16,
        norm_topk_prob=renormalize,
        hidden_act="silu",
    )
    layer = SparseMoE(cfg, types.SimpleNamespace(rank=0, size=1))
    assert moe_spec(cfg).renormalize is renormalize
    seen = {}

    def record(x, weights, ids, act):
        seen["w"] = weights
        return torch.zeros_like(x)

    layer.experts.forward = record
    torch.nn.init.normal_(layer.gate.weight)
    layer(torch.randn(5, 12))
    sums = seen["w"].sum(-1)
    if renormalize:
        torch.testing.assert_close(sums, torch.ones(5))
    else:
        assert (sums < 1).all()


def test_a_missing_expert_is_never_counted_loaded():
    experts = _experts()
    names = set()
    for e in range(8):
        for part in (0, 1, 2):
            if (e, part) != (5, 1):
                shape = (16, 12) if part < 2 else (12, 16)
                names.add(experts.load_weight(f"{e}_{part}", torch.zeros(shape)))
    assert "w2" in names and "w13" not in names  # expert 5's up_proj never came
