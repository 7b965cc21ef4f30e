"""The fused CPU sampling kernel (vserve/cpu_ops/sample.cpp, workers/cpu_sampling.py) against the
torch sampler it replaces on the CPU, which stays the oracle and the fallback.

For the same (seed, position) both paths must pick the same token: over many seeds, positions
and temperatures, fp32 and bf16 logits, mixed batches of greedy / plain / filtered rows, ties,
-inf entries (grammar masks, min_tokens masks, logit bias), rows with one finite logit, and
temperatures from 1e-4 to 1e4. The two compute the same probabilities up to float rounding, so
in principle a uniform falling within rounding of a CDF edge may pick the neighbour; at the
fixed seeds below no such draw occurs, and the tests demand equality.

One rounding effect is systematic at huge temperatures: at T = 1e4 the probabilities of two
distinct logits can round to the same float in torch's softmax, which then orders them by id,
while the kernel keeps their logit order (the exact order of the true probabilities). Filtered
rows at such temperatures are checked against the exact kept set instead of the oracle.
"""

import shutil

import numpy as np
import pytest
import torch

from vserve import cpu_ops
from vserve.workers import sampler
from vserve.workers.sampler import Sampler, SamplingMetadata

pytestmark = pytest.mark.skipif(
    shutil.which("c++") is None and shutil.which("g++") is None,
    reason="no C++ compiler: the torch sampler runs instead",
)

PARAMS = [  # (temperature, top_k, top_p, min_p)
    (0.0, 0, 1.0, 0.0),
    (1.0, 0, 1.0, 0.0),
    (0.5, 0, 1.0, 0.0),
    (2.0, 0, 1.0, 0.0),
    (1.0, 50, 1.0, 0.0),
    (1.0, 50, 0.9, 0.0),
    (0.7, 0, 0.9, 0.0),
    (1.3, 0, 0.95, 0.0),
    (1.0, 0, 1.0, 0.05),
    (1.0, 20, 0.8, 0.1),
    (0.5, 0, 0.5, 0.0),
    (1.0, 5000, 1.0, 0.0),
    (2.0, 0, 0.999, 0.0),
    (1.0, 1, 1.0, 0.0),
    (0.0, 40, 0.5, 0.0),
    (1.0, 1024, 1.0, 0.0),
    (1e-4, 0, 1.0, 0.0),
    (1e-4, 30, 0.9, 0.0),
    (1e4, 0, 1.0, 0.0),
    (100.0, 100, 0.5, 0.02),
]


@pytest.fixture(scope="module")
def kernel():
    module = cpu_ops.load_sampler()
    assert module is not None, "the sampling kernel failed to build (see the log)"
    return module


def meta_for(params, seed=0, position=0, **extra) -> SamplingMetadata:
    n = len(params)
    fields = dict(
        temperature=[p[0] for p in params],
        top_k=[p[1] for p in params],
        top_p=[p[2] for p in params],
        min_p=[p[3] for p in params],
        seeds=[seed * 1000 + i for i in range(n)],
        positions=[position + 5 * i for i in range(n)],
        num_logprobs=[None] * n,
        logit_bias=[None] * n,
        masked_ids=[None] * n,
        presence=[0.0] * n,
        frequency=[0.0] * n,
        repetition=[1.0] * n,
    )
    fields.update(extra)
    return SamplingMetadata(**fields)


def both(logits: torch.Tensor, meta: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    return Sampler(use_kernel=True)(logits, meta).token_ids, Sampler(use_kernel=False)(
        logits, meta
    ).token_ids


def random_logits(rows: int, vocab: int, scale: float, seed: int, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, vocab, generator=g) * scale).to(dtype)


def test_exp_is_within_two_ulp(kernel):
    x = torch.cat(
        [
            -torch.rand(200_000, generator=torch.Generator().manual_seed(0)) * 87,
            torch.tensor([0.0, -1e-30, -1e-7, -0.5, -87.3]),
        ]
    )
    out = kernel.exp_for_test(x).double()
    ref = x.double().exp()
    assert ((out - ref).abs() / ref).max().item() < 2 * 2**-24
    assert kernel.exp_for_test(torch.tensor([-float("inf"), -88.0, -1e4])).eq(0).all()


def _block_sums(e: np.ndarray) -> tuple[float, float]:
    """One 2048-token block's sum as the kernel's block pass takes it (two 16-lane fp32
    accumulators over alternate chunks, lanes added in double) and its double sum by chunks
    (the walk's)."""
    lanes = [np.zeros(16, np.float32), np.zeros(16, np.float32)]
    for c in range(0, len(e), 16):
        lanes[c // 16 % 2] = (lanes[c // 16 % 2] + e[c : c + 16]).astype(np.float32)
    fp32 = sum(float(v) for v in lanes[0]) + sum(float(v) for v in lanes[1])
    exact = sum(sum(float(v) for v in e[c : c + 16]) for c in range(0, len(e), 16))
    return fp32, exact


def test_a_target_between_a_blocks_two_sums_stays_in_that_block(kernel):
    """The block pass sums in fp32 lanes, the walk in double: a target that falls between the
    two sums of a block must pick a token of that block, not the first of the next one (a
    token whose own probability is ~1e-16 here)."""
    for seed in range(50):
        g = torch.Generator().manual_seed(seed)
        x = (torch.randn(4096, generator=g) * 2).to(torch.bfloat16)
        x[2048] = -36.0  # the next block's first token: almost no mass
        m = float(x.float().max())
        e = kernel.exp_for_test(x.float() - m).numpy()
        fp32, exact = _block_sums(e[:2048])
        if fp32 > exact:
            break
    else:
        pytest.skip("no block whose fp32 sum exceeds its double sum")
    total = fp32 + _block_sums(e[2048:])[0]
    u = torch.tensor([(exact + fp32) / 2 / total], dtype=torch.float64)
    token, _, _ = kernel.sample(x.view(1, -1), torch.ones(1), u, torch.zeros(1, dtype=torch.long))
    assert int(token) < 2048


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("vocab", [37, 5003, 40_000])
def test_kernel_picks_the_torch_samplers_token(kernel, dtype, vocab):
    for seed in range(4):
        scale = (0.5, 2.0, 4.0, 8.0)[seed]
        logits = random_logits(len(PARAMS), vocab, scale, seed, dtype)
        for position in (17, 123_456):
            new, old = both(logits, meta_for(PARAMS, seed, position))
            assert torch.equal(new, old), (seed, position, (new != old).nonzero().tolist())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_many_draws_of_one_row_agree(kernel, dtype):
    """One row sampled at 400 positions per parameter set: the CDF walk and the candidate path
    agree with the oracle draw after draw, not only on a few."""
    row = random_logits(1, 20_000, 3.0, 42, dtype)
    for params in [
        (1.0, 0, 1.0, 0.0),
        (0.6, 0, 1.0, 0.0),
        (1.0, 50, 0.9, 0.0),
        (1.5, 0, 0.8, 0.0),
        (1.0, 0, 1.0, 0.1),
    ]:
        n = 400
        meta = meta_for([params] * n, seed=3, seeds=[99] * n, positions=list(range(n)))
        new, old = both(row.expand(n, -1).contiguous(), meta)
        assert torch.equal(new, old), params


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_ties_follow_the_lower_id_first_order(kernel, dtype):
    """Quantised logits (many exact ties, also at the top-k boundary) and an all-equal row."""
    logits = (random_logits(len(PARAMS), 8192, 2.0, 5, torch.float32) * 2).round() / 2
    logits[3] = 0.0
    logits[4] = 0.0  # top_k=50 over an all-equal row: ids 0..49
    logits = logits.to(dtype)
    for position in range(5):
        new, old = both(logits, meta_for(PARAMS, 7, position))
        assert torch.equal(new, old)
        assert new[4].item() < 50


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("vocab", [1, 7, 16, 4096, 262144 + 5])
def test_argmax_is_torchs_first_maximum(kernel, dtype, vocab):
    """The greedy path's argmax: the first index of each row's maximum, as torch.argmax gives
    it, over ties (quantised logits), -inf entries, an all -inf row, a tail past the lanes and a
    strided row view."""
    g = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(9, vocab, generator=g) * 2).round().to(dtype)  # many exact ties
    logits[1] = float("-inf")
    logits[2, vocab // 2 :] = float("-inf")
    logits[3] = 0.0
    logits[4, -1] = 50.0  # the maximum in the tail
    assert torch.equal(kernel.argmax(logits), logits.float().argmax(dim=-1))
    rows = logits[::2]  # rows 2 * vocab apart
    assert torch.equal(kernel.argmax(rows), rows.float().argmax(dim=-1))
    assert torch.equal(Sampler().argmax(rows), rows.float().argmax(dim=-1))
    if vocab > 1:
        with pytest.raises(RuntimeError, match="rows dense"):
            kernel.argmax(logits.t())


@pytest.mark.parametrize("rows", [1, 15, 16, 17, 40])
def test_argmax_rows_in_claimed_groups(kernel, two_threads, rows):
    """Rows go to the threads in groups of ~64k logits (16 rows of 4096 here), claimed one at
    a time: every row of a last, partial group and of a single group is computed."""
    g = torch.Generator().manual_seed(rows)
    logits = torch.randn(rows, 4096, generator=g)
    assert torch.equal(kernel.argmax(logits), logits.argmax(dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_minus_infinity_entries(kernel, dtype):
    """Masked tokens (-inf in the logits themselves, or from grammar / min_tokens / logit bias
    processing) are never picked, and the pick equals the oracle's."""
    rows, vocab = len(PARAMS), 6000
    logits = random_logits(rows, vocab, 3.0, 11, torch.float32)
    g = torch.Generator().manual_seed(1)
    logits[torch.rand(rows, vocab, generator=g) < 0.4] = float("-inf")
    one = torch.randint(vocab, (rows,), generator=g)
    logits[::2] = float("-inf")  # every other row: a single finite logit
    logits[torch.arange(0, rows, 2), one[::2]] = 1.5
    logits = logits.to(dtype)
    for position in range(4):
        new, old = both(logits, meta_for(PARAMS, 2, position))
        assert torch.equal(new, old)
        assert torch.equal(new[::2], one[::2])
        assert torch.isfinite(logits.float().gather(1, new.unsqueeze(1))).all()
    grammar = torch.rand(rows, vocab, generator=g) < 0.02
    grammar[:, 7] = True
    extra = dict(
        logit_bias=[{5: -100.0, 9: 30.0} if i % 3 == 0 else None for i in range(rows)],
        masked_ids=[[9, 11] if i % 3 == 0 else None for i in range(rows)],
        grammar_rows=list(range(1, rows, 2)),
        grammar_mask=grammar[1::2],
    )
    logits = random_logits(rows, vocab, 3.0, 12, dtype)
    for position in range(4):
        meta = meta_for(PARAMS, 4, position, **extra)
        new, old = both(logits, meta)
        assert torch.equal(new, old)
        assert all(grammar[i, new[i]] for i in range(1, rows, 2))
        assert all(new[i] not in (5, 9, 11) for i in range(0, rows, 3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_huge_temperature_with_top_k_picks_among_the_k_largest_logits(kernel, dtype):
    logits = random_logits(1, 6000, 3.0, 13, dtype)
    n = 400
    meta = meta_for([(1e4, 100, 0.5, 0.02)] * n, seeds=[5] * n, positions=list(range(n)))
    picked = Sampler(use_kernel=True)(logits.expand(n, -1).contiguous(), meta).token_ids
    order = logits[0].float().argsort(descending=True, stable=True)
    assert set(picked.tolist()) <= set(order[:100].tolist())
    assert len(set(picked.tolist())) > 90  # nearly uniform over the 100 at T = 1e4


def test_candidates_when_the_estimated_threshold_is_too_high(kernel):
    """The kernel starts collecting candidates above a threshold estimated from 16 neighbours
    every 1024 tokens; when those hold the row's best logits, fewer than top_k tokens reach
    the estimate and the kernel collects from -inf instead: still the oracle's tokens."""
    logits = random_logits(3, 40_000, 1.0, 21, torch.float32)
    logits[:, (torch.arange(40_000) % 1024) < 16] += 20.0
    params = [(1.0, 50, 1.0, 0.0), (1.0, 200, 0.95, 0.0), (1.0, 0, 0.9, 0.0)]
    for position in range(6):
        new, old = both(logits, meta_for(params, 3, position))
        assert torch.equal(new, old)


def test_rows_whose_kept_tokens_exceed_the_candidates_take_the_torch_path(kernel, monkeypatch):
    """Flat rows under top-p 0.999 keep more tokens than the candidates hold: they fall back
    to the torch sampler's path, peaked rows do not, and both agree with the oracle."""
    monkeypatch.setattr(sampler, "CANDIDATES", 256)
    calls = []
    real = sampler._sample_filtered

    def counting(scaled, u, meta, group):
        calls.append(len(group))
        return real(scaled, u, meta, group)

    logits = random_logits(4, 8192, 1.0, 3, torch.bfloat16)
    logits[0] *= 40
    logits[2] *= 40
    meta = meta_for([(2.0, 0, 0.999, 0.0)] * 4, 9, 1)
    expected = Sampler(use_kernel=False)(logits, meta).token_ids
    monkeypatch.setattr(sampler, "_sample_filtered", counting)
    assert torch.equal(Sampler(use_kernel=True)(logits, meta).token_ids, expected)
    assert calls == [2]  # rows 1 and 3, once, together


@pytest.mark.parametrize("use_kernel", [True, False], ids=["kernel", "torch"])
def test_logprobs_come_from_the_raw_logits_of_the_rows_that_ask(kernel, use_kernel):
    logits = random_logits(4, 3000, 2.0, 8, torch.float32)  # fp32: no ties among the top
    params = [(1.0, 0, 1.0, 0.0), (0.0, 0, 1.0, 0.0), (1.0, 40, 0.9, 0.0), (0.5, 0, 1.0, 0.0)]
    meta = meta_for(
        params, 1, 3, num_logprobs=[2, None, 0, 5], logit_bias=[{3: 50.0}, None, None, None]
    )
    out = Sampler(use_kernel)(logits, meta)
    assert out.token_ids[0].item() == 3  # the bias decides the pick ...
    ref = logits.log_softmax(dim=-1)  # ... not the logprobs
    assert out.logprobs[1] is None
    for i in (0, 2, 3):
        delta = out.logprobs[i]
        token = out.token_ids[i].item()
        assert delta.token_ids[0][0] == token
        assert delta.logprobs[0][0] == pytest.approx(ref[i, token].item(), abs=1e-5)
        n = meta.num_logprobs[i]
        assert delta.token_ids[0][1:] == ref[i].topk(n).indices.tolist()
        torch.testing.assert_close(torch.tensor(delta.logprobs[0][1:]), ref[i].topk(n).values)
        assert delta.ranks[0] == int((ref[i] > ref[i, token]).sum()) + 1


def test_kernel_logprobs_equal_the_torch_ones_on_bf16(kernel):
    """bf16 logits tie often: the kernel lists tied tokens lower id first (torch's topk leaves
    their order open); values agree to fp32 rounding, ranks exactly."""
    logits = random_logits(6, 20_000, 3.0, 4, torch.bfloat16)
    ids = torch.randint(20_000, (6,), generator=torch.Generator().manual_seed(0))
    lp, ranks, top_ids, top_lp = kernel.logprobs(logits, ids, 20)
    ref = logits.float().log_softmax(dim=-1)
    torch.testing.assert_close(lp, ref.gather(1, ids.unsqueeze(1)).squeeze(1))
    assert torch.equal(ranks, (ref > ref.gather(1, ids.unsqueeze(1))).sum(dim=-1) + 1)
    torch.testing.assert_close(top_lp, ref.topk(20).values)
    torch.testing.assert_close(top_lp, ref.gather(1, top_ids))
    raw = logits.float().gather(1, top_ids)
    assert (
        (raw[:, :-1] > raw[:, 1:])
        | ((raw[:, :-1] == raw[:, 1:]) & (top_ids[:, :-1] < top_ids[:, 1:]))
    ).all()


def test_without_the_kernel_the_torch_path_samples(monkeypatch, caplog):
    logits = random_logits(len(PARAMS), 5000, 3.0, 1, torch.bfloat16)
    meta = meta_for(PARAMS, 5, 2)
    expected = Sampler(use_kernel=False)(logits, meta).token_ids
    monkeypatch.setattr(cpu_ops, "_state", {})
    monkeypatch.setattr(cpu_ops, "_compile", lambda *a: (_ for _ in ()).throw(OSError("no cc")))
    assert Sampler().kernel(logits) is None
    assert "no cc" in caplog.text
    assert torch.equal(Sampler()(logits, meta).token_ids, expected)
    monkeypatch.setattr(cpu_ops, "_state", {})
    monkeypatch.setenv("VSERVE_CPU_OPS", "0")
    assert cpu_ops.load_sampler() is None
    assert torch.equal(Sampler()(logits, meta).token_ids, expected)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_samples_the_same_tokens_on_both_paths(kernel, dtype, tiny_model_dir):
    """End to end on a tiny model: seeded requests with mixed parameters (and logprobs, a
    logit bias, min_tokens) generate the same tokens whichever path samples."""
    from tests.support.engines import make_llm
    from vserve import SamplingParams

    llm = make_llm(tiny_model_dir("gemma3"), dtype=dtype, max_model_len=128)
    sampler_ = llm.engine.client.core.executor.worker.runner.step_sampler.sampler
    params = [
        SamplingParams(
            temperature=t,
            top_k=k,
            top_p=p,
            min_p=m,
            seed=10 + i,
            max_tokens=24,
            ignore_eos=True,
            logprobs=1 if i % 2 else None,
            logit_bias={7: 2.0} if i == 3 else None,
            min_tokens=4,
        )
        for i, (t, k, p, m) in enumerate(PARAMS[:12])
    ]
    prompts = [{"prompt_token_ids": [5 + i, 17, 99, 3 * i + 1]} for i in range(len(params))]
    try:
        outs = {}
        for use in (True, False):
            sampler_.use_kernel = use
            outs[use] = [
                o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)
            ]
    finally:
        llm.shutdown()
    assert outs[True] == outs[False]
    assert len({tuple(o) for o in outs[True]}) > 6  # the rows did sample differently
