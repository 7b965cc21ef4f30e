"""The clients of the hostile catalogue (`hostile.py`): one plain request, clients that give up
after a second, a request with small ones beside it, uploads that stall, and a stream left
unread; each returns the `Outcome` the probe judges (`hostile_probe.py`)."""

from __future__ import annotations

import contextlib
import os
import selectors
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from vserve.bench.hostile import (
    CLOSED,
    ORDINARY,
    ORDINARY_ROUTE,
    Entry,
    _json,
)


# -- the options -----------------------------------------------------------------------------
@dataclass
class ProbeOptions:
    timeout: float = 300.0  # one request's wait
    stall_wait_s: float = 75.0  # how long stalled uploads may wait to be closed
    stall_s: float = 20.0  # how long the slow reader reads nothing
    settle_s: float = 1.5  # idle time before the last RSS sample (heaps are trimmed at idle)
    server_pid: int | None = None


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of `pid` (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


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


CLIENTS: dict[str, Callable[[str, Entry, ProbeOptions], Outcome]] = {
    "send": _send_entry,
    "abandon": _abandon,
    "parallel": _parallel,
    "stall": _stall,
    "slow_reader": _slow_reader,
}
