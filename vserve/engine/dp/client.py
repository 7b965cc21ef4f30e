"""Data parallel: one client over N independent engine cores (`--data-parallel-size N`).

Each engine is an ordinary `SyncMPClient` / `AsyncMPClient` (local: its own process over
`ipc://`; remote: a `--headless` host's engine over TCP, `dp/remote.py`); their outputs go to
one shared queue, stamped with the engine's rank. A request goes to the engine the
`LoadRouter` picks (or the one it names), and its aborts follow it there.

| one engine dies                  | what happens                                              |
|----------------------------------|-----------------------------------------------------------|
| default                          | the whole engine is dead: every request fails, the server |
|                                  | reports it (`/health` 503) and exits 1                    |
| `data_parallel_keep_serving`     | its requests fail (finish_reason "error", with the cause),|
|                                  | new ones go to the others; the last one's death is fatal  |

Utility calls go to every live engine; `combine` merges their answers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from vserve.config import EngineConfig
from vserve.core.outputs import ERROR_DEAD
from vserve.engine.dp.router import LoadRouter
from vserve.engine.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from vserve.engine.mp_client import AsyncMPClient, EngineDeadError, SyncMPClient

logger = logging.getLogger("vserve")


def engine_configs(config: EngineConfig) -> dict[int, EngineConfig]:
    """One config per engine rank this front end drives (local and remote)."""
    dp = config.data_parallel
    ranks = [*dp.local_ranks, *dp.remote_ranks]
    return {
        r: dataclasses.replace(config, data_parallel=dataclasses.replace(dp, engine_index=r))
        for r in sorted(ranks)
    }


def start_engines(
    config: EngineConfig, make: Callable[[EngineConfig, Any], Any]
) -> tuple[dict[int, Any], Any]:
    """Start every engine at once (each handshake waits for its own core); if one fails, the
    others are shut down and its error raised. Returns the clients by rank, and the remote
    engines' handshake server (None without remote ranks)."""
    from vserve.engine.dp.remote import RemoteEngines

    configs = engine_configs(config)
    remote = RemoteEngines(config) if config.data_parallel.remote_ranks else None
    factories = {
        r: remote.factory(c) if remote is not None and r in remote.ranks else None
        for r, c in configs.items()
    }
    with ThreadPoolExecutor(len(configs)) as pool:
        futures = {r: pool.submit(make, c, factories[r]) for r, c in configs.items()}
        clients, error = {}, None
        for r, fut in futures.items():
            try:
                clients[r] = fut.result()
            except BaseException as e:  # noqa: BLE001 -- re-raised below, after cleanup
                error = error or e
    if remote is not None:
        remote.stop_handshakes()
    if error is not None:
        _shutdown_all(clients, remote)
        raise error
    return clients, remote


def combine(method: str, values: dict[int, Any]) -> Any:
    """One answer from every engine's answer to a utility call."""
    if method == "process_memory":
        return {f"{name}_dp{r}": v for r, mem in values.items() for name, v in mem.items()}
    if method == "take_step_records":
        return [rec for r in sorted(values) for rec in values[r]]
    if method == "reset_prefix_cache":
        return all(values.values())
    if method == "ping":
        return "pong"
    if method == "num_kv_blocks_info":
        return sum(values.values())
    if method == "stats":  # the engines' sum (the metrics ask each engine instead)
        merged: dict[str, Any] = {}
        for stats in values.values():
            for k, v in stats.items():
                merged[k] = merged.get(k, 0) + v if isinstance(v, (int, float)) else v
        if values:
            merged["kv_cache_usage"] = merged.get("kv_cache_usage", 0.0) / len(values)
        return merged
    return values


class _DPBase:
    """Routing, ownership of requests and the death rules, shared by both clients."""

    clients: dict[int, Any]

    def _init_dp(self, config: EngineConfig) -> None:
        self.keep_serving = config.data_parallel.keep_serving
        self.router = LoadRouter(sorted(self.clients))
        self.owners: dict[str, tuple[int, int]] = {}  # request id -> (rank, incarnation)
        self.dead: dict[int, str] = {}  # rank -> why
        self.dead_message: str | None = None
        self.num_kv_blocks = min(c.num_kv_blocks for c in self.clients.values())

    @property
    def engine_indices(self) -> list[int]:
        return sorted(self.router.alive)

    def _assign_all(self, requests: list[EngineCoreRequest], rank: int | None) -> int:
        """One engine for a prompt's requests (each counted there as one more waiting)."""
        for request in requests:
            rank = self._assign(request, rank)
        assert rank is not None  # a prompt has at least one request
        return rank

    def _assign(self, request: EngineCoreRequest, rank: int | None) -> int:
        while True:
            if self.dead_message is not None:
                raise EngineDeadError(self.dead_message)
            chosen = self.router.choose(rank)
            why = self.clients[chosen].dead_message
            if why is None:
                break
            # its client knows, but the death's message may still wait in the queue (no
            # request read it): apply the death rules now, and choose again
            died = self._engine_died(chosen, why)
            if died is not None:
                self._push(died)
        self.owners[request.request_id] = (chosen, request.incarnation)
        return chosen

    def _push(self, outs: EngineCoreOutputs) -> None:
        raise NotImplementedError

    def _by_engine(self, request_ids: list[str]) -> dict[int, list[str]]:
        groups: dict[int, list[str]] = {}
        for request_id in request_ids:
            owner = self.owners.pop(request_id, None)
            if owner is not None and owner[0] in self.router.alive:
                groups.setdefault(owner[0], []).append(request_id)
        return groups

    def _on_outputs(self, outs: EngineCoreOutputs) -> EngineCoreOutputs | None:
        """What the front end sees of one engine's message (None: nothing)."""
        rank = outs.engine_index
        if outs.engine_error is not None:
            return self._engine_died(rank, outs.engine_error)
        if rank in self.dead:
            return None  # a straggler from an engine already given up
        stats = outs.scheduler_stats
        if stats is not None:
            self.router.publish(rank, stats.num_waiting_reqs, stats.num_running_reqs)
        for out in outs.outputs:
            if out.finish_reason is not None:
                owner = self.owners.get(out.request_id)
                if owner == (rank, out.incarnation):
                    del self.owners[out.request_id]
        return outs

    def _engine_died(self, rank: int, message: str) -> EngineCoreOutputs | None:
        if rank in self.dead or self.dead_message is not None:
            return None
        if not message.startswith("data-parallel engine"):
            message = f"data-parallel engine {rank}: {message}"
        self.dead[rank] = message
        self.router.remove(rank)
        logger.error("%s", message)
        if self.keep_serving and self.router.alive:
            lost = [(rid, inc) for rid, (r, inc) in self.owners.items() if r == rank]
            for rid, _ in lost:
                del self.owners[rid]
            logger.error(
                "%d request(s) failed; serving on data-parallel engine(s) %s",
                len(lost),
                sorted(self.router.alive),
            )
            failed = [
                EngineCoreOutput(
                    rid,
                    [],
                    finish_reason="error",
                    error=message,
                    incarnation=inc,
                    error_kind=ERROR_DEAD,
                )
                for rid, inc in lost
            ]
            return EngineCoreOutputs(failed, engine_index=rank)
        self.dead_message = message
        return EngineCoreOutputs(engine_error=message, engine_index=rank)

    def _live(self) -> dict[int, Any]:
        return {r: c for r, c in self.clients.items() if r in self.router.alive}


class DPSyncClient(_DPBase):
    """`EngineCoreClient` over N engine cores (the offline `LLM`)."""

    def __init__(self, config: EngineConfig) -> None:
        self.outputs: queue.Queue[EngineCoreOutputs] = queue.Queue()
        self.clients, self.remote = start_engines(
            config, lambda c, engine: SyncMPClient(c, outputs=self.outputs, engine=engine)
        )
        self._init_dp(config)

    def _push(self, outs: EngineCoreOutputs) -> None:
        self.outputs.put(outs)

    def add_requests(
        self, requests: list[EngineCoreRequest], data_parallel_rank: int | None = None
    ) -> int:
        rank = self._assign_all(requests, data_parallel_rank)
        self.clients[rank].add_requests(requests)
        return rank

    def abort_requests(self, request_ids: list[str]) -> None:
        for rank, ids in self._by_engine(request_ids).items():
            self.clients[rank].abort_requests(ids)

    def get_output(self) -> EngineCoreOutputs:
        while True:
            outs = self._on_outputs(self.outputs.get())
            if outs is not None:
                return outs

    def call_utility_each(self, method: str, *args) -> dict[int, Any]:
        return {r: c.call_utility(method, *args) for r, c in self._live().items()}

    def call_utility(self, method: str, *args) -> Any:
        return combine(method, self.call_utility_each(method, *args))

    def process_memory(self) -> dict[str, int]:
        return self.call_utility("process_memory")

    def shutdown(self) -> None:
        _shutdown_all(self.clients, self.remote)


class DPAsyncClient(_DPBase):
    """`AsyncEngineCoreClient` over N engine cores (the HTTP server)."""

    def __init__(self, config: EngineConfig) -> None:
        self.outputs: asyncio.Queue[EngineCoreOutputs] | None = None
        self.clients, self.remote = start_engines(
            config, lambda c, engine: AsyncMPClient(c, engine=engine)
        )
        self._init_dp(config)

    def start(self) -> None:
        if self.outputs is not None:
            return
        self.outputs = asyncio.Queue()
        for client in self.clients.values():
            client.outputs = self.outputs
            client.start()

    def _push(self, outs: EngineCoreOutputs) -> None:
        assert self.outputs is not None, "start() first"
        self.outputs.put_nowait(outs)  # on the loop's thread, like every add

    async def add_requests_async(
        self, requests: list[EngineCoreRequest], data_parallel_rank: int | None = None
    ) -> int:
        rank = self._assign_all(requests, data_parallel_rank)
        await self.clients[rank].add_requests_async(requests)
        return rank

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        for rank, ids in self._by_engine(request_ids).items():
            await self.clients[rank].abort_requests_async(ids)

    async def get_output_async(self) -> EngineCoreOutputs:
        assert self.outputs is not None, "start() first"
        while True:
            outs = self._on_outputs(await self.outputs.get())
            if outs is not None:
                return outs

    async def call_utility_each_async(self, method: str, *args) -> dict[int, Any]:
        live = self._live()
        values = await asyncio.gather(*(c.call_utility_async(method, *args) for c in live.values()))
        return dict(zip(live, values))

    async def call_utility_async(self, method: str, *args) -> Any:
        return combine(method, await self.call_utility_each_async(method, *args))

    def shutdown(self) -> None:
        for client in self.clients.values():
            client.stop_tasks()  # on the loop's thread; the engines then stop in parallel
        _shutdown_all(self.clients, self.remote)


def _shutdown_all(clients: dict[int, Any], remote) -> None:
    """Every engine stops at once (each waits for its core to exit)."""
    if clients:
        try:
            with ThreadPoolExecutor(len(clients)) as pool:
                list(pool.map(lambda c: c.shutdown(), clients.values()))
        except RuntimeError:  # at interpreter exit no new thread starts: one by one
            for client in clients.values():
                client.shutdown()
        clients.clear()
    if remote is not None:
        remote.close()


def _internal_lb(config: EngineConfig) -> bool:
    dp = config.data_parallel
    return dp.size > 1 and dp.rank is None


def make_sync_client(config: EngineConfig):
    """The multiprocess client for `config`: over every engine with data parallel (one
    rank alone with external load balancing), else over the one engine."""
    return DPSyncClient(config) if _internal_lb(config) else SyncMPClient(config)


def make_async_client(config: EngineConfig):
    return DPAsyncClient(config) if _internal_lb(config) else AsyncMPClient(config)
