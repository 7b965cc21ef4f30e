"""The engine core process: idle means blocked (no busy spin), and a stop string that spans
two steps' text ends the request cleanly under async scheduling (scenarios 18 and 32)."""

import time
from pathlib import Path

import pytest
from hf_reference import PROMPTS

from vserve import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    engine = LLM(tiny_model_dir("llama"), dtype="float32", max_model_len=256)
    yield engine
    engine.shutdown()


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100.0   # utime + stime, in clock ticks


def test_idle_engine_core_blocks_instead_of_spinning(llm):
    llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    pid = llm.engine.client.engine.proc.pid
    time.sleep(0.5)
    before = _cpu_seconds(pid)
    time.sleep(2.0)
    assert _cpu_seconds(pid) - before < 0.3   # a spinning loop would burn ~2 s


def test_stop_string_spanning_two_steps(llm):
    tok = llm.get_tokenizer()
    full = llm.generate(PROMPTS[1], GREEDY, use_tqdm=False)[0].outputs[0]
    ids = full.token_ids
    # a stop string made of the end of one token's text and the start of the next one's
    found = None
    for i in range(3, len(ids) - 1):
        head = tok.decode(ids[:i], skip_special_tokens=True)
        both = tok.decode(ids[:i + 1], skip_special_tokens=True)
        if head and both.startswith(head) and len(both) > len(head) and \
                "\ufffd" not in (head[-1], both[len(head)]) and full.text.startswith(head):
            stop = head[-1] + both[len(head)]
            if full.text.find(stop) == len(head) - 1:
                found = (i, head, stop)
                break
    assert found, "the reference output has no usable token boundary"
    i, head, stop = found
    out = llm.generate(PROMPTS[1], GREEDY.clone(stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.text == full.text[:len(head) - 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert len(out.token_ids) >= i + 1                        # the stop lay across steps
    assert out.token_ids == full.token_ids[:len(out.token_ids)]
    deadline = time.monotonic() + 5   # the front end aborts it in the engine: blocks come back
    while True:
        stats = llm.engine.client.call_utility("stats")
        if stats["num_running_reqs"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert stats["num_running_reqs"] == 0 and stats["kv_cache_usage"] == 0.0
