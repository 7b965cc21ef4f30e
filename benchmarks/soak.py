"""Soak and chaos: minutes of mixed traffic at full concurrency against `vserve serve`.

    python benchmarks/soak.py [--minutes 30] [--model gemma-3-270m] [--concurrency 32]
                              [--short] [-- extra `vserve serve` flags]

Starts a server (engine core in debug mode: VSERVE_DEBUG_INVARIANTS=1, so every time it goes
idle it checks free + cached + in-use blocks == total with none in use), then runs seeded,
bounded, mixed traffic: completions and chat, streaming and not, n > 1, seeds, logprobs, stop
strings, guided_choice and JSON-schema requests, clients that disconnect mid-stream and clients
that give up (abort) before the answer. Every answer is checked (status, number of choices, a
choice from the list, JSON that parses). `--hostile-mix F` draws that share of requests from
the cheap entries of the hostile catalogue (`vserve.bench.hostile`: refused constraints, nested
strings, out-of-range values, ...), each answered with its entry's expected status (a refusal
there is no error). Afterwards it waits for idle and checks:

- no error of any kind (HTTP status, exception, client timeout = hang, malformed answer);
- every hostile request got its expected status;
- KV cache in use at the end is 0 (`vserve:kv_cache_usage_perc`), nothing running or waiting;
- RSS of every process of the server's tree grew < 5 % between the end of warm-up and the end
  (warm-up: 15 % of the run, 10 s to 2 min, and 4 requests per client done; with a hostile
  mix it begins with HOSTILE_PRIMING rounds of every hostile entry, 8 at a time, so that the
  high-water marks those requests leave -- the front end's heap after a 10 MB body parsed in
  a thread, say -- are reached before RSS is first read: growth then measures leaks, not the
  first visit of each kind);
- `/health` is 200 and the server exits cleanly on SIGTERM with no process left behind.

It reports requests served, errors by kind, and the p99 of the step launch interval and of the
forward time per window (from the /metrics histograms), prints a table, writes JSON
(benchmarks/results/soak.json by default) and exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import NamedTuple

import httpx
from common import wait_healthy  # benchmarks/common.py (this script's folder)

from vserve.bench.hostile import Entry, repeatable_entries
from vserve.bench.sse import sse_lines
from vserve.host.proc_tree import cmdline, descendants
from vserve.startup import kv_resident_bytes, resident_bytes

RSS_GROWTH_LIMIT = 0.05
WORDS = (
    "the a of and to in is it that for on with as was at by an be this from or have "
    "one all were when we there can more if out so what up time about into than them "
    "cat dog river stone light house garden paper music window bread north quickly "
    "silver number seven green table city morning question answer story engine"
).split()
SHARED_PREFIX = " ".join(WORDS[i % len(WORDS)] for i in range(0, 240, 7))
CHOICES = ["red", "green", "blue", "yellow"]
SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
    "required": ["n", "ok"],
    "additionalProperties": False,
}
# --short: half a minute, sized for a tiny model on a small CI machine (the suite's budget)
SHORT_MODE = {
    "minutes": 0.5,
    "concurrency": 16,
    "window": 5.0,
    "request_timeout": 60.0,
    "ready_timeout": 120.0,
}
HOSTILE_PRIMING = 6  # rounds of every hostile entry before the traffic (see the docstring)
WARMUP_REQUESTS_PER_CLIENT = 4  # and at least 15 % of the run (10 s to 2 min): see _warm
HOSTILE = repeatable_entries()  # for --hostile-mix
# request kinds and their weights
KINDS = {
    "completion": 4,
    "completion_stream": 4,
    "chat": 2,
    "chat_stream": 2,
    "guided_choice": 1,
    "json_schema": 1,
    "disconnect": 2,
    "abort": 1,
}
CHAOS_KINDS = ("disconnect", "abort")  # counted in `chaos`, not `served`


# -- processes -----------------------------------------------------------------------------------
class ProcMemory(NamedTuple):
    cmd: str
    rss: int  # bytes
    kv: int  # of which the CPU KV cache's


def rss_of(pid: int) -> ProcMemory | None:
    """A live process's resident memory, None once it is gone. The KV cache's pages are
    committed as its blocks are first touched and stay, up to the KV budget: growth there is
    the cache filling, not a leak, so it is told apart."""
    rss = resident_bytes(pid)
    if not rss:
        return None
    cmd = cmdline(pid).replace(b"\0", b" ").decode(errors="replace")
    return ProcMemory(cmd.strip()[:80], rss, kv_resident_bytes(pid))


def rss_table(pid: int) -> dict[int, ProcMemory]:
    return {p: r for p in [pid, *descendants(pid)] if (r := rss_of(p)) is not None}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- metrics ---------------------------------------------------------------------------------------
def scrape(text: str) -> dict[str, float]:
    """`vserve:` samples by name (labels other than `le` dropped); histogram buckets keep
    `name{le}`."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("vserve:"):
            continue
        name_part, value = line.rsplit(" ", 1)
        name = name_part.split("{", 1)[0]
        if 'le="' in name_part:
            name += "{" + name_part.split('le="', 1)[1].split('"', 1)[0] + "}"
        values[name] = values.get(name, 0.0) + float(value)
    return values


def histogram_p99(before: dict, after: dict, name: str) -> tuple[float | None, int]:
    """p99 and count of observations between two scrapes; the p99 is interpolated linearly
    inside its bucket, as Prometheus' histogram_quantile does."""
    buckets = []
    for key, value in after.items():
        if key.startswith(name + "_bucket{"):
            le = key.split("{", 1)[1][:-1]
            edge = float("inf") if le == "+Inf" else float(le)
            buckets.append((edge, value - before.get(key, 0.0)))
    buckets.sort()
    total = buckets[-1][1] if buckets else 0
    if total <= 0:
        return None, 0
    rank, lower, below = 0.99 * total, 0.0, 0.0
    for edge, count in buckets:
        if count >= rank:
            if edge == float("inf"):
                return lower, int(total)
            inside = count - below
            frac = (rank - below) / inside if inside > 0 else 1.0
            return round(lower + (edge - lower) * frac, 6), int(total)
        lower, below = edge, count
    return lower, int(total)


# -- traffic ---------------------------------------------------------------------------------------
class Traffic:
    def __init__(self, client: httpx.AsyncClient, model: str, args) -> None:
        self.client, self.model, self.args = client, model, args
        self.served = Counter()  # completed and checked, by kind
        self.chaos = Counter()  # deliberate disconnects / aborts
        self.errors = Counter()  # by kind
        self.hostile = Counter()  # hostile requests answered as expected, by entry
        self.hostile_unexpected = Counter()  # by entry and status
        self.error_examples: dict[str, str] = {}

    def _error(self, kind: str, detail: str) -> None:
        self.errors[kind] += 1
        self.error_examples.setdefault(kind, detail[:300])

    def _prompt(self, rng: random.Random) -> str:
        num_words = rng.randint(3, self.args.max_prompt_words)
        words = " ".join(rng.choice(WORDS) for _ in range(num_words))
        return (SHARED_PREFIX + " " + words) if rng.random() < 0.3 else words

    def _body(self, rng: random.Random, kind: str) -> tuple[str, dict]:
        chat = kind.startswith("chat") or kind == "json_schema"
        body: dict = {
            "model": self.model,
            "max_tokens": rng.randint(1, self.args.max_tokens),
            "temperature": rng.choice([0.0, 0.7, 1.0]),
            "seed": rng.randint(0, 2**31),
        }
        if rng.random() < 0.3:
            body["top_p"], body["top_k"] = 0.9, rng.choice([5, 50, -1])
        if rng.random() < 0.2:
            body["ignore_eos"] = True
        if rng.random() < 0.2:
            body["stop"] = [rng.choice(WORDS)]
        if kind in ("completion", "completion_stream", "disconnect", "abort"):
            body["n"] = rng.choice([1, 1, 2, 3])
            if body["n"] > 1:  # greedy n > 1 is a 400 (identical choices)
                body["temperature"] = rng.choice([0.7, 1.0])
            if rng.random() < 0.3:
                body["logprobs"] = rng.randint(0, 3)
        if chat:
            body["messages"] = [{"role": "user", "content": self._prompt(rng)}]
            if rng.random() < 0.2 and kind != "json_schema":
                body["logprobs"], body["top_logprobs"] = True, rng.randint(0, 3)
        else:
            body["prompt"] = self._prompt(rng)
        if kind == "guided_choice":
            body["guided_choice"] = CHOICES
            body.pop("stop", None)
        if kind == "json_schema":
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "s", "schema": SCHEMA},
            }
            body["max_tokens"] = 64
            body.pop("stop", None)
        if kind in ("completion_stream", "chat_stream", "disconnect"):
            body["stream"] = True
        path = "/v1/chat/completions" if chat else "/v1/completions"
        return path, body

    async def one(self, rng: random.Random) -> None:
        if self.args.hostile_mix > 0 and rng.random() < self.args.hostile_mix:
            await self._hostile(rng)
            return
        kind = rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
        path, body = self._body(rng, kind)
        try:
            if body.get("stream"):
                await self._stream(path, body, kind, rng)
            elif kind == "abort":
                await self._abort(path, body, rng)
            else:
                await self._plain(path, body, kind)
        except httpx.TimeoutException as e:
            self._error("client_timeout", f"{kind}: {e!r}")
        except Exception as e:  # noqa: BLE001 -- every failure is counted by kind
            self._error(f"exception_{type(e).__name__}", f"{kind}: {e!r}")

    async def prime_hostile(self) -> None:
        """HOSTILE_PRIMING rounds of every hostile entry, 8 requests at a time."""
        gate = asyncio.Semaphore(8)

        async def send(entry: Entry) -> None:
            async with gate:
                await self._send_hostile(entry)

        for _ in range(HOSTILE_PRIMING):
            await asyncio.gather(*(send(entry) for entry in HOSTILE))

    async def _hostile(self, rng: random.Random) -> None:
        """A cheap hostile request; its status checked against the entry's expectation."""
        await self._send_hostile(rng.choice(HOSTILE))

    async def _send_hostile(self, entry: Entry) -> None:
        try:
            method, path, body, headers = await asyncio.to_thread(entry.request)
            r = await self.client.request(
                method, path, content=body, headers=headers, timeout=self.args.request_timeout
            )
            status: int | str = r.status_code
        except httpx.HTTPError as e:
            status = type(e).__name__
        if entry.accepts(status):
            self.hostile[entry.name] += 1
        else:
            self.hostile_unexpected[f"{entry.name}: {status}"] += 1

    async def _plain(self, path: str, body: dict, kind: str) -> None:
        r = await self.client.post(path, json=body, timeout=self.args.request_timeout)
        if r.status_code != 200:
            self._error(f"http_{r.status_code}", f"{kind}: {r.text}")
            return
        choices = r.json()["choices"]
        if len(choices) != body.get("n", 1):
            self._error("bad_output_n", f"{kind}: {len(choices)} choices for n={body.get('n')}")
            return
        for c in choices:
            text = c["message"]["content"] if "message" in c else c["text"]
            if kind == "guided_choice" and c["finish_reason"] == "stop" and text not in CHOICES:
                self._error("bad_output_choice", repr(text))
                return
            if kind == "json_schema" and c["finish_reason"] == "stop":
                try:
                    value = json.loads(text)
                    assert set(value) == {"n", "ok"}, value
                except (ValueError, AssertionError) as e:
                    self._error("bad_output_json", f"{text!r}: {e}")
                    return
        self.served[kind] += 1

    async def _stream(self, path: str, body: dict, kind: str, rng: random.Random) -> None:
        cut = rng.randint(1, 4) if kind == "disconnect" else None
        chunks, done = 0, False
        async with self.client.stream(
            "POST", path, json=body, timeout=self.args.request_timeout
        ) as r:
            if r.status_code != 200:
                self._error(f"http_{r.status_code}", f"{kind}: {(await r.aread()).decode()}")
                return
            async for line in sse_lines(r):
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                event = json.loads(line[6:])
                if "error" in event:
                    self._error("stream_error", f"{kind}: {event['error']}")
                    return
                chunks += 1
                if cut is not None and chunks >= cut:
                    self.chaos["disconnect"] += 1
                    return  # leaving the block closes the connection mid-stream
        if not done:
            self._error("stream_truncated", f"{kind}: no [DONE] after {chunks} chunks")
            return
        self.served[kind] += 1

    async def _abort(self, path: str, body: dict, rng: random.Random) -> None:
        """A client that gives up: the request is cancelled after a short random wait."""
        body["max_tokens"] = self.args.max_tokens
        task = asyncio.ensure_future(
            self.client.post(path, json=body, timeout=self.args.request_timeout)
        )
        done, _ = await asyncio.wait([task], timeout=rng.uniform(0.01, 0.5))
        if done:
            r = task.result()
            if r.status_code != 200:
                self._error(f"http_{r.status_code}", f"abort: {r.text}")
            else:
                self.served["abort_finished_first"] += 1
            return
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        self.chaos["abort"] += 1

    async def worker(self, index: int, deadline: float) -> None:
        rng = random.Random(self.args.seed * 100003 + index)
        while time.monotonic() < deadline:
            await self.one(rng)


# -- the run ---------------------------------------------------------------------------------------
class Server:
    def __init__(self, args, extra: list[str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115 -- open while the server runs
            "w+", prefix="vserve-soak-", suffix=".log", delete=False
        )
        cmd = [
            sys.executable,
            "-m",
            "vserve.cli",
            "serve",
            args.model,
            "--port",
            str(self.port),
            *extra,
        ]
        env = {**os.environ, "VSERVE_DEBUG_INVARIANTS": "1"}
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.tree: set[int] = set()

    def wait_ready(self, timeout: float) -> None:
        wait_healthy(self.url, self.proc, timeout, self.log_tail)

    def stop(self) -> tuple[int, list[int]]:
        """SIGTERM; (exit code, processes of the tree still alive 10 s later, then killed)."""
        self.tree |= {self.proc.pid, *descendants(self.proc.pid)}
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        deadline = time.monotonic() + 10
        while True:
            left = [p for p in self.tree if p != self.proc.pid and rss_of(p) is not None]
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        return code, left

    def log_tail(self, num_chars: int = 3000) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()[-num_chars:]


async def _wait_idle(client: httpx.AsyncClient, timeout: float) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = scrape((await client.get("/metrics", timeout=10)).text)
        idle = all(
            m.get(f"vserve:{g}", 1) == 0
            for g in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
        )
        if idle or time.monotonic() > deadline:
            return m
        await asyncio.sleep(0.5)


async def drive(server: Server, args) -> dict:
    duration = args.minutes * 60
    warmup = min(120.0, max(10.0, 0.15 * duration))
    limits = httpx.Limits(max_connections=args.concurrency + 8)
    async with httpx.AsyncClient(base_url=server.url, limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        traffic = Traffic(client, model, args)
        if args.hostile_mix > 0:
            await traffic.prime_hostile()
        start = time.monotonic()
        deadline = start + duration
        workers = [
            asyncio.ensure_future(traffic.worker(i, deadline)) for i in range(args.concurrency)
        ]
        windows, rss_start = [], None
        last = scrape((await client.get("/metrics")).text)
        next_window = start + args.window
        while not all(w.done() for w in workers):
            await asyncio.sleep(0.5)
            now = time.monotonic()
            if rss_start is None and _warm(traffic, now - start, warmup, duration, args):
                rss_start, warmup = rss_table(server.proc.pid), round(now - start, 1)
            if now >= next_window or all(w.done() for w in workers):
                cur = scrape((await client.get("/metrics", timeout=30)).text)
                windows.append(
                    {**_window(now - start, last, cur), **_rss_window(rss_table(server.proc.pid))}
                )
                last, next_window = cur, now + args.window
        await asyncio.gather(*workers)
        traffic_s = time.monotonic() - start
        final = await _wait_idle(client, 60)
        await asyncio.sleep(3.0)  # idle: the front end and workers trim their heaps after 1 s
        rss_end = rss_table(server.proc.pid)
        health = (await client.get("/health", timeout=10)).status_code
    return {
        "traffic": traffic,
        "windows": windows,
        "rss_start": rss_start or {},
        "rss_end": rss_end,
        "final": final,
        "health": health,
        "traffic_s": traffic_s,
        "warmup_s": warmup,
    }


def _warm(traffic: Traffic, elapsed: float, warmup: float, duration: float, args) -> bool:
    """Warm-up is over (RSS is read as the start) after `warmup` seconds once every client
    has finished WARMUP_REQUESTS_PER_CLIENT requests and every kind of request has been
    served once (the first structured request starts the grammar worker and grows the engine
    core by its grammar state, ~40 MiB on a tiny model: a first visit, not a leak), so that a
    slow start on a busy machine does not count as growth; at half the run at the latest."""
    done = sum(traffic.served.values()) + sum(traffic.chaos.values()) + sum(traffic.errors.values())
    every_kind = all(traffic.served[k] > 0 for k in KINDS if k not in CHAOS_KINDS)
    return elapsed >= duration / 2 or (
        elapsed >= warmup and every_kind and done >= WARMUP_REQUESTS_PER_CLIENT * args.concurrency
    )


def _window(t: float, before: dict, after: dict) -> dict:
    out = {"t_s": round(t, 1)}
    for short, name in (
        ("launch_interval", "vserve:step_launch_interval_seconds"),
        ("forward", "vserve:model_forward_time_seconds"),
    ):
        p99, count = histogram_p99(before, after, name)
        out[f"{short}_p99_s"], out[f"{short}_steps"] = p99, count
    return out


def _rss_window(table: dict[int, ProcMemory]) -> dict:
    return {
        "rss_mib": {p: round(r.rss / 2**20, 1) for p, r in table.items()},
        "kv_mib": {p: round(r.kv / 2**20, 1) for p, r in table.items() if r.kv},
    }


def evaluate(res: dict, code: int, left: list[int], args) -> dict:
    t: Traffic = res["traffic"]
    final = res["final"]
    kv_usage = final.get("vserve:kv_cache_usage_perc")
    rss = []
    for pid, (cmd, end, kv_end) in res["rss_end"].items():
        _, begin, kv_begin = res["rss_start"].get(pid, (cmd, None, 0))
        # the growth that counts: resident memory besides the KV cache's committed pages
        growth = None if not begin else (end - kv_end - begin + kv_begin) / (begin - kv_begin)
        rss.append(
            {
                "pid": pid,
                "cmd": cmd,
                "rss_start_mib": begin and round(begin / 2**20, 1),
                "rss_end_mib": round(end / 2**20, 1),
                "kv_start_mib": round(kv_begin / 2**20, 1),
                "kv_end_mib": round(kv_end / 2**20, 1),
                "growth": None if growth is None else round(growth, 4),
            }
        )
    checks = {
        "no_errors": sum(t.errors.values()) == 0,
        "served_requests": sum(t.served.values()) > 0,
        "kv_blocks_in_use_0": kv_usage == 0,
        "idle_at_end": final.get("vserve:num_requests_running") == 0
        and final.get("vserve:num_requests_waiting") == 0,
        "rss_growth_below_5pct": bool(rss)
        and all(r["growth"] is not None and r["growth"] < RSS_GROWTH_LIMIT for r in rss),
        "hostile_as_expected": not t.hostile_unexpected,
        "health_200": res["health"] == 200,
        "clean_exit": code == 0 and not left,
    }
    return {
        "model": args.model,
        "minutes": args.minutes,
        "concurrency": args.concurrency,
        "seed": args.seed,
        "traffic_s": round(res["traffic_s"], 1),
        "warmup_s": res["warmup_s"],
        "served": sum(t.served.values()),
        "served_by_kind": dict(t.served),
        "chaos": dict(t.chaos),
        "errors": dict(t.errors),
        "hostile": dict(t.hostile),
        "hostile_unexpected": dict(t.hostile_unexpected),
        "error_examples": t.error_examples,
        "generation_tokens": final.get("vserve:generation_tokens_total"),
        "kv_cache_usage_end": kv_usage,
        "rss": rss,
        "windows": res["windows"],
        "server_exit_code": code,
        "leftover_processes": left,
        "checks": checks,
        "passed": all(checks.values()),
    }


def report(result: dict) -> None:
    print(
        f"\nsoak: {result['model']}, {result['traffic_s']} s of traffic at concurrency "
        f"{result['concurrency']} (seed {result['seed']})"
    )
    print(f"  served {result['served']}  {result['served_by_kind']}")
    print(f"  chaos  {result['chaos']}")
    print(f"  errors {result['errors'] or 'none'}")
    if result["hostile"] or result["hostile_unexpected"]:
        print(f"  hostile as expected {result['hostile']}")
        print(f"  hostile unexpected  {result['hostile_unexpected'] or 'none'}")
    for kind, text in result["error_examples"].items():
        print(f"    {kind}: {text}")
    print(f"  KV cache in use at the end: {result['kv_cache_usage_end']}")
    print(
        f"  {'pid':>8} {'RSS start MiB':>14} {'RSS end MiB':>12} {'KV start':>9} "
        f"{'KV end':>8} {'growth':>8}  command (growth: RSS besides the KV cache)"
    )
    for r in result["rss"]:
        growth = "-" if r["growth"] is None else f"{100 * r['growth']:+.1f}%"
        print(
            f"  {r['pid']:>8} {r['rss_start_mib'] or '-':>14} {r['rss_end_mib']:>12} "
            f"{r['kv_start_mib']:>9} {r['kv_end_mib']:>8} {growth:>8}  {r['cmd']}"
        )
    print(
        f"  {'t (s)':>8} {'steps':>7} {'launch p99 (s)':>15} {'forward p99 (s)':>16}  "
        "RSS MiB by pid"
    )
    for w in result["windows"]:
        print(
            f"  {w['t_s']:>8} {w['launch_interval_steps']:>7} "
            f"{w['launch_interval_p99_s'] or '-':>15} {w['forward_p99_s'] or '-':>16}  "
            f"{w.get('rss_mib', '-')}"
        )
    for name, ok in result["checks"].items():
        print(f"  {'PASS' if ok else 'FAIL'}  {name}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--model", default="gemma-3-270m", help="default: the embedded model")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--max-prompt-words", type=int, default=120)
    p.add_argument("--window", type=float, default=60.0, help="seconds per step-time window")
    p.add_argument(
        "--request-timeout",
        type=float,
        default=300.0,
        help="a request slower than this counts as a hang (client_timeout)",
    )
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument(
        "--hostile-mix",
        type=float,
        default=0.0,
        metavar="FRACTION",
        help="share of requests drawn from the cheap hostile entries (vserve.bench.hostile)",
    )
    p.add_argument("--result", default=str(Path(__file__).parent / "results" / "soak.json"))
    p.add_argument(
        "--short",
        action="store_true",
        help="the short mode CI runs on a tiny model: "
        + ", ".join(f"--{k.replace('_', '-')} {v:g}" for k, v in SHORT_MODE.items())
        + " (flags given as well win)",
    )
    args, extra = p.parse_known_args(argv)
    if args.short:
        p.set_defaults(**SHORT_MODE)
        args, extra = p.parse_known_args(argv)
    return args, [a for a in extra if a != "--"]


def main(argv=None) -> int:
    args, extra = parse_args(argv)
    server = Server(args, extra)
    try:
        server.wait_ready(args.ready_timeout)
        res = asyncio.run(drive(server, args))
    except BaseException:
        server.stop()
        print(server.log_tail(), file=sys.stderr)
        raise
    code, left = server.stop()
    result = evaluate(res, code, left, args)
    report(result)
    if not result["passed"]:
        print(f"--- server log tail ---\n{server.log_tail()}", file=sys.stderr)
    Path(args.result).parent.mkdir(parents=True, exist_ok=True)
    Path(args.result).write_text(json.dumps(result, indent=1) + "\n")
    print(f"  wrote {args.result}")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
