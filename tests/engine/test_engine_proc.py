"""The engine core process: idle means blocked (no busy spin), a stop string that spans
two steps' text ends the request cleanly under async scheduling (scenarios 18 and 32), and a
frame that does not decode or reuses a live id fails only its own request."""

import queue
import time
from pathlib import Path

import msgspec
import pytest

from tests.support.hf_reference import PROMPTS
from vserve import LLM, SamplingParams, StructuredOutputsParams
from vserve.engine.messages import EngineCoreRequest, EngineCoreRequests, RequestType
from vserve.host.proc_tree import children

pytestmark = pytest.mark.slow  # the fast tier (-m "not slow") leaves these out

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    engine = LLM(tiny_model_dir("llama"), dtype="float32", max_model_len=256)
    yield engine
    engine.shutdown()


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100.0  # utime + stime, in clock ticks


def test_idle_engine_blocks_instead_of_spinning(llm):
    """Every process of an idle engine blocks: the engine core, its worker processes (whose
    OpenMP threads spin only for libgomp's spin count after a step) and the front end's
    threads (this process, asleep here)."""
    llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    core = llm.engine.client.engine.proc.pid
    workers = children(core)
    assert workers, "the engine core has no worker process to measure"
    time.sleep(0.5)
    before = {pid: _cpu_seconds(pid) for pid in [core, *workers]}
    front_before = time.process_time()
    time.sleep(2.0)
    for pid, seconds in before.items():
        assert _cpu_seconds(pid) - seconds < 0.3, pid  # a spinning loop would burn ~2 s
    assert time.process_time() - front_before < 0.3


def test_stop_string_spanning_two_steps(llm):
    tok = llm.get_tokenizer()
    full = llm.generate(PROMPTS[1], GREEDY, use_tqdm=False)[0].outputs[0]
    ids = full.token_ids
    # a stop string made of the end of one token's text and the start of the next one's
    found = None
    for i in range(3, len(ids) - 1):
        head = tok.decode(ids[:i], skip_special_tokens=True)
        both = tok.decode(ids[: i + 1], skip_special_tokens=True)
        if (
            head
            and both.startswith(head)
            and len(both) > len(head)
            and "\ufffd" not in (head[-1], both[len(head)])
            and full.text.startswith(head)
        ):
            stop = head[-1] + both[len(head)]
            if full.text.find(stop) == len(head) - 1:
                found = (i, head, stop)
                break
    assert found, "the reference output has no usable token boundary"
    i, head, stop = found
    out = llm.generate(PROMPTS[1], GREEDY.clone(stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.text == full.text[: len(head) - 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert len(out.token_ids) >= i + 1  # the stop lay across steps
    assert out.token_ids == full.token_ids[: len(out.token_ids)]
    deadline = time.monotonic() + 5  # the front end aborts it in the engine: blocks come back
    while True:
        stats = llm.engine.client.call_utility("stats")
        if stats["num_running_reqs"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert stats["num_running_reqs"] == 0 and stats["kv_cache_usage"] == 0.0


# -- per-request isolation in the input thread ----------------------------------------------
def _send_raw(llm, kind: int, payload: bytes) -> None:
    llm.engine.client._send([bytes([kind]), payload])


def _wait_output(llm, request_id: str, timeout: float = 10.0):
    """The engine's output for `request_id` (read below the front end, which drops outputs
    of requests it does not know); a timeout is a failure, never the expected error."""
    client = llm.engine.client
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            outs = client.outputs.get(timeout=0.2)
        except queue.Empty:
            continue
        assert not outs.engine_error, outs.engine_error
        for out in outs.outputs:
            if out.request_id == request_id and out.finished:
                return out
    raise AssertionError(f"no output for {request_id} within {timeout} s (engine hung?)")


def _request(request_id: str, **params) -> EngineCoreRequest:
    return EngineCoreRequest(request_id, [5, 6, 7], SamplingParams(**params), [2], 1)


def _still_serving(llm, pid: int) -> None:
    assert llm.engine.client.engine.proc.pid == pid and llm.engine.client.engine.alive()
    out = llm.generate("still works", GREEDY.clone(max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


@pytest.mark.parametrize(
    "fields, match",
    [
        # what an unchecked front end (or a params object changed after construction) sent
        (["bad-type", [5, 6], {"top_p": "x"}, [2], 1], "Expected `float`"),
        (["bad-range", [5, 6], {"top_p": 0.0}, [2], 1], "top_p"),
        (["bad-grammar", [5, 6], {"structured_outputs": {"regex": 123}}, [2], 1], "regex"),
        (["bad-shape", "not a list of ids"], "could not decode"),
    ],
)
def test_undecodable_add_fails_only_its_request(llm, fields, match):
    """Before: the input thread died silently; every later request hung, /health said 200."""
    pid = llm.engine.client.engine.proc.pid
    _send_raw(llm, RequestType.ADD, msgspec.msgpack.encode([[fields]]))  # a one-request frame
    out = _wait_output(llm, fields[0])
    assert out.finish_reason == "error" and match in out.error, out.error
    _still_serving(llm, pid)


def test_duplicate_request_id_gets_an_error_output(llm):
    """Before: the scheduler raised inside the busy loop and the engine core died."""
    pid = llm.engine.client.engine.proc.pid
    encoder = msgspec.msgpack.Encoder()
    first = EngineCoreRequests([_request("dup", max_tokens=200, ignore_eos=True, temperature=0)])
    _send_raw(llm, RequestType.ADD, encoder.encode(first))
    _send_raw(llm, RequestType.ADD, encoder.encode(first))
    out = _wait_output(llm, "dup")
    assert out.finish_reason == "error" and "already running" in out.error
    _send_raw(llm, RequestType.ABORT, encoder.encode(["dup"]))
    _still_serving(llm, pid)
    assert llm.engine.client.call_utility("stats")["num_running_reqs"] == 0


# -- no busy spin while grammars compile -----------------------------------------------------
CHOICE = SamplingParams(
    temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=["yes", "no"])
)


def test_engine_core_blocks_while_only_grammars_compile(tiny_model_dir, monkeypatch):
    """While the only request waits for its grammar (2 s here), the engine core schedules no
    steps (before: an empty step to the workers and a stats message per loop turn)."""
    monkeypatch.setenv("VSERVE_FAULT_INJECT", "grammar_compile_delay:2")
    llm = LLM(tiny_model_dir("llama"), dtype="float32", max_model_len=256)
    try:
        llm.engine.take_step_records()
        out = llm.generate("a prompt", CHOICE, use_tqdm=False)[0].outputs[0]
        assert out.text in ("yes", "no")
        steps = llm.engine.take_step_records()
        assert len(steps) <= len(out.token_ids) + 4, len(steps)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("async_on", [False, True])
def test_inproc_engine_blocks_while_only_grammars_compile(tiny_model_dir, monkeypatch, async_on):
    from tests.support.engines import make_llm
    from vserve.engine.structured_output import StructuredOutputManager

    compile_ = StructuredOutputManager._compile_here

    def slow_compile(self, job, size):
        time.sleep(1.5)
        return compile_(self, job, size)

    monkeypatch.setattr(StructuredOutputManager, "_compile_here", slow_compile)
    llm = make_llm(tiny_model_dir("llama"), max_model_len=256, async_scheduling=async_on)
    executor = llm.engine.client.core.executor
    calls = []
    execute = executor.execute_model

    def counting(so, *args, **kwargs):
        calls.append(so.total_num_scheduled_tokens)
        return execute(so, *args, **kwargs)

    executor.execute_model = counting
    out = llm.generate("a prompt", CHOICE, use_tqdm=False)[0].outputs[0]
    assert out.text in ("yes", "no")
    assert len(calls) <= len(out.token_ids) + 4, calls
