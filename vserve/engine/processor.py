"""Front-end input processing: tokenize, validate, and fan `n > 1` out into engine requests.

Every check happens here, before anything reaches the engine core; a bad request raises a
`ValueError` that says what to change, and the engine never sees it.
"""

from __future__ import annotations

import itertools
import random
import time
import weakref

import msgspec

from vserve.config import EngineConfig
from vserve.core.seeds import splitmix64
from vserve.engine.grammars import check_grammar, grammar_source
from vserve.engine.messages import EngineCoreRequest
from vserve.sampling_params import SamplingParams, StructuredOutputsParams

_CONSTRAINT_NAMES = {"json": "JSON schema", "regex": "regex", "ebnf": "grammar"}

Prompt = str | dict | list


class InputProcessor:
    def __init__(self, config: EngineConfig, tokenizer) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = config.model.vocab_size
        self.max_model_len = config.model.max_model_len
        self._rng = random.Random(config.model.seed)
        self._incarnations = itertools.count(1)
        # constraints checked, by identity (a Struct is not hashable), while they live
        self._checked: dict[int, weakref.ref] = {}

    def tokenize_prompt(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            check_text(prompt, "prompt")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._check_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self.tokenize_prompt(prompt["prompt"])
            raise ValueError("a dict prompt needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return None, self._check_ids(prompt)
        raise ValueError(
            f"unsupported prompt type {type(prompt).__name__}; pass a str, "
            "a list of token ids or {'prompt_token_ids': [...]}"
        )

    def _check_ids(self, ids) -> list[int]:
        """Every id an int in the vocabulary; the common case in C-speed passes (a batch
        of long prompts is millions of ids), the offender found only when there is one."""
        if not isinstance(ids, list) or not ids:
            raise ValueError("prompt_token_ids must be a non-empty list of ints")
        if set(map(type, ids)) != {int} or min(ids) < 0 or max(ids) >= self.vocab_size:
            bad = next(
                t
                for t in ids
                if type(t) is not int or not 0 <= t < self.vocab_size  # noqa: E721 -- not bool
            )
            raise ValueError(
                f"Token id {bad!r} is out of vocabulary (vocab size {self.vocab_size})"
            )
        return list(ids)

    def check_params(self, params: SamplingParams, num_prompt_tokens: int) -> None:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be SamplingParams, got {type(params)}")
        if num_prompt_tokens >= self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your prompt contains {num_prompt_tokens} input tokens, which leaves no room "
                "for output; shorten the prompt or raise max_model_len."
            )
        max_lp = self.config.model.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > max_lp:
                raise ValueError(f"{name} must be at most {max_lp} (max_logprobs), got {value}")
        for t in list(params.logit_bias or {}) + list(params.stop_token_ids or []):
            if not 0 <= t < self.vocab_size:
                raise ValueError(
                    f"Token id {t} in logit_bias / stop_token_ids is out of "
                    f"vocabulary (vocab size {self.vocab_size})"
                )
        _check_wire(params)
        if params.structured_outputs is not None:
            self.check_constraint(params.structured_outputs)

    def check_constraint(self, constraint: StructuredOutputsParams) -> None:
        """Its size against `max_constraint_chars`, then that it parses; each constraint
        object is checked once, however many prompts and children carry it."""
        if self._checked.get(id(constraint), _dead)() is constraint:
            return
        limit = self.config.structured.max_constraint_chars
        kind, source = grammar_source(constraint)
        if len(source) > limit:
            raise ValueError(
                f"structured outputs: the {_CONSTRAINT_NAMES.get(kind, kind)} has "
                f"{len(source)} characters; the limit is {limit} (--max-constraint-chars)"
            )
        _check_wire(constraint, StructuredOutputsParams)
        check_grammar(constraint)
        key = id(constraint)
        self._checked[key] = weakref.ref(constraint, lambda _: self._checked.pop(key, None))

    def _engine_params(self, params: SamplingParams) -> SamplingParams:
        """What one engine request carries: n=1 (children), and top_k at or above the
        vocabulary means "off" (0), as in vLLM."""
        changes = {}
        if params.n > 1:
            changes["n"] = 1
        if params.top_k >= self.vocab_size:
            changes["top_k"] = 0
        return params.clone(**changes) if changes else params

    def make_requests(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> list[EngineCoreRequest]:
        """One engine request per choice; children of `n > 1` share the prompt's KV blocks."""
        self.check_params(params, len(prompt_ids))
        arrival = arrival_time or time.time()
        base_seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        eos = list(self.config.model.eos_token_ids)
        child_params = self._engine_params(params)
        salt = None
        if params.n > 1 and not self.config.cache.enable_prefix_caching:
            salt = request_id
        out = []
        ids = list(prompt_ids)  # one list for every child: its frame carries it once
        for i in range(params.n):
            child_id = request_id if params.n == 1 else f"{i}_{request_id}"
            seed = base_seed if i == 0 else splitmix64((base_seed + i) & ((1 << 64) - 1))
            if i == 1 and params.prompt_logprobs is not None:  # the first child's suffice
                child_params = child_params.clone(prompt_logprobs=None)
            out.append(
                EngineCoreRequest(
                    child_id,
                    ids,
                    child_params,
                    eos,
                    seed & ((1 << 63) - 1),
                    arrival,
                    salt,
                    next(self._incarnations),
                )
            )
        return out


def _check_wire(params: msgspec.Struct, kind: type = SamplingParams) -> None:
    """Decode the params as the engine core will: a value changed after construction (or of
    a type msgspec refuses) fails here, in the caller, not in the engine's input thread. The
    constraint, which may be long, is checked on its own, once (`check_constraint`)."""
    if isinstance(params, SamplingParams) and params.structured_outputs is not None:
        params = params.clone(structured_outputs=None)
    try:
        msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=kind)
    except (msgspec.MsgspecError, OverflowError, TypeError, ValueError) as e:
        raise ValueError(f"invalid sampling params: {e}") from e


def _dead() -> None:
    return None


def check_text(text: str, name: str) -> None:
    """Text a tokenizer can read: no lone surrogate (JSON escapes can carry one)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"{name} is not valid Unicode: a lone surrogate at position {e.start}"
        ) from None
