"""`POST /v1/embeddings`: each input's pooled, normalized last hidden state (how the model
pools: `entrypoints/embedding.py`), computed by the engine that also generates, so
embeddings and completions batch together under the same limits: the inputs count against
--max-num-seqs-per-request, their texts and ids against the prompt and request budgets, and
the response (up to inputs x hidden size numbers) is built off the event loop."""

from __future__ import annotations

import asyncio
import base64

from fastapi import Request
from fastapi.responses import Response

from vserve.entrypoints.embedding import (
    PoolingConfig,
    embedding_params,
    finish,
    pooling_config,
)
from vserve.entrypoints.openai.embeddings_protocol import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
)
from vserve.entrypoints.openai.errors import APIError
from vserve.entrypoints.openai.request_prep import (
    base_request_id,
    check_params,
    check_prompt_sizes,
    data_parallel_rank,
    prompt_list,
    raise_if_error,
    tokenize_all,
)
from vserve.entrypoints.openai.serving_base import (
    ServerContext,
    iterate,
    release,
    submit,
    until_disconnect,
)


class EmbeddingServer:
    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx
        self._pooling: PoolingConfig | None = None  # read from the model folder when first asked

    @property
    def pooling(self) -> PoolingConfig:
        if self._pooling is None:
            try:
                self._pooling = pooling_config(self.ctx.engine.config.model.model)
            except ValueError as e:
                raise APIError(400, f"this model serves no embeddings: {e}") from e
        return self._pooling

    @property
    def size(self) -> int:
        return self.ctx.engine.config.model.hidden_size

    async def create(self, req: EmbeddingRequest, raw: Request) -> Response:
        ctx = self.ctx
        ctx.check_model(req.model)
        given = prompt_list(req.input)
        ctx.limits.check_fan_out(len(given), 1)
        check_prompt_sizes(ctx, given)
        if req.dimensions is not None and req.dimensions != self.size:
            raise APIError(
                400,
                f"dimensions: this model's embeddings have {self.size} numbers "
                f"(it is not trained to be truncated); got {req.dimensions}",
                "dimensions",
            )
        prompts = await ctx.off_loop(tokenize_all, ctx, given, req.add_special_tokens, 1)
        params = embedding_params(self.pooling)
        for _, ids in prompts:
            check_params(ctx, params, len(ids))
        states = await submit(
            ctx, prompts, [params] * len(prompts), base_request_id(raw), data_parallel_rank(raw)
        )
        try:
            vectors = await until_disconnect(raw, self._collect(states))
        finally:
            release(ctx, states)
        num_prompt = sum(len(ids) for _, ids in prompts)
        body = await asyncio.to_thread(self._body, req, vectors, num_prompt)
        return Response(body, media_type="application/json")

    async def _collect(self, states) -> list[list[float]]:
        vectors: list[list[float] | None] = [None] * len(states)
        async for index, out in iterate(self.ctx, states):
            for c in out.outputs:
                raise_if_error(c)
            if out.embedding is not None:
                vectors[index] = out.embedding
        missing = [i for i, v in enumerate(vectors) if v is None]
        if missing:
            raise APIError(500, f"the engine returned no embedding for input {missing[0]}")
        return [v for v in vectors if v is not None]  # (every one, checked above)

    def _body(self, req: EmbeddingRequest, vectors: list[list[float]], num_prompt: int) -> str:
        data = []
        for i, vector in enumerate(vectors):
            values = finish(vector, self.pooling.normalize)
            if req.encoding_format == "base64":
                raw = values.astype("<f4").tobytes()
                data.append(EmbeddingData(index=i, embedding=base64.b64encode(raw).decode()))
            else:
                data.append(EmbeddingData(index=i, embedding=values.tolist()))
        usage = EmbeddingUsage(prompt_tokens=num_prompt, total_tokens=num_prompt)
        response = EmbeddingResponse(data=data, model=self.ctx.model_name, usage=usage)
        return response.model_dump_json()
