"""GGUF block formats the CPU kernels do not run, rewritten at load as Q8_0 (which they do).

| GGML type | as Q8_0                                                                 |
|-----------|-------------------------------------------------------------------------|
| Q3_K      | exact: each weight is d * s * q (d the block's fp16, s a 6-bit signed   |
|           | sub-block scale, q in -4..3), so s * q is an integer in -124..128:      |
|           | Q8_0 with scale -d and quants -s * q (in -128..124)                     |
| IQ4_NL    | exact: d * t with t from a table of 16 int8 values: scale d, quants t   |
| IQ4_XS    | nearly: d * s_j * t per 32 weights (s_j 6-bit signed, t as IQ4_NL's):   |
|           | quants t, scale d * s_j rounded to fp16 (within 2^-11 of it)            |
| Q2_K      | requantized: d * s * q - dmin * m has two scales per 16 weights; Q8_0   |
|           | rounds each to within amax / 254 of its block of 32                     |

Q8_0 reads 34 bytes per 32 weights (8.5 bits a weight: 2.5x Q3_K's bytes, half of bf16's) and
runs on the int8 gemv and GEMM; the other types still dequantize to dense weights at load
(`gguf_source.iter_gguf_weights`). The values come from `gguf`'s own dequantization, so each
rewrite is checked against it (tests/models/test_gguf_repack.py).
"""

from __future__ import annotations

import numpy as np

Q8_0 = 8
# GGML type id: (name, from its own scales: the type's integers kept; else requantized)
REPACKED = {11: ("Q3_K", True), 20: ("IQ4_NL", True), 23: ("IQ4_XS", True), 10: ("Q2_K", False)}
_Q8_BLOCK, _Q8_BYTES = 32, 34


def to_q8_0(data: np.ndarray, qtype: int, k: int) -> np.ndarray:
    """[rows, row bytes] of a REPACKED type -> [rows, k / 32 * 34] Q8_0 bytes, a few MB of
    rows at a time (the fp32 values of a whole embedding would be GBs)."""
    out = np.empty((data.shape[0], k // _Q8_BLOCK * _Q8_BYTES), dtype=np.uint8)
    step = max(1, _CHUNK_VALUES // k)
    for r in range(0, data.shape[0], step):
        out[r : r + step] = _rows_as_q8_0(data[r : r + step], qtype, k)
    return out


_CHUNK_VALUES = 1 << 20


def _rows_as_q8_0(data: np.ndarray, qtype: int, k: int) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    values = dequantize(np.ascontiguousarray(data), GGMLQuantizationType(qtype)).reshape(-1, k)
    if not REPACKED[qtype][1]:
        return quantize(values, GGMLQuantizationType.Q8_0).reshape(values.shape[0], -1)
    scale = _scales(data, qtype)  # [rows, k / 32], fp32: each value / scale is an integer
    blocks = values.reshape(values.shape[0], -1, _Q8_BLOCK)
    safe = np.where(scale == 0, 1, scale)[..., None]
    quants = np.where(scale[..., None] == 0, 0, np.rint(blocks / safe))
    assert -128 <= quants.min(initial=0) and quants.max(initial=0) <= 127
    out = np.empty((values.shape[0], k // _Q8_BLOCK, _Q8_BYTES), dtype=np.uint8)
    out[..., :2] = scale.astype(np.float16)[..., None].view(np.uint8)
    out[..., 2:] = quants.astype(np.int8).view(np.uint8)
    return out.reshape(values.shape[0], -1)


def _scales(data: np.ndarray, qtype: int) -> np.ndarray:
    """Each 32 weights' scale as the type stores it, for the types rewritten from their own
    scales."""
    rows = data.shape[0]
    if qtype == 20:  # IQ4_NL: 18-byte blocks of 32, fp16 d first
        return _half(data.reshape(rows, -1, 18)[..., 0:2])
    if qtype == 23:  # IQ4_XS: 136-byte blocks of 256: fp16 d, 16 high bits, 8 low nibbles
        blocks = data.reshape(rows, -1, 136)
        high = blocks[..., 2:4].copy().view(np.uint16).astype(np.int32)  # [rows, n, 1]
        low = blocks[..., 4:8].astype(np.int32)
        j = np.arange(8)
        s = ((low[..., j // 2] >> (4 * (j % 2))) & 15) | (((high >> (2 * j)) & 3) << 4)
        return (_half(blocks[..., 0:2])[..., None] * (s - 32)).reshape(rows, -1).astype(np.float32)
    # Q3_K: 110-byte blocks of 256, fp16 d last; eight blocks of 32 share it, negated
    return np.repeat(-_half(data.reshape(rows, -1, 110)[..., 108:110]), 8, axis=1)


def _half(pairs: np.ndarray) -> np.ndarray:
    """[..., 2] bytes of fp16 values -> [...] fp32."""
    return pairs.copy().view(np.float16)[..., 0].astype(np.float32)
