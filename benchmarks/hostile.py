"""Hostile requests against a live `vserve serve`: what each one does to the server.

    python benchmarks/hostile.py [--url URL] [--only NAME,...] [--output FILE]
                                 [--rss-cap-gb 6] [--server-root DIR] [-- serve flags]

Without `--url` it starts `vserve serve` (the embedded model unless the serve flags name one)
on a free port, from this checkout or from `--server-root DIR` (another checkout: run there
with PYTHONPATH=DIR, for before/after tables), warms it up (a plain and a json_object
request: one-time costs are not growth), and runs every entry of the catalogue in
`vserve/bench/hostile.py` (or those of `--only`). Entries that need other server flags
(`host_evil`: `--host 0.0.0.0`) run last, on a server of their own (one server at a time).

For each entry: the status against the expected one, the response time, the worst `/health`
wait while it ran, the RSS growth of each server process (peak over start), whether an
ordinary request was served afterwards and whether the server is alive. A server that died is
started again for the next entry (not possible with `--url`), and the death is recorded.
A guard thread kills the server's whole process tree once any of its processes passes
`--rss-cap-gb` (default 6), and records "killed at the RSS cap" for the entry: some requests
grow a server without bound, and the machine must survive them.

Prints a table, writes JSON (`--output`, default benchmarks/results/hostile.json) and exits 1
when any entry differs from its expectation: its status and its own bounds, and for every
entry /health within 1 s and RSS growth under 256 MB (engine core) and 512 MB (front end).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from common import wait_healthy  # benchmarks/common.py (this script's folder)

from vserve.bench.hostile import CATALOGUE, ENTRIES, Entry
from vserve.bench.hostile_clients import ProbeOptions
from vserve.bench.hostile_probe import (
    ProbeResult,
    RssGuard,
    kill_tree,
    listening_pid,
    probe,
    server_alive,
    warm_up,
)

ROOT = Path(__file__).resolve().parents[1]
ROLES = {"frontend": "fe", "engine_core": "ec", "worker": "w", "grammar_worker": "gw"}


class ManagedServer:
    """`vserve serve` on a free port, its output in a temporary log; start, stop, restart."""

    def __init__(self, flags: list[str], root: Path | None, ready_timeout: float) -> None:
        self.flags, self.root, self.ready_timeout = flags, root, ready_timeout
        self.proc: subprocess.Popen | None = None
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115 -- open while the server runs
            "w+", prefix="vserve-hostile-", suffix=".log", delete=False
        )
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self) -> ManagedServer:
        self.port = _free_port()
        cmd = [sys.executable, "-m", "vserve.cli", "serve", *self.flags]
        env = dict(os.environ)
        if self.root is not None:
            env["PYTHONPATH"] = str(self.root)
        self.proc = subprocess.Popen(
            [*cmd, "--port", str(self.port)],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=self.root,
        )
        self._wait_ready()
        warm_up(self.url)
        return self

    def _wait_ready(self) -> None:
        assert self.proc is not None  # started
        wait_healthy(self.url, self.proc, self.ready_timeout, self.log_tail)

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL for the whole tree after 60 s; the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            kill_tree(self.proc.pid)
            code = self.proc.wait()
        self.proc = None
        return code

    def log_tail(self, num_chars: int = 3000) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")[-num_chars:]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_entries(entries: list[Entry], args, server: ManagedServer | None) -> list[dict]:
    """Probe each entry in turn, under the RSS guard; restart a managed server that died."""
    url = args.url or (server.url if server else "")
    pid = server.pid if server else listening_pid(int(url.rsplit(":", 1)[1].split("/")[0]))
    out = []
    with RssGuard(pid or 0, int(args.rss_cap_gb * 2**30)) as guard:
        for entry in entries:
            if server is None and not server_alive(url, pid):
                out.append({"name": entry.name, "expected": entry.expect_label, "skipped": True})
                print(f"  {entry.name}: skipped, the server at {url} is down", flush=True)
                continue
            print(f"  {entry.name} ...", flush=True)
            row = _probe_one(entry, args, url, pid, server)
            if guard.tripped:
                row["problems"].append(guard.tripped)
                row["killed"], row["ok"] = guard.tripped, False
            out.append(row)
            print(f"    {_line(row)}", flush=True)
            if server is not None and not server_alive(server.url, server.pid):
                row["server_died"] = True
                row["exit_code"] = server.stop()
                server.start()
                url, pid = server.url, server.pid
                guard.watch(pid)
    return out


def _probe_one(entry: Entry, args, url: str, pid: int | None, server) -> dict:
    opts = ProbeOptions(timeout=args.timeout, stall_wait_s=args.stall_wait, stall_s=args.stall_s)
    log = server.log.name if server else args.log
    result: ProbeResult = probe(url, entry, server_pid=pid, log_path=log, options=opts)
    row = result.to_dict()
    row["server_flags"] = list(entry.server_flags)
    if server is None and entry.server_flags:
        row["note"] = f"run against --url, not a server with {' '.join(entry.server_flags)}"
    return row


def growth_summary(row: dict) -> str:
    """The largest peak-over-start RSS growth per role, in MB: 'fe +45 ec +12'."""
    best: dict[str, float] = {}
    for r in row.get("rss", {}).values():
        role = ROLES.get(r["role"])
        if role:
            best[role] = max(best.get(role, -1e9), r["peak_mb"] - r["before_mb"])
    return " ".join(f"{k} {v:+.0f}" for k, v in best.items())


def _line(row: dict) -> str:
    if row.get("skipped"):
        return f"{row['name']}: skipped (server down)"
    return (
        f"{row['name']}: {row['status']} (expected {row['expected']}) in {row['seconds']} s, "
        f"/health max {row['health_max_ms']:.0f} ms, RSS {growth_summary(row)} MB, "
        f"ordinary {'ok' if row['ordinary_ok'] else 'FAILED'}, "
        f"{'alive' if row['alive'] else 'DEAD'}"
        + ("" if row["ok"] else f"; {'; '.join(row['problems'])}")
    )


def table(rows: list[dict]) -> str:
    """The markdown table of the results."""
    head = (
        "| entry | expected | got | time (s) | /health max (ms) | max RSS growth (MB) "
        "| ordinary ok | alive | verdict |\n|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in rows:
        if r.get("skipped"):
            lines.append(f"| {r['name']} | {r['expected']} | skipped | | | | | | server down |")
            continue
        got = str(r["status"]).replace("|", "/")
        verdict = "ok" if r["ok"] else "; ".join(r["problems"]).replace("|", "/")
        lines.append(
            f"| {r['name']} | {r['expected']} | {got} | {r['seconds']:.2f} "
            f"| {r['health_max_ms']:.0f} | {growth_summary(r)} "
            f"| {'yes' if r['ordinary_ok'] else 'NO'} | {'yes' if r['alive'] else 'NO'} "
            f"| {verdict} |"
        )
    return "\n".join(lines)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def _commit(root: Path) -> str:
    try:
        cmd = ["git", "-C", str(root), "rev-parse", "--short", "HEAD"]
        return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--url", default=None, help="a running server (no restarts)")
    p.add_argument("--log", default=None, help="with --url: the server's log, for log checks")
    p.add_argument("--only", default=None, help="comma-separated entry names")
    p.add_argument("--output", default=str(ROOT / "benchmarks" / "results" / "hostile.json"))
    p.add_argument("--rss-cap-gb", type=float, default=6.0)
    p.add_argument("--server-root", type=Path, default=None, help="a checkout to serve from")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds one request may take")
    p.add_argument("--stall-wait", type=float, default=75.0, help="seconds stalls may stay open")
    p.add_argument("--stall-s", type=float, default=20.0, help="the slow reader's pause")
    p.add_argument("--ready-timeout", type=float, default=600.0)
    args, extra = p.parse_known_args(argv)
    unknown = [e for e in (args.only or "").split(",") if e and e not in ENTRIES]
    if unknown:
        p.error(f"unknown entries: {unknown}; known: {', '.join(ENTRIES)}")
    return args, [a for a in extra if a != "--"]


def main(argv=None) -> int:
    args, flags = parse_args(argv)
    names = [n for n in (args.only or "").split(",") if n]
    entries = [ENTRIES[n] for n in names] if names else list(CATALOGUE)
    groups: dict[tuple[str, ...], list[Entry]] = {}
    for e in sorted(entries, key=lambda e: bool(e.server_flags)):
        groups.setdefault(e.server_flags if not args.url else (), []).append(e)
    rows: list[dict] = []
    for extra_flags, group in groups.items():
        rows += _run_group(group, args, [*flags, *extra_flags])
    result = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "commit": _commit(args.server_root or ROOT),
        "server": args.url or {"flags": flags, "root": str(args.server_root or ROOT)},
        "rss_cap_gb": args.rss_cap_gb,
        "entries": rows,
        "passed": all(r.get("ok") for r in rows),
    }
    print(f"\nhostile requests on {result['cpu']} ({result['commit']})\n{table(rows)}")
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.output}")
    return 0 if result["passed"] else 1


def _run_group(group: list[Entry], args, flags: list[str]) -> list[dict]:
    if args.url:
        warm_up(args.url)
        return run_entries(group, args, None)
    server = ManagedServer(flags, args.server_root, args.ready_timeout)
    print(f"starting vserve serve {' '.join(flags)} (log {server.log.name})", flush=True)
    server.start()
    try:
        return run_entries(group, args, server)
    finally:
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
