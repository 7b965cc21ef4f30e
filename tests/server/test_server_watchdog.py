"""`vserve serve --watchdog-timeout`: a worker stopped mid-generation (SIGSTOP) is declared
dead; the open stream ends with an error event, `/health` answers 503, the server exits
non-zero and no process of its tree survives. A client timeout fails the test."""

from __future__ import annotations

import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.support.openai_server import TINY_ARGS, ServerProcess, children_of, is_running
from tests.support.proc_utils import kill
from vserve.host.proc_tree import cmdline, descendants

pytestmark = pytest.mark.slow  # the fast tier (-m "not slow") leaves these out


def _stream(url: str, body: dict, started: threading.Event) -> list:
    events = []
    with httpx.stream(
        "POST", url + "/v1/completions", json={**body, "stream": True}, timeout=httpx.Timeout(30.0)
    ) as r:  # a hang fails the test
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: ") :]
                events.append(data if data == "[DONE]" else json.loads(data))
                if len(events) >= 3:
                    started.set()
    return events


def _health_log(url: str, stop: threading.Event) -> list:
    """/health status every 20 ms until the server stops listening or drops the connection
    ('refused' then)."""
    seen = []
    while not stop.is_set():
        try:
            seen.append(httpx.get(url + "/health", timeout=5).status_code)
        except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):
            seen.append("refused")  # gone, or closed this connection as it exited (not a
            return seen  # timeout: a hang still fails the test)
        time.sleep(0.02)
    return seen


def _worker_pid(server_pid: int) -> int:
    for pid in descendants(server_pid):
        if b"spawn_main" in cmdline(pid):
            return pid
    raise AssertionError("no worker process under the server")


def test_stopped_worker_fails_the_stream_and_stops_the_server(tiny_model_dir):
    model = tiny_model_dir("llama", max_position_embeddings=8192)
    srv = ServerProcess(
        [model, *TINY_ARGS, "--max-model-len", "8192", "--watchdog-timeout", "3"]
    ).wait_ready()
    worker = _worker_pid(srv.pid)
    try:
        assert children_of(srv.pid)
        started, stop = threading.Event(), threading.Event()
        body = {"prompt": "The quick brown fox", "max_tokens": 5000, "ignore_eos": True}
        with ThreadPoolExecutor(2) as pool:
            stream = pool.submit(_stream, srv.url, body, started)
            assert started.wait(60), "the stream did not start"
            health = pool.submit(_health_log, srv.url, stop)
            kill(worker, signal.SIGSTOP)
            events = stream.result(timeout=60)
            code = srv.wait_exit(timeout=30)
            stop.set()
            statuses = health.result(timeout=30)
        assert events[-1] == "[DONE]" and "error" in events[-2], events[-3:]
        assert events[-2]["error"]["code"] == 500
        assert "watchdog" in events[-2]["error"]["message"], events[-2]
        assert code not in (None, 0), srv.log_tail()
        assert 503 in statuses, statuses[-5:]
        assert 200 not in statuses[statuses.index(503) :], statuses[-5:]
    finally:
        if is_running(worker):
            kill(worker, signal.SIGCONT)
            kill(worker, signal.SIGKILL)
        srv.stop()  # asserts that no process of the tree survived
