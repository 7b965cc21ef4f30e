"""A dead or failing worker or engine core gives every pending request an error within
seconds and leaves no process behind (scenario 22)."""

import os
import signal
import threading
import time

import pytest

from tests.support.proc_utils import descendants, kill, wait_dead, worker_pids
from vserve import LLM, SamplingParams
from vserve.engine.mp_client import EngineDeadError

pytestmark = pytest.mark.slow  # the fast tier (-m "not slow") leaves these out

LONG = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)


def _start(model_dir, **kwargs):
    return LLM(model_dir, dtype="float32", max_model_len=1024, **kwargs)


def _generate_in_thread(llm, prompts):
    box = {}

    def run():
        try:
            box["result"] = llm.generate(prompts, LONG, use_tqdm=False)
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            box["error"] = e
            box["when"] = time.monotonic()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


def _engine_pid(llm) -> int:
    return llm.engine.client.engine.proc.pid


@pytest.mark.parametrize("target", ["worker", "engine"])
def test_killed_process_fails_pending_requests_fast(tiny_model_dir, target):
    llm = _start(tiny_model_dir("llama"), max_num_seqs=4)
    engine_pid = _engine_pid(llm)
    workers = worker_pids(engine_pid)
    tree = descendants(engine_pid)
    assert len(workers) == 1, "the engine core should have one worker process"
    thread, box = _generate_in_thread(llm, ["one", "two", "three"])
    time.sleep(0.7)
    killed_at = time.monotonic()
    kill(workers[0] if target == "worker" else engine_pid, signal.SIGKILL)
    thread.join(timeout=10)
    assert not thread.is_alive(), "generate hung after a process died"
    assert isinstance(box.get("error"), EngineDeadError)
    assert box["when"] - killed_at < 5
    llm.shutdown()
    assert wait_dead([engine_pid, *tree], timeout=10) == []


def test_worker_exception_is_reported_with_its_message(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("VSERVE_FAULT_INJECT", "execute_model:4")
    llm = _start(tiny_model_dir("llama"))
    tree = [_engine_pid(llm), *descendants(_engine_pid(llm))]
    with pytest.raises(EngineDeadError, match="injected fault at step 4"):
        llm.generate(["a prompt"], LONG, use_tqdm=False)
    with pytest.raises(EngineDeadError):  # a dead engine fails new work at once
        llm.generate(["another"], LONG, use_tqdm=False)
    llm.shutdown()
    assert wait_dead(tree, timeout=10) == []


def test_pipeline_worker_death_is_detected(tiny_model_dir):
    llm = _start(tiny_model_dir("llama"), pipeline_parallel_size=2)
    engine_pid = _engine_pid(llm)
    workers = worker_pids(engine_pid)
    assert len(workers) == 2
    thread, box = _generate_in_thread(llm, ["x", "y"])
    time.sleep(0.7)
    kill(workers[-1], signal.SIGKILL)
    thread.join(timeout=10)
    assert isinstance(box.get("error"), EngineDeadError)
    llm.shutdown()
    assert wait_dead([engine_pid, *descendants(engine_pid), *workers], timeout=10) == []


def test_front_end_death_takes_the_engine_down(tiny_model_dir, tmp_path):
    """The engine core notices its parent is gone and exits with its workers."""
    script = tmp_path / "front.py"
    script.write_text(
        "import sys, time\n"
        "from vserve import LLM\n"
        f"llm = LLM({tiny_model_dir('llama')!r}, dtype='float32', max_model_len=256)\n"
        "print(llm.engine.client.engine.proc.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    import subprocess
    import sys

    front = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    engine_pid = int(front.stdout.readline())
    tree = [engine_pid, *descendants(engine_pid)]
    os.kill(front.pid, signal.SIGKILL)
    front.wait()
    assert wait_dead(tree, timeout=15) == []


def test_front_end_death_while_the_engine_is_stuck(tiny_model_dir, tmp_path):
    """The engine core leaves with its parent even when its busy loop cannot (a step waits on
    a stopped worker, watchdog off): it kills its workers and exits."""
    script = tmp_path / "front.py"
    model = tiny_model_dir("llama", max_position_embeddings=8192)
    script.write_text(
        "import threading, time\n"
        "from vserve import LLM, SamplingParams\n"
        f"llm = LLM({model!r}, dtype='float32', max_model_len=4096, watchdog_timeout=0)\n"
        "print(llm.engine.client.engine.proc.pid, flush=True)\n"
        "sp = SamplingParams(temperature=0, max_tokens=4000, ignore_eos=True)\n"
        "threading.Thread(target=llm.generate, args=(['x'], sp), daemon=True).start()\n"
        "while not (llm.engine.last_stats and llm.engine.last_stats.num_running_reqs):\n"
        "    time.sleep(0.05)\n"
        "print('running', flush=True)\n"
        "time.sleep(600)\n"
    )
    import subprocess
    import sys

    front = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    tree = []
    try:
        engine_pid = int(front.stdout.readline())
        assert front.stdout.readline().strip() == "running"
        tree = [engine_pid, *descendants(engine_pid)]
        workers = worker_pids(engine_pid)
        assert len(workers) == 1
        kill(workers[0], signal.SIGSTOP)
        os.kill(front.pid, signal.SIGKILL)
        front.wait()
        assert wait_dead(tree, timeout=20) == []
    finally:
        front.kill()
        for pid in tree:
            kill(pid, signal.SIGCONT)
            kill(pid, signal.SIGKILL)


@pytest.mark.parametrize(
    "frames",
    [
        [bytes([0]), b"\xc1"],  # an ADD whose request id cannot be read
        [bytes([1]), b"\x05"],  # an ABORT that is not a list of ids
        [bytes([2]), b"\x90", b"extra"],  # a frame too many
    ],
)
def test_frame_without_a_request_is_fatal_and_reported(tiny_model_dir, frames, monkeypatch):
    """Before: the input thread died silently and every later call hung. Now the engine
    core reports DEAD: pending and new requests get EngineDeadError within seconds."""
    # 10 ms a step: the pending request is still running when the bad frame arrives
    monkeypatch.setenv("VSERVE_FAULT_INJECT", "execute_model_delay:10")
    llm = _start(tiny_model_dir("llama"))
    tree = [_engine_pid(llm), *descendants(_engine_pid(llm))]
    thread, box = _generate_in_thread(llm, ["a prompt"])
    time.sleep(0.5)
    sent_at = time.monotonic()
    llm.engine.client._send(frames)
    thread.join(timeout=10)
    assert not thread.is_alive(), "generate hung after a bad frame"
    assert isinstance(box.get("error"), EngineDeadError), box
    assert "cannot decode" in str(box["error"]) and box["when"] - sent_at < 5
    with pytest.raises(EngineDeadError):
        llm.generate(["another"], LONG, use_tqdm=False)
    llm.shutdown()
    assert wait_dead(tree, timeout=10) == []
