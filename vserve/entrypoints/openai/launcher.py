"""Runs the app under uvicorn with vserve's lifecycle rules.

| event              | what happens                                                 | exit   |
|--------------------|--------------------------------------------------------------|--------|
| SIGTERM / SIGINT   | new requests and `/health` get 503; in-flight requests run   | 0      |
|                    | up to `--shutdown-timeout` s, the rest end with              |        |
|                    | finish_reason "abort"; then uvicorn stops                    |        |
| a second signal    | uvicorn's immediate stop                                     | signal |
| engine core dies   | in-flight requests get 500 or an error event, `/health` 503; | 1      |
| or hangs           | the watchdog stops the server (a hang: `--watchdog-timeout`  |        |
|                    | s with a step in flight or the engine core silent)           |        |
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time

import uvicorn

from vserve.entrypoints.openai.metrics import ServerMetrics, StatsLogger
from vserve.entrypoints.openai.serving_base import ServerContext

logger = logging.getLogger("vserve.server")

WATCHDOG_INTERVAL_S = 0.5
STATS_LOG_INTERVAL_S = 5.0


class _Server(uvicorn.Server):
    def __init__(
        self, config: uvicorn.Config, ctx: ServerContext, shutdown_timeout: float, url: str
    ) -> None:
        super().__init__(config)
        self.ctx = ctx
        self.shutdown_timeout = shutdown_timeout
        self.url = url
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task | None = None

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)
        if self.started:
            logger.info(
                "vserve ready: serving %s at %s (OpenAI API under %s/v1)",
                self.ctx.model_name,
                self.url,
                self.url,
            )

    def handle_exit(self, sig, frame) -> None:
        # runs as a signal handler: only flags and a thread-safe call into the loop
        if self.ctx.draining or self._loop is None:
            super().handle_exit(sig, frame)
            return
        self.ctx.draining = True
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain = asyncio.ensure_future(drain(self.ctx, self.shutdown_timeout))


async def drain(ctx: ServerContext, timeout: float) -> None:
    """Let in-flight requests finish (up to `timeout`), abort the rest, then stop."""
    loop = asyncio.get_running_loop()
    logger.info(
        "shutting down: %d request(s) in flight, waiting up to %.1f s", len(ctx.active), timeout
    )
    deadline = loop.time() + timeout
    while ctx.active and loop.time() < deadline:
        await asyncio.sleep(0.05)
    if ctx.active:
        logger.warning("aborting %d request(s) still running", len(ctx.active))
        for request_id in list(ctx.active):
            await ctx.engine.abort(request_id)
        deadline = loop.time() + 2.0  # the handlers send their last (aborted) outputs
        while ctx.active and loop.time() < deadline:
            await asyncio.sleep(0.05)
    ctx.request_exit(0)


async def watchdog(ctx: ServerContext, metrics: ServerMetrics, log_stats: bool) -> None:
    """Stops the server once the engine is dead (errors inside a stream never reach the
    exception handlers), and writes the periodic stats line when enabled."""
    stats_logger = StatsLogger(metrics) if log_stats else None
    last_log = time.monotonic()
    while True:
        await asyncio.sleep(WATCHDOG_INTERVAL_S)
        if ctx.engine.errored:
            logger.error("the engine is dead (%s); stopping the server", ctx.engine.dead_error)
            ctx.request_exit(1)
            return
        if stats_logger and time.monotonic() - last_log >= STATS_LOG_INTERVAL_S:
            last_log = time.monotonic()
            logger.info(stats_logger.line())


def serve(app, args: argparse.Namespace) -> int:
    """Serve until stopped; returns the exit status (0 after a drain, 1 if the engine died
    or the server never started)."""
    ctx: ServerContext = app.state.ctx
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=str(args.log_level).lower(),
        timeout_graceful_shutdown=5,
        limit_concurrency=ctx.limits.max_connections,
    )
    url = f"http://{args.host}:{args.port}"
    server = _Server(config, ctx, float(args.shutdown_timeout), url)

    def request_exit(code: int) -> None:
        ctx.exit_code = max(ctx.exit_code, code)
        server.should_exit = True

    ctx.request_exit = request_exit
    server.run()
    if not server.started:
        return max(ctx.exit_code, 1)
    return ctx.exit_code
