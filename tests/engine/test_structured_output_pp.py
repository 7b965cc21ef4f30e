"""Structured output with three pipeline stages under async scheduling (a queue of depth 3):
a grammar request admitted while other steps are in flight sits in more than one queued step,
and its deferred bitmask must wait for all of them. Tokens equal the sync PP=1 run and every
output parses."""

import itertools
import json
import time

import pytest

from tests.engine.test_structured_output import SCHEMA, _validate
from tests.support.hf_reference import PROMPTS
from vserve import SamplingParams, StructuredOutputsParams
from vserve.engine.arg_utils import EngineArgs
from vserve.engine.llm_engine import LLMEngine

ENGINE = dict(
    dtype="float32", max_model_len=256, block_size=4, max_num_batched_tokens=16, max_num_seqs=8
)


def _run(model, **mode):
    """A free request starts first; grammar requests arrive while its steps are in flight
    (their prompts chunked by the small token budget), their grammar already compiled."""
    engine = LLMEngine.from_engine_args(EngineArgs(model=model, **ENGINE, **mode))
    grammar = SamplingParams(
        temperature=0, max_tokens=80, structured_outputs=StructuredOutputsParams(json=SCHEMA)
    )
    free = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    results = {}
    try:
        _finish(engine, "warm-up", grammar)  # its grammar compiled: the rest are admitted at once
        engine.add_request("free", PROMPTS[0], free)
        deadline = time.monotonic() + 300  # a guard against a hang, not a timing
        for step in itertools.count():
            if time.monotonic() > deadline:
                break
            if step in (1, 2):
                for i in range(step, len(PROMPTS), 2):
                    engine.add_request(f"g{i}", PROMPTS[i], grammar)
            for out in engine.step():
                if out.finished:
                    results[out.request_id] = out.outputs[0]
            if step > 2 and not engine.has_unfinished_requests():
                return results
        raise AssertionError("requests did not finish")
    finally:
        engine.shutdown()


def _finish(engine: LLMEngine, request_id: str, params: SamplingParams) -> None:
    engine.add_request(request_id, PROMPTS[0], params)
    deadline = time.monotonic() + 300  # a guard against a hang, not a timing
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        engine.step()


@pytest.mark.slow
def test_pp3_async_grammar_equals_sync_pp1(tiny_model_dir):
    model = tiny_model_dir("llama")  # 4 layers: stages of 2, 1 and 1
    reference = _run(model, async_scheduling=False, distributed_executor_backend="uni")
    got = _run(
        model, async_scheduling=True, pipeline_parallel_size=3, distributed_executor_backend="mp"
    )
    assert set(got) == set(reference) == {"free"} | {f"g{i}" for i in range(1, len(PROMPTS))}
    for req_id, comp in got.items():
        assert comp.token_ids == reference[req_id].token_ids, req_id
        if req_id != "free":
            assert comp.finish_reason == "stop", (req_id, comp)
            _validate(json.loads(comp.text))
