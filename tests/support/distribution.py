"""The distribution sampling parameters define, and the chi-square check that tokens drawn
from it follow it: for the sampler's own tests (tests/workers/test_sampling_distribution.py)
and the engine's and server's (tests/e2e/test_sampling_vs_transformers.py)."""

import math

import torch

Z_999 = 3.0902  # standard normal quantile at 0.999


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


def chi_square_ok(tokens: torch.Tensor, probs: torch.Tensor) -> bool:
    """False when the counts of `tokens` reject `probs` at significance 0.001; a token drawn
    where probs is 0 always rejects."""
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
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
