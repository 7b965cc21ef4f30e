"""The GGUF files llama.cpp's own tools made (tests/fixtures/llamacpp) and what tests do with
them: an in-process fp32 engine on a file, its greedy ids and prompt logprobs, the worst
per-token difference between two runs, and llama.cpp's recorded greedy ids for a file."""

from __future__ import annotations

import json
from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "llamacpp"
PROMPTS = ["The quick brown fox jumps over the lazy dog", "Paris is the capital of France"]
ENGINE = dict(max_model_len=256, multiprocess=False, distributed_executor_backend="uni")


def fixture(name: str) -> Path:
    path = FIXTURES / name
    assert path.is_file(), f"{path} is missing: tests/fixtures/llamacpp/make_fixtures.py"
    return path


def make_llm(path: Path, quantization: str = "gguf", **kw):
    from vserve import LLM

    return LLM(str(path), quantization=quantization, **{"dtype": "float32", **ENGINE, **kw})


def runner_model(llm):
    return llm.engine.client.core.executor.worker.runner.model


def greedy_and_logprobs(llm, max_tokens: int = 12):
    """Greedy ids after PROMPTS and each prompt token's logprob; shuts the engine down."""
    from vserve import SamplingParams

    try:
        sp = SamplingParams(
            temperature=0, max_tokens=max_tokens, ignore_eos=True, prompt_logprobs=0
        )
        outs = llm.generate(PROMPTS, sp, use_tqdm=False)
    finally:
        llm.shutdown()
    lps = [
        [e[t].logprob for e, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])] for o in outs
    ]
    return [list(o.outputs[0].token_ids) for o in outs], lps


def worst_difference(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


def greedy_of_recorded_prompts(name: str) -> tuple[list[list[int]], list[list[int]]]:
    """(vserve's greedy ids, llama.cpp's recorded ones) after the fixture script's prompts,
    16 tokens each, on the fp32 file `name`."""
    from vserve import SamplingParams

    recorded = json.loads((FIXTURES / "llamacpp_greedy.json").read_text())
    llm = make_llm(fixture(name))
    try:
        sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        prompts = [{"prompt_token_ids": p} for p in recorded["prompts"]]
        outs = llm.generate(prompts, sp, use_tqdm=False)
    finally:
        llm.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs], recorded["greedy"][name]
