"""Counter-based random numbers: a request's randomness is a function of (seed, position)
only, so it does not depend on the batch, chunking, scheduling mode or preemption."""

from __future__ import annotations

_MASK64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def uniform_for(seed: int, position: int) -> float:
    """A uniform number in [0, 1) that depends only on the seed and the position."""
    return (splitmix64(splitmix64(seed & _MASK64) ^ position) >> 11) * (1.0 / (1 << 53))
