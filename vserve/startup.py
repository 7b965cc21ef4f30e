"""Start-up phases and process memory: one INFO line per phase with its time, and the
resident memory of each process of an engine.

Every process logs its own phases (`phase("load weights")`), prefixed with its role
(frontend, engine_core, worker_0, ...), so `--log-level INFO` shows where start-up time goes.
`resident_bytes(pid)` reads `/proc/<pid>/statm` (psutil elsewhere); the engine core answers
the `process_memory` utility with its own and its workers' figures, which `/metrics` exports
as `vserve:process_resident_memory_bytes{process=...}` and `LLM` logs once it is ready.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

from vserve.host import heap

logger = logging.getLogger("vserve.startup")

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


@contextmanager
def phase(name: str, process: str) -> Iterator[None]:
    """Log `process: name took N s` at INFO when the block ends (also when it raises)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        logger.info("start-up %s: %s %.2f s", process, name, time.perf_counter() - start)


def resident_bytes(pid: int | None = None) -> int:
    """Resident set size of process `pid` (default: this one) in bytes, 0 if it is gone."""
    pid = os.getpid() if pid is None else pid
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        pass
    try:
        import psutil

        return int(psutil.Process(pid).memory_info().rss)
    except Exception:  # no psutil, no such process
        return 0


# the name of the CPU KV cache's memory (vserve.workers.kv_cache): /proc/PID/smaps shows its
# mappings as "/memfd:vserve-kv (deleted)", so the cache's resident pages can be told apart
KV_MAPPING_NAME = "vserve-kv"


def kv_resident_bytes(pid: int | None = None) -> int:
    """Resident bytes of process `pid`'s CPU KV cache (0 if none, or it is gone). Committed
    pages stay resident when their blocks are freed: bounded by the KV budget."""
    pid = os.getpid() if pid is None else pid
    total, in_kv = 0, False
    try:
        with open(f"/proc/{pid}/smaps") as f:
            for line in f:
                if line[:1] in "0123456789abcdef" and "-" in line.split(" ", 1)[0]:
                    in_kv = f"/memfd:{KV_MAPPING_NAME}" in line  # a mapping's header
                elif in_kv and line.startswith("Rss:"):
                    total += int(line.split()[1]) * 1024
    except OSError:
        return 0
    return total


def seconds_since_process_start() -> float | None:
    """Wall time since this process started (Linux: /proc), imports included; None if
    unknown."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return time.time() - (boot + ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def log_ready(process: str) -> None:
    elapsed = seconds_since_process_start()
    if elapsed is not None:
        logger.info("start-up %s: ready %.2f s after the process started", process, elapsed)


def memory_line(memory: dict[str, int]) -> str:
    """`frontend 512 MB, engine_core 240 MB, ...; total 1.2 GB`."""
    parts = [f"{name} {value / 2**20:.0f} MB" for name, value in memory.items()]
    return ", ".join(parts) + f"; total {sum(memory.values()) / 2**30:.2f} GB"


def log_memory(memory: dict[str, int]) -> None:
    logger.info("resident memory: %s", memory_line(memory))


def start_with_tokenizer(tokenizer_path: str, start_client):
    """Load the tokenizer on a thread while `start_client()` starts the engine core and its
    workers (they import and load in parallel with it); returns (tokenizer, client). A
    tokenizer that fails to load shuts the started client down before the error propagates."""
    from concurrent.futures import ThreadPoolExecutor

    from vserve.tokenizer import load_tokenizer

    def load():
        with phase("tokenizer", "frontend"):
            tokenizer = load_tokenizer(tokenizer_path)
            heap.trim()  # the parse of tokenizer.json leaves its garbage in the heap
            return tokenizer

    with ThreadPoolExecutor(1, thread_name_prefix="vserve-tokenizer-load") as pool:
        tokenizer = pool.submit(load)
        with phase("engine core and workers ready", "frontend"):
            client = start_client()
        try:
            return tokenizer.result(), client
        except BaseException:
            client.shutdown()
            raise
