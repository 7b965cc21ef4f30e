"""The OpenAI-compatible HTTP server: `build_app(engine, args)` makes the FastAPI app over a
running `AsyncLLM`; the server runs it until SIGTERM (drain, exit 0) or engine death (exit 1)
(`run.py`).

Routes: `/v1/completions`, `/v1/chat/completions`, `/v1/models`, `/health`, `/ping`,
`/metrics`, `/tokenize`, `/detokenize`, `/version`. Every error is an OpenAI-style body
`{"error": {"message", "type", "param", "code"}}`; invalid input is 400, never FastAPI's 422.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

import vserve
from vserve.engine.async_llm import AsyncLLM
from vserve.engine.mp_client import EngineDeadError
from vserve.entrypoints.chat import load_chat_template
from vserve.entrypoints.openai.embeddings_protocol import EmbeddingRequest, EmbeddingResponse
from vserve.entrypoints.openai.errors import (
    APIError,
    Req,
    error_response,
    error_status,
    parse_body,
)
from vserve.entrypoints.openai.launcher import watchdog
from vserve.entrypoints.openai.limits import AdmissionLimits
from vserve.entrypoints.openai.metrics import ServerMetrics
from vserve.entrypoints.openai.middleware import LOOPBACK_NAMES, FrontDoor, host_policy
from vserve.entrypoints.openai.openapi import body_doc, document_bodies
from vserve.entrypoints.openai.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from vserve.entrypoints.openai.responses_protocol import ResponsesRequest
from vserve.entrypoints.openai.serving_base import ServerContext
from vserve.entrypoints.openai.serving_chat import ChatServer
from vserve.entrypoints.openai.serving_completion import CompletionServer
from vserve.entrypoints.openai.serving_embedding import EmbeddingServer
from vserve.entrypoints.openai.serving_responses import ResponsesServer
from vserve.entrypoints.openai.tool_calls import template_tools
from vserve.entrypoints.openai.tool_settings import ToolSettings
from vserve.envs import ENV
from vserve.startup import log_memory, log_ready

logger = logging.getLogger("vserve.server")


def build_app(engine: AsyncLLM, args: argparse.Namespace) -> FastAPI:
    names, aliases = _model_names(engine, getattr(args, "served_model_name", None))
    ctx = ServerContext(
        engine,
        names,
        load_chat_template(getattr(args, "chat_template", None)),
        aliases,
        AdmissionLimits.from_args(args),
        ToolSettings.from_args(args, engine.tokenizer),
        getattr(args, "reasoning_parser", None),
        getattr(args, "structured_outputs_in_reasoning", False),
    )
    metrics = ServerMetrics(ctx.model_name, _engine_ranks(engine))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        # binds the engine to this loop now, so its death is seen before any request
        await engine.call_utility("ping")
        metrics.attach(engine)
        log_ready("frontend")
        log_memory(await engine.process_memory())
        task = asyncio.create_task(
            watchdog(ctx, metrics, not getattr(args, "disable_log_stats", True))
        )
        yield
        task.cancel()
        ctx.tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="vserve", version=vserve.__version__, lifespan=lifespan)
    app.state.ctx, app.state.metrics = ctx, metrics
    keys = getattr(args, "api_key", None) or ([ENV.api_key] if ENV.api_key else [])
    hosts = host_policy(getattr(args, "host", "127.0.0.1"), getattr(args, "allowed_hosts", None))
    if hosts.names is not None and hosts.names != frozenset(LOOPBACK_NAMES):
        logger.info(
            "serving Host names %s and IP addresses; add others (a service or ingress name) "
            "with --allowed-hosts, or '*' for any",
            ", ".join(sorted(hosts.names)),
        )
    app.add_middleware(
        FrontDoor, ctx=ctx, api_keys=[keys] if isinstance(keys, str) else keys, hosts=hosts
    )
    _add_error_handlers(app, ctx)
    _add_openai_routes(app, ctx, metrics)
    _add_service_routes(app, ctx, metrics)
    document_bodies(
        app,
        [
            CompletionRequest,
            ChatCompletionRequest,
            ResponsesRequest,
            EmbeddingRequest,
            TokenizeRequest,
            DetokenizeRequest,
        ],
        [
            CompletionResponse,
            CompletionChunk,
            ChatCompletionResponse,
            ChatCompletionChunk,
            EmbeddingResponse,
            TokenizeResponse,
            DetokenizeResponse,
        ],
    )
    return app


def _engine_ranks(engine: AsyncLLM) -> tuple[int, ...]:
    dp = getattr(engine.config, "data_parallel", None)
    if dp is None:
        return (0,)
    return (dp.rank,) if dp.rank is not None else tuple(range(dp.size))


def _model_names(engine: AsyncLLM, given: str | list[str] | None) -> tuple[list[str], list[str]]:
    """The names the API lists, and names it also accepts: a model served by its path (no
    --served-model-name) is listed by its folder name, so that the server's filesystem stays
    private, and still accepted by the path."""
    if given:
        return (list(given) if isinstance(given, list) else [given]), []
    name = engine.config.model.served_model_name
    if "/" in name or "\\" in name:
        return [Path(name).name or name], [name]
    return [name], []


def _add_error_handlers(app: FastAPI, ctx: ServerContext) -> None:
    def fail(exc: BaseException) -> JSONResponse:
        status, message = error_status(exc)
        if ctx.engine.errored:  # a dead engine: answer, then stop the server (exit 1)
            ctx.request_exit(1)
        elif status == 500:
            logger.exception("request failed", exc_info=exc)
        return error_response(
            status, message, getattr(exc, "param", None), getattr(exc, "headers", None)
        )

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return fail(exc)

    @app.exception_handler(EngineDeadError)
    async def _dead(_: Request, exc: EngineDeadError):
        return fail(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError):
        return error_response(400, str(exc.errors()[:3]))

    @app.exception_handler(ClientDisconnect)
    async def _gone(_: Request, exc: ClientDisconnect):
        return Response(status_code=499)  # nobody reads it; not worth a traceback

    @app.exception_handler(HTTPException)
    async def _http(_: Request, exc: HTTPException):
        return error_response(exc.status_code, str(exc.detail), headers=exc.headers)

    @app.exception_handler(Exception)
    async def _any(_: Request, exc: Exception):
        return fail(exc)


def _add_openai_routes(app: FastAPI, ctx: ServerContext, metrics: ServerMetrics) -> None:
    completions = CompletionServer(ctx)
    chat = ChatServer(ctx)
    responses = ResponsesServer(chat)
    embeddings = EmbeddingServer(ctx)

    async def parse(raw: Request, model: type[Req]) -> Req:
        return await parse_body(raw, model, metrics.ignored_fields.inc)

    @app.post(
        "/v1/completions",
        openapi_extra=body_doc(CompletionRequest, CompletionResponse, CompletionChunk),
    )
    async def create_completion(raw: Request):
        return await completions.create(await parse(raw, CompletionRequest), raw)

    @app.post(
        "/v1/chat/completions",
        openapi_extra=body_doc(ChatCompletionRequest, ChatCompletionResponse, ChatCompletionChunk),
    )
    async def create_chat_completion(raw: Request):
        return await chat.create(await parse(raw, ChatCompletionRequest), raw)

    @app.post("/v1/embeddings", openapi_extra=body_doc(EmbeddingRequest, EmbeddingResponse))
    async def create_embedding(raw: Request):
        return await embeddings.create(await parse(raw, EmbeddingRequest), raw)

    @app.post("/v1/responses", openapi_extra=body_doc(ResponsesRequest))
    async def create_response(raw: Request):
        return await responses.create(await parse(raw, ResponsesRequest), raw)

    @app.get("/v1/models", response_model=ModelList)
    async def list_models():
        cfg = ctx.engine.config.model
        # root names the model, never its path on the server's disk
        cards = [
            ModelCard(id=name, root=ctx.model_name, max_model_len=cfg.max_model_len)
            for name in ctx.served_model_names
        ]
        return JSONResponse(ModelList(data=cards).model_dump())

    @app.post("/tokenize", openapi_extra=body_doc(TokenizeRequest, TokenizeResponse))
    async def tokenize(raw: Request):
        req = await parse(raw, TokenizeRequest)
        ctx.check_model(req.model)
        tok = ctx.engine.tokenizer
        if req.messages is not None:
            ids = await chat.render(
                req.messages,
                req.add_generation_prompt,
                req.continue_final_message,
                tools=template_tools(req.tools),
            )
        else:
            ctx.limits.check_prompt_chars(len(req.prompt), ctx.max_model_len, "prompt")
            ids = await ctx.off_loop(
                tok.encode, req.prompt, add_special_tokens=req.add_special_tokens
            )
        body = TokenizeResponse(count=len(ids), max_model_len=ctx.max_model_len, tokens=ids)
        if req.return_token_strs:
            body.token_strs = await ctx.off_loop(tok.convert_ids_to_tokens, ids)
        return JSONResponse(body.model_dump(exclude_none=True))

    @app.post("/detokenize", openapi_extra=body_doc(DetokenizeRequest, DetokenizeResponse))
    async def detokenize(raw: Request):
        req = await parse(raw, DetokenizeRequest)
        ctx.check_model(req.model)
        limit = ctx.limits.prompt_chars(ctx.max_model_len)
        if len(req.tokens) > limit:
            raise APIError(
                400,
                f"tokens has {len(req.tokens)} entries; the limit is {limit} (--max-prompt-chars).",
                "tokens",
            )
        vocab = ctx.engine.config.model.vocab_size
        bad = [t for t in req.tokens if t >= vocab]
        if bad:
            raise APIError(
                400, f"Token id {bad[0]} is out of vocabulary (vocab size {vocab})", "tokens"
            )
        text = await ctx.off_loop(ctx.engine.tokenizer.decode, req.tokens)
        return JSONResponse(DetokenizeResponse(prompt=text).model_dump())


def _add_service_routes(app: FastAPI, ctx: ServerContext, metrics: ServerMetrics) -> None:
    @app.get("/health")
    async def health():
        if ctx.draining or ctx.engine.errored:
            if ctx.engine.errored:
                ctx.request_exit(1)
            return Response(status_code=503)
        return Response(status_code=200)

    for method in ("GET", "POST"):  # one operation id each: generated clients need them unique
        app.add_api_route("/ping", health, methods=[method], operation_id=f"ping_{method.lower()}")

    @app.get("/metrics")
    async def scrape():
        await metrics.refresh(ctx.engine)
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version():
        return JSONResponse({"version": vserve.__version__})
