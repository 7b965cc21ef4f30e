"""`vserve serve --headless`: a host that runs data-parallel engines for a head elsewhere and
no API server.

For each local rank (`--data-parallel-start-rank` .. + `--data-parallel-size-local`) it asks
the head's handshake port where that rank's sockets are, then starts the engine core
(`python -m vserve.engine.core_proc`, as a local front end does), which connects to them.
It returns when its engines have stopped: 0 when the head shut them down; 1 when one failed
(the others are stopped first, unless `--data-parallel-keep-serving`). SIGTERM or Ctrl-C stops
them (SIGTERM, then SIGKILL after `STOP_GRACE_S`); they also exit if this process dies, and
when the head's connection drops.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import subprocess
import time

import msgspec
import zmq

from vserve.config import EngineConfig
from vserve.engine.dp_transport import Hello, Welcome, check_remote_setup, secure_client
from vserve.engine.mp_client import spawn_engine_core
from vserve.envs import read_env

logger = logging.getLogger("vserve")
STOP_GRACE_S = 10.0


def run_headless(config: EngineConfig) -> int:
    dp = config.data_parallel
    check_remote_setup(dp.address, dp.rpc_port)
    if dp.size_local < 1:
        raise ValueError("--headless needs --data-parallel-size-local >= 1")
    stop: list[int] = []
    previous = {
        sig: signal.signal(sig, lambda s, _f: stop.append(s))
        for sig in (signal.SIGTERM, signal.SIGINT)
    }
    procs: dict[int, subprocess.Popen] = {}
    try:
        for rank in dp.local_ranks:
            welcome = ask_head(dp.address, dp.rpc_port, rank, stop)
            if welcome is None:
                return 128 + stop[0]
            engine_config = dataclasses.replace(
                config, data_parallel=dataclasses.replace(dp, engine_index=rank)
            )
            procs[rank] = spawn_engine_core(engine_config, welcome.input_addr, welcome.output_addr)
            logger.warning("data-parallel engine %d started for the head %s", rank, dp.address)
        return _supervise(procs, stop, dp.keep_serving)
    finally:
        _stop_all(procs)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def ask_head(address: str, port: int, rank: int, stop: list[int]) -> Welcome | None:
    """The addresses of `rank`'s sockets on the head (which may not be up yet: the request
    waits for it); None when a signal came first."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    secure_client(sock, read_env().dp_secret)
    host = f"[{address}]" if ":" in address else address
    sock.connect(f"tcp://{host}:{port}")
    timeout = read_env().engine_ready_timeout
    try:
        sock.send(msgspec.msgpack.encode(Hello(rank)))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not stop:
            if sock.poll(200):
                welcome = msgspec.msgpack.decode(sock.recv(), type=Welcome)
                if welcome.error:
                    raise ValueError(f"the head refused data-parallel rank {rank}: {welcome.error}")
                return welcome
        if stop:
            return None
        raise TimeoutError(
            f"no answer from the head at {address}:{port} within {timeout:.0f} s (is it "
            "running? is VSERVE_DP_SECRET the same on both hosts?)"
        )
    finally:
        sock.close(linger=0)
        ctx.term()


def _supervise(procs: dict[int, subprocess.Popen], stop: list[int], keep_serving: bool) -> int:
    while True:
        if stop:
            return 128 + stop[0]
        codes = {r: p.poll() for r, p in procs.items()}
        failed = [r for r, c in codes.items() if c not in (None, 0)]
        if failed and not (keep_serving and None in codes.values()):
            logger.error(
                "data-parallel engine(s) %s failed (exit codes %s)",
                failed,
                [codes[r] for r in failed],
            )
            return 1
        if None not in codes.values():
            return 1 if failed else 0
        time.sleep(0.2)


def _stop_all(procs: dict[int, subprocess.Popen]) -> None:
    from vserve.engine.mp_client import _kill_group

    for proc in procs.values():
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for proc in procs.values():
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        if proc.poll() is None:
            _kill_group(proc)
            proc.wait()
