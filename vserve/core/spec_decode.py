"""N-gram speculative decoding (prompt lookup): the config and the proposer.

The proposer looks for the longest suffix of a request's tokens (between `prompt_lookup_min`
and `prompt_lookup_max` long) that occurred earlier in the same request, and proposes the
tokens that followed its most recent earlier occurrence. It needs every token id, so the
scheduler proposes only for requests with no step in flight (all ids known on the host).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass


@dataclass
class SpecDecodeStats:
    """Cumulative: steps that verified drafts, draft tokens sent, draft tokens accepted."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def record(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens


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
            raise ValueError(
                f"unknown speculative_config keys {sorted(unknown)}; expected {sorted(known)}"
            )
        cfg = SpeculativeConfig(**value)
        if cfg.method != "ngram":
            raise ValueError(f"speculative method {cfg.method!r} is not supported; use 'ngram'")
        if not 1 <= cfg.num_speculative_tokens <= 16:
            raise ValueError("num_speculative_tokens must be in [1, 16]")
        if not 1 <= cfg.prompt_lookup_min <= cfg.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        return cfg


def propose_ngram(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier match of the longest suffix (the
    most recent match with k tokens after it, else the one with the most)."""
    length = len(tokens)
    if k <= 0 or length < 2:
        return []
    data = array("i", tokens).tobytes()  # the search runs in C: bytes.rfind, 4-byte aligned
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = data[_WIDTH * (length - n) :]
        end = _WIDTH * (length - 1)  # a match ends before the last id: it has a follower
        best: list[int] = []
        while True:
            pos = data.rfind(suffix, 0, end)
            if pos < 0:
                break
            end = pos + len(suffix) - 1  # the next search finds matches starting before pos
            if pos % _WIDTH:
                continue
            start = pos // _WIDTH + n
            follow = tokens[start : start + k]
            if len(follow) == k:
                return follow
            if len(follow) > len(best):
                best = follow
        if best:
            return best
    return []


_WIDTH = array("i").itemsize
