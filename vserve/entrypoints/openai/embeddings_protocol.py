"""`/v1/embeddings`: OpenAI's request and response shapes (vLLM's `add_special_tokens` too)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from vserve.entrypoints.openai.protocol import OpenAIBaseModel, TokenId


class EmbeddingRequest(OpenAIBaseModel):
    model: str | None = None
    # a text, a list of texts, a list of token ids or a list of such lists (OpenAI's input)
    input: str | list[TokenId] | list[str] | list[list[TokenId]]
    encoding_format: Literal["float", "base64"] = "float"  # base64: float32, little-endian
    dimensions: int | None = Field(default=None, ge=1)  # the model's own size only
    user: str | None = None
    add_special_tokens: bool = True


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage
