"""Sampling rows without filters in one kernel launch (the CUDA path of
`vserve.workers.sampler.Sampler` for rows with no top-k / top-p / min-p).

One program per row reads the logits in the model's dtype, with no copy of the row:
  pass 1: the maximum m and its first index (a greedy row, T == 0, stops here: argmax);
  pass 2: the total of e_i = exp(x_i / T - m / T) in fp32 (IEEE division), chunk sums added
          in fp64, as softmax(x / T) computes its terms;
  pass 3: the first token whose cumulative sum exceeds u * total, u the row's uniform number
          from (request seed, position) (`vserve.core.seeds.uniform_for`): the inverse CDF of
          `workers/sampler.py`'s torch path and of the CPU kernel, so a seeded request picks
          the same token on every device, except where u falls within rounding of a CDF edge.
          The cumulative sum is taken inside the one chunk where it crosses the target only;
          should rounding leave that chunk's running sum short of the target, its last token
          of nonzero probability is taken (never a masked one).
`sample_rows_reference` is the float64 torch computation it is tested against.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096  # logits a chunk (8 KB of bf16); a smaller vocabulary takes one chunk


@triton.jit
def row_max(base, V, BLOCK: tl.constexpr):
    """The maximum of a row's V logits at `base`, in fp32, and its first index."""
    offs = tl.arange(0, BLOCK)
    m = tl.full([], float("-inf"), tl.float32)
    arg = tl.full([], 0, tl.int64)
    for start in range(0, V, BLOCK):
        idx = start + offs
        x = tl.load(base + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
        cm = tl.max(x, 0)
        ci = tl.min(tl.where((x == cm) & (idx < V), idx, V), 0).to(tl.int64)
        arg = tl.where(cm > m, ci, arg)
        m = tl.maximum(m, cm)
    return m, arg


@triton.jit
def _sample_kernel(
    logits_ptr,  # [rows, V], the row stride given, unit stride along the vocabulary
    stride_row,
    rows_ptr,  # [n] int64: the logits row of each program
    temp_ptr,  # [n] fp32: 0 is greedy
    u_ptr,  # [n] fp64 in [0, 1)
    out_ptr,  # [n] int64
    V,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0)
    base = logits_ptr + tl.load(rows_ptr + i) * stride_row
    offs = tl.arange(0, BLOCK)
    m, arg = row_max(base, V, BLOCK)  # pass 1
    t = tl.load(temp_ptr + i)
    if t > 0.0:
        mt = tl.div_rn(m, t)
        # pass 2: the total
        total = tl.full([], 0.0, tl.float64)
        for start in range(0, V, BLOCK):
            idx = start + offs
            x = tl.load(base + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
            e = tl.exp(tl.div_rn(x, t) - mt)
            total += tl.sum(e.to(tl.float64), 0)
        # pass 3: the first cumulative sum above u * total
        target = tl.load(u_ptr + i) * total
        run = tl.full([], 0.0, tl.float64)
        pick = tl.zeros([], tl.int64) + V
        for start in range(0, V, BLOCK):
            idx = start + offs
            x = tl.load(base + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
            e = tl.exp(tl.div_rn(x, t) - mt).to(tl.float64)
            s = tl.sum(e, 0)
            if (pick == V) & (run + s > target):
                c = tl.cumsum(e, 0) + run
                first = tl.min(tl.where((c > target) & (idx < V), idx, V), 0).to(tl.int64)
                last = tl.max(tl.where(e > 0, idx, -1), 0).to(tl.int64)
                pick = tl.where(first < V, first, last)
            run += s
        arg = tl.minimum(pick, V - 1)  # (run ends at total, so some chunk crosses u * total)
    tl.store(out_ptr + i, arg)


def sample_rows(
    logits: torch.Tensor, rows: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor
) -> torch.Tensor:
    """Token ids [n] for logits rows `rows` [n] (int64) at `temperature` [n] (fp32; 0:
    greedy) with uniform numbers `u` [n] (fp64); logits [R, V] in any float dtype, unit
    stride along the vocabulary."""
    assert logits.stride(-1) == 1, "the vocabulary must be contiguous"
    n = rows.shape[0]
    out = torch.empty(n, dtype=torch.int64, device=logits.device)
    if n:
        _sample_kernel[(n,)](
            logits,
            logits.stride(0),
            rows,
            temperature,
            u,
            out,
            logits.shape[-1],
            BLOCK=min(BLOCK, triton.next_power_of_2(logits.shape[-1])),
        )
    return out


def sample_rows_reference(
    logits: torch.Tensor, rows: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor
) -> torch.Tensor:
    """The same picks in torch: argmax for T == 0, else the inverse CDF of softmax(x / T) with
    float64 cumulative sums."""
    x = logits[rows].float()
    out = x.argmax(dim=-1)
    hot = temperature > 0
    if bool(hot.any()):
        scaled = x[hot] / temperature[hot].unsqueeze(1)
        e = (scaled - scaled.amax(dim=-1, keepdim=True)).exp().double()
        cdf = e.cumsum(dim=-1)
        target = (u[hot] * cdf[:, -1]).unsqueeze(1)
        pick = torch.searchsorted(cdf, target, right=True).squeeze(1)
        out[hot] = pick.clamp(max=x.shape[-1] - 1)
    return out
