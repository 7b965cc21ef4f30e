"""Admission limits of the HTTP server: what one request may ask for, checked before any
tokenization or engine work, so that no single request can stall or swamp the server.

| limit                              | flag                         | default        | client    |
|------------------------------------|------------------------------|----------------|-----------|
| sequences waiting (beyond          | `--max-num-queued-reqs`      | 1024           | 503 +     |
|   max_num_seqs)                    |                              |                | Retry-Aft.|
| prompts x n in one request         | `--max-num-seqs-per-request` | 256            | 400       |
| request body                       | `--max-request-body-bytes`   | 32 MiB         | 413       |
| JSON objects, arrays and keys in a | (fixed)                      | 131072         | 400       |
|   body (counted before parsing)    |                              |                |           |
| time to receive a body             | `--request-body-timeout`     | 60 s           | 408       |
| bodies being received or parsed,   | `--max-pending-body-bytes`   | 128 MiB        | 503 +     |
|   all requests together            |                              |                | Retry-Aft.|
| open connections                   | `--max-connections`          | 2048           | 503       |
| characters of a prompt or a chat   | `--max-prompt-chars`         | 16 x max_m._l. | 400       |
| characters of a request (every     | `--max-request-chars`        | 8 x the above  | 400       |
|   prompt, message, tool, template  |                              |                |           |
|   variable and tool call)          |                              |                |           |
| tokens of a request's prompts      | `--max-request-tokens`       | 32 x max_m._l. | 400       |
| logprob entries of a response      | `--max-response-logprobs`    | 1048576        | 400       |
|   (choices x positions x (k + 1))  |                              |                |           |
| stop strings; stop token ids       | `--max-stop-sequences`       | 64 each        | 400       |
| characters of one stop string      | `--max-stop-chars`           | 1024           | 400       |
| `logit_bias` entries               | `--max-logit-bias`           | 1024           | 400       |
| time from admission to the end     | `--request-timeout`          | off            | "abort"   |

The body limits are enforced by the middleware (`FrontDoor`) and the body parser (`errors.py`);
the connection limit by uvicorn; the others by the handlers. The engine's own limits on
structured-output constraints (`--max-constraint-chars`, the grammar compile budget) are
engine arguments (`vserve.config.StructuredOutputConfig`).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from vserve.entrypoints.openai.api_error import APIError

PROMPT_CHARS_PER_TOKEN = 16  # default character budget per token of max_model_len
REQUEST_PROMPTS = 8  # default character budget of a request, in prompts of the largest size
REQUEST_CONTEXTS = 32  # default token budget of a request's prompts, in max_model_len


@dataclass(frozen=True)
class AdmissionLimits:
    max_num_queued_reqs: int = 1024
    max_num_seqs_per_request: int = 256
    max_request_body_bytes: int = 32 << 20
    max_prompt_chars: int | None = None  # None: PROMPT_CHARS_PER_TOKEN x max_model_len
    max_stop_sequences: int = 64
    max_stop_chars: int = 1024
    max_logit_bias: int = 1024
    request_timeout: float | None = None  # seconds; None: no deadline
    max_request_chars: int | None = None  # None: REQUEST_PROMPTS x the prompt characters
    max_request_tokens: int | None = None  # None: REQUEST_CONTEXTS x max_model_len
    max_response_logprobs: int = 1 << 20
    max_pending_body_bytes: int = 128 << 20
    request_body_timeout: float = 60.0
    max_connections: int = 2048

    def __post_init__(self) -> None:
        for name in ("max_num_queued_reqs", "max_stop_sequences", "max_logit_bias"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in (
            "max_num_seqs_per_request",
            "max_request_body_bytes",
            "max_stop_chars",
            "max_response_logprobs",
            "max_pending_body_bytes",
            "max_connections",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_prompt_chars", "max_request_chars", "max_request_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        for name in ("request_timeout", "request_body_timeout"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> AdmissionLimits:
        given = {
            name: getattr(args, name)
            for name in cls.__dataclass_fields__
            if getattr(args, name, None) is not None
        }
        if given.get("request_timeout") == 0:
            given.pop("request_timeout")  # 0 = off
        return cls(**given)

    def prompt_chars(self, max_model_len: int) -> int:
        if self.max_prompt_chars is not None:
            return self.max_prompt_chars
        return PROMPT_CHARS_PER_TOKEN * max_model_len

    def request_chars(self, max_model_len: int) -> int:
        if self.max_request_chars is not None:
            return self.max_request_chars
        return REQUEST_PROMPTS * self.prompt_chars(max_model_len)

    def request_tokens(self, max_model_len: int) -> int:
        if self.max_request_tokens is not None:
            return self.max_request_tokens
        return REQUEST_CONTEXTS * max_model_len

    # -- checks (each raises a 400 APIError naming the field) --------------------------------
    def check_fan_out(self, num_prompts: int, n: int) -> None:
        if num_prompts * n > self.max_num_seqs_per_request:
            raise APIError(
                400,
                f"This request asks for {num_prompts} prompt(s) x n={n} = "
                f"{num_prompts * n} sequences; the limit is "
                f"{self.max_num_seqs_per_request} (--max-num-seqs-per-request).",
                "prompt" if num_prompts > 1 else "n",
            )

    def check_prompt_chars(self, num_chars: int, max_model_len: int, param: str) -> None:
        limit = self.prompt_chars(max_model_len)
        if num_chars > limit:
            raise APIError(
                400,
                f"The {param} has {num_chars} characters; the limit is {limit} "
                f"(--max-prompt-chars). This model's maximum context length is "
                f"{max_model_len} tokens.",
                param,
            )

    def check_request_chars(self, num_chars: int, max_model_len: int, param: str) -> None:
        """Characters of a whole request (all its prompts), before any is tokenized."""
        limit = self.request_chars(max_model_len)
        if num_chars > limit:
            raise APIError(
                400,
                f"This request has {num_chars} characters of input in all; the limit is "
                f"{limit} (--max-request-chars).",
                param,
            )

    def check_request_tokens(self, num_tokens: int, max_model_len: int) -> None:
        limit = self.request_tokens(max_model_len)
        if num_tokens > limit:
            raise APIError(
                400,
                f"This request's prompts have {num_tokens} tokens in all; the limit is "
                f"{limit} (--max-request-tokens).",
                "prompt",
            )

    def check_response_logprobs(self, num_entries: int, param: str) -> None:
        if num_entries > self.max_response_logprobs:
            raise APIError(
                400,
                f"This request asks for {num_entries} logprob entries in its response "
                f"(choices x positions x (top-k + 1)); the limit is "
                f"{self.max_response_logprobs} (--max-response-logprobs).",
                param,
            )

    def check_stops(self, stop: str | list[str] | None, stop_token_ids: list[int] | None) -> None:
        stops = [stop] if isinstance(stop, str) else stop or []
        for name, values in (("stop", stops), ("stop_token_ids", stop_token_ids or [])):
            if len(values) > self.max_stop_sequences:
                raise APIError(
                    400,
                    f"{name} has {len(values)} entries; the limit is "
                    f"{self.max_stop_sequences} (--max-stop-sequences).",
                    name,
                )
        for s in stops:
            if isinstance(s, str) and len(s) > self.max_stop_chars:
                raise APIError(
                    400,
                    f"stop strings may have at most {self.max_stop_chars} "
                    f"characters (--max-stop-chars), got one of {len(s)}.",
                    "stop",
                )

    def check_logit_bias(self, bias: dict | None) -> None:
        if bias and len(bias) > self.max_logit_bias:
            raise APIError(
                400,
                f"logit_bias has {len(bias)} entries; the limit is "
                f"{self.max_logit_bias} (--max-logit-bias).",
                "logit_bias",
            )


def add_limit_args(parser: argparse.ArgumentParser) -> None:
    """The `vserve serve` flags of AdmissionLimits (defaults shown by --help)."""
    d = AdmissionLimits()
    g = parser.add_argument_group("admission limits (see README, 'Admission limits')")
    g.add_argument(
        "--max-num-queued-reqs",
        type=int,
        default=d.max_num_queued_reqs,
        help="sequences that may wait beyond --max-num-seqs; more get 503 + "
        "Retry-After (default %(default)s)",
    )
    g.add_argument(
        "--max-num-seqs-per-request",
        type=int,
        default=d.max_num_seqs_per_request,
        help="prompts x n in one request; more is 400 (default %(default)s)",
    )
    g.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=d.max_request_body_bytes,
        help="largest request body; larger is 413 (default %(default)s = 32 MiB)",
    )
    g.add_argument(
        "--max-prompt-chars",
        type=int,
        default=None,
        help="characters of one prompt (a conversation: all its messages), "
        "checked before tokenization; more is 400 (default "
        f"{PROMPT_CHARS_PER_TOKEN} x max_model_len)",
    )
    g.add_argument(
        "--max-stop-sequences",
        type=int,
        default=d.max_stop_sequences,
        help="entries of stop and of stop_token_ids (default %(default)s)",
    )
    g.add_argument(
        "--max-stop-chars",
        type=int,
        default=d.max_stop_chars,
        help="characters of one stop string (default %(default)s)",
    )
    g.add_argument(
        "--max-logit-bias",
        type=int,
        default=d.max_logit_bias,
        help="entries of logit_bias (default %(default)s)",
    )
    g.add_argument(
        "--max-request-chars",
        type=int,
        default=None,
        help="characters of one request in all: every prompt, message, tool definition, "
        "tool call and chat template variable, checked before tokenization; more is 400 "
        f"(default {REQUEST_PROMPTS} x --max-prompt-chars)",
    )
    g.add_argument(
        "--max-request-tokens",
        type=int,
        default=None,
        help="tokens of one request's prompts in all; more is 400 (default "
        f"{REQUEST_CONTEXTS} x max_model_len)",
    )
    g.add_argument(
        "--max-response-logprobs",
        type=int,
        default=d.max_response_logprobs,
        help="logprob entries one response may carry (choices x positions x (top-k + 1), "
        "prompt logprobs and echo included); more is 400 (default %(default)s)",
    )
    g.add_argument(
        "--max-pending-body-bytes",
        type=int,
        default=d.max_pending_body_bytes,
        help="bytes of request bodies being received or parsed, all requests together; a "
        "request beyond gets 503 + Retry-After (default %(default)s = 128 MiB)",
    )
    g.add_argument(
        "--request-body-timeout",
        type=float,
        default=d.request_body_timeout,
        help="seconds a client may take to send a request body; slower gets 408 and the "
        "connection closes (default %(default)s)",
    )
    g.add_argument(
        "--max-connections",
        type=int,
        default=d.max_connections,
        help="open connections (uvicorn's limit_concurrency); more get 503 (default %(default)s)",
    )
    g.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        help="seconds a request may run after admission; then it is aborted in "
        "the engine and ends with finish_reason 'abort' (default: off)",
    )
