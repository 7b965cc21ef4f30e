"""Prompt logprobs (`SamplingParams.prompt_logprobs`) equal transformers' log-softmax of the
same prompt (fp32 tiny models, 1e-4) under plain batching, chunked prefill (budget 7),
prefix-cache hits and preemption, scheduled synchronously and asynchronously (the default),
and PP=2; bad values fail before the engine."""

import functools

import pytest
import torch

from tests.support.engines import make_llm
from tests.support.hf_reference import PROMPTS, SHARED_PREFIX
from vserve import SamplingParams

pytestmark = pytest.mark.slow  # the fast tier (-m "not slow") leaves these out

TOP = 3
SCENARIOS = {
    "plain": dict(async_scheduling=False),
    "chunked": dict(max_num_batched_tokens=7, async_scheduling=False),
    "chunked-async": dict(max_num_batched_tokens=7, async_scheduling=True),
    "prefix": dict(block_size=4, async_scheduling=False),
    "prefix-async": dict(block_size=4, async_scheduling=True),
    "preempt": dict(
        block_size=4, num_gpu_blocks_override=24, max_model_len=96, async_scheduling=False
    ),
    "preempt-async": dict(
        block_size=4,
        num_gpu_blocks_override=24,
        max_model_len=96,
        async_scheduling=True,
        max_num_batched_tokens=7,
    ),
    # the last stage computes them; engine core and workers in their own processes
    "pp2-async-chunked": dict(
        multiprocess=True,
        distributed_executor_backend="mp",
        pipeline_parallel_size=2,
        async_scheduling=True,
        max_num_batched_tokens=7,
    ),
}
PREFIX_PROMPTS = [SHARED_PREFIX + s for s in ("Paris is", "1 2 3 4 5 6 7 8 9")]


@functools.lru_cache(maxsize=None)
def _hf_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _hf_logprobs(model_dir: str, prompt_ids: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: row t - 1 is the distribution of prompt token t."""
    with torch.no_grad():
        logits = _hf_model(model_dir)(torch.tensor([prompt_ids])).logits[0, :-1].float()
    return logits.log_softmax(-1)


def _check(model_dir, out, top: int) -> None:
    """Each prompt token t >= 1: its own logprob and rank, and the top-`top` ids and values."""
    ids = out.prompt_token_ids
    ref = _hf_logprobs(model_dir, ids)
    got = out.prompt_logprobs
    assert got is not None and len(got) == len(ids) and got[0] is None
    for t in range(1, len(ids)):
        entry, row = got[t], ref[t - 1]
        own = entry[ids[t]]
        assert abs(own.logprob - row[ids[t]].item()) < 1e-4, (t, own, row[ids[t]].item())
        assert own.rank == int((row > row[ids[t]]).sum()) + 1
        ref_vals, ref_ids = row.topk(top)
        assert len(entry) == top + (int(ids[t]) not in ref_ids.tolist())
        for k in range(top):
            lp = entry[int(ref_ids[k])]
            assert abs(lp.logprob - ref_vals[k].item()) < 1e-4 and lp.rank == k + 1


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_prompt_logprobs_match_transformers(tiny_model_dir, scenario):
    model_dir = tiny_model_dir("llama")
    kwargs = {"max_model_len": 256, **SCENARIOS[scenario]}
    llm = make_llm(model_dir, **kwargs)
    try:
        _run_scenario(llm, model_dir, scenario)
    finally:
        llm.shutdown()


def _run_scenario(llm, model_dir: str, scenario: str) -> None:
    sched = getattr(llm.engine.client, "core", None) and llm.engine.client.core.scheduler
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=TOP)
    plain = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    if scenario.startswith("prefix"):
        # a plain request caches the shared prefix; the next ones ask for prompt logprobs
        llm.generate([PREFIX_PROMPTS[0]], plain, use_tqdm=False)
        hits = sched.kv.num_hit_tokens
        outs = llm.generate(PREFIX_PROMPTS, sp, use_tqdm=False)
        assert sched.kv.num_hit_tokens == hits  # no hit may skip an asked-for position
        again = llm.generate([PREFIX_PROMPTS[1]], plain, use_tqdm=False)[0]
        assert again.num_cached_tokens > 0  # what they computed is cached for others
    else:
        prompts = PROMPTS + ([PROMPTS[1] + PROMPTS[3]] if scenario.startswith("preempt") else [])
        outs = llm.generate(
            prompts, [sp, plain] * (len(prompts) // 2) + [sp] * (len(prompts) % 2), use_tqdm=False
        )
        for out, asked in zip(outs, [True, False] * len(prompts)):
            if not asked:
                assert out.prompt_logprobs is None
        outs = [o for o, asked in zip(outs, [True, False] * len(prompts)) if asked]
    if scenario.startswith("preempt"):
        assert sched.num_preemptions > 0
    for out in outs:
        _check(model_dir, out, TOP)
    # the sampled tokens are the same as without prompt logprobs
    ref = llm.generate([o.prompt for o in outs], plain, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [r.outputs[0].token_ids for r in ref]
    assert not sched or sched.kv.pool.num_used_blocks == 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_prompt_logprobs_preempted_mid_prompt_are_not_repeated(tiny_model_dir, async_scheduling):
    """The last admitted request is the victim: B (prompt logprobs, 41 tokens in chunks of at
    most 7) loses its blocks to A's decode after some of its chunks committed, and computes
    its prompt again; the entries that already arrived are not sent twice."""
    model_dir = tiny_model_dir("llama")
    llm = make_llm(
        model_dir,
        max_model_len=56,
        block_size=4,
        num_gpu_blocks_override=14,
        max_num_batched_tokens=7,
        async_scheduling=async_scheduling,
    )
    a = {"prompt_token_ids": [2] + list(range(100, 108))}
    b = {"prompt_token_ids": [2] + list(range(30, 70))}
    outs = llm.generate(
        [a, b],
        [
            SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2),
        ],
        use_tqdm=False,
    )
    assert llm.engine.client.core.scheduler.num_preemptions > 0
    assert outs[0].prompt_logprobs is None
    _check(model_dir, outs[1], 2)


def test_prompt_logprobs_zero_top_and_one_token_prompt(tiny_model_dir):
    model_dir = tiny_model_dir("qwen3")
    llm = make_llm(model_dir, max_model_len=128, max_num_batched_tokens=5)
    sp = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    long_out, one = llm.generate([PROMPTS[1], {"prompt_token_ids": [7]}], sp, use_tqdm=False)
    _check(model_dir, long_out, 0)
    assert all(len(e) == 1 for e in long_out.prompt_logprobs[1:])
    assert one.prompt_logprobs == [None]


def test_prompt_logprobs_n2_streaming_once(tiny_model_dir):
    """n > 1: computed once (for the first choice), delivered once to a DELTA stream."""
    import asyncio

    from vserve.engine.arg_utils import EngineArgs
    from vserve.engine.async_llm import AsyncLLM

    model_dir = tiny_model_dir("llama")
    engine = AsyncLLM.from_engine_args(
        EngineArgs(model=model_dir, dtype="float32", max_model_len=128, max_num_batched_tokens=6)
    )
    sp = SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=4, prompt_logprobs=2)

    async def run():
        seen = []
        try:
            async for out in engine.generate(PROMPTS[0], sp, "r1"):
                seen.append(out.prompt_logprobs)
        finally:
            engine.shutdown()
        return seen

    seen = asyncio.run(asyncio.wait_for(run(), 60))
    delivered = [p for p in seen if p is not None]
    assert len(delivered) == 1 and delivered[0][0] is None


@pytest.mark.parametrize("value", [-1, 1.5, "3", True])
def test_prompt_logprobs_bad_values(value):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=value)


def test_prompt_logprobs_over_max_logprobs(tiny_model_dir):
    llm = make_llm(tiny_model_dir("llama"), max_model_len=64)
    with pytest.raises(ValueError, match="prompt_logprobs must be at most 20"):
        llm.generate(["hi"], SamplingParams(prompt_logprobs=21), use_tqdm=False)
