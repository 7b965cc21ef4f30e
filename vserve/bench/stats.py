"""Small statistics shared by the benchmarks: percentiles and per-request TPOT."""

from __future__ import annotations


def request_tpots(request_outputs) -> list[float]:
    """Per request: (last token time - first token time) / (output tokens - 1), in ms."""
    out = []
    for ro in request_outputs:
        m = ro.metrics
        n = sum(len(c.token_ids) for c in ro.outputs) // max(1, len(ro.outputs))
        if n > 1 and "first_token_time" in m:
            out.append((m["last_token_time"] - m["first_token_time"]) / (n - 1) * 1e3)
    return out


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)
