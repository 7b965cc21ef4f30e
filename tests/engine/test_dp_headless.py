"""A real head and `--headless` host on 127.0.0.1 without VSERVE_DP_SECRET: the per-run
secret reaches the headless host through its private file (gone once the engines are up), and
a stranger's connections, junk frames and stolen-input attempts on the remote engine's sockets
neither kill it nor take its work; once the head shuts down, the host exits 0."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest
import zmq

from tests.support.proc_utils import descendants, wait_dead
from vserve import LLM, SamplingParams
from vserve.engine.dp.transport import run_secret_path
from vserve.executor.multiproc import free_port

pytestmark = pytest.mark.slow

PROMPTS = [{"prompt_token_ids": [2, 10 + i, 20 + 2 * i, 30 + 3 * i]} for i in range(4)]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
TINY = ["--dtype", "float32", "--max-model-len", "1024", "--num-gpu-blocks-override", "512"]
ARGS = dict(dtype="float32", max_model_len=1024, num_gpu_blocks_override=512)


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def _stranger_attacks(ctx: zmq.Context, input_addr: str, output_addr: str) -> zmq.Socket:
    """A bare TCP connect and close, a keyless PUSH of junk to the engine's output that then
    leaves, and a keyless PULL left on its input (returned: it must receive nothing)."""
    for addr in (input_addr, output_addr):
        host, port = addr.removeprefix("tcp://").rsplit(":", 1)
        socket.create_connection((host, int(port))).close()
    junk = ctx.socket(zmq.PUSH)
    junk.connect(output_addr)
    junk.send_multipart([b"junk", b"\xc1"])
    time.sleep(0.5)
    junk.close(linger=0)
    thief = ctx.socket(zmq.PULL)
    thief.connect(input_addr)
    return thief


def test_loopback_without_a_secret_serves_and_shrugs_off_strangers(
    tiny_model_dir, monkeypatch, tmp_path
):
    monkeypatch.delenv("VSERVE_DP_SECRET", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    model, port = tiny_model_dir("llama"), free_port()
    dp = ["--data-parallel-size", "2", "--data-parallel-size-local", "1"]
    dp += ["--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(port)]
    cmd = [sys.executable, "-m", "vserve.cli", "serve", model, "--headless", *dp]
    host1 = subprocess.Popen([*cmd, *TINY, "--data-parallel-start-rank", "1"], env=os.environ)
    ctx = zmq.Context()
    try:
        llm = LLM(
            model,
            data_parallel_size=2,
            data_parallel_size_local=1,
            data_parallel_address="127.0.0.1",
            data_parallel_rpc_port=port,
            **ARGS,
        )
        tree = descendants(host1.pid)
        assert not run_secret_path("127.0.0.1", port).exists()
        welcome = llm.engine.client.remote.welcomes[1]
        thief = _stranger_attacks(ctx, welcome.input_addr, welcome.output_addr)
        time.sleep(1.0)
        on_rank = [
            _ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False, data_parallel_rank=r))
            for r in (0, 1)
        ]
        assert on_rank[0] == on_rank[1]
        assert not thief.poll(200)
        llm.shutdown()
        assert host1.wait(timeout=30) == 0
        assert wait_dead(tree, timeout=10) == []
    finally:
        ctx.destroy(linger=0)
        if host1.poll() is None:
            host1.kill()
            host1.wait()
