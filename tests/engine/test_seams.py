"""The typed seams between layers: every executor implements `Executor`, every engine-core
client its protocol, and a utility call returns the same shapes in process and across
processes."""

from __future__ import annotations

import inspect

import pytest

from tests.support.engines import make_llm
from tests.support.fakes import FakeExecutor
from vserve.engine.client import AsyncEngineCoreClient, EngineCoreClient, InprocClient
from vserve.engine.mp_client import AsyncMPClient, SyncMPClient
from vserve.executor.base import Executor
from vserve.executor.multiproc import MultiprocExecutor
from vserve.executor.uniproc import UniProcExecutor


def _protocol_methods(protocol) -> dict[str, inspect.Signature]:
    return {
        name: inspect.signature(fn)
        for name, fn in vars(protocol).items()
        if callable(fn) and not name.startswith("_")
    }


@pytest.mark.parametrize("cls", [UniProcExecutor, MultiprocExecutor, FakeExecutor])
def test_executors_implement_the_interface(cls):
    assert issubclass(cls, Executor)
    assert not getattr(cls, "__abstractmethods__", None), cls.__abstractmethods__


@pytest.mark.parametrize(
    "cls, protocol",
    [
        (InprocClient, EngineCoreClient),
        (SyncMPClient, EngineCoreClient),
        (AsyncMPClient, AsyncEngineCoreClient),
    ],
)
def test_clients_implement_their_protocol(cls, protocol):
    for name, expected in _protocol_methods(protocol).items():
        method = getattr(cls, name, None)
        assert method is not None, f"{cls.__name__} lacks {name}"
        got = inspect.signature(method)
        assert inspect.iscoroutinefunction(method) == inspect.iscoroutinefunction(
            vars(protocol)[name]
        ), name
        # the protocol's parameters, by name and kind (a client may add keyword options)
        wanted = [(p.name, p.kind) for p in expected.parameters.values()]
        assert [(p.name, p.kind) for p in got.parameters.values()][: len(wanted)] == wanted, (
            f"{cls.__name__}.{name}{got} does not match {expected}"
        )


def test_utilities_return_wire_shapes_in_process(tiny_model_dir):
    """What a utility returns in process is what msgpack would carry: plain dicts and
    lists, so a front end never needs to know where the engine core runs."""
    llm = make_llm(tiny_model_dir("llama"), max_model_len=64)
    try:
        llm.generate("hello", use_tqdm=False)
        client = llm.engine.client
        assert isinstance(client, InprocClient)
        stats = client.call_utility("stats")
        assert isinstance(stats, dict) and stats["num_running_reqs"] == 0
        assert client.call_utility("ping") == "pong"
        assert llm.engine.process_memory().keys() == {"frontend"}  # one process
        records = llm.engine.take_step_records()
        assert records and all(r.step_id > 0 for r in records)
        with pytest.raises(ValueError, match="unknown utility"):
            client.call_utility("shutdown")
    finally:
        llm.shutdown()
