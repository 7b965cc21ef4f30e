"""Greedy token ids equal transformers' `generate` (fp32 tiny random models) under plain
batching, chunked prefill, prefix-cache hits and preemption by a tiny KV cache. The later
families (Granite, OLMo 2, SmolLM3, Phi-3, Gemma 2) and the mixtures of experts (Qwen3-MoE,
Qwen2-MoE, Mixtral, OLMoE) differ from the first five in their layers only, not in how steps
are scheduled: they run plain, and chunked in the slow tier, as do qwen2's and qwen3's
scheduling scenarios."""

import pytest

from tests.support.engines import make_llm
from tests.support.hf_reference import PREFIX_PROMPTS, PROMPTS, hf_greedy
from tests.support.tiny_models import FAMILY_KINDS, MOE_KINDS
from vserve import SamplingParams

MAX_TOKENS = 24
KINDS = ["llama", "qwen2", "qwen3", "gemma3", "mistral"]

SCENARIOS = {
    "plain": dict(),
    "chunked": dict(max_num_batched_tokens=7),
    "prefix": dict(block_size=4),
    "preempt": dict(block_size=4, num_gpu_blocks_override=34, max_model_len=128),
}


def _generate(model_dir, prompts, **engine_kwargs):
    engine_kwargs.setdefault("max_model_len", 256)
    llm = make_llm(model_dir, **engine_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs]


# the scheduling scenarios on every family, in the fast tier where attention differs: llama
# (full attention), gemma3 and mistral (sliding windows, which prefix hits, chunks and
# recomputation must respect); qwen2 and qwen3 differ from llama in their layers only
FAST_SCENARIO_KINDS = {"llama", "gemma3", "mistral"}
CASES = [
    *[
        (k, s)
        if s == "plain" or k in FAST_SCENARIO_KINDS
        else pytest.param(k, s, marks=pytest.mark.slow)
        for k in KINDS
        for s in SCENARIOS
    ],
    *[(k, "plain") for k in FAMILY_KINDS + MOE_KINDS],
    *[pytest.param(k, "chunked", marks=pytest.mark.slow) for k in FAMILY_KINDS + MOE_KINDS],
]


@pytest.mark.parametrize("kind, scenario", CASES)
def test_greedy_matches_transformers(tiny_model_dir, kind, scenario):
    model_dir = tiny_model_dir(kind)
    prompts = PREFIX_PROMPTS if scenario == "prefix" else PROMPTS
    ref = hf_greedy(model_dir, tuple(prompts), MAX_TOKENS)
    llm, got = _generate(model_dir, prompts, **SCENARIOS[scenario])
    assert got == ref
    sched = llm.engine.client.core.scheduler
    if scenario == "prefix":
        assert sched.kv.num_hit_tokens > 0
    if scenario == "preempt":
        assert sched.num_preemptions > 0
    assert sched.kv.pool.num_used_blocks == 0
