"""N-gram speculative decoding end to end: greedy outputs identical with and without drafts
(sync and async, with preemption and aborts), drafts accepted on repetitive text, and the
rejection sampler keeps the target distribution."""

import math

import pytest
import torch

from tests.support.engines import assert_worker_drained, make_llm
from tests.support.hf_reference import PROMPTS
from vserve import SamplingParams
from vserve.engine.arg_utils import EngineArgs
from vserve.engine.llm_engine import LLMEngine
from vserve.sampling_params import SamplingParams as SP
from vserve.workers.spec_verify import verify

SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_max": 4,
    "prompt_lookup_min": 1,
}
GREEDY = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("gemma3")


@pytest.fixture(scope="module")
def reference(model):
    llm = make_llm(model, max_model_len=512)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("async_on", [False, True])
def test_greedy_equal_with_drafts_and_drafts_accepted(model, reference, async_on):
    llm = make_llm(model, max_model_len=512, async_scheduling=async_on, speculative_config=SPEC)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert got == reference
    stats = llm.engine.last_stats
    assert stats.spec_num_drafts > 0
    assert 0 < stats.spec_num_accepted_tokens <= stats.spec_num_draft_tokens


def test_drafts_with_preemption_and_aborts(model, reference):
    engine = LLMEngine.from_engine_args(
        EngineArgs(
            model=model,
            dtype="float32",
            max_model_len=128,
            block_size=4,
            num_gpu_blocks_override=40,
            distributed_executor_backend="uni",
            speculative_config=SPEC,
        )
    )
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p, GREEDY)
    engine.add_request("gone", PROMPTS[0], GREEDY)
    results, steps = {}, 0
    while engine.has_unfinished_requests():
        if steps == 5:
            engine.abort_request(["gone"])
        for out in engine.step():
            results[out.request_id] = out.outputs[0].token_ids
        steps += 1
    assert [results[f"r{i}"] for i in range(len(PROMPTS))] == reference
    sched = engine.client.core.scheduler
    assert sched.num_preemptions > 0 and sched.spec_stats.num_drafts > 0
    assert sched.kv.pool.num_used_blocks == 0
    sched.check_invariants()
    assert_worker_drained(engine)  # no row of a finished, preempted or aborted request


def test_seeded_sampling_with_drafts_is_reproducible(model):
    llm = make_llm(model, max_model_len=512, speculative_config=SPEC)
    sp = SamplingParams(temperature=0.7, seed=42, max_tokens=40, ignore_eos=True)
    first = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False)]
    again = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False)]
    alone = llm.generate(PROMPTS[2], sp, use_tqdm=False)[0].outputs[0].token_ids
    assert first == again and first[2] == alone


def test_seeded_sampling_with_drafts_equal_sync_and_async(model):
    """Sync and async runs draft at the same positions (the decision is taken on ids known
    in both), so seeded sampling, whose tokens depend on the drafts, gives the same tokens."""
    sp = SamplingParams(temperature=0.8, seed=7, max_tokens=40, ignore_eos=True)
    outs = {}
    for async_on in (False, True):
        llm = make_llm(model, max_model_len=512, async_scheduling=async_on, speculative_config=SPEC)
        outs[async_on] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False)]
        assert llm.engine.client.core.scheduler.spec_stats.num_drafts > 0
        llm.shutdown()
    assert outs[False] == outs[True]


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_rejection_sampling_keeps_the_target_distribution(temperature):
    """Draft d at position 0: the first emitted token follows p0 = softmax(logits / T)
    exactly, and after an accepted draft the next one follows p1."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 6, generator=gen) * 1.5
    params = SP(temperature=temperature)
    p = (logits / temperature).softmax(-1)
    drafts = [int(p[0].argmax()), 2]
    n = 6000
    first, second = [0] * 6, [0] * 6
    accepted = 0
    for seed in range(n):
        out = verify(logits, drafts, params, seed, first_position=10)
        first[out[0]] += 1
        if out[0] == drafts[0]:
            accepted += 1
            second[out[1]] += 1
    for x in range(6):
        expected = p[0, x].item() * n
        assert abs(first[x] - expected) < 4 * math.sqrt(expected) + 5, (x, first, expected)
        expected2 = p[1, x].item() * accepted
        assert abs(second[x] - expected2) < 4 * math.sqrt(expected2) + 5, (x, second)


def test_greedy_verification_rule():
    logits = torch.full((4, 5), -5.0)
    for pos, tok in enumerate([1, 2, 3, 4]):
        logits[pos, tok] = 5.0
    params = SP(temperature=0)
    assert verify(logits, [1, 2, 3], params, 0, 0) == [1, 2, 3, 4]  # all + bonus
    assert verify(logits, [1, 0, 3], params, 0, 0) == [1, 2]  # first mismatch
    assert verify(logits, [4, 2, 3], params, 0, 0) == [1]


def test_spec_config_validation():
    with pytest.raises(ValueError, match="not supported"):
        EngineArgs(model=None, speculative_config={"method": "eagle"})._speculative()
    with pytest.raises(ValueError, match="unknown speculative_config"):
        EngineArgs(speculative_config={"method": "ngram", "k": 3})._speculative()
    with pytest.raises(ValueError, match="pipeline parallel"):
        EngineArgs(speculative_config=SPEC, pipeline_parallel_size=2)._speculative()
