"""top-k / top-p / min-p sampling on a candidate set picks exactly the token a full sort of the
vocabulary picks, and falls back to the full sort when the kept tokens do not fit; the filtered
distribution that verifies speculative drafts is the same on both paths. Sampling tests run on
the torch sampler's candidates and on the fused CPU kernel's
(tests/workers/test_sampler_kernel.py)."""

import pytest
import torch

from vserve.workers import sampler
from vserve.workers.sampler import Sampler, SamplingMetadata

VOCAB = 8192


def _meta(params, seed=0):
    n = len(params)
    return SamplingMetadata(
        temperature=[p[0] for p in params],
        top_k=[p[1] for p in params],
        top_p=[p[2] for p in params],
        min_p=[p[3] for p in params],
        seeds=[seed + i for i in range(n)],
        positions=[7 * i + 3 for i in range(n)],
        num_logprobs=[None] * n,
        logit_bias=[None] * n,
        masked_ids=[None] * n,
        presence=[0.0] * n,
        frequency=[0.0] * n,
        repetition=[1.0] * n,
    )


PARAMS = [  # (temperature, top_k, top_p, min_p)
    (1.0, 50, 1.0, 0.0),
    (0.7, 0, 0.9, 0.0),
    (1.3, 0, 0.95, 0.0),
    (1.0, 0, 1.0, 0.05),
    (1.0, 20, 0.8, 0.1),
    (0.5, 0, 0.5, 0.0),
    (1.0, 5000, 1.0, 0.0),
    (2.0, 0, 0.999, 0.0),
]


def _logits(rows, sharpness, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, VOCAB, generator=g) * sharpness
    return x.bfloat16().float()  # bf16 rounding: many exactly tied logits, as in real runs


def _full_sort(monkeypatch, logits, meta):
    with monkeypatch.context() as m:
        m.setattr(sampler, "CANDIDATES", VOCAB)  # no candidate path: always the full sort
        return Sampler(use_kernel=False)(logits, meta).token_ids


BOTH_PATHS = pytest.mark.parametrize("use_kernel", [False, True], ids=["torch", "kernel"])


@BOTH_PATHS
@pytest.mark.parametrize("sharpness", [0.5, 3.0, 8.0])
def test_candidates_pick_what_the_full_sort_picks(sharpness, use_kernel, monkeypatch):
    monkeypatch.setattr(sampler, "CANDIDATES", 256)
    for seed in range(6):
        logits = _logits(len(PARAMS), sharpness, seed)
        meta = _meta(PARAMS, seed * 100)
        fast = Sampler(use_kernel)(logits, meta).token_ids
        assert torch.equal(fast, _full_sort(monkeypatch, logits, meta))


@BOTH_PATHS
def test_both_paths_are_taken(use_kernel, monkeypatch):
    """Peaked rows fit in the candidates, flat rows (top-p 0.999 at temperature 2 over random
    logits) do not; count the rows each path handles."""
    monkeypatch.setattr(sampler, "CANDIDATES", 256)
    calls = {"full": 0}
    real_sort = torch.Tensor.sort

    def counting_sort(self, *args, **kwargs):
        if self.shape[-1] == VOCAB:
            calls["full"] += self.shape[0]
        return real_sort(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "sort", counting_sort)
    logits = _logits(2, 1.0, 0)
    logits[0] *= 8.0  # peaked: fits
    Sampler(use_kernel)(logits, _meta([(1.0, 0, 0.9, 0.0), (2.0, 0, 0.999, 0.0)]))
    assert calls["full"] == 1  # only the flat row sorts


@BOTH_PATHS
def test_ties_at_the_candidate_boundary_fall_back(use_kernel, monkeypatch):
    """Every token equally likely: the kept prefix is decided among ties, which only the full
    sort orders (lower id first), so the row must not take the candidate path."""
    monkeypatch.setattr(sampler, "CANDIDATES", 256)
    logits = torch.zeros(1, VOCAB)
    meta = _meta([(1.0, 100, 1.0, 0.0)])
    picked = Sampler(use_kernel)(logits, meta).token_ids
    assert picked.item() < 100 and torch.equal(picked, _full_sort(monkeypatch, logits, meta))


def test_candidate_sampling_keeps_the_distribution(monkeypatch):
    """Empirical frequencies over many seeds match the filtered distribution."""
    monkeypatch.setattr(sampler, "CANDIDATES", 256)
    logits = torch.full((1, VOCAB), -40.0)
    logits[0, :6] = torch.tensor([3.0, 2.5, 2.0, 1.0, 0.5, 0.0])
    top_p = 0.8
    probs = logits.softmax(-1)[0]
    sorted_p, _ = probs.sort(descending=True)
    keep = (sorted_p.cumsum(0) - sorted_p) < top_p
    want = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))[:6]
    want = want / want.sum()
    n = 4000
    meta = _meta([(1.0, 0, top_p, 0.0)] * n)
    meta.positions = list(range(n))
    picked = Sampler()(logits.expand(n, -1).contiguous(), meta).token_ids
    freq = torch.bincount(picked, minlength=VOCAB)[:6].float() / n
    assert picked.max().item() < 6
    assert (freq - want).abs().max().item() < 0.03


@pytest.mark.parametrize("params", PARAMS)
def test_filtered_probs_equal_the_full_sort(params, monkeypatch):
    """The drafts' verifier filters with the same candidate machinery: the probabilities in
    vocab order are bitwise those of the full sort, for peaked rows (candidates) and flat
    ones (fallback) in one call."""
    from vserve.sampling_params import SamplingParams

    temperature, top_k, top_p, min_p = params
    sp = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    logits = _logits(6, 1.0, 3)
    logits[:3] *= 8.0
    scaled = logits / temperature
    monkeypatch.setattr(sampler, "CANDIDATES", 256)
    fast = sampler.filtered_probs(scaled, sp)
    monkeypatch.setattr(sampler, "CANDIDATES", VOCAB)
    full = sampler.filtered_probs(scaled, sp)
    assert torch.equal(fast, full)
    assert (fast > 0).sum(dim=-1).min().item() >= 1


def test_sampler_imports_on_its_own():
    """Regression: importing workers.sampler first used to hit a circular import (the front
    end's processor imported the seed hash from it)."""
    import subprocess
    import sys

    subprocess.run(
        [sys.executable, "-c", "import vserve.workers.sampler"],
        check=True,
        cwd=str(__import__("pathlib").Path(__file__).parents[2]),
    )
