"""Worker processes start with libgomp's spin count pinned (vserve.executor.multiproc says why),
unless the user set it."""

import os

from vserve.executor.multiproc import WORKER_ENV_DEFAULTS, _environment


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
