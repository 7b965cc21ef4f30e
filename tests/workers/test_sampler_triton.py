"""The Triton sampling kernel (csrc_triton/sample.py, the CUDA path for rows without filters)
picks what its float64 torch reference picks, and through the Sampler its tokens follow
softmax(logits / T) at T = 0.5, 1 and 2 (the chi-square check of test_sampling_distribution.py)
and equal the torch path's token for token, filtered and greedy rows beside them included.

Without CUDA the kernel runs under the Triton interpreter, so the shapes stay small.
"""

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
from vserve.workers.sampler import Sampler  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DRAWS = 500  # one interpreted program each


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


def _draw(row: torch.Tensor, **params) -> torch.Tensor:
    logits = row.unsqueeze(0).expand(DRAWS, -1).contiguous().to(DEVICE)
    meta = _meta(DRAWS, seed=11, **params)
    return Sampler(triton=True)(logits, meta).token_ids.cpu()


@pytest.mark.slow  # 500 interpreted programs a draw
@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_triton_tokens_follow_the_distribution(temperature):
    row = _row()
    tokens = _draw(row, temperature=temperature)
    assert chi_square_ok(tokens, reference_probs(row, temperature))
    if temperature == 0.5:  # the check has the power to see a temperature ignored
        assert not chi_square_ok(_draw(row, temperature=1.0), reference_probs(row, temperature))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("processed", [False, True], ids=["raw", "biased"])
def test_a_mixed_batch_equals_the_torch_path_token_for_token(dtype, processed, monkeypatch):
    import vserve.csrc_triton.sample as kernel

    launched = []
    monkeypatch.setattr(
        kernel, "sample_rows", lambda *a: launched.append(len(a[1])) or sample_rows(*a)
    )
    g = torch.Generator().manual_seed(5)
    n = 24
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
