"""Admission limits of the HTTP server: what one request may ask for, checked before any
tokenization or engine work, so that no single request can stall or swamp the server.

| limit                            | flag                         | default        | client sees |
|----------------------------------|------------------------------|----------------|-------------|
| sequences waiting (beyond        | `--max-num-queued-reqs`      | 1024           | 503 +       |
|   max_num_seqs)                  |                              |                | Retry-After |
| prompts x n in one request       | `--max-num-seqs-per-request` | 256            | 400         |
| request body                     | `--max-request-body-bytes`   | 32 MiB         | 413         |
| characters of a prompt or a chat | `--max-prompt-chars`         | 16 x max_m._l. | 400         |
| stop strings; stop token ids     | `--max-stop-sequences`       | 64 each        | 400         |
| characters of one stop string    | `--max-stop-chars`           | 1024           | 400         |
| `logit_bias` entries             | `--max-logit-bias`           | 1024           | 400         |
| time from admission to the end   | `--request-timeout`          | off            | "abort"     |

The body limit is enforced by the middleware (`FrontDoor`); the others by the handlers.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from vserve.entrypoints.openai.errors import APIError

PROMPT_CHARS_PER_TOKEN = 16  # default character budget per token of max_model_len


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

    def __post_init__(self) -> None:
        for name in ("max_num_queued_reqs", "max_stop_sequences", "max_logit_bias"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("max_num_seqs_per_request", "max_request_body_bytes", "max_stop_chars"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_prompt_chars is not None and self.max_prompt_chars < 1:
            raise ValueError(f"max_prompt_chars must be >= 1, got {self.max_prompt_chars}")
        if self.request_timeout is not None and not self.request_timeout > 0:
            raise ValueError(f"request_timeout must be > 0, got {self.request_timeout}")

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
        "--request-timeout",
        type=float,
        default=None,
        help="seconds a request may run after admission; then it is aborted in "
        "the engine and ends with finish_reason 'abort' (default: off)",
    )
