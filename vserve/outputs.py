"""What `LLM.generate` and the front ends return, named as vLLM names them, and how often a
request's consumer wants them (`OutputKind`)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class OutputKind(enum.Enum):
    CUMULATIVE = 0  # every output carries everything so far
    DELTA = 1  # every output carries only what is new (streaming)
    FINAL_ONLY = 2  # one output, when the request finished


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # with finish_reason "error": what went wrong
    # with finish_reason "error": "invalid" (the request's input cannot be served as asked),
    # "busy" (a retry may succeed), "dead" (its engine died), None (the engine failed)
    error_kind: str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    # per prompt token: None for the first, then {token id: Logprob} with the prompt token's
    # own entry and the top `prompt_logprobs` (None unless SamplingParams.prompt_logprobs)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # SamplingParams.pooling: the prompt's pooled last hidden state (not normalized)
    embedding: list[float] | None = None


@dataclass
class EmbeddingOutput:
    embedding: list[float]  # normalized when the model's pooling says so


@dataclass
class EmbeddingRequestOutput:
    """`LLM.embed`'s result for one prompt (vLLM's shape)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
