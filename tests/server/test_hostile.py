"""Hostile requests against a live `vserve serve` on the embedded model (the catalogue of
`vserve.bench.hostile`): each one gets its expected status, `/health` answers within 1 s while
it runs, no server process grows past its bound (engine core 256 MB, front end 512 MB, less
where the entry says so), the next ordinary request is served and the server stays alive.
The server is warmed up first (a plain and a json_object request), so that one-time costs do
not count as growth.

The server runs with small budgets so that the module takes minutes: grammar compiles get
3 s (`--grammar-compile-timeout`) and request bodies 3 s to arrive (`--request-body-timeout`).
A guard kills the server's process tree past 4 GB of RSS in any process (a server that grows
without bound fails its test, not the machine); a server killed or dead after one entry is
started again for the next, so each entry's result stands on its own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import subprocess
import sys

import httpx
import pytest

from tests.support.openai_server import TINY_ARGS, ServerProcess, free_port, serving
from vserve.bench.hostile import CATALOGUE, ENTRIES, Entry
from vserve.bench.hostile_clients import ProbeOptions
from vserve.bench.hostile_probe import RssGuard, kill_tree, probe, warm_up

# the tests that start the embedded model are slow (the fast tier, -m "not slow", leaves them
# out); the check of an empty --api-key starts no model and stays in the fast tier
slow = pytest.mark.slow

FLAGS = ["--grammar-compile-timeout", "3", "--request-body-timeout", "3"]
RSS_CAP = 4 << 30
# entries another entry here proves a superset of, which the benchmark alone runs
SUBSUMED = {"echo_logprobs_n4": "echo_logprobs_n8, the same request with twice the samples"}
ON_MAIN_SERVER = [e for e in CATALOGUE if not e.server_flags and e.name not in SUBSUMED]


def options(entry: Entry) -> ProbeOptions:
    """Requests may take 60 s; stalled uploads wait 15 s to be closed (the body timeout is
    3 s); the slow reader pauses 6 s. The server idles 1.5 s before the last RSS sample
    (heaps are trimmed at idle) only for an entry that bounds it (`after_mb`): the others
    are judged by their peak."""
    settle_s = 1.5 if entry.after_mb else 0.0
    return ProbeOptions(timeout=60.0, stall_wait_s=15.0, stall_s=6.0, settle_s=settle_s)


def at_test_scale(entry: Entry) -> Entry:
    """The entry as this module sends it: the slow reader's stream at 32 tokens a sample
    instead of 256 (16 x 256 take the embedded model half a minute to decode, 16 x 32 a few
    seconds, within the 6 s pause; their 512 events of over 100 bytes each still fill its
    4 KB receive buffer many times over). The benchmark sends every entry as catalogued."""
    if entry.mode != "slow_reader" or entry.body is None:
        return entry
    body = {**json.loads(entry.body()), "max_tokens": 32}
    return dataclasses.replace(entry, body=lambda: json.dumps(body).encode())


class LiveServer:
    """The embedded model's server under the RSS guard, started again when it died."""

    def __init__(self, flags: list[str]) -> None:
        self.flags = flags
        self.guard = RssGuard(0, RSS_CAP).__enter__()
        self.srv = self._start()

    def _start(self) -> ServerProcess:
        srv = ServerProcess(self.flags).wait_ready(timeout=600)
        self.guard.watch(srv.pid)
        warm_up(srv.url)
        return srv

    def ready(self) -> ServerProcess:
        """The server, started again if it is not serving."""
        if self.srv.proc.poll() is None and _healthy(self.srv.url):
            return self.srv
        kill_tree(self.srv.pid)
        with contextlib.suppress(AssertionError):  # leftovers are killed all the same
            self.srv.stop()
        self.srv = self._start()
        return self.srv

    def close(self) -> int:
        self.guard.__exit__(None, None, None)
        return self.srv.stop()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=10).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def live():
    server = LiveServer(FLAGS)
    try:
        yield server
    finally:
        assert server.close() == 0


def _summary(result) -> str:
    keep = ("status", "seconds", "health_max_ms", "ordinary_ok", "alive", "extra", "body_head")
    rss = {r["role"]: (r["before_mb"], r["peak_mb"], r["after_mb"]) for r in result.rss.values()}
    return f"{ {k: getattr(result, k) for k in keep} }\nRSS MB (before, peak, after): {rss}"


@slow
def test_host_header_checked_on_all_interfaces(tiny_model_dir):
    """With `--host 0.0.0.0` the Host allow-list still applies: `GET /v1/models` with
    `Host: evil.example` gets 400 (DNS rebinding), the server keeps serving. A small model
    of its own; this test runs before the module's main server starts."""
    entry = ENTRIES["host_evil"]
    with serving([tiny_model_dir("llama"), *TINY_ARGS, *entry.server_flags]) as srv:
        result = probe(srv.url, entry, server_pid=srv.pid, options=options(entry))
        assert result.status == 400, _summary(result)
        assert result.ordinary_ok and result.alive, _summary(result)
        plain = httpx.get(srv.url + "/v1/models", timeout=10)
        assert plain.status_code == 200, plain.text


@slow
@pytest.mark.parametrize("entry", ON_MAIN_SERVER, ids=[e.name for e in ON_MAIN_SERVER])
def test_hostile_request(live, entry):
    """The entry gets its expected status (and meets its own bounds: time, memory, log lines,
    a stream that completes, stalled uploads closed), /health answers within 1 s throughout,
    the engine core grows less than 256 MB and the front end less than 512 MB, an ordinary
    request is served afterwards and the server is alive."""
    srv = live.ready()
    result = probe(
        srv.url,
        at_test_scale(entry),
        server_pid=srv.pid,
        log_path=srv.log.name,
        options=options(entry),
    )
    problems = result.problems  # the entry's bounds and every entry's (vserve.bench.hostile)
    if live.guard.tripped:
        problems.append(live.guard.tripped)
    assert not problems, f"{entry.name}: {problems}\n{_summary(result)}"


def test_empty_api_key_refused():
    """`vserve serve --api-key ""` exits non-zero at once with a message about the empty key,
    instead of serving without authentication; it loads no model first."""
    cmd = [sys.executable, "-m", "vserve.cli", "serve", "--api-key", ""]
    proc = subprocess.Popen(
        [*cmd, "--port", str(free_port())],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        out, _ = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        proc.wait()
        pytest.fail("vserve serve --api-key '' did not exit within 30 s (it served)")
    assert proc.returncode != 0, out
    assert "api-key" in out and "empty" in out.lower(), out
    assert "start-up" not in out, f"a model was loaded first:\n{out}"


def test_subsumed_entries_name_catalogue_entries():
    """What the module leaves to the benchmark names entries that exist, and their cover."""
    for name, cover in SUBSUMED.items():
        assert name in ENTRIES and cover.split(",")[0] in ENTRIES, (name, cover)
