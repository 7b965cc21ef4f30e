"""A live `vserve serve` process for tests: start on a free port, wait for /health, stop, and
check that no process of its tree outlives it.

Descendants are found through /proc (`vserve.host.proc_tree`): the engine core is a child of the
server and its workers are grandchildren, so the whole tree is recorded while the server runs.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from vserve.host.proc_tree import children as children_of
from vserve.host.proc_tree import descendants, is_running

__all__ = [
    "TINY_ARGS",
    "ServerProcess",
    "children_of",
    "free_port",
    "is_running",
    "metric_value",
    "serving",
]

# small, fast settings for the tiny test models
TINY_ARGS = ["--dtype", "float32", "--num-gpu-blocks-override", "2048"]
# the tiny llama server that the OpenAI-surface and bench-serve modules share (one start-up
# for all of them: `tiny_llama_server` in tests/conftest.py)
TINY_NAME = "tiny"
TINY_MAX_MODEL_LEN = 512


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115 -- open while the server runs
            "w+", prefix="vserve-server-", suffix=".log", delete=False
        )
        cmd = [
            sys.executable,
            "-m",
            "vserve.cli",
            "serve",
            *args,
            "--port",
            str(self.port),
        ]
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
        self.tree: set[int] = set()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_ready(self, timeout: float = 180.0) -> ServerProcess:
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=2) as client:  # one client: a new one loads certificates
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    code = self.proc.returncode
                    raise RuntimeError(f"server exited ({code}):\n{self.log_tail()}")
                try:
                    if client.get(self.url + "/health").status_code == 200:
                        self.remember_tree()
                        return self
                except httpx.HTTPError:
                    pass
                time.sleep(0.05)
        raise TimeoutError(f"server not ready in {timeout} s:\n{self.log_tail()}")

    def remember_tree(self) -> set[int]:
        self.tree |= set(descendants(self.pid))
        return self.tree

    def wait_exit(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def survivors(self, timeout: float = 10.0) -> list[int]:
        """Processes of the recorded tree still running after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            alive = [p for p in self.tree if is_running(p)]
            if not alive or time.monotonic() > deadline:
                return alive
            time.sleep(0.05)

    def stop(self) -> int:
        """SIGTERM, then SIGKILL for anything left (the test fails on leftovers)."""
        if self.proc.poll() is None:
            self.remember_tree()
            self.proc.send_signal(signal.SIGTERM)
        code = self.wait_exit(60)
        if code is None:
            self.proc.kill()
            code = self.proc.wait()
        left = self.survivors()
        for pid in left:  # never leave strays behind, even when the test fails
            os.kill(pid, signal.SIGKILL)
        assert not left, f"processes outlived the server: {left}\n{self.log_tail()}"
        return code

    def log_tail(self, num_chars: int = 4000) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()[-num_chars:]


def metric_value(text: str, name: str) -> float:
    """The value of a `vserve:` sample (first one whose name matches)."""
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


@contextlib.contextmanager
def serving(args: list[str]):
    """A server for a test module: ready, its engine processes noted (`engine_pids`), and
    stopped cleanly (exit 0) at the end."""
    srv = ServerProcess(args)
    try:
        srv.wait_ready()
        srv.engine_pids = children_of(srv.pid)
        yield srv
    finally:
        assert srv.stop() == 0


def offline_app(**args):
    """The server's FastAPI app over a stand-in engine that is never called: for what needs no
    engine (the OpenAPI document, the front door's errors, validation before admission).
    Requests go through `starlette`'s TestClient with base_url http://127.0.0.1."""
    import argparse
    from types import SimpleNamespace

    from vserve.entrypoints.openai.server import build_app

    model = SimpleNamespace(served_model_name="offline", max_model_len=64, vocab_size=100)
    engine = SimpleNamespace(
        config=SimpleNamespace(model=model, scheduler=SimpleNamespace(max_num_seqs=4)),
        tokenizer=None,
        errored=False,
    )
    return build_app(engine, argparse.Namespace(**args))
