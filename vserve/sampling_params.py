"""Sampling parameters: what a request asks of the sampler and of the stop checks.

`SamplingParams` is a msgspec struct so that it crosses the front end -> engine core boundary
as msgpack without pickling. Every value is checked when the object is built; a bad value
raises `ValueError` with a message that names the field and the accepted range.
"""

from __future__ import annotations

import math

import msgspec

_GREEDY_EPS = 1e-5
_FLOAT32_MAX = 3.4028234663852886e38  # the sampler divides logits in float32
# a logit (up to ~1e4 in magnitude) divided or multiplied by the penalty stays finite in float32
_MIN_REPETITION_PENALTY, _MAX_REPETITION_PENALTY = 1e-4, 1e4
_INT64 = 2**63  # integers must fit int64: msgpack and torch carry nothing wider
POOLINGS = (None, "last", "mean")  # SamplingParams.pooling
MAX_STARTS_AFTER_CHARS = 64  # a tag such as "</think>", matched against each output token
_TYPE_NAMES = {"regex": "a string", "grammar": "a string", "choice": "a list of strings"}


class StructuredOutputsParams(msgspec.Struct, kw_only=True, omit_defaults=True, weakref=True):
    """Constrain the output: exactly one of a JSON schema (`json`, a dict or its JSON text),
    any JSON object (`json_object=True`), a regular expression, a list of choices, or an
    EBNF grammar (xgrammar's dialect).

    `starts_after`: the constraint applies only to the tokens after the one that completes
    this text in the output (a thinking model's `</think>`: its thoughts stay free, the
    answer is constrained); until then the output is unconstrained."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    starts_after: str | None = None

    def __post_init__(self) -> None:
        import json as _json

        self._check_types()
        if isinstance(self.json, dict):
            self.json = _json.dumps(self.json)
        kinds = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k)]
        kinds += ["json_object"] if self.json_object else []
        _check(
            len(kinds) == 1,
            "structured outputs need exactly one of json, json_object, "
            f"regex, choice or grammar; got {kinds or 'none'}",
        )
        if self.json:
            try:
                _json.loads(self.json)
            except RecursionError:
                raise ValueError("structured outputs: json is nested too deeply") from None
            except ValueError as e:
                raise ValueError(f"structured outputs: json is not a valid schema: {e}") from e
        if self.choice is not None:
            _check(
                all(isinstance(c, str) and c for c in self.choice),
                "structured outputs: choice must be a list of non-empty strings",
            )
        if self.starts_after is not None:
            _check(
                isinstance(self.starts_after, str)
                and 0 < len(self.starts_after) <= MAX_STARTS_AFTER_CHARS,
                f"structured outputs: starts_after must be a string of 1 to "
                f"{MAX_STARTS_AFTER_CHARS} characters",
            )

    def _check_types(self) -> None:
        """msgspec does not check types in `__init__`: a wrong type would pass here and fail
        only when the engine core decodes the request."""
        for name, types in (
            ("json", (str, dict)),
            ("regex", str),
            ("grammar", str),
            ("choice", list),
        ):
            value = getattr(self, name)
            _check(
                value is None or isinstance(value, types),
                f"structured outputs: {name} must be "
                f"{'a string or an object' if name == 'json' else _TYPE_NAMES[name]}, "
                f"got {type(value).__name__}",
            )
        _check(
            isinstance(self.json_object, bool),
            f"structured outputs: json_object must be a boolean, got "
            f"{type(self.json_object).__name__}",
        )

    @property
    def key(self) -> tuple[str, str]:
        """What to compile, and a cache key for it."""
        if self.json:
            return "json", self.json
        if self.json_object:
            return "json_object", ""
        if self.regex:
            return "regex", self.regex
        if self.choice:
            return "choice", "\x00".join(self.choice)
        return "grammar", self.grammar


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # top-k per prompt position (+ the prompt token's own)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    detokenize: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    # an embedding: the prompt's last-layer hidden states pooled ("last" token or "mean");
    # the engine samples one token (dropped) and returns the pooled vector with it
    pooling: str | None = None

    def __post_init__(self) -> None:
        self._normalize()
        self._verify()

    # -- derived views -------------------------------------------------------------------------
    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def stop_strings(self) -> list[str]:
        return list(self.stop or [])

    @property
    def needs_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def clone(self, **changes) -> SamplingParams:
        return msgspec.structs.replace(self, **changes)

    # -- checks ----------------------------------------------------------------------------------
    def _normalize(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias:
            _check(
                isinstance(self.logit_bias, dict),
                f"logit_bias must be a dict of token id -> bias, got {_short(self.logit_bias)}.",
            )
            self.logit_bias = {_token_id(k): _clamp_bias(v) for k, v in self.logit_bias.items()}
        if isinstance(self.temperature, (int, float)) and 0 <= self.temperature < _GREEDY_EPS:
            self.temperature = 0.0
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    def _verify(self) -> None:
        self._verify_types()
        _check(
            _is_int64(self.n) and self.n >= 1,
            f"n must be an integer >= 1 (64-bit), got {_short(self.n)}.",
        )
        _check(
            _is_finite(self.temperature) and 0 <= self.temperature <= _FLOAT32_MAX,
            f"temperature must be a finite number >= 0 that a float32 holds, got "
            f"{_short(self.temperature)}.",
        )
        _check(
            _is_num(self.top_p) and 0 < self.top_p <= 1,
            f"top_p must be in (0, 1], got {_short(self.top_p)}.",
        )
        _check(
            _is_int64(self.top_k) and self.top_k >= 0,
            f"top_k must be -1 or 0 (disabled) or at least 1 (64-bit), got {_short(self.top_k)}.",
        )
        _check(
            _is_num(self.min_p) and 0 <= self.min_p <= 1,
            f"min_p must be in [0, 1], got {_short(self.min_p)}.",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(
                _is_num(value) and -2 <= value <= 2,
                f"{name} must be in [-2, 2], got {_short(value)}.",
            )
        _check(
            _is_num(self.repetition_penalty)
            and _MIN_REPETITION_PENALTY <= self.repetition_penalty <= _MAX_REPETITION_PENALTY,
            f"repetition_penalty must be in [{_MIN_REPETITION_PENALTY:g}, "
            f"{_MAX_REPETITION_PENALTY:g}], got {_short(self.repetition_penalty)}.",
        )
        _check(
            self.seed is None or (_is_int(self.seed) and -_INT64 <= self.seed < _INT64),
            f"seed must be a 64-bit integer, got {_short(self.seed)}.",
        )
        _check(
            self.max_tokens is None or (_is_int64(self.max_tokens) and self.max_tokens >= 1),
            f"max_tokens must be at least 1 (64-bit), got {_short(self.max_tokens)}.",
        )
        _check(
            _is_int64(self.min_tokens) and self.min_tokens >= 0,
            f"min_tokens must be >= 0 (64-bit), got {_short(self.min_tokens)}.",
        )
        if self.max_tokens is not None:
            _check(
                self.min_tokens <= self.max_tokens,
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens}).",
            )
        _check(
            self.logprobs is None or (_is_int64(self.logprobs) and self.logprobs >= 0),
            f"logprobs must be a non-negative integer, got {_short(self.logprobs)}.",
        )
        _check(
            self.prompt_logprobs is None
            or (_is_int64(self.prompt_logprobs) and self.prompt_logprobs >= 0),
            f"prompt_logprobs must be a non-negative integer, got {_short(self.prompt_logprobs)}.",
        )
        for s in self.stop or []:
            _check(isinstance(s, str) and s != "", "stop strings must be non-empty strings.")
        for t in self.stop_token_ids or []:
            _check(
                _is_int64(t) and t >= 0,
                f"stop_token_ids must be non-negative 64-bit ints, got {_short(t)}.",
            )
        _check(
            self.pooling in POOLINGS,
            f"pooling must be one of {', '.join(map(str, POOLINGS))}, got {_short(self.pooling)}.",
        )
        if self.n > 1:
            _check(
                not self.greedy,
                "n > 1 needs random sampling: set temperature > 0 (greedy choices would "
                "all be identical).",
            )

    def _verify_types(self) -> None:
        """Containers, flags and the nested params, whose wrong types msgspec would otherwise
        find only when the engine core decodes the request."""
        _check(
            self.stop is None or isinstance(self.stop, list),
            f"stop must be a string or a list of strings, got {_short(self.stop)}.",
        )
        _check(
            self.stop_token_ids is None or isinstance(self.stop_token_ids, list),
            f"stop_token_ids must be a list of ints, got {_short(self.stop_token_ids)}.",
        )
        for name in (
            "ignore_eos",
            "include_stop_str_in_output",
            "skip_special_tokens",
            "spaces_between_special_tokens",
            "detokenize",
        ):
            _check(
                isinstance(getattr(self, name), bool),
                f"{name} must be a boolean, got {getattr(self, name)!r}.",
            )
        _check(
            self.structured_outputs is None
            or isinstance(self.structured_outputs, StructuredOutputsParams),
            "structured_outputs must be a StructuredOutputsParams.",
        )


def _token_id(key: object) -> int:
    try:
        token_id = int(key) if isinstance(key, (int, str)) and not isinstance(key, bool) else None
    except ValueError:
        token_id = None
    _check(
        token_id is not None and 0 <= token_id < _INT64,
        f"logit_bias keys must be token ids, got {_short(key)}.",
    )
    return token_id


def _clamp_bias(value: object) -> float:
    _check(_is_finite(value), f"logit_bias values must be finite numbers, got {_short(value)}.")
    return float(max(-100, min(100, value)))


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_int64(value: object) -> bool:
    return _is_int(value) and -_INT64 <= value < _INT64


def _is_finite(value: object) -> bool:
    """A number a float holds that is not inf or NaN."""
    if not _is_num(value):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:  # an int beyond the float range
        return False


def _is_num(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
