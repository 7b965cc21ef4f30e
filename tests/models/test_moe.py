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
