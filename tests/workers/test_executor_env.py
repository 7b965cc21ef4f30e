"""Worker processes start with libgomp's spin count pinned (vserve.executor.multiproc says why),
unless the user set it; the runner turns MKL's load-dependent thread count off."""

import ctypes
import os
from pathlib import Path

import pytest
import torch

from tests.support.engines import make_llm
from vserve.executor.multiproc import WORKER_ENV_DEFAULTS, _environment
from vserve.workers.device import fix_blas_thread_count


def test_worker_env_defaults_apply_only_while_spawning(monkeypatch):
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    with _environment(WORKER_ENV_DEFAULTS):
        assert os.environ["GOMP_SPINCOUNT"] == WORKER_ENV_DEFAULTS["GOMP_SPINCOUNT"]
    assert "GOMP_SPINCOUNT" not in os.environ


def test_a_value_the_user_set_wins(monkeypatch):
    monkeypatch.setenv("GOMP_SPINCOUNT", "123")
    with _environment(WORKER_ENV_DEFAULTS):
        assert os.environ["GOMP_SPINCOUNT"] == "123"
    assert os.environ["GOMP_SPINCOUNT"] == "123"


def test_spawned_workers_inherit_the_defaults(tiny_model_dir, monkeypatch):
    from tests.support.engines import make_llm

    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    llm = make_llm(tiny_model_dir("llama"), distributed_executor_backend="mp", max_model_len=64)
    try:
        proc = llm.engine.client.core.executor.procs[0]
        with open(f"/proc/{proc.pid}/environ", "rb") as f:
            env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        assert env[b"GOMP_SPINCOUNT"] == WORKER_ENV_DEFAULTS["GOMP_SPINCOUNT"].encode()
        assert "GOMP_SPINCOUNT" not in os.environ  # this process is left as it was
    finally:
        llm.shutdown()


def _mkl(name: str):
    lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
    return getattr(lib, name, None)


@pytest.mark.skipif(_mkl("mkl_serv_get_dynamic") is None, reason="torch without MKL")
def test_the_runner_fixes_blas_threads_against_the_load(tiny_model_dir):
    """With MKL's dynamic threading on, a busy machine made products run on fewer threads and
    the same request's fp32 logprobs moved by ulps (a flaky exact-logprob server test)."""
    _mkl("MKL_Set_Dynamic")(1)
    fix_blas_thread_count.cache_clear()
    assert _mkl("mkl_serv_get_dynamic")() == 1
    llm = make_llm(tiny_model_dir("llama"), max_model_len=64)
    try:
        assert _mkl("mkl_serv_get_dynamic")() == 0
    finally:
        llm.shutdown()
