"""Offline lifecycle, as in vLLM: dropping the last reference to an `LLM` (or leaving its
`with` block) shuts its engine core and workers down; LLMs created one after another leave no
process behind; a script that simply ends prints no error. Waits are bounded."""

import gc
import os
import subprocess
import sys
import threading
import time
import weakref

import pytest

from tests.support.proc_utils import descendants, wait_dead
from vserve import LLM, SamplingParams

pytestmark = pytest.mark.slow  # the fast tier (-m "not slow") leaves these out

SHORT = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def _start(model_dir) -> LLM:
    return LLM(model_dir, dtype="float32", max_model_len=256)


def _tree(llm) -> list[int]:
    engine_pid = llm.engine.client.engine.proc.pid
    tree = [engine_pid, *descendants(engine_pid)]
    assert len(tree) >= 2, "expected an engine core and a worker"
    return tree


def _client_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("vserve-client")]


def _wait_collected(ref, timeout: float = 20) -> bool:
    deadline = time.monotonic() + timeout
    while ref() is not None and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.1)
    return ref() is None


def test_leaving_a_with_block_shuts_the_engine_down(tiny_model_dir):
    with _start(tiny_model_dir("llama")) as llm:
        llm.generate(["hello"], SHORT, use_tqdm=False)
        tree = _tree(llm)
    assert wait_dead(tree, timeout=30) == []
    llm.shutdown()  # a second shutdown is harmless


def test_llms_in_a_row_and_del_leave_no_process(tiny_model_dir):
    """A second LLM replaces (and so collects) the first; dropping the last reference to the
    second (`del`) shuts it down: no process, no client thread, the client collected. (One
    LLM more in a row caught nothing these two miss, and a separate `del` test started one.)"""
    trees, clients = [], []
    for _ in range(2):
        llm = _start(tiny_model_dir("llama"))  # replaces (and so collects) the previous one
        llm.generate(["hello"], SHORT, use_tqdm=False)
        trees.append(_tree(llm))
        clients.append(weakref.ref(llm.engine.client))
        assert wait_dead([p for t in trees[:-1] for p in t], timeout=30) == []
    del llm
    gc.collect()
    assert wait_dead([p for t in trees for p in t], timeout=30) == []
    assert all(_wait_collected(c) for c in clients), "an engine client is kept alive"
    assert _client_threads() == []


def _exit_quietly(tmp_path, body: str, num_engines: int) -> None:
    """Run `body` as a script whose LLMs are still alive when it ends (it prints each engine
    core's pid): it exits 0, prints no error, and leaves no engine process."""
    script = tmp_path / "script.py"
    script.write_text("from vserve import LLM, SamplingParams\n" + body)
    run = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "VSERVE_LOG_LEVEL": "WARNING"},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    bad = [
        line
        for line in run.stderr.splitlines()
        if any(word in line for word in ("ERROR", "Error", "Traceback", "dead", "leaked"))
    ]
    assert bad == [], run.stderr[-3000:]
    engine_pids = [int(line) for line in run.stdout.split()]
    assert len(engine_pids) == num_engines
    assert wait_dead(engine_pids, timeout=10) == []


def test_data_parallel_llm_at_script_exit_shuts_down_quietly(tiny_model_dir, tmp_path):
    """A DP=2 LLM still alive at exit: its engines stop one by one (no new thread starts
    then; the parallel shutdown raised "cannot schedule new futures after interpreter
    shutdown" and left its engines to the lifelines)."""
    body = (
        f"llm = LLM({tiny_model_dir('llama')!r}, dtype='float32', max_model_len=256,"
        " data_parallel_size=2)\n"
        "llm.generate(['hi', 'yo'], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)\n"
        "for client in llm.engine.client.clients.values():\n"
        "    print(client.engine.proc.pid, flush=True)\n"
    )
    _exit_quietly(tmp_path, body, num_engines=2)


def test_script_exit_prints_no_error_and_leaves_no_process(tiny_model_dir, tmp_path):
    """Two LLMs still alive when the script ends: both shut down quietly at exit."""
    body = (
        "sp = SamplingParams(temperature=0, max_tokens=4)\n"
        f"a = LLM({tiny_model_dir('llama')!r}, dtype='float32', max_model_len=256)\n"
        f"b = LLM({tiny_model_dir('llama')!r}, dtype='float32', max_model_len=256)\n"
        "for llm in (a, b):\n"
        "    llm.generate(['hi'], sp, use_tqdm=False)\n"
        "    print(llm.engine.client.engine.proc.pid, flush=True)\n"
    )
    _exit_quietly(tmp_path, body, num_engines=2)
