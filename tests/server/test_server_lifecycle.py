"""Server lifecycle: engine death (the core process SIGKILLed, or a fault injected into the
worker's forward) makes /health 503, fails in-flight and new requests fast with 5xx or an error
event, and the server exits non-zero with no process of its tree left; SIGTERM lets in-flight
requests finish (up to --shutdown-timeout, the rest end with finish_reason "abort"), refuses
new ones, and exits 0."""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.support.openai_server import TINY_ARGS, ServerProcess, children_of
from vserve.host.proc_tree import cmdline

pytestmark = pytest.mark.slow  # the fast tier (-m "not slow") leaves these out

PROMPT = "The quick brown fox"
LONG = {"prompt": PROMPT, "max_tokens": 5000, "ignore_eos": True}


@pytest.fixture
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama", max_position_embeddings=8192)


def _start(model_dir: str, *extra: str, env: dict | None = None) -> ServerProcess:
    srv = ServerProcess([model_dir, *TINY_ARGS, "--max-model-len", "8192", *extra], env=env)
    try:
        return srv.wait_ready()
    except Exception:
        srv.stop()
        raise


def _stream_events(url: str, body: dict, started: list | None = None) -> list:
    """Every SSE event of one streaming completion ('[DONE]' as a string)."""
    events = []
    with httpx.stream(
        "POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: ") :]
                events.append(data if data == "[DONE]" else json.loads(data))
                if started is not None:
                    started.append(True)
    return events


def _engine_core_pid(server_pid: int) -> int:
    for pid in children_of(server_pid):
        if b"vserve.engine.core_proc" in cmdline(pid):
            return pid
    raise AssertionError("no engine core process under the server")


def _poll_until(check, timeout: float) -> float:
    start = time.monotonic()
    while not check():
        assert time.monotonic() - start < timeout, "condition not met in time"
        time.sleep(0.05)
    return time.monotonic() - start


# the server has exited (or is closing the connection as it exits); a timeout is NOT one of
# these: it is a hang, and fails the test
# (a connection reset while the exiting server closes its sockets is "gone" too; a read
# timeout is not)
GONE = (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError)


def _health(url: str) -> int | None:
    try:
        return httpx.get(url + "/health", timeout=2).status_code
    except GONE:
        return None  # the server already exited


def _failed_fast(url: str, route: str, **kwargs) -> bool:
    """A request to a dead server fails quickly: 5xx, or the connection is refused once the
    server has exited. It must never hang or succeed."""
    start = time.monotonic()
    try:
        r = httpx.request(kwargs.pop("method", "POST"), url + route, timeout=5, **kwargs)
    except GONE:
        return True
    assert r.status_code in (500, 503), r.text
    assert time.monotonic() - start < 2
    return True


def test_engine_killed(model_dir):
    srv = _start(model_dir)
    try:
        started: list = []
        with ThreadPoolExecutor(2) as pool:
            stream = pool.submit(_stream_events, srv.url, LONG, started)
            plain = pool.submit(httpx.post, srv.url + "/v1/completions", json=LONG, timeout=60)
            _poll_until(lambda: len(started) >= 3, timeout=30)
            srv.remember_tree()
            os.kill(_engine_core_pid(srv.pid), signal.SIGKILL)
            killed_at = time.monotonic()
            seen = []  # the death is seen: /health 503, or refused once the server exited
            _poll_until(lambda: seen.append(_health(srv.url)) or seen[-1] != 200, timeout=3)
            assert seen[-1] in (503, None), seen
            _failed_fast(srv.url, "/v1/completions", json={"prompt": PROMPT})
            events = stream.result(timeout=10)
            response = plain.result(timeout=10)
        assert events[-1] == "[DONE]" and "error" in events[-2], events[-3:]
        assert events[-2]["error"]["code"] == 500
        assert response.status_code == 500 and "engine" in response.json()["error"]["message"]
        code = srv.wait_exit(timeout=10)
        assert code not in (None, 0), srv.log_tail()
        assert time.monotonic() - killed_at < 10
    finally:
        srv.stop()  # asserts that no process of the tree survived


def test_fault_in_forward(model_dir):
    srv = _start(model_dir, env={"VSERVE_FAULT_INJECT": "execute_model:5"})
    try:
        r = httpx.post(srv.url + "/v1/completions", json={**LONG, "max_tokens": 50}, timeout=30)
        assert r.status_code == 500 and r.json()["error"]["type"] == "InternalServerError"
        _failed_fast(srv.url, "/health", method="GET")
        code = srv.wait_exit(timeout=10)
        assert code not in (None, 0), srv.log_tail()
    finally:
        srv.stop()


def test_sigterm_drains_then_exits_zero(model_dir):
    # 40 ms a step: the 24-token request is still running at SIGTERM however fast the model
    # is (it finished first once the fp32 decode attention got faster), and ends in ~1 s,
    # well within the 3 s drain
    srv = _start(
        model_dir, "--shutdown-timeout", "3", env={"VSERVE_FAULT_INJECT": "execute_model_delay:40"}
    )
    try:
        started: list = []
        with ThreadPoolExecutor(2) as pool:
            short = pool.submit(
                httpx.post, srv.url + "/v1/completions", json={**LONG, "max_tokens": 24}, timeout=60
            )
            long = pool.submit(_stream_events, srv.url, LONG, started)
            _poll_until(lambda: len(started) >= 2, timeout=30)
            srv.remember_tree()
            assert not short.done()
            srv.proc.send_signal(signal.SIGTERM)
            # draining once /health says so (polled: a loaded host may take the signal late)
            _poll_until(
                lambda: httpx.get(srv.url + "/health", timeout=5).status_code == 503, timeout=10
            )
            r = httpx.post(srv.url + "/v1/completions", json={"prompt": PROMPT}, timeout=5)
            assert r.status_code == 503  # no new work while draining
            done = short.result(timeout=30)
            events = long.result(timeout=30)
        assert done.status_code == 200  # in flight: finished
        assert done.json()["choices"][0]["finish_reason"] == "length"
        assert done.json()["usage"]["completion_tokens"] == 24
        reasons = [
            c["finish_reason"] for e in events[:-1] for c in e["choices"] if c["finish_reason"]
        ]
        assert reasons == ["abort"] and events[-1] == "[DONE]"  # past the timeout: aborted
        assert srv.wait_exit(timeout=15) == 0, srv.log_tail()
    finally:
        assert srv.stop() == 0
