"""Mixtures of experts run as the dense models do under every scheduling mode: async, PP=2
and TP=2 (experts' rows split over the ranks, Qwen2-MoE's shared expert a row-parallel MLP)
produce the sync engine's greedy tokens, fp32, with chunked prefill and prefix hits."""

import pytest

from tests.support.hf_reference import PREFIX_PROMPTS, PROMPTS
from vserve import LLM, SamplingParams

pytestmark = pytest.mark.slow  # multiprocess engines

ENGINE = dict(dtype="float32", max_model_len=128, block_size=4, max_num_batched_tokens=16)
MODES = {
    "async": dict(multiprocess=False, async_scheduling=True, distributed_executor_backend="uni"),
    "pp2": dict(pipeline_parallel_size=2, async_scheduling=True),
    "tp2": dict(tensor_parallel_size=2, async_scheduling=True),
}


def _greedy(model: str, **mode) -> list[list[int]]:
    llm = LLM(model, **ENGINE, **mode)
    try:
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        outs = llm.generate(PROMPTS + PREFIX_PROMPTS, params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def sync_tokens(tiny_model_dir):
    sync = dict(multiprocess=False, async_scheduling=False, distributed_executor_backend="uni")
    cache = {}

    def get(kind: str) -> list[list[int]]:
        if kind not in cache:
            cache[kind] = _greedy(tiny_model_dir(kind), **sync)
        return cache[kind]

    return get


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen2_moe"])
@pytest.mark.parametrize("mode", list(MODES))
def test_moe_modes_equal_sync(tiny_model_dir, sync_tokens, kind, mode):
    assert _greedy(tiny_model_dir(kind), **MODES[mode]) == sync_tokens(kind)
