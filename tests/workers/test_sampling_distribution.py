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

import math

import pytest
import torch

from vserve.workers.sampler import Sampler, SamplingMetadata

VOCAB = 120
DRAWS = 4000
Z_999 = 3.0902  # standard normal quantile at 0.999


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


def reference_probs(
    row: torch.Tensor, temperature: float, top_k=0, top_p=1.0, min_p=0.0
) -> torch.Tensor:
    """The distribution the parameters define, in float64 (vLLM's and the OpenAI API's rules:
    top-k most likely; the smallest prefix by probability with mass >= top_p; tokens with
    probability >= min_p x the largest), renormalised."""
    p = (row.double() / temperature).softmax(dim=-1)
    order = p.argsort(descending=True, stable=True)
    sorted_p = p[order]
    keep = torch.ones_like(sorted_p, dtype=torch.bool)
    if top_k > 0:
        keep[top_k:] = False
    keep &= (sorted_p.cumsum(0) - sorted_p) < top_p
    keep &= sorted_p >= min_p * sorted_p[0]
    out = torch.zeros_like(p)
    out[order[keep]] = sorted_p[keep]
    return out / out.sum()


def draw(
    row: torch.Tensor, use_kernel: bool, dtype=torch.float32, seed=7, **params
) -> torch.Tensor:
    logits = row.to(dtype).unsqueeze(0).expand(DRAWS, -1).contiguous()
    return Sampler(use_kernel)(logits, _meta(DRAWS, seed=seed, **params)).token_ids


def chi_square_ok(tokens: torch.Tensor, probs: torch.Tensor) -> bool:
    """False when the counts of `tokens` reject `probs` at significance 0.001; a token drawn
    where probs is 0 always rejects."""
    counts = torch.bincount(tokens, minlength=VOCAB).double()
    if counts[probs == 0].sum() > 0:
        return False
    expected = probs * len(tokens)
    order = expected.argsort(descending=True)
    bins_obs, bins_exp, acc_obs, acc_exp = [], [], 0.0, 0.0
    for i in order.tolist():  # merge the smallest expectations until each bin has >= 5
        if expected[i] == 0:
            continue
        acc_obs += counts[i].item()
        acc_exp += expected[i].item()
        if acc_exp >= 5:
            bins_obs.append(acc_obs)
            bins_exp.append(acc_exp)
            acc_obs = acc_exp = 0.0
    if acc_exp > 0:
        bins_obs[-1] += acc_obs
        bins_exp[-1] += acc_exp
    df = len(bins_exp) - 1
    if df == 0:
        return True
    stat = sum((o - e) ** 2 / e for o, e in zip(bins_obs, bins_exp))
    # Wilson-Hilferty: the chi-square quantile from the normal one
    critical = df * (1 - 2 / (9 * df) + Z_999 * math.sqrt(2 / (9 * df))) ** 3
    return stat < critical


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
