import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VSERVE_DEBUG_INVARIANTS", "1")   # engine cores check KV blocks at idle
if not __import__("torch").cuda.is_available():
    # Triton decides at import whether to interpret: set before anything imports it
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tiny_models import build_model  # noqa: E402

MODEL_KINDS = ["llama", "qwen2", "qwen3", "gemma3", "mistral"]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-models")
    built = {}

    def get(kind: str, **overrides) -> str:
        key = (kind, tuple(sorted(overrides.items())))
        if key not in built:
            name = kind + "".join(f"-{k}{v}" for k, v in sorted(overrides.items()))
            built[key] = str(build_model(kind, root / name, **overrides))
        return built[key]

    return get


def make_llm(model_dir, **kwargs):
    """An in-process engine with the model runner in this process: fast to start, and its
    scheduler can be inspected (`llm.engine.client.core`)."""
    from vserve import LLM

    kwargs.setdefault("multiprocess", False)
    kwargs.setdefault("distributed_executor_backend", "uni")
    kwargs.setdefault("dtype", "float32")
    return LLM(model_dir, **kwargs)


def greedy_with_logprobs(llm, prompts, max_tokens: int, one_at_a_time: bool = False):
    """Greedy token ids and every top-3 logprob per prompt (token-id lists), for exact
    comparisons between engines; `one_at_a_time` runs each prompt alone (batch 1 decode)."""
    from vserve import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=3, ignore_eos=True)
    requests = [{"prompt_token_ids": p} for p in prompts]
    outs = ([llm.generate([r], sp, use_tqdm=False)[0] for r in requests] if one_at_a_time
            else llm.generate(requests, sp, use_tqdm=False))
    return [(o.outputs[0].token_ids,
             [{t: lp.logprob for t, lp in e.items()} for e in o.outputs[0].logprobs])
            for o in outs]
