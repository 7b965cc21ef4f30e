"""`LLM.reset_prefix_cache` (vLLM's name): after it a repeated prompt is computed again, not
read from the cache; the bench's warm-up relies on it (vserve/bench/throughput.py)."""

from tests.support.engines import make_llm
from vserve import SamplingParams

PROMPT = {"prompt_token_ids": list(range(10, 74))}  # four full 16-token blocks
ONE = SamplingParams(temperature=0, max_tokens=1)


def test_reset_prefix_cache_forgets_cached_prompts(tiny_model_dir):
    llm = make_llm(tiny_model_dir("llama"), max_model_len=128)
    first = llm.generate([PROMPT], ONE, use_tqdm=False)[0]
    again = llm.generate([PROMPT], ONE, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens >= 48
    assert llm.reset_prefix_cache()
    after = llm.generate([PROMPT], ONE, use_tqdm=False)[0]
    assert after.num_cached_tokens == 0
    assert after.outputs[0].token_ids == first.outputs[0].token_ids
