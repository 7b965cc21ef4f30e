"""Sampling rows with top-k / top-p / min-p without sorting the vocabulary (the CUDA path of
`vserve.workers.sampler.Sampler` for filtered rows).

The torch path sorts each row by probability (ties: lower id first), keeps a prefix of that
order and picks by inverse CDF along it. This kernel finds the same prefix and the same pick
by searching over the probabilities' values instead of sorting them. One program per row:

- e_i = exp(x_i / T - m / T) in fp32, as the unfiltered kernel computes it; e_i in [0, 1], and
  its float bits, read as an integer, order the tokens as their probabilities order them.
- N(w) and M(w): how many tokens have a key >= w, and their mass (summed in fp64). Both only
  fall as w rises, so the least w where a rule holds is found by a 16-way search: each pass
  over the row tests 16 keys at once, and eight passes narrow the 2^30 keys of [0, 1] down
  to one.
- The kept prefix is every token with a key above some b, and the first n_b tokens (by id) of
  key b: b + 1 is the least w with N(w) < k and M(w) < top_p x total (no search for a row
  with min-p alone), raised to min-p's key when that is higher (min-p keeps every token at
  or above it); n_b follows from the counts.
- The pick: the target u x (kept mass), u from (request seed, position); the token whose
  stretch of the prefix's cumulative mass holds the target is in the group of key c, c + 1
  the least w with M(w) <= target (or c = b), at rank floor((target - M(c + 1)) / e_c) among
  that group's ids.

So a row costs about twenty passes over its logits in the model's dtype, with no copy, no
sort and no host read. `sample_filtered_reference` is the float64 torch computation it is
tested against; the picks equal the torch sampler's except where rounding moves a boundary.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vserve.csrc_triton.sample import row_max

BLOCK = 512  # logits a chunk; each is tested against 16 keys at once ([512, 16] in fp64)
NUM_WARPS = 8
KEY_ONE = tl.constexpr(0x3F800000)  # the float bits of 1.0: every key lies in [0, KEY_ONE]


@triton.jit
def _keys(base, idx, V, t, mt):
    """e and its key for the logits at `idx` (key -1 past the vocabulary)."""
    x = tl.load(base + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
    e = tl.exp(tl.div_rn(x, t) - mt)
    key = tl.where(idx < V, e.to(tl.int32, bitcast=True), -1)
    return e, key


@triton.jit
def _counts(base, V, t, mt, piv, BLOCK: tl.constexpr):
    """N and M at each of the 16 keys `piv`. Every count and mass the kernel compares comes
    from here, summed in one order, so the same set of tokens always has the same mass."""
    offs = tl.arange(0, BLOCK)
    n = tl.full([16], 0, tl.int64)  # (tl.full, not tl.zeros: a builtin, cheap to interpret)
    mass = tl.full([16], 0.0, tl.float64)
    for start in range(0, V, BLOCK):
        e, key = _keys(base, start + offs, V, t, mt)
        ge = key[:, None] >= piv[None, :]
        n += tl.sum(ge.to(tl.int32), 0).to(tl.int64)
        # fp64 sums, as the torch path's inverse CDF: an fp32 sum of a row would lose the
        # tail's probabilities (1e-10 beside a total of 1) to its rounding
        mass += tl.sum(tl.where(ge, e.to(tl.float64)[:, None], 0.0), 0)
    return n, mass


@triton.jit
def _tally(base, V, t, mt, v, BLOCK: tl.constexpr):
    """N(v + 1) and M(v + 1), the count and the mass of the tokens whose key is above v, and
    the count of those whose key is v."""
    j = tl.arange(0, 16)
    n, mass = _counts(base, V, t, mt, tl.where(j == 0, v + 1, v), BLOCK)
    n_above = tl.sum(tl.where(j == 0, n, 0), 0)
    n_at = tl.sum(tl.where(j == 1, n, 0), 0) - n_above
    return n_above, tl.sum(tl.where(j == 0, mass, 0.0), 0), n_at


@triton.jit
def _least(base, V, t, mt, lo, hi, k, bound, STRICT: tl.constexpr, BLOCK: tl.constexpr):
    """The least w in [lo, hi] with N(w) < k and M(w) < bound (STRICT), or with M(w) <= bound
    (not STRICT); the rule must hold at hi."""
    j = tl.arange(0, 16)
    lo += tl.full([], 0, tl.int64)
    hi += tl.full([], 0, tl.int64)
    while lo < hi:
        step = (hi - lo + 15) // 16
        piv = tl.minimum(lo + j * step, hi)
        n, mass = _counts(base, V, t, mt, piv, BLOCK)
        if STRICT:
            ok = (n < k) & (mass < bound)
        else:
            ok = mass <= bound
        first = tl.min(tl.where(ok, j, 16), 0)  # the rule fails below pivot `first`
        below = tl.minimum(lo + (first - 1) * step, hi)
        hi = tl.where(first < 16, tl.minimum(lo + first * step, hi), hi)
        lo = tl.where(first == 0, lo, below + 1)
    return lo


@triton.jit
def _nth_of_key(base, V, t, mt, c, rank, BLOCK: tl.constexpr):
    """The id of the rank-th (from 0) token, by id, whose key is c."""
    offs = tl.arange(0, BLOCK)
    run = tl.full([], 0, tl.int64)
    pick = tl.full([], -1, tl.int64)
    for start in range(0, V, BLOCK):
        idx = start + offs
        _, key = _keys(base, idx, V, t, mt)
        eq = (key == c).to(tl.int64)
        s = tl.sum(eq, 0)
        if (pick < 0) & (run + s > rank):
            cum = tl.cumsum(eq, 0) + run
            pick = tl.min(tl.where((eq > 0) & (cum > rank), idx, V), 0).to(tl.int64)
        run += s
    return pick


@triton.jit
def _sample_filtered_kernel(
    logits_ptr,  # [rows, V], the row stride given, unit stride along the vocabulary
    stride_row,
    rows_ptr,  # [n] int64: the logits row of each program
    temp_ptr,  # [n] fp32, > 0
    u_ptr,  # [n] fp64 in [0, 1)
    top_k_ptr,  # [n] int64, in [1, V]
    top_p_ptr,  # [n] fp64, in (0, 1]
    min_p_ptr,  # [n] fp32, in [0, 1]
    out_ptr,  # [n] int64
    V,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0)
    base = logits_ptr + tl.load(rows_ptr + i) * stride_row
    t = tl.load(temp_ptr + i)
    m, arg = row_max(base, V, BLOCK)  # arg: the first most likely token, always kept
    mt = tl.div_rn(m, t)
    _, total, _ = _tally(base, V, t, mt, -1, BLOCK)
    k = tl.load(top_k_ptr + i)
    top_p = tl.load(top_p_ptr + i)
    bound = tl.where(top_p < 1.0, top_p * total, float("inf"))
    # the kept prefix: every key above b, and the first n_b ids of key b
    b = tl.full([], 0, tl.int64)  # without top-k and top-p: every token (key 0 has no mass)
    if (k < V) | (top_p < 1.0):
        b = _least(base, V, t, mt, 1, KEY_ONE + 1, k, bound, True, BLOCK) - 1
    n_above, m_above, n_at = _tally(base, V, t, mt, b, BLOCK)
    e_b = b.to(tl.int32).to(tl.float32, bitcast=True).to(tl.float64)
    by_mass = tl.minimum(tl.ceil((bound - m_above) / e_b), V).to(tl.int64)
    n_b = tl.minimum(tl.minimum(n_at, k - n_above), by_mass)
    floor_key = tl.load(min_p_ptr + i).to(tl.int32, bitcast=True).to(tl.int64)  # min-p: >= it
    if floor_key > b:
        b = floor_key - 1
        n_above, m_above, _ = _tally(base, V, t, mt, b, BLOCK)
        n_b = n_b * 0
    kept = m_above + n_b.to(tl.float64) * e_b
    # u x kept may round up to kept: the last kept token's stretch ends just below it
    target = tl.minimum(tl.load(u_ptr + i) * kept, kept - kept * 2.220446049250313e-16)
    # the pick: the group of key c holding the target, then its rank there
    if m_above > target:
        c = _least(base, V, t, mt, b + 2, KEY_ONE + 1, 0, target, False, BLOCK) - 1
        _, m_over, group = _tally(base, V, t, mt, c, BLOCK)
    else:
        c, m_over, group = b, m_above, n_b
    e_c = c.to(tl.int32).to(tl.float32, bitcast=True).to(tl.float64)
    rank = tl.floor((target - m_over) / e_c).to(tl.int64)
    rank = tl.maximum(tl.minimum(rank, group - 1), 0)
    pick = _nth_of_key(base, V, t, mt, c, rank, BLOCK)
    tl.store(out_ptr + i, tl.where(pick >= 0, pick, arg))  # (-1: found none; never expected)


def sample_filtered(
    logits: torch.Tensor,
    rows: torch.Tensor,
    temperature: torch.Tensor,
    u: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    """Token ids [n] for logits rows `rows` [n] (int64) at `temperature` [n] (fp32, > 0) with
    uniform numbers `u` [n] (fp64) under top_k [n] (int64; 0: none), top_p [n] (fp64; 1:
    none) and min_p [n] (fp32; 0: none); logits [R, V] in any float dtype, unit stride along
    the vocabulary."""
    assert logits.stride(-1) == 1, "the vocabulary must be contiguous"
    n, vocab = rows.shape[0], logits.shape[-1]
    out = torch.empty(n, dtype=torch.int64, device=logits.device)
    if n:
        k = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab)
        _sample_filtered_kernel[(n,)](
            logits,
            logits.stride(0),
            rows,
            temperature,
            u,
            k,
            top_p,
            min_p,
            out,
            vocab,
            BLOCK=min(BLOCK, triton.next_power_of_2(vocab)),
            num_warps=NUM_WARPS,
        )
    return out


def sample_filtered_reference(
    logits: torch.Tensor,
    rows: torch.Tensor,
    temperature: torch.Tensor,
    u: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    """The same picks by a stable sort: e in fp32 (by torch's exp, which may round an e
    differently from the kernel's), everything after in fp64."""
    out = []
    for j, r in enumerate(rows.tolist()):
        x = logits[r].float()
        t = temperature[j].float()
        e = torch.exp(x / t - x.max() / t).double()
        p, order = e.sort(descending=True, stable=True)
        keep = torch.ones_like(p, dtype=torch.bool)
        if 0 < int(top_k[j]) < p.numel():
            keep[int(top_k[j]) :] = False
        if float(top_p[j]) < 1.0:
            keep &= (p.cumsum(0) - p) < float(top_p[j]) * p.sum()
        keep &= p >= float(min_p[j].float())
        keep[0] = True
        kept = torch.where(keep, p, 0.0)
        cdf = kept.cumsum(0)
        pick = torch.searchsorted(cdf, (u[j] * cdf[-1]).reshape(1), right=True)
        out.append(order[min(int(pick), int(keep.sum()) - 1)])
    return torch.stack(out) if out else torch.empty(0, dtype=torch.int64)
