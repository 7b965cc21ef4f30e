"""Sync, async (the default) and PP=2 engines give the same tokens in the default dtype: the
embedded model on its GGUF blocks (bf16 activations, int8 per block on an int8-gemv CPU; fp32
where the CPU has no bf16 instructions) and a second architecture (a tiny Qwen3 with Q8_0
weights, `quantization="int8"`).

The modes schedule the same batches (async feeds the previous step's tokens on the device but
never changes what runs with what), and each kernel's result depends only on its batch, so
greedy and seeded tokens are identical, and so are the logprobs, bit for bit. The engine
cores run in this process, where `generate` queues every prompt before the first step: a
multiprocess engine core starts stepping when the first request arrives, so how a call's
prompts split across the first steps depends on timing, and in bf16 the rows of a step change
the numerics (the int8 gemv up to 8 rows, the int8 or AMX GEMM past them; the tiny Qwen3's
first logprob moved by 0.05 nats between such splits, and its greedy ids after three
tokens). That batch dependence is the invariance the README does not claim.
"""

from __future__ import annotations

import pytest

from tests.support.hf_reference import PROMPTS
from vserve import LLM, SamplingParams

pytestmark = pytest.mark.slow

INPROC = dict(multiprocess=False, distributed_executor_backend="uni")
MODES = {
    "sync": dict(INPROC, async_scheduling=False),
    "async": dict(INPROC, async_scheduling=True),
    "pp2-async": dict(
        multiprocess=False, distributed_executor_backend="mp", pipeline_parallel_size=2
    ),
}


def _run(model: str | None, mode: dict, **kwargs) -> list:
    llm = LLM(model, max_model_len=256, **kwargs, **mode)
    try:
        greedy = SamplingParams(temperature=0, max_tokens=16, logprobs=2, ignore_eos=True)
        seeded = SamplingParams(temperature=1.0, seed=3, max_tokens=16, logprobs=2, ignore_eos=True)
        params = [greedy if i % 2 == 0 else seeded for i in range(len(PROMPTS))]
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        return [
            (
                o.outputs[0].token_ids,
                [{t: lp.logprob for t, lp in e.items()} for e in o.outputs[0].logprobs],
            )
            for o in outs
        ]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("which", ["embedded", "qwen3-int8"], ids=["embedded-gguf", "qwen3-int8"])
def test_modes_agree_in_the_default_dtype(which, tiny_model_dir):
    if which == "embedded":
        model, kwargs = None, {}
    else:
        model, kwargs = tiny_model_dir("qwen3"), dict(quantization="int8")
    results = {name: _run(model, mode, **kwargs) for name, mode in MODES.items()}
    for name in ("async", "pp2-async"):
        for i, (ours, theirs) in enumerate(zip(results[name], results["sync"])):
            assert ours[0] == theirs[0], (name, i)  # the same tokens
            assert ours[1] == theirs[1], (name, i)  # and the same logprobs, bit for bit
