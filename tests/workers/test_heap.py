"""The C heap's policy (`vserve.host.heap`): freed pages go back to the OS at the end of start-up
and when a worker is idle, and only then."""

from __future__ import annotations

import contextlib
import ctypes
import platform

import pytest

from vserve import startup
from vserve.host import heap
from vserve.workers import worker_proc

glibc = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc"
)


@glibc
def test_trim_returns_freed_heap_pages():
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    # 64 MiB in 64 KiB blocks (below the mmap threshold: they live in the heap), then freed
    blocks = [libc.malloc(64 * 1024) for _ in range(1024)]
    for b in blocks:
        ctypes.memset(b, 1, 64 * 1024)  # touch: resident
    before = startup.resident_bytes()
    for b in blocks[::2]:  # holes between live blocks: free() alone can never return them
        libc.free(b)
    assert heap.trim()
    assert startup.resident_bytes() < before - 16 * 2**20
    for b in blocks[1::2]:
        libc.free(b)


class _Conn:
    """A worker's request pipe: `ready` says whether a request waits."""

    def __init__(self) -> None:
        self.ready = True
        self.polls: list[float] = []

    def poll(self, timeout: float) -> bool:
        self.polls.append(timeout)
        return self.ready

    def recv_bytes(self) -> bytes:
        return b"step"


def _rank0(conn: _Conn):
    loop = object.__new__(worker_proc._RankLoop)  # only what _next_request reads
    loop.rank, loop.pp, loop.req_conn, loop.busy, loop.prefetch = 0, None, conn, False, None
    return loop


def test_idle_worker_trims_once_per_idle_period(monkeypatch):
    trims = []
    monkeypatch.setattr(heap, "trim", lambda: trims.append(1) or True)
    conn = _Conn()
    loop = _rank0(conn)
    assert loop._next_request() == (b"step", None)
    assert conn.polls == [] and trims == []  # nothing ran since start-up's trim
    loop._next_request()  # a request was already waiting: busy, no trim
    assert conn.polls == [worker_proc.IDLE_TRIM_S] and trims == []
    conn.ready = False  # nothing for IDLE_TRIM_S: idle
    loop._next_request()
    assert trims == [1]
    loop._next_request()  # the next request came: trims again only after it
    assert trims == [1, 1]


def test_tokenizer_load_is_followed_by_a_trim(monkeypatch, tiny_model_dir):
    events = []
    monkeypatch.setattr(heap, "trim", lambda: events.append("trim") or True)
    tokenizer, client = startup.start_with_tokenizer(
        tiny_model_dir("llama"), lambda: events.append("client") or "client"
    )
    assert client == "client" and tokenizer is not None
    assert "trim" in events


def test_front_end_trims_once_after_each_busy_period(monkeypatch):
    """Driven by the counter's value at each wake (a scripted sleep, no clock): no trim while
    idle from the start or while outputs keep coming, one when they stop, none again until
    the next busy period has ended."""
    import asyncio

    trims = []
    monkeypatch.setattr(heap, "trim", lambda: trims.append(count[0]) or True)
    count = [0]
    # the counter at each wake: idle, busy, busy, idle (trim), idle, busy, idle (trim), idle
    script = iter([0, 0, 4, 7, 7, 7, 9, 9, 9])

    async def wake(_seconds) -> None:
        try:
            count[0] = next(script)
        except StopIteration:
            raise asyncio.CancelledError from None

    async def run() -> None:
        with contextlib.suppress(asyncio.CancelledError):
            await heap.trim_when_idle(lambda: count[0], idle_s=0.1, sleep=wake)

    asyncio.run(run())
    assert trims == [7, 9]


def test_prompt_sized_bpe_memo_is_bounded():
    """A Gemma-shaped tokenizer (spaces normalized to '\u2581' before a split on ' ') makes each
    prompt one pre-token; the Rust BPE memo of them grew the front end by ~1.1 KB per request.
    `bound_caches` (run by load_tokenizer) caps it: 12000 distinct prompts stay within a few
    MB where the default memo takes ~40 MB."""
    import random

    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

    from vserve.tokenizer import bound_caches

    def gemma_shaped() -> Tokenizer:
        vocab = {
            "<unk>": 0,
            "\u2581": 1,
            **{c: i + 2 for i, c in enumerate("abcdefghijklmnopqrstuvwxyz")},
        }
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
        tok.normalizer = normalizers.Replace(" ", "\u2581")
        tok.pre_tokenizer = pre_tokenizers.Split(" ", "merged_with_previous")
        return tok

    def growth_mb(tok: Tokenizer) -> float:
        rng = random.Random(0)
        words = ["alpha", "bravo", "charlie", "delta", "echo", "fox", "golf", "hotel"]
        heap.trim()
        before = startup.resident_bytes()
        for _ in range(12000):
            tok.encode(" ".join(rng.choice(words) for _ in range(rng.randint(3, 40))))
        heap.trim()
        return (startup.resident_bytes() - before) / 2**20

    bounded = gemma_shaped()
    bound_caches(type("Fast", (), {"backend_tokenizer": bounded})())
    unbounded = growth_mb(gemma_shaped())
    assert growth_mb(bounded) < 12 < unbounded, unbounded


def test_load_tokenizer_bounds_the_memo(tiny_model_dir, monkeypatch):
    from vserve import tokenizer as tokenizer_module

    seen = []
    monkeypatch.setattr(tokenizer_module, "bound_caches", seen.append)
    tokenizer_module.load_tokenizer.cache_clear()
    loaded = tokenizer_module.load_tokenizer(tiny_model_dir("llama"))
    tokenizer_module.load_tokenizer.cache_clear()
    assert seen == [loaded]


def test_startup_over_collects_and_freezes_what_survives(monkeypatch):
    """After start-up no full collection walks start-up's objects again (a 90-160 ms gen-2
    pause inside a worker's step, seen at batch 1): they are frozen, its garbage collected."""
    import gc

    class Cycle:
        def __init__(self):
            self.me = self

    calls = []
    monkeypatch.setattr(heap, "trim", lambda: calls.append("trim") or True)
    gc.unfreeze()
    garbage = Cycle()
    survivor = Cycle()
    ref = __import__("weakref").ref(garbage)
    del garbage
    try:
        heap.startup_over()
        assert ref() is None  # start-up's garbage went first
        assert gc.get_freeze_count() > 0 and calls == ["trim"]
        assert survivor.me is survivor
    finally:
        gc.unfreeze()


def test_only_processes_vserve_owns_freeze(tiny_model_dir):
    """An in-process engine leaves its user's process unfrozen; a worker process freezes when
    its KV cache is made (the multiprocess engine's worker, checked through the handler)."""
    import gc

    from tests.support.engines import make_llm

    gc.unfreeze()
    llm = make_llm(tiny_model_dir("llama"), max_model_len=64)
    try:
        assert gc.get_freeze_count() == 0
    finally:
        llm.shutdown()
    frozen = []
    loop = object.__new__(worker_proc._RankLoop)
    loop.rank, loop.pp = 0, None
    loop.worker = type("W", (), {"init_kv_cache": lambda self, n: None})()
    loop._direct_reply = lambda value: None
    original = heap.startup_over
    heap.startup_over = lambda: frozen.append(1)
    try:
        loop._handle(worker_proc.wire.InitKvCache(4))
    finally:
        heap.startup_over = original
    assert frozen == [1]
