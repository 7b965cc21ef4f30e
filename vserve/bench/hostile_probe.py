"""The hostile-request probe: `probe(url, entry)` sends one entry of the catalogue
(`hostile.py`) with its client (`hostile_clients.py`) while it samples the RSS of every process
of the server's tree every 100 ms and polls `/health` every 50 ms, then sends one ordinary
request and checks that the server is alive; `verdict` lists what differs from the entry's
expectation. `RssGuard` kills the server's whole process tree once any of its processes passes
an RSS cap, so that a server that grows without bound fails its probe instead of the machine.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from vserve.bench.hostile import (
    GROWTH_MB,
    HEALTH_MS,
    ORDINARY,
    ORDINARY_ROUTE,
    Entry,
    _json,
)
from vserve.bench.hostile_clients import CLIENTS, ProbeOptions, cpu_seconds, send
from vserve.host.proc_tree import cmdline, descendants, is_running


def warm_up(url: str, timeout: float = 300.0) -> None:
    """An ordinary request and a structured one (json_object), so that one-time costs (the
    first step, the grammar backend's tables for the vocabulary) are paid before a probe
    measures memory and time."""
    headers = {"content-type": "application/json"}
    json_object = {**ORDINARY, "max_tokens": 8, "response_format": {"type": "json_object"}}
    for body in (ORDINARY, json_object):
        send(url, "POST", ORDINARY_ROUTE, _json(body), headers, timeout)


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
    outcome = CLIENTS[entry.mode](url, entry, opts)
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
        alive=server_alive(url, pid),
        log_max_line=_longest_new_line(log_path, log_start),
        extra=outcome.extra,
    )
    growth = GROWTH_MB if growth_mb is None else growth_mb
    result.problems = verdict(entry, result, health_ms=health_ms, growth_mb=growth)
    return result


def server_alive(url: str, pid: int | None) -> bool:
    """The server's process runs (when known) and its /health answers 200."""
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
