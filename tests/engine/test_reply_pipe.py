"""A worker's reply and the engine core's next request cross in the pipes without a deadlock:
the worker never blocks its main loop on a reply the engine core has not read yet, so a large
reply (prompt logprobs) and a large request (new prompts, a grammar bitmask) may be in flight
together. The pipes are shrunk to one page here so that ordinary requests are "large"."""

import fcntl
import os
import threading
import time
from multiprocessing import Pipe

import pytest

from tests.support.engines import make_llm
from vserve import SamplingParams
from vserve.workers.reply_pipe import ReplyPipe

F_SETPIPE_SZ = 1031
PAGE = 4096


def _shrink(conn) -> None:
    fcntl.fcntl(conn.fileno(), F_SETPIPE_SZ, PAGE)


def _read_all(conn, count: int, box: list) -> None:
    for _ in range(count):
        box.append(conn.recv_bytes())


def test_send_never_waits_for_the_reader():
    r, w = Pipe(duplex=False)
    _shrink(w)
    pipe = ReplyPipe(w)
    messages = [b"a" * 10, os.urandom(1 << 20), b"", b"b" * 5000, os.urandom(100_000), b"c"]
    started = time.monotonic()
    for m in messages:  # nobody reads yet: a blocking send would stop at the first megabyte
        pipe.send(m)
    assert time.monotonic() - started < 5
    got: list = []
    reader = threading.Thread(target=_read_all, args=(r, len(messages), got))
    reader.start()
    reader.join(timeout=30)
    assert not reader.is_alive()
    assert got == messages  # whole, in order
    pipe.close(timeout=5)


def test_send_after_the_reader_went_away_raises():
    r, w = Pipe(duplex=False)
    pipe = ReplyPipe(w)
    r.close()
    with pytest.raises(OSError):
        for _ in range(100):  # the drain thread may see the broken pipe first
            pipe.send(os.urandom(100_000))
            time.sleep(0.01)
    pipe.close(timeout=5)


def test_close_delivers_what_is_left():
    r, w = Pipe(duplex=False)
    _shrink(w)
    pipe = ReplyPipe(w)
    data = os.urandom(200_000)
    pipe.send(data)
    got: list = []
    reader = threading.Thread(target=_read_all, args=(r, 1, got))
    reader.start()
    pipe.close(timeout=30)
    reader.join(timeout=30)
    assert got == [data]


@pytest.mark.slow
def test_large_reply_and_large_request_cross(tiny_model_dir):
    """Async scheduling sends step N+1 before it reads step N's reply. With prompt logprobs in
    every reply and new prompts in every request, both exceed the (one-page) pipes: a worker
    that sent its reply from the main loop with a blocking write stopped reading requests
    while the engine core stopped in its write of the next one."""
    llm = make_llm(
        tiny_model_dir("llama", max_position_embeddings=2048),
        distributed_executor_backend="mp",
        async_scheduling=True,
        max_model_len=2048,
        max_num_seqs=8,
        max_num_batched_tokens=2048,
        watchdog_timeout=30,
    )
    executor = llm.engine.client.core.executor
    _shrink(executor.req_w)
    _shrink(executor.resp_r)
    # ids past 255 take three bytes each in a request: a new prompt exceeds the page
    prompts = [
        {"prompt_token_ids": [256 + (7 * i + 3 * t) % 128 for t in range(1500)]} for i in range(12)
    ]
    params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=5, ignore_eos=True)
    box: dict = {}

    def run():
        try:
            box["out"] = llm.generate(prompts, params, use_tqdm=False)
        except BaseException as e:  # noqa: BLE001 - reported below
            box["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout=60)  # seconds when nothing waits on the other
    try:
        assert not thread.is_alive(), "the engine core and the worker wait on each other"
        assert "error" not in box, box.get("error")
        assert [len(o.prompt_logprobs) for o in box["out"]] == [1500] * len(prompts)
    finally:
        if thread.is_alive():
            executor.kill()  # the blocked write ends with a broken pipe
        llm.shutdown()
