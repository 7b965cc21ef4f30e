"""N-gram speculative decoding (prompt lookup): the config and the proposer.

The proposer looks for the longest suffix of a request's tokens (between `prompt_lookup_min`
and `prompt_lookup_max` long) that occurred earlier in the same request, and proposes the
tokens that followed its most recent earlier occurrence. It needs every token id, so the
scheduler proposes only for requests with no step in flight (all ids known on the host).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1

    @staticmethod
    def from_dict(value: dict | None) -> SpeculativeConfig | None:
        if not value:
            return None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(value).__name__}")
        known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"}
        unknown = set(value) - known
        if unknown:
            raise ValueError(f"unknown speculative_config keys {sorted(unknown)}; "
                             f"expected {sorted(known)}")
        cfg = SpeculativeConfig(**value)
        if cfg.method != "ngram":
            raise ValueError(f"speculative method {cfg.method!r} is not supported; use 'ngram'")
        if not 1 <= cfg.num_speculative_tokens <= 16:
            raise ValueError("num_speculative_tokens must be in [1, 16]")
        if not 1 <= cfg.prompt_lookup_min <= cfg.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        return cfg


def propose_ngram(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier match of the longest suffix."""
    length = len(tokens)
    if k <= 0:
        return []
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n:]
        first = suffix[0]
        best: list[int] = []
        for start in range(length - n - 1, -1, -1):
            if tokens[start] == first and tokens[start:start + n] == suffix:
                follow = tokens[start + n:start + n + k]
                if len(follow) == k:
                    return follow   # the most recent match with a full continuation
                if len(follow) > len(best):
                    best = follow   # a match near the end continues only briefly
        if best:
            return best
    return []
