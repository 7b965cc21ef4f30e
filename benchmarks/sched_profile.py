"""Where a running engine's CPU time goes, per process and thread (Linux): CPU share, time
runnable but waiting for a core (the run-queue wait of /proc's schedstat) and context switches,
over a window of a command's run, e.g. a `vserve bench throughput` whose front end, engine core
and workers share the host's cores.

    python benchmarks/sched_profile.py --delay 12 --window 8 -- \\
        python -m vserve.cli bench throughput --num-prompts 32 --output-len 640

Each process of the command's tree is named by its role (front end: the command itself; engine
core; worker); a thread's line is printed when it used more than 1% of a core.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class ThreadSample:
    name: str
    cpu_ns: int
    wait_ns: int  # runnable, not running
    involuntary: int
    voluntary: int


def children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except OSError:
                pass
    return out


def tree(pid: int) -> list[int]:
    return [pid] + [p for c in children(pid) for p in tree(c)]


def sample(pid: int) -> dict[int, ThreadSample]:
    threads = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return threads
    for tid in tids:
        base = f"/proc/{pid}/task/{tid}"
        try:
            with open(f"{base}/schedstat") as f:
                cpu, wait, _ = map(int, f.read().split())
            with open(f"{base}/comm") as f:
                name = f.read().strip()
            with open(f"{base}/status") as f:
                fields = (line.split(":", 1) for line in f)
                switches = {k: v for k, v in fields if k.endswith("ctxt_switches")}
        except OSError:
            continue
        threads[int(tid)] = ThreadSample(
            name,
            cpu,
            wait,
            int(switches.get("nonvoluntary_ctxt_switches", 0)),
            int(switches.get("voluntary_ctxt_switches", 0)),
        )
    return threads


def role(pid: int, root: int) -> str:
    if pid == root:
        return "front end"
    with open(f"/proc/{pid}/cmdline") as f:
        cmd = f.read().replace("\0", " ")
    if "core_proc" in cmd:
        return "engine core"
    return "worker" if "spawn" in cmd or "worker" in cmd else cmd[:40]


def report(pids: list[int], roles: dict[int, str], before: dict, after: dict, dt: float) -> None:
    def pct(ns: float) -> float:
        return 100 * ns / 1e9 / dt

    for pid in pids:
        cpu = wait = 0.0
        for tid, b in after[pid].items():
            a = before[pid].get(tid)
            if a is None:
                continue
            d_cpu, d_wait = b.cpu_ns - a.cpu_ns, b.wait_ns - a.wait_ns
            cpu, wait = cpu + d_cpu, wait + d_wait
            if pct(d_cpu) > 1:
                print(
                    f"  {roles[pid]:11s} {b.name:16s} cpu {pct(d_cpu):6.1f}%  "
                    f"run-queue wait {pct(d_wait):5.1f}%  "
                    f"involuntary {(b.involuntary - a.involuntary) / dt:6.1f}/s  "
                    f"voluntary {(b.voluntary - a.voluntary) / dt:6.1f}/s"
                )
        print(f"{roles[pid]:11s} pid {pid}: cpu {pct(cpu):.1f}%  run-queue wait {pct(wait):.1f}%")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--delay", type=float, default=12.0, help="seconds before the window")
    p.add_argument("--window", type=float, default=8.0, help="seconds measured")
    p.add_argument("command", nargs=argparse.REMAINDER, help="after --: the command to run")
    args = p.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(args.delay)
        pids = tree(proc.pid)
        roles = {pid: role(pid, proc.pid) for pid in pids}
        before = {pid: sample(pid) for pid in pids}
        start = time.monotonic()
        time.sleep(args.window)
        after = {pid: sample(pid) for pid in pids}
        report(pids, roles, before, after, time.monotonic() - start)
    finally:
        proc.wait()


if __name__ == "__main__":
    main()
