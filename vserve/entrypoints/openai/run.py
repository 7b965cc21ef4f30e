"""`run_server(args)`: starts the engine, then serves its app until stopped; returns the exit
status. Light on purpose: the web stack (FastAPI, pydantic, uvicorn and the routes, about
0.7 s of imports) is imported on a thread while the engine core and its workers start in their
own processes, so a server is ready as soon as its engine is."""

from __future__ import annotations

import argparse
import logging
from concurrent.futures import ThreadPoolExecutor

logger = logging.getLogger("vserve.server")


def _web_stack():
    from vserve.entrypoints.openai import launcher, server

    return server, launcher


def run_server(args: argparse.Namespace) -> int:
    """Start the engine and serve; returns the process exit status."""
    from vserve.engine.async_llm import AsyncLLM
    from vserve.entrypoints.cli_args import engine_args_from
    from vserve.host import heap

    with ThreadPoolExecutor(1, thread_name_prefix="vserve-web-import") as pool:
        web = pool.submit(_web_stack)
        try:
            engine = AsyncLLM.from_engine_args(engine_args_from(args))
        except Exception as e:  # noqa: BLE001 -- a start-up failure is reported, not a traceback
            logger.error("the engine failed to start: %s", e)
            return 1
        try:
            server, launcher = web.result()
            heap.startup_over()  # the start-up objects, web stack included, leave the GC's walks
            app = server.build_app(engine, args)
            return launcher.serve(app, args)
        finally:
            engine.shutdown()
