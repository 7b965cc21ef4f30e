"""Start-up time and resident memory, each case a fresh process, repeated.

* generate: wall time of `vserve generate "The capital of France is"` (start to exit), the
  start-up phases it logs, the resident memory of each process after the request (the line
  `vserve generate` logs) and the largest seen from outside during the run (`peak`);
* serve: time from starting `vserve serve` to the first `/health` 200, then one completion,
  then the resident memory of every process (read from outside, and as `/metrics` exports
  it);
* load: memory follows use. `vserve serve`, one request, then 64 concurrent requests of
  128 prompt / 128 output tokens, then 5 s of idle: the resident memory (and the worker's KV
  cache pages) after the first request, at the peak of the load, and idle afterwards.

    python benchmarks/startup.py [--model M] [--runs 3] [--engine-args "--dtype float32"]
                                 [--compare-tree /path/to/other/checkout]

`--compare-tree` runs the same cases with another source tree on PYTHONPATH, interleaved
run by run with this one, and reports the ratios (the machine may be shared: compare within
one run). Caches are warm after the first run of each tree: the first run of each is a
warm-up and not counted unless `--runs 1`. `--compare-engine-args "--quantization none"` runs
this checkout a second way, interleaved; `--fresh-cache` gives every run an empty model cache
(the kernels stay built) and counts every run: the first start's time, e.g. GGUF-native
against the conversion path. Prints a table and writes
benchmarks/results/startup.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from vserve.host import proc_tree
from vserve.startup import kv_resident_bytes, resident_bytes

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "The capital of France is"
_PHASE = re.compile(r"start-up (\w+): (.+?) (\d+\.\d+) s$", re.M)
_AFTER = re.compile(r"(\w+) (\d+) MB[,;]")  # vserve.startup.memory_line (MiB)


_CACHE: dict[str, str] = {}  # with --fresh-cache: XDG_CACHE_HOME of the run in progress


def _env(tree: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(tree), "TOKENIZERS_PARALLELISM": "false", **_CACHE}


@contextlib.contextmanager
def _fresh_cache(on: bool):
    """An empty vserve cache for one run (the kernels' build linked in: a first start on a
    machine that has built them), removed afterwards."""
    if not on:
        yield
        return
    import shutil

    from vserve.cache_files import cache_dir

    base = Path(tempfile.mkdtemp(prefix="vserve-fresh-"))
    (base / "vserve").mkdir()
    (base / "vserve" / "cpu_ops").symlink_to(cache_dir("cpu_ops"))
    _CACHE["XDG_CACHE_HOME"] = str(base)
    try:
        yield
    finally:
        _CACHE.clear()
        shutil.rmtree(base, ignore_errors=True)


def _cli(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "vserve.cli", *args]


def run_generate(tree: Path, model: str, engine_args: list[str]) -> dict:
    """Wall time; memory after the request (logged) and each process's largest RSS, sampled
    from outside every 0.1 s."""
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(
            _cli(
                [
                    "--log-level",
                    "INFO",
                    "generate",
                    PROMPT,
                    "--max-tokens",
                    "8",
                    "--model",
                    model,
                    *engine_args,
                ]
            ),
            env=_env(tree),
            cwd=tree,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
        peak: dict[str, int] = {}
        while proc.poll() is None:
            for name, value in tree_rss_mb(proc.pid).items():
                peak[name] = max(peak.get(name, 0), value)
            time.sleep(0.1)
        wall = time.perf_counter() - start
        err.seek(0)
        log = err.read()
    if proc.returncode != 0:
        raise RuntimeError(f"generate failed:\n{log[-3000:]}")
    line = re.search(r"resident memory: (.*)", log)  # a tree without the line: the peak
    after = {n: int(mb) for n, mb in _AFTER.findall(line.group(1))} if line else peak
    return {"wall_s": wall, "phases": _phases(log), "rss_mb": after, "peak_rss_mb": peak}


def tree_rss_mb(pid: int) -> dict[str, int]:
    """RSS (MB) of a front end and its engine processes, named by role."""
    found: dict[str, int] = {}
    workers = 0
    for p in sorted([pid, *proc_tree.descendants(pid)]):
        cmd = proc_tree.cmdline(p).replace(b"\0", b" ").decode(errors="replace")
        rss = resident_bytes(p) >> 20
        if not rss:  # gone meanwhile
            continue
        if p == pid:
            name = "frontend"
        elif "core_proc" in cmd:
            name = "engine_core"
        elif "spawn_main" in cmd and "resource_tracker" not in cmd:
            name, workers = f"worker_{workers}", workers + 1
        else:  # the resource tracker, a kernel build's compiler: not part of the engine
            continue
        found[name] = rss
    return found


@contextlib.contextmanager
def _server(tree: Path, model: str, engine_args: list[str], sink):
    """A `vserve serve` of `tree`, ready and answering one completion: yields (process, url,
    seconds from start to `/health` 200); stopped (SIGTERM, then SIGKILL) at the end."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    start = time.perf_counter()
    proc = subprocess.Popen(
        _cli(["serve", model, "--port", str(port), *engine_args]),
        env=_env(tree),
        cwd=tree,
        stdout=sink,
        stderr=subprocess.STDOUT,
    )
    try:
        ready = _wait_health(proc, url, start)
        body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0}
        httpx.post(url + "/v1/completions", json=body, timeout=300)
        yield proc, url, ready
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_serve(tree: Path, model: str, engine_args: list[str]) -> dict:
    with tempfile.TemporaryFile("w+") as sink:
        with _server(tree, model, engine_args, sink) as (proc, url, ready):
            rss = tree_rss_mb(proc.pid)  # from outside: any version of the server
            exported = _metric_rss(httpx.get(url + "/metrics", timeout=60).text)
        sink.seek(0)
        text = sink.read()
    return {"ready_s": ready, "phases": _phases(text), "rss_mb": rss, "metrics_rss_mb": exported}


def run_load(tree: Path, model: str, engine_args: list[str]) -> dict:
    with _server(tree, model, engine_args, subprocess.DEVNULL) as (proc, url, ready):
        one = _memory(proc.pid)
        peak = _under_load(proc.pid, url, 64, 128, 128)
        time.sleep(5.0)  # idle: the front end and the worker trim their heaps after 1 s
        idle = _memory(proc.pid)
    return {
        "ready_s": ready,
        "phases": {},
        "rss_mb": idle["rss_mb"],
        "stages": {"after one request": one, "peak of 64 x 128/128": peak, "idle after it": idle},
    }


def _memory(pid: int) -> dict:
    kv = sum(kv_resident_bytes(p) for p in proc_tree.descendants(pid)) >> 20
    return {"rss_mb": tree_rss_mb(pid), "kv_mb": kv}


def _under_load(pid: int, url: str, num: int, input_len: int, output_len: int) -> dict:
    """Largest total RSS while `num` requests run at once (sampled every 0.2 s)."""
    import threading

    words = "the quick brown fox jumps over a lazy dog and runs far away".split()
    prompts = [" ".join(words[(i + j) % len(words)] for j in range(input_len)) for i in range(num)]

    def one(prompt: str) -> None:
        body = {"prompt": prompt, "max_tokens": output_len, "ignore_eos": True}
        httpx.post(url + "/v1/completions", json=body, timeout=900)

    threads = [threading.Thread(target=one, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    peak = _memory(pid)
    while any(t.is_alive() for t in threads):
        now = _memory(pid)
        if sum(now["rss_mb"].values()) > sum(peak["rss_mb"].values()):
            peak = now
        time.sleep(0.2)
    return peak


def _wait_health(proc: subprocess.Popen, url: str, start: float) -> float:
    while time.perf_counter() - start < 900:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return time.perf_counter() - start
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise TimeoutError("server not ready in 900 s")


def _metric_rss(text: str) -> dict[str, int]:
    found = re.findall(
        r'^vserve:process_resident_memory_bytes\{[^}]*process="(\w+)"[^}]*\} '
        r"(\S+)$",
        text,
        re.M,
    )
    return {name: int(float(value) / 2**20) for name, value in found}


def _phases(log: str) -> dict[str, float]:
    return {f"{process}: {name}": float(secs) for process, name, secs in _PHASE.findall(log)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def summarize(runs: list[dict], warmup: bool = True) -> dict:
    counted = runs[1:] if warmup and len(runs) > 1 else runs  # the first run warms the caches
    key = "wall_s" if "wall_s" in runs[0] else "ready_s"
    phases = {
        name: statistics.median(r["phases"].get(name, 0.0) for r in counted)
        for name in counted[-1]["phases"]
    }
    rss = counted[-1]["rss_mb"]
    peak = counted[-1].get("peak_rss_mb")
    return {
        key: statistics.median(r[key] for r in counted),
        "phases": phases,
        "rss_mb": rss,
        "rss_total_mb": sum(rss.values()),
        "peak_rss_total_mb": sum(peak.values()) if peak else None,
        "runs": runs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--engine-args", default="", help="extra engine flags, one string")
    parser.add_argument("--cases", default="generate,serve")
    parser.add_argument(
        "--compare-tree",
        default=None,
        help="another vserve checkout, run interleaved with this one",
    )
    parser.add_argument(
        "--compare-engine-args",
        default=None,
        help="this checkout again with these engine flags instead, interleaved",
    )
    parser.add_argument(
        "--fresh-cache",
        action="store_true",
        help="every run on an empty model cache (first start; the kernels stay built)",
    )
    parser.add_argument("--output-json", default=str(ROOT / "benchmarks/results/startup.json"))
    args = parser.parse_args()
    engine_args = shlex.split(args.engine_args)
    variants = {"this": (ROOT, engine_args)}
    if args.compare_tree:
        variants["compare"] = (Path(args.compare_tree).resolve(), engine_args)
    if args.compare_engine_args is not None:
        variants[args.compare_engine_args] = (ROOT, shlex.split(args.compare_engine_args))
    trees = {name: tree for name, (tree, _) in variants.items()}
    cases = {"generate": run_generate, "serve": run_serve, "load": run_load}
    results: dict[str, dict[str, list]] = {t: {c: [] for c in args.cases.split(",")} for t in trees}
    for i in range(args.runs):
        for case in args.cases.split(","):
            for tree_name, (tree, flags) in variants.items():
                with _fresh_cache(args.fresh_cache):
                    result = cases[case](tree, args.model, flags)
                results[tree_name][case].append(result)
                print(
                    f"run {i} {tree_name:8s} {case:8s} "
                    f"{result.get('wall_s', result.get('ready_s')):6.2f} s "
                    f"rss {sum(result['rss_mb'].values())} MB",
                    flush=True,
                )
    summary = {
        t: {c: summarize(r, warmup=not args.fresh_cache) for c, r in cases_.items()}
        for t, cases_ in results.items()
    }
    print_table(summary)
    print_load(summary)
    out = Path(args.output_json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "model": args.model,
                "engine_args": {t: flags for t, (_, flags) in variants.items()},
                "fresh_cache": args.fresh_cache,
                "runs": args.runs,
                "trees": {t: str(p) for t, p in trees.items()},
                "summary": summary,
            },
            indent=2,
        )
    )
    print(f"wrote {out}")


def print_load(summary: dict) -> None:
    rows = [(t, c["load"]["runs"][-1]["stages"]) for t, c in summary.items() if "load" in c]
    if not rows:
        return
    print("\n| tree | load stage | RSS total (MiB) | per process (MiB) | KV cache pages (MiB) |")
    print("|---|---|---|---|---|")
    for tree, stages in rows:
        for stage, m in stages.items():
            per = ", ".join(f"{k} {v}" for k, v in m["rss_mb"].items())
            print(f"| {tree} | {stage} | {sum(m['rss_mb'].values())} | {per} | {m['kv_mb']} |")


def print_table(summary: dict) -> None:
    print(
        "\n| tree | case | time (s) | RSS total after the request (MiB) | per process (MiB) "
        "| peak total (MiB) |"
    )
    print("|---|---|---|---|---|---|")
    for tree, cases in summary.items():
        for case, s in cases.items():
            value = s.get("wall_s", s.get("ready_s"))
            per = ", ".join(f"{k} {v}" for k, v in s["rss_mb"].items())
            peak = s.get("peak_rss_total_mb") or "-"
            print(f"| {tree} | {case} | {value:.2f} | {s['rss_total_mb']} | {per} | {peak} |")
    names = sorted({n for cases in summary.values() for s in cases.values() for n in s["phases"]})
    if not names:
        return
    trees = list(summary)
    print(
        "\n| phase (median s) | " + " | ".join(f"{t} {c}" for t in trees for c in summary[t]) + " |"
    )
    print("|---|" + "---|" * sum(len(summary[t]) for t in trees))
    for name in names:
        cells = [
            f"{summary[t][c]['phases'].get(name, float('nan')):.2f}"
            for t in trees
            for c in summary[t]
        ]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
