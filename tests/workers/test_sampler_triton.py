"""The Triton sampling kernels (the CUDA path of the sampler: csrc_triton/sample.py for rows
without filters, csrc_triton/sample_filtered.py for rows with top-k / top-p / min-p) pick what
their float64 torch references pick, and through the Sampler their tokens follow the
distribution the parameters define at T = 0.5, 1 and 2 (the chi-square check of
test_sampling_distribution.py) and equal the torch path's token for token, filtered and greedy
rows beside them included.

Without CUDA the kernel runs under the Triton interpreter, so the shapes stay small, and a
distribution check draws its first rows through the kernels (which must pick what their
references pick) and the rest through the references.
"""

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first `import triton`
triton = pytest.importorskip("triton")
if not torch.cuda.is_available() and type(triton.language.zeros).__name__ == "JITFunction":
    raise RuntimeError("triton was imported before TRITON_INTERPRET=1 was set")

from tests.support.distribution import chi_square_ok, reference_probs  # noqa: E402
from tests.workers.test_sampling_distribution import _meta, _row  # noqa: E402
from vserve.core.seeds import uniform_for  # noqa: E402
from vserve.csrc_triton.sample import BLOCK, sample_rows, sample_rows_reference  # noqa: E402
from vserve.csrc_triton.sample_filtered import BLOCK as FILTERED_BLOCK  # noqa: E402
from vserve.csrc_triton.sample_filtered import (  # noqa: E402
    sample_filtered,
    sample_filtered_reference,
)
from vserve.workers.sampler import Sampler  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DRAWS = 500  # per distribution check
# each row is one program, and the interpreter takes milliseconds per operation: without CUDA
# the kernels draw the first rows only, and must pick exactly what their references pick
INTERPRETED_DRAWS = 16


def _case(rows: int, vocab: int, dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=g) * 3).to(dtype).to(DEVICE)
    picked = torch.arange(rows - 1, -1, -2, dtype=torch.long, device=DEVICE)  # some, reordered
    temps = torch.tensor([(0.0, 0.5, 1.0, 2.0)[i % 4] for i in range(len(picked))])
    u = torch.tensor([uniform_for(seed, i) for i in range(len(picked))], dtype=torch.float64)
    return logits, picked, temps.to(DEVICE), u.to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [120, BLOCK, 2 * BLOCK + 77], ids=["short", "one", "ragged"])
def test_kernel_equals_its_reference(dtype, vocab):
    logits, rows, temps, u = _case(16, vocab, dtype)
    got = sample_rows(logits, rows, temps, u)
    assert torch.equal(got, sample_rows_reference(logits, rows, temps, u))
    greedy = temps == 0
    assert torch.equal(got[greedy], logits[rows[greedy]].float().argmax(dim=-1))


def test_kernel_reads_rows_of_a_strided_view_and_keeps_ties_first():
    logits, rows, temps, u = _case(12, 300, torch.float32, seed=3)
    logits[:, 17] = logits[:, 42] = 50.0  # a tie for the maximum: the first index wins
    view = logits[:, :257]  # row stride 300, vocabulary 257
    got = sample_rows(view, rows, temps, u)
    assert torch.equal(got, sample_rows_reference(view, rows, temps, u))
    assert (got[temps == 0] == 17).all()


def test_a_u_just_below_one_takes_the_last_token():
    logits = torch.zeros(1, 50, device=DEVICE)
    one = torch.tensor([1.0], device=DEVICE)
    top = torch.tensor([1.0 - 2.0**-53], dtype=torch.float64, device=DEVICE)
    assert sample_rows(logits, torch.zeros(1, dtype=torch.long, device=DEVICE), one, top) == 49


def _sampler_draws(row: torch.Tensor, n: int, seed: int, **params) -> torch.Tensor:
    """Rows 0..n-1 of one seed, each the same logits, through the Sampler's Triton path."""
    logits = row.unsqueeze(0).expand(n, -1).contiguous().to(DEVICE)
    return Sampler(triton=True)(logits, _meta(n, seed=seed, **params)).token_ids.cpu()


def _reference_draws(row: torch.Tensor, seed: int, **params) -> torch.Tensor:
    """The same DRAWS rows picked by the float64 reference of the kernel that takes them."""
    n = DRAWS
    args = (
        row.unsqueeze(0),
        torch.zeros(n, dtype=torch.long),
        torch.full((n,), params["temperature"]),
        torch.tensor([uniform_for(seed, i) for i in range(n)], dtype=torch.float64),
    )
    limits = (params.get("top_k", 0), params.get("top_p", 1.0), params.get("min_p", 0.0))
    if limits == (0, 1.0, 0.0):
        return sample_rows_reference(*args)
    top_k, top_p, min_p = limits
    return sample_filtered_reference(
        *args,
        torch.full((n,), top_k),
        torch.full((n,), top_p, dtype=torch.float64),
        torch.full((n,), min_p),
    )


def _draws(row: torch.Tensor, seed: int, **params) -> torch.Tensor:
    """DRAWS tokens of the Sampler's Triton path: all its own on CUDA; under the interpreter
    its first INTERPRETED_DRAWS, which must equal the reference's, and the reference's rest."""
    if DEVICE == "cuda":
        return _sampler_draws(row, DRAWS, seed, **params)
    picks = _reference_draws(row, seed, **params)
    ours = _sampler_draws(row, INTERPRETED_DRAWS, seed, **params)
    assert torch.equal(ours, picks[:INTERPRETED_DRAWS]), (ours, picks[:INTERPRETED_DRAWS])
    return picks


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_triton_tokens_follow_the_distribution(temperature):
    row = _row()
    tokens = _draws(row, seed=11, temperature=temperature)
    assert chi_square_ok(tokens, reference_probs(row, temperature))
    if temperature == 0.5:  # the check has the power to see a temperature ignored
        ignored = _reference_draws(row, seed=11, temperature=1.0)  # the same draws at T = 1
        assert not chi_square_ok(ignored, reference_probs(row, temperature))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("processed", [False, True], ids=["raw", "biased"])
def test_a_mixed_batch_equals_the_torch_path_token_for_token(dtype, processed, monkeypatch):
    import vserve.csrc_triton.sample as kernel

    launched = []
    monkeypatch.setattr(
        kernel, "sample_rows", lambda *a: launched.append(len(a[1])) or sample_rows(*a)
    )
    g = torch.Generator().manual_seed(5)
    n = 17  # every kind of row below, a greedy one with top-k and top-p (16) the last
    logits = (torch.randn(n, 700, generator=g) * 2).to(dtype).to(DEVICE)
    meta = _meta(n, temperature=1.0, seed=3)
    meta.temperature = [(0.0, 0.7, 1.0, 1.6)[i % 4] for i in range(n)]
    meta.top_k = [20 if i % 5 == 1 else 0 for i in range(n)]
    meta.top_p = [0.8 if i % 7 == 2 else 1.0 for i in range(n)]
    meta.seeds = [100 + i for i in range(n)]
    if processed:  # an fp32 copy with the bias applied is what gets sampled
        meta.logit_bias = [{i: 5.0, 3: -100.0} if i % 3 == 0 else None for i in range(n)]
    triton_ids = Sampler(triton=True)(logits, meta).token_ids
    torch_ids = Sampler(use_kernel=False)(logits, meta).token_ids
    assert torch.equal(triton_ids.cpu(), torch_ids.cpu())
    hot = [t > 0 for t in meta.temperature]
    filters = [k > 0 or p < 1 for k, p in zip(meta.top_k, meta.top_p)]
    filtered = sum(h and f for h, f in zip(hot, filters))
    assert launched == [n - filtered]  # one launch, for every unfiltered row


def test_which_samplers_take_triton():
    logits = torch.randn(2, 64)
    assert Sampler(triton=True)._takes_triton(logits)
    assert not Sampler(use_kernel=False, triton=True)._takes_triton(logits)
    assert not Sampler()._takes_triton(logits)  # CPU tensors: the fused CPU kernel
    assert not Sampler(triton=True)._takes_triton(logits.t())  # vocabulary not contiguous


# -- rows with top-k / top-p / min-p (csrc_triton/sample_filtered.py) ------------------------

LIMITS = [  # (top_k, top_p, min_p): each rule alone, together, and at its extremes
    (5, 1.0, 0.0),
    (0, 0.9, 0.0),
    (0, 1.0, 0.05),
    (50, 0.5, 0.02),
    (1, 1.0, 0.0),
    (0, 0.99, 0.0),
    (0, 1.0, 1.0),
    (3, 0.1, 0.0),
]


def _filtered_case(rows: int, vocab: int, dtype, ties: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * 3
    if ties:  # whole numbers: groups of equal probability, ordered by id
        logits = logits.round()
    logits = logits.to(dtype).to(DEVICE)
    limits = [LIMITS[i % len(LIMITS)] for i in range(rows)]
    return (
        logits,
        torch.arange(rows - 1, -1, -1, device=DEVICE),
        torch.tensor([(0.5, 1.0, 2.0)[i % 3] for i in range(rows)], device=DEVICE),
        torch.rand(rows, generator=g, dtype=torch.float64).to(DEVICE),
        torch.tensor([k for k, _, _ in limits], device=DEVICE),
        torch.tensor([p for _, p, _ in limits], dtype=torch.float64, device=DEVICE),
        torch.tensor([m for _, _, m in limits], device=DEVICE),
    )


@pytest.mark.parametrize(
    "dtype, vocab, ties",
    [
        (torch.float32, 60, True),
        (torch.bfloat16, 300, False),
        (torch.float32, FILTERED_BLOCK + 77, False),  # two chunks, the second ragged
    ],
    ids=["ties", "bf16", "ragged"],
)
def test_filtered_kernel_equals_its_reference(dtype, vocab, ties):
    case = _filtered_case(16 if vocab < FILTERED_BLOCK else 8, vocab, dtype, ties)
    assert torch.equal(sample_filtered(*case), sample_filtered_reference(*case))


@pytest.mark.parametrize("limits", [(0, 1.0, 0.01), (40, 1.0, 0.0)], ids=["min_p", "top_k"])
def test_a_u_just_below_one_takes_the_last_kept_token(limits):
    """The target sits a rounding away from the mass above the last kept group: the pick
    lands in that group (never on a token of no group, id -1)."""
    n, vocab = 8, 64
    logits = (torch.randn(n, vocab, generator=torch.Generator().manual_seed(0)) * 3).to(DEVICE)
    case = (
        logits,
        torch.arange(n, device=DEVICE),
        torch.ones(n, device=DEVICE),
        torch.full((n,), 1.0 - 2.0**-53, dtype=torch.float64, device=DEVICE),
        torch.full((n,), limits[0], device=DEVICE),
        torch.full((n,), limits[1], dtype=torch.float64, device=DEVICE),
        torch.full((n,), limits[2], device=DEVICE),
    )
    assert torch.equal(sample_filtered(*case), sample_filtered_reference(*case))


def _one_row(logits: list[float], u: float, top_k=0, top_p=1.0, min_p=0.0, t=1.0) -> int:
    def col(value, dtype=None):
        return torch.tensor([value], dtype=dtype, device=DEVICE)

    x = torch.tensor([logits], device=DEVICE)
    args = (col(0), col(t), col(u, torch.float64), col(top_k), col(top_p, torch.float64))
    return int(sample_filtered(x, *args, col(min_p)))


def test_filtered_kernel_at_the_edges():
    ninf = float("-inf")
    tied = [0.0, 3.0, 3.0, 1.0, 3.0, 3.0]  # four tokens share the maximum
    assert _one_row(tied, 0.999, top_k=2) == 2  # the two lowest ids of the tie, then the last
    assert _one_row(tied, 0.0, top_k=2) == 1
    assert _one_row(tied, 0.999, min_p=1.0) == 5  # min-p 1 keeps exactly the maximal tokens
    assert _one_row(tied, 0.7, top_k=1) == 1  # top-k 1: the first maximal token
    # masked tokens are never picked, even with nothing left to filter
    masked = [ninf, 2.0, ninf, 2.0, ninf]
    assert _one_row(masked, 1.0 - 2.0**-53, top_k=5) == 3
    # top-p: mass strictly before a token below top_p keeps it (0.5 + 0.25 >= 0.75: not 2)
    halves = [math.log(0.5), math.log(0.25), math.log(0.125), math.log(0.125)]
    assert _one_row(halves, 1.0 - 2.0**-53, top_p=0.75) == 1
    assert _one_row(halves, 1.0 - 2.0**-53, top_p=0.76) == 2
    # ... and inside a group of ties, ids in order while that holds (1.5 >= 0.6 x 2.5: not 2)
    tied_halves = [0.0] + [math.log(0.5)] * 3
    assert _one_row(tied_halves, 1.0 - 2.0**-53, top_p=0.6) == 1
    assert _one_row(tied_halves, 1.0 - 2.0**-53, top_p=0.61) == 2


@pytest.mark.slow  # a second each: the filtered kernel's searches, interpreted
@pytest.mark.parametrize(
    "params, broken",
    [
        (dict(temperature=0.5, top_k=10), dict(temperature=1.0)),
        (dict(temperature=1.0, top_p=0.8), dict(top_p=1.0)),
        (dict(temperature=2.0, top_k=40, min_p=0.05), dict(temperature=1.0)),
    ],
    ids=["t0.5-top_k", "t1-top_p", "t2-top_k-min_p"],
)
def test_filtered_tokens_follow_the_distribution(params, broken):
    row = _row()[:48]
    tokens = _draws(row, seed=13, **params)
    assert chi_square_ok(tokens, reference_probs(row, **params))
    # the check has the power to see the break: the same draws with a parameter ignored
    ignored = _reference_draws(row, seed=13, **dict(params, **broken))
    assert not chi_square_ok(ignored, reference_probs(row, **params))
