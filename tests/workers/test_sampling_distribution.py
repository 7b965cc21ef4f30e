"""Sampled tokens follow the exact distribution: softmax(logits / T) at T = 0.5, 1 and 2, and after
top-k, top-p and min-p, on both sampling paths (the fused CPU kernel and the torch sampler).

Each case draws 4000 tokens from one fixed row of 120 logits, one draw per position (a fixed
seed per case, distinct positions), and compares the counts with probabilities computed here
in float64 by a chi-square test at significance 0.001 (bins with expected count under 5
merged). The draws
are deterministic, so the test cannot flake; `test_the_check_catches_a_sampler_that_ignores_*`
shows it has the power to fail: the same check rejects samples drawn at T = 1 when T = 0.5 or 2
was asked for, and samples drawn without the filter when a filter was asked for.
"""

import pytest
import torch

from tests.support.distribution import chi_square_ok, reference_probs
from vserve.workers.sampler import Sampler, SamplingMetadata

VOCAB = 120
DRAWS = 4000


def _row() -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    return torch.randn(VOCAB, generator=g) * 1.5  # a spread of likely and unlikely tokens


def _meta(n: int, temperature: float, top_k=0, top_p=1.0, min_p=0.0, seed=7) -> SamplingMetadata:
    return SamplingMetadata(
        temperature=[temperature] * n,
        top_k=[top_k] * n,
        top_p=[top_p] * n,
        min_p=[min_p] * n,
        seeds=[seed] * n,
        positions=list(range(n)),
        num_logprobs=[None] * n,
        logit_bias=[None] * n,
        masked_ids=[None] * n,
        presence=[0.0] * n,
        frequency=[0.0] * n,
        repetition=[1.0] * n,
    )


def draw(
    row: torch.Tensor, use_kernel: bool, dtype=torch.float32, seed=7, **params
) -> torch.Tensor:
    logits = row.to(dtype).unsqueeze(0).expand(DRAWS, -1).contiguous()
    return Sampler(use_kernel)(logits, _meta(DRAWS, seed=seed, **params)).token_ids


CASES = [
    dict(temperature=0.5),
    dict(temperature=1.0),
    dict(temperature=2.0),
    dict(temperature=1.0, top_k=10),
    dict(temperature=2.0, top_k=25),
    dict(temperature=1.0, top_p=0.7),
    dict(temperature=0.5, top_p=0.9),
    dict(temperature=1.0, min_p=0.1),
    dict(temperature=2.0, min_p=0.05),
    dict(temperature=1.5, top_k=30, top_p=0.8, min_p=0.02),
]


@pytest.mark.parametrize("use_kernel", [True, False], ids=["kernel", "torch"])
@pytest.mark.parametrize("params", CASES, ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()))
def test_sampled_tokens_follow_the_distribution(params, use_kernel):
    row = _row()
    tokens = draw(row, use_kernel, seed=CASES.index(params), **params)  # its own uniforms
    assert chi_square_ok(tokens, reference_probs(row, **params))


@pytest.mark.parametrize("use_kernel", [True, False], ids=["kernel", "torch"])
def test_bf16_logits_follow_the_distribution_of_their_values(use_kernel):
    row = _row().bfloat16().float()
    tokens = draw(row, use_kernel, dtype=torch.bfloat16, temperature=0.7, top_p=0.95)
    assert chi_square_ok(tokens, reference_probs(row, temperature=0.7, top_p=0.95))


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_the_check_catches_a_sampler_that_ignores_temperature(temperature):
    row = _row()
    ignoring = draw(row, True, temperature=1.0)  # what a sampler ignoring T would draw
    assert not chi_square_ok(ignoring, reference_probs(row, temperature))


@pytest.mark.parametrize(
    "params", [dict(top_k=10), dict(top_p=0.7), dict(min_p=0.1)], ids=["top_k", "top_p", "min_p"]
)
def test_the_check_catches_a_sampler_that_ignores_a_filter(params):
    row = _row()
    ignoring = draw(row, True, temperature=1.0)
    assert not chi_square_ok(ignoring, reference_probs(row, 1.0, **params))
