"""Hostile HTTP requests against `vserve serve`, and a probe that measures what each one does
to a live server.

The catalogue (`CATALOGUE`, by name in `ENTRIES`) holds requests that a client may send to
make the server spend memory or time out of proportion: constraints too large or too costly
to compile, bodies of millions of JSON values, strings nested 50000 deep, echo and logprobs
multiplied by `n`, uploads that stall, streams nobody reads, a foreign `Host`. Each entry says
how to send it (a JSON body built lazily, since some are ~32 MiB; raw bytes for malformed
bodies; or a special client: stalled uploads, clients that disconnect, a stream left unread),
the status the server should answer, and the bounds that go with it (time, memory).

`probe(url, entry)` sends one entry while it samples the RSS of every process of the server's
tree every 100 ms and polls `/health` every 50 ms, then sends one ordinary request and checks
that the server is alive; `verdict` lists what differs from the entry's expectation.
`RssGuard` kills the server's whole process tree once any of its processes passes an RSS cap,
so that a server that grows without bound fails its probe instead of the machine.

Used by `benchmarks/hostile.py` (the table), `benchmarks/soak.py --hostile-mix` (the cheap
entries, repeated) and the server tests.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import selectors
import signal
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from vserve.proc_tree import cmdline, descendants, is_running

MIB = 1 << 20
MAX_BODY_BYTES = 32 * MIB  # the server's default --max-request-body-bytes
PROMPT_CHARS = 131_000  # just under the default --max-prompt-chars (16 x 8192) on CPU
# "(a|b)" x 10000: 50 kB, far under the constraint cap, but about 20 s to compile against the
# embedded model's 262k-token vocabulary on a 2-core Xeon (8000: 15 s, 6000: 6.6 s), twice
# the default --grammar-compile-timeout of 10 s
COMPILE_HEAVY_UNITS = 10_000
ABANDONED_UNITS = 8_000  # each abandoned compile: about 15 s on the same machine
ORDINARY = {"prompt": "Hello", "max_tokens": 4}
ORDINARY_ROUTE = "/v1/completions"
CLOSED = "closed"  # an outcome: the server closed the connection without an answer
# bounds for every entry (an entry's own are kept where stricter): the worst /health wait
# while a request runs, and the peak RSS growth of the engine core and the front end
HEALTH_MS = 1000.0
GROWTH_MB = {"engine_core": 256.0, "frontend": 512.0}

Body = Callable[[], bytes]


# -- the catalogue ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Entry:
    """One hostile request and what the server should do with it.

    `mode` picks the client: "send" (one request), "abandon" (`abandoned` bodies sent by
    clients that disconnect after 1 s, then `body`), "parallel" (`body` while small requests
    run beside it), "stall" (`stall_count` uploads that stop after `stall_bytes`), "slow_reader"
    (a stream not read for a while). `expect` lists the accepted outcomes (HTTP statuses, or
    CLOSED). Bounds left as None are not checked."""

    name: str
    route: str
    expect: tuple[int | str, ...]
    description: str
    body: Body | None = None
    method: str = "POST"
    headers: tuple[tuple[str, str], ...] = (("content-type", "application/json"),)
    mode: str = "send"
    max_seconds: float | None = None  # the answer's time
    health_ms: float | None = None  # the worst /health wait during the request
    growth_mb: tuple[tuple[str, float], ...] = ()  # (role, MB): peak RSS over the start
    after_mb: tuple[tuple[str, float], ...] = ()  # (role, MB): end RSS over the start
    log_line_max: int | None = None  # bytes of the longest new server log line
    server_flags: tuple[str, ...] = ()  # needs a server started with these flags
    repeatable: bool = True  # cheap enough to repeat in a soak
    abandoned: Callable[[], list[bytes]] | None = None
    stall_count: int = 0
    stall_bytes: int = 0
    stall_declared: int = MAX_BODY_BYTES
    stall_require: int | None = None  # a status that at least one stalled upload must get

    @property
    def expect_label(self) -> str:
        return "/".join(str(s) for s in self.expect)

    def accepts(self, status: int | str) -> bool:
        """Whether `status` is one of the outcomes this entry expects."""
        return status in self.expect

    def request(self) -> tuple[str, str, bytes, dict[str, str]]:
        """(method, route, body, headers) of a plain entry (mode "send")."""
        return self.method, self.route, self.body() if self.body else b"", dict(self.headers)


def _json(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def _lazy(build: Callable[[], Any]) -> Body:
    return lambda: _json(build())


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def compile_heavy_regex(units: int = COMPILE_HEAVY_UNITS) -> str:
    """A regex far under the size cap that is slow to compile against a large vocabulary;
    its random literal tail makes every call a new constraint (no compile cache helps)."""
    return "(a|b)" * units + f"c{random.randrange(10**9)}"


def _schema_body(description_chars: int) -> dict:
    schema = {"type": "object", "description": "A" * description_chars}
    return {
        "prompt": [[1000], [1001]],
        "n": 64,
        "temperature": 1,
        "max_tokens": 1,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    }


def _echo_logprobs(n: int) -> dict:
    return {
        "prompt": [[1000] * 1000, [1001] * 1000],
        "echo": True,
        "logprobs": 20,
        "prompt_logprobs": 20,
        "n": n,
        "temperature": 1,
        "max_tokens": 1,
    }


def _many_messages(body_bytes: int = MAX_BODY_BYTES) -> bytes:
    """`{"messages":[{"role":"a"},...]}` as long as fits under `body_bytes`."""
    one = b'{"role":"a"}'
    count = (body_bytes - len(b'{"messages":[]}') + 1) // (len(one) + 1)
    return b'{"messages":[' + b",".join([one] * count) + b"]}"


def _many_id_lists(body_bytes: int = MAX_BODY_BYTES) -> bytes:
    """`{"prompt":[[0],[0],...]}` as long as fits under `body_bytes` (~8 M lists)."""
    count = (body_bytes - len(b'{"prompt":[]}') + 1) // len(b"[0],")
    return b'{"prompt":[' + b",".join([b"[0]"] * count) + b"]}"


def _long_prompt(chars: int) -> str:
    words = "the quick brown fox jumps over a lazy dog near seven green river stones "
    return (words * (chars // len(words) + 1))[:chars]


def _many_prompts(count: int = 255, chars: int = PROMPT_CHARS) -> bytes:
    prompt = _json(_long_prompt(chars))
    return b'{"max_tokens":1,"prompt":[' + b",".join([prompt] * count) + b"]}"


def _tool_args_nested() -> dict:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": _nested(50000)}}
    return {
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "user", "content": "again"},
        ],
        "max_tokens": 1,
    }


def _unknown_keys(count: int = 100_000) -> dict:
    body: dict[str, Any] = {f"k{i}": 0 for i in range(count)}
    body.update(prompt="Hello", max_tokens=1)
    return body


def _abandoned_regexes() -> list[bytes]:
    return [
        _json({"prompt": "x", "max_tokens": 1, "structured_outputs": {"regex": rx}})
        for rx in (compile_heavy_regex(ABANDONED_UNITS) for _ in range(4))
    ]


C, CHAT = "/v1/completions", "/v1/chat/completions"
ENGINE_64MB = (("engine_core", 64.0),)

CATALOGUE: tuple[Entry, ...] = (
    Entry(
        "regex_1p2mb",
        C,
        (400,),
        "a 1.2 MB regex (a|b) x 200000: over --max-constraint-chars",
        _lazy(
            lambda: {
                "prompt": "x",
                "max_tokens": 1,
                "structured_outputs": {"regex": "(a|b)" * 200000},
            }
        ),
        repeatable=False,  # cheap once refused, but a server without the cap grows to GBs
    ),
    Entry(
        "regex_compile_heavy",
        C,
        (400,),
        "a 50 kB regex under the size cap that compiles for ~20 s: over the compile budget",
        _lazy(
            lambda: {
                "prompt": "x",
                "max_tokens": 1,
                "structured_outputs": {"regex": compile_heavy_regex()},
            }
        ),
        repeatable=False,
    ),
    Entry(
        "chat_2p5m_messages",
        CHAT,
        (400,),
        "~2.6 M {'role':'a'} messages in a body just under 32 MiB: too many JSON values",
        _many_messages,
        max_seconds=5.0,
        repeatable=False,
    ),
    Entry(
        "prompt_8m_lists",
        C,
        (400,),
        "~8.4 M one-id prompt lists in a body just under 32 MiB: too many JSON values",
        _many_id_lists,
        max_seconds=5.0,
        repeatable=False,
    ),
    Entry(
        "guided_json_nested_string",
        C,
        (400,),
        "guided_json as a string nested 50000 deep",
        _lazy(lambda: {"prompt": "x", "max_tokens": 1, "guided_json": _nested(50000)}),
    ),
    Entry(
        "so_json_nested_string",
        C,
        (400,),
        "structured_outputs.json as a string nested 50000 deep",
        _lazy(
            lambda: {"prompt": "x", "max_tokens": 1, "structured_outputs": {"json": _nested(50000)}}
        ),
    ),
    Entry(
        "tool_args_nested_string",
        CHAT,
        (400,),
        "an assistant tool call whose arguments string nests 50000 deep",
        _lazy(_tool_args_nested),
    ),
    Entry(
        "lone_surrogate",
        C,
        (400,),
        "a prompt with a lone surrogate (the JSON escape \\ud800)",
        lambda: b'{"prompt":"ab\\ud800cd","max_tokens":1}',
    ),
    Entry(
        "schema_1mb_n64",
        C,
        (400,),
        "a 1 MB JSON schema x 2 prompts x n=64: over --max-constraint-chars",
        _lazy(lambda: _schema_body(1_000_000)),
    ),
    Entry(
        "schema_200k_n64",
        C,
        (200,),
        "a 200 kB JSON schema x 2 prompts x n=64: one shared constraint, not 128 copies",
        _lazy(lambda: _schema_body(200_000)),
        growth_mb=ENGINE_64MB,
    ),
    Entry(
        "template_kwargs_bos",
        CHAT,
        (400,),
        "chat_template_kwargs.bos_token of 4 M characters: refused before tokenization",
        _lazy(
            lambda: {
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 1,
                "chat_template_kwargs": {"bos_token": "a " * 2_000_000},
            }
        ),
        max_seconds=0.5,
    ),
    Entry(
        "echo_logprobs_n16",
        C,
        (400,),
        "echo + logprobs 20 + prompt_logprobs 20, 2 x 1000 ids, n=16: over --max-response-logprobs",
        _lazy(lambda: _echo_logprobs(16)),
        repeatable=False,
    ),
    Entry(
        "echo_logprobs_n8",
        C,
        (200,),
        "the same with n=8 (672k logprob entries, under the cap)",
        _lazy(lambda: _echo_logprobs(8)),
        health_ms=1000.0,
        repeatable=False,
    ),
    Entry(
        "echo_logprobs_n4",
        C,
        (200,),
        "the same with n=4",
        _lazy(lambda: _echo_logprobs(4)),
        health_ms=1000.0,
    ),
    Entry(
        "echo_only_n128",
        C,
        (200,),
        "echo-only (max_tokens 0), 2 x 8000 ids, n=128: 256 prompt decodes off the event loop",
        _lazy(
            lambda: {
                "prompt": [[1000] * 8000, [1001] * 8000],
                "echo": True,
                "max_tokens": 0,
                "n": 128,
                "temperature": 1,
            }
        ),
        health_ms=1000.0,
        repeatable=False,
    ),
    Entry(
        "abandoned_compiles",
        C,
        (200,),
        "4 compile-heavy regexes whose clients leave after 1 s, then a json_object request",
        _lazy(lambda: {"prompt": "x", "max_tokens": 8, "response_format": {"type": "json_object"}}),
        mode="abandon",
        max_seconds=5.0,
        abandoned=_abandoned_regexes,
        repeatable=False,
    ),
    Entry(
        "many_prompts_chars",
        C,
        (400,),
        "255 prompts of 131000 characters (33 MB): over --max-request-chars, small requests unhurt",
        _many_prompts,
        mode="parallel",
        max_seconds=5.0,
        repeatable=False,
    ),
    Entry(
        "stalled_uploads",
        C,
        (408, 503, CLOSED),
        "20 uploads declaring 32 MiB that stall after 1 MiB: closed by --request-body-timeout",
        mode="stall",
        after_mb=(("frontend", 50.0),),
        stall_count=20,
        stall_bytes=MIB,
        repeatable=False,
    ),
    Entry(
        "pending_body_cap",
        C,
        (408, 503, CLOSED),
        "5 uploads declaring 32 MiB that stall after 30 MiB: over --max-pending-body-bytes, 503",
        mode="stall",
        after_mb=(("frontend", 50.0),),
        stall_count=5,
        stall_bytes=30 * MIB,
        stall_require=503,
        repeatable=False,
    ),
    Entry(
        "unknown_keys_100k",
        C,
        (200,),
        "100000 unknown top-level keys beside a valid prompt: ignored, no log line over 1 KB",
        _lazy(_unknown_keys),
        log_line_max=1024,
    ),
    Entry(
        "unknown_keys_200k",
        C,
        (400,),
        "200000 unknown top-level keys: more JSON values than a body may hold, refused unparsed",
        _lazy(lambda: _unknown_keys(200_000)),
        max_seconds=1.0,
        log_line_max=1024,
    ),
    Entry(
        "temperature_1e39",
        C,
        (400,),
        "temperature 1e39: finite in float64, inf in float32",
        _lazy(lambda: {"prompt": "x", "max_tokens": 1, "temperature": 1e39}),
    ),
    Entry(
        "repetition_penalty_1e-46",
        C,
        (400,),
        "repetition_penalty 1e-46: 0 in float32",
        _lazy(lambda: {"prompt": "x", "max_tokens": 1, "repetition_penalty": 1e-46}),
    ),
    Entry(
        "host_evil",
        "/v1/models",
        (400,),
        "GET /v1/models with Host: evil.example (DNS rebinding), the server on --host 0.0.0.0",
        method="GET",
        headers=(("host", "evil.example"),),
        server_flags=("--host", "0.0.0.0"),
    ),
    Entry(
        "slow_stream_reader",
        C,
        (200,),
        "a stream of n=16 x 256 tokens left unread for 20 s, then read: it completes",
        _lazy(
            lambda: {
                "prompt": "x",
                "stream": True,
                "n": 16,
                "temperature": 1,
                "max_tokens": 256,
                "ignore_eos": True,
            }
        ),
        mode="slow_reader",
        repeatable=False,
    ),
)
ENTRIES: dict[str, Entry] = {e.name: e for e in CATALOGUE}


def warm_up(url: str, timeout: float = 300.0) -> None:
    """An ordinary request and a structured one (json_object), so that one-time costs (the
    first step, the grammar backend's tables for the vocabulary) are paid before a probe
    measures memory and time."""
    headers = {"content-type": "application/json"}
    json_object = {**ORDINARY, "max_tokens": 8, "response_format": {"type": "json_object"}}
    for body in (ORDINARY, json_object):
        send(url, "POST", ORDINARY_ROUTE, _json(body), headers, timeout)


def repeatable_entries() -> list[Entry]:
    """Plain entries cheap enough to repeat (no 32 MiB bodies, stalls or compile budgets)."""
    return [e for e in CATALOGUE if e.repeatable and e.mode == "send" and not e.server_flags]


# -- processes: roles, RSS, CPU --------------------------------------------------------------------
def role_of(pid: int, server_pid: int) -> str:
    """frontend, engine_core, grammar_worker, worker, resource_tracker or other."""
    if pid == server_pid:
        return "frontend"
    cmd = cmdline(pid)
    for needle, role in (
        (b"vserve.engine.core_proc", "engine_core"),
        (b"grammar_worker", "grammar_worker"),
        (b"resource_tracker", "resource_tracker"),
        (b"spawn_main", "worker"),
    ):
        if needle in cmd:
            return role
    return "other"


def rss_bytes(pid: int) -> int:
    """VmRSS of `pid` from /proc/<pid>/status, 0 once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of `pid` (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def tree(pid: int) -> list[int]:
    """`pid` and its descendants."""
    return [pid, *descendants(pid)]


def listening_pid(port: int) -> int | None:
    """The lowest pid holding a socket that listens on TCP `port` (from /proc), or None."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(f"socket:[{cols[9]}]")
    holders = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and _holds_any(entry / "fd", inodes):
            holders.append(int(entry.name))
    return min(holders) if holders else None


def _holds_any(fd_dir: Path, links: set[str]) -> bool:
    try:
        return any(os.readlink(fd) in links for fd in fd_dir.iterdir())
    except OSError:
        return False


def kill_tree(pid: int) -> list[int]:
    """SIGKILL `pid` and every descendant (one snapshot, children first); the pids hit."""
    pids = [*reversed(descendants(pid)), pid]
    for p in pids:
        with contextlib.suppress(OSError):
            os.kill(p, signal.SIGKILL)
    return pids


class RssGuard:
    """A thread that kills the server's whole process tree when one of its processes passes
    `cap_bytes` of RSS (sampled every `interval` s); `tripped` then says which and when.
    `watch(pid)` points it at a restarted server and clears `tripped`."""

    def __init__(self, pid: int, cap_bytes: int, interval: float = 0.1) -> None:
        self.pid, self.cap, self.interval = pid, cap_bytes, interval
        self.tripped: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-guard", daemon=True)

    def __enter__(self) -> RssGuard:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def watch(self, pid: int) -> None:
        self.pid, self.tripped = pid, None

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            pid = self.pid
            if self.tripped or not is_running(pid):
                continue
            for p in tree(pid):
                rss = rss_bytes(p)
                if rss > self.cap:
                    kill_tree(pid)
                    self.tripped = (
                        f"killed at the RSS cap: {role_of(p, pid)} (pid {p}) at "
                        f"{rss / 2**30:.2f} GB > {self.cap / 2**30:.2f} GB"
                    )
                    break


class RssSampler:
    """Samples the RSS of every process of the tree under `pid` every `interval` s: the first
    sample (`before`), the highest (`peak`) and, on `finish`, the last (`after`); plus the CPU
    seconds each process used in between."""

    def __init__(self, pid: int, interval: float = 0.1) -> None:
        self.pid, self.interval = pid, interval
        self.roles: dict[int, str] = {}
        self.before = self._sample()
        self.peak = dict(self.before)
        self.cpu0 = {p: cpu_seconds(p) for p in self.before}
        self.after: dict[int, int] = {}
        self.cpu: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()

    def _sample(self) -> dict[int, int]:
        out = {}
        for p in tree(self.pid):
            self.roles.setdefault(p, role_of(p, self.pid))
            out[p] = rss_bytes(p)
        return out

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            for p, rss in self._sample().items():
                if rss > self.peak.get(p, 0):
                    self.peak[p] = rss
                self.cpu0.setdefault(p, 0.0)

    def finish(self) -> None:
        self._stop.set()
        self._thread.join()
        self.after = self._sample()
        self.cpu = {p: max(0.0, cpu_seconds(p) - c) for p, c in self.cpu0.items()}

    def table(self) -> dict[str, dict[str, Any]]:
        """pid -> role, MB before / peak / after, CPU seconds."""
        mb = 1e6
        return {
            str(p): {
                "role": self.roles.get(p, "other"),
                "before_mb": round(self.before.get(p, 0) / mb, 1),
                "peak_mb": round(self.peak.get(p, 0) / mb, 1),
                "after_mb": round(self.after.get(p, 0) / mb, 1),
                "cpu_s": round(self.cpu.get(p, 0.0), 2),
            }
            for p in sorted(self.peak)
        }


class HealthPoller:
    """GET /health every `interval` s on its own thread; `worst_ms` is the slowest answer, a
    /health that does not answer counting as its wait so far."""

    def __init__(self, url: str, interval: float = 0.05, timeout: float = 600.0) -> None:
        self.url, self.interval, self.timeout = url, interval, timeout
        self.worst_ms = 0.0
        self.failures = 0
        self.polls = 0
        self._since: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="health-poller", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with httpx.Client(timeout=self.timeout) as client:
            while not self._stop.is_set():
                self._since = time.monotonic()
                try:
                    ok = client.get(self.url + "/health").status_code == 200
                except httpx.HTTPError:
                    ok = False
                self._note(time.monotonic() - self._since, ok)
                self._since = None
                self._stop.wait(self.interval)

    def _note(self, seconds: float, ok: bool) -> None:
        self.polls += 1
        self.failures += not ok
        self.worst_ms = max(self.worst_ms, 1000 * seconds)

    def finish(self) -> float:
        """Stop polling (without waiting for an unanswered poll); the worst wait in ms."""
        self._stop.set()
        since = self._since
        if since is not None:
            self.worst_ms = max(self.worst_ms, 1000 * (time.monotonic() - since))
        self._thread.join(timeout=0.5)
        return round(self.worst_ms, 1)


# -- the clients -----------------------------------------------------------------------------------
@dataclass
class Outcome:
    status: int | str
    seconds: float
    body_head: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def _head(data: bytes | str) -> str:
    text = data.decode("utf-8", "replace") if isinstance(data, bytes) else data
    return text[:200]


def send(
    url: str, method: str, route: str, body: bytes, headers: dict[str, str], timeout: float
) -> Outcome:
    """One request; its status (or "timeout" / "error: ...") and the start of its body."""
    start = time.monotonic()
    try:
        with httpx.Client(timeout=timeout) as client:
            r = client.request(method, url + route, content=body or None, headers=headers)
        return Outcome(r.status_code, time.monotonic() - start, _head(r.content))
    except httpx.TimeoutException:
        return Outcome("timeout", time.monotonic() - start)
    except httpx.HTTPError as e:
        return Outcome(f"error: {type(e).__name__}", time.monotonic() - start, _head(str(e)))


def _send_entry(url: str, entry: Entry, opts: ProbeOptions) -> Outcome:
    method, route, body, headers = entry.request()
    return send(url, method, route, body, headers, opts.timeout)


def _abandon(url: str, entry: Entry, opts: ProbeOptions) -> Outcome:
    """The abandoned bodies at once, each client leaving after 1 s; then the entry's body."""
    bodies = entry.abandoned() if entry.abandoned else []
    headers = dict(entry.headers)
    with ThreadPoolExecutor(max(1, len(bodies))) as pool:
        left = list(pool.map(lambda b: send(url, "POST", entry.route, b, headers, 1.0), bodies))
    out = _send_entry(url, entry, opts)
    out.extra["abandoned"] = [str(o.status) for o in left]
    return out


def _parallel(url: str, entry: Entry, opts: ProbeOptions) -> Outcome:
    """The entry's body while ordinary requests run one after another beside it; their
    slowest time against a baseline taken just before."""
    small = _json(ORDINARY)
    headers = {"content-type": "application/json"}

    def ordinary() -> float:
        return send(url, "POST", ORDINARY_ROUTE, small, headers, opts.timeout).seconds

    baseline = sorted(ordinary() for _ in range(3))[1]
    times: list[float] = []
    with ThreadPoolExecutor(1) as pool:
        big = pool.submit(_send_entry, url, entry, opts)
        time.sleep(0.2)
        while not big.done() or not times:
            times.append(ordinary())
        out = big.result()
    slowest = max(times)
    out.extra.update(small_baseline_s=round(baseline, 3), small_max_s=round(slowest, 3))
    out.extra.setdefault("checks", {})["small_request_unhurt"] = slowest < 2 * baseline + 1.0
    return out


def _raw_request(host: str, port: int, route: str, length: int) -> bytes:
    return (
        f"POST {route} HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
    ).encode()


def _status_of(data: bytes) -> int | str:
    try:
        return int(data.split(b" ", 2)[1])
    except (IndexError, ValueError):
        return CLOSED


def _open_stall(host: str, port: int, entry: Entry, timeout: float) -> socket.socket | None:
    """A connection that sends the headers and `stall_bytes` of the body, then nothing (None
    when the server refused the connection)."""
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError:
        return None
    head = _raw_request(host, port, entry.route, entry.stall_declared)
    with contextlib.suppress(OSError):  # refused early: the answer is read below
        sock.sendall(head + b'{"prompt":"' + b"a" * (entry.stall_bytes - 11))
    return sock


def _stall(url: str, entry: Entry, opts: ProbeOptions) -> Outcome:
    """`stall_count` uploads that stop after `stall_bytes` of their declared length; each
    one's outcome (a status, CLOSED, or "open" at the end of the wait)."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    start = time.monotonic()
    socks = [_open_stall(host, port, entry, opts.stall_wait_s) for _ in range(entry.stall_count)]
    outcomes = _await_answers(socks, start + opts.stall_wait_s)
    seconds = time.monotonic() - start
    for s in socks:
        if s is not None:
            s.close()
    kinds = sorted({str(o) for o, _ in outcomes})
    summary = " ".join(f"{k}x{sum(str(o) == k for o, _ in outcomes)}" for k in kinds)
    worst = max(t for _, t in outcomes)
    status: int | str = outcomes[0][0] if len(kinds) == 1 else summary
    out = Outcome(status, seconds, summary)
    out.extra.update(outcomes=summary, slowest_close_s=round(worst, 2))
    checks = {"all_closed": all(entry.accepts(o) for o, _ in outcomes)}
    if entry.stall_require is not None:
        checks[f"some_{entry.stall_require}"] = any(o == entry.stall_require for o, _ in outcomes)
    out.extra["checks"] = checks
    return out


def _await_answers(
    socks: list[socket.socket | None], deadline: float
) -> list[tuple[int | str, float]]:
    """For each socket: the status the server answered (or CLOSED), and when; "open" for one
    still open at `deadline`."""
    start = time.monotonic()
    found: dict[int, tuple[int | str, float]] = {}
    with selectors.DefaultSelector() as sel:
        for i, s in enumerate(socks):
            if s is None:
                found[i] = (CLOSED, 0.0)
                continue
            s.setblocking(False)
            sel.register(s, selectors.EVENT_READ, i)
        while len(found) < len(socks) and time.monotonic() < deadline:
            for key, _ in sel.select(timeout=min(1.0, max(0.0, deadline - time.monotonic()))):
                try:
                    data = key.fileobj.recv(4096)  # type: ignore[union-attr]
                except OSError:
                    data = b""
                found[key.data] = (_status_of(data), time.monotonic() - start)
                sel.unregister(key.fileobj)
    return [found.get(i, ("open", time.monotonic() - start)) for i in range(len(socks))]


def _slow_reader(url: str, entry: Entry, opts: ProbeOptions) -> Outcome:
    """A streamed request on a socket with a tiny receive buffer, not read for `stall_s`
    seconds (the server's sends block), then read to the end; the front end's CPU time
    during the stall."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    body = entry.body() if entry.body else b""
    start = time.monotonic()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(opts.timeout)
    sock.connect((host, port))
    sock.sendall(_raw_request(host, port, entry.route, len(body)) + body)
    front = opts.server_pid
    cpu0 = cpu_seconds(front) if front else 0.0
    time.sleep(opts.stall_s)
    stall_cpu = (cpu_seconds(front) - cpu0) if front else None
    data = _read_stream(sock, time.monotonic() + opts.timeout)
    sock.close()
    out = Outcome(_status_of(data), time.monotonic() - start, _head(data))
    done = b"data: [DONE]" in data
    out.extra.update(stream_bytes=len(data), stream_done=done, stall_s=opts.stall_s)
    checks: dict[str, bool] = {"stream_done": done}
    if stall_cpu is not None:
        out.extra["frontend_cpu_in_stall_s"] = round(stall_cpu, 2)
        checks["frontend_cpu_modest"] = stall_cpu < 0.5 * opts.stall_s
    out.extra["checks"] = checks
    return out


def _read_stream(sock: socket.socket, deadline: float) -> bytes:
    """Everything until the stream's end (the last chunk, or `[DONE]`), a close or `deadline`."""
    chunks, tail = [], b""
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(1 << 16)
        except OSError:
            break
        if not chunk:
            break
        chunks.append(chunk)
        tail = (tail + chunk)[-64:]
        if tail.endswith(b"\r\n0\r\n\r\n") or tail.rstrip().endswith(b"data: [DONE]"):
            break
    return b"".join(chunks)


_CLIENTS: dict[str, Callable[[str, Entry, ProbeOptions], Outcome]] = {
    "send": _send_entry,
    "abandon": _abandon,
    "parallel": _parallel,
    "stall": _stall,
    "slow_reader": _slow_reader,
}


# -- the probe -------------------------------------------------------------------------------------
@dataclass
class ProbeOptions:
    timeout: float = 300.0  # one request's wait
    stall_wait_s: float = 75.0  # how long stalled uploads may wait to be closed
    stall_s: float = 20.0  # how long the slow reader reads nothing
    settle_s: float = 1.5  # idle time before the last RSS sample (heaps are trimmed at idle)
    server_pid: int | None = None


@dataclass
class ProbeResult:
    name: str
    route: str
    expected: str
    status: int | str
    seconds: float
    body_head: str
    health_max_ms: float
    health_failures: int
    rss: dict[str, dict[str, Any]]
    ordinary_ok: bool
    ordinary_s: float
    alive: bool
    log_max_line: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}

    def growth_mb(self, role: str, at: str = "peak_mb") -> float:
        """The largest growth (at `at` over the start) among the processes of `role`."""
        rows = [r for r in self.rss.values() if r["role"] == role]
        return max((round(r[at] - r["before_mb"], 1) for r in rows), default=0.0)


def probe(
    url: str,
    entry: Entry,
    *,
    server_pid: int | None = None,
    log_path: str | Path | None = None,
    options: ProbeOptions | None = None,
    health_ms: float | None = HEALTH_MS,
    growth_mb: dict[str, float] | None = None,
) -> ProbeResult:
    """Send `entry` to the server at `url` and measure it: the answer, the worst /health wait,
    the RSS of every server process (before, peak, after) and their CPU time, then whether an
    ordinary request is served and the server is alive. `server_pid` (the front end) is found
    from the listening port when not given; `log_path`, the server's log, lets the probe
    measure the log lines the request added. `health_ms` and `growth_mb` (role -> MB, default
    GROWTH_MB) bound every entry besides its own bounds (see `verdict`)."""
    opts = options or ProbeOptions()
    pid = server_pid or listening_pid(urlsplit(url).port or 80)
    opts.server_pid = pid
    log_start = _log_size(log_path)
    sampler = RssSampler(pid) if pid else None
    health = HealthPoller(url)
    outcome = _CLIENTS[entry.mode](url, entry, opts)
    worst_health_ms = health.finish()
    ordinary = send(
        url, "POST", ORDINARY_ROUTE, _json(ORDINARY), {"content-type": "application/json"}, 60
    )
    time.sleep(opts.settle_s)
    if sampler:
        sampler.finish()
    result = ProbeResult(
        name=entry.name,
        route=entry.route,
        expected=entry.expect_label,
        status=outcome.status,
        seconds=round(outcome.seconds, 3),
        body_head=outcome.body_head,
        health_max_ms=worst_health_ms,
        health_failures=health.failures,
        rss=sampler.table() if sampler else {},
        ordinary_ok=ordinary.status == 200,
        ordinary_s=round(ordinary.seconds, 3),
        alive=_alive(url, pid),
        log_max_line=_longest_new_line(log_path, log_start),
        extra=outcome.extra,
    )
    growth = GROWTH_MB if growth_mb is None else growth_mb
    result.problems = verdict(entry, result, health_ms=health_ms, growth_mb=growth)
    return result


def _alive(url: str, pid: int | None) -> bool:
    if pid is not None and not is_running(pid):
        return False
    try:
        return httpx.get(url + "/health", timeout=10).status_code == 200
    except httpx.HTTPError:
        return False


def _log_size(path: str | Path | None) -> int | None:
    try:
        return os.path.getsize(path) if path else None
    except OSError:
        return None


def _longest_new_line(path: str | Path | None, start: int | None) -> int | None:
    """Bytes of the longest line written to the log at `path` after offset `start`."""
    if path is None or start is None:
        return None
    try:
        with open(path, "rb") as f:
            f.seek(start)
            return max((len(line) for line in f), default=0)
    except OSError:
        return None


def verdict(
    entry: Entry,
    result: ProbeResult,
    health_ms: float | None = None,
    growth_mb: dict[str, float] | None = None,
) -> list[str]:
    """What differs from the entry's expectation: the status, its bounds (time, /health,
    memory, log lines, the checks of its client), the ordinary request, the server alive.
    `health_ms` and `growth_mb` (role -> MB) add bounds for every entry; an entry's own
    are kept where stricter."""
    problems = []
    if "all_closed" in result.extra.get("checks", {}):
        pass  # stalled uploads: each one's outcome is checked (`all_closed`), not the mix
    elif not entry.accepts(result.status):
        problems.append(f"status {result.status}, expected {entry.expect_label}")
    if entry.max_seconds is not None and result.seconds > entry.max_seconds:
        problems.append(f"took {result.seconds:.2f} s > {entry.max_seconds} s")
    limit = min(x for x in (entry.health_ms, health_ms, float("inf")) if x is not None)
    if result.health_max_ms > limit:
        problems.append(f"/health waited {result.health_max_ms:.0f} ms > {limit:.0f} ms")
    problems += _memory_problems(entry, result, growth_mb or {})
    if entry.log_line_max is not None and (result.log_max_line or 0) > entry.log_line_max:
        problems.append(f"a log line of {result.log_max_line} bytes > {entry.log_line_max}")
    for name, ok in result.extra.get("checks", {}).items():
        if not ok:
            problems.append(f"check failed: {name}")
    if not result.ordinary_ok:
        problems.append("the ordinary request after it failed")
    if not result.alive:
        problems.append("the server is not alive")
    return problems


def _memory_problems(entry: Entry, result: ProbeResult, general: dict[str, float]) -> list[str]:
    bounds = dict(general)
    for role, mb in entry.growth_mb:
        bounds[role] = min(mb, bounds.get(role, mb))
    problems = []
    for role, mb in bounds.items():
        grew = result.growth_mb(role)
        if grew > mb:
            problems.append(f"{role} RSS grew {grew:.0f} MB > {mb:.0f} MB")
    for role, mb in entry.after_mb:
        left = result.growth_mb(role, "after_mb")
        if left > mb:
            problems.append(f"{role} RSS ended {left:.0f} MB over its start (> {mb:.0f} MB)")
    return problems
