"""A mixture of experts' step in two grouped GEMM launches (the CUDA path of
`vserve.models.moe.Experts`).

A step's T x k (token, slot) pairs are sorted by expert and each expert's run is padded to
whole tiles of BLOCK_M rows (`align`, torch ops without a host sync: the grid is sized by the
bound ceil(T k / BLOCK_M) + E, and the tiles past the last run exit at once). One program
computes a BLOCK_M x BLOCK_N tile of one expert's product and reads only that expert's
weights, so a decode step streams the routed experts' bytes. `fused_experts` runs gate/up
(rows gathered by token), the gated activation (torch), then down scaled by each pair's
routing weight, and sums each token's k rows. `fused_experts_reference` is the per-expert
torch loop it is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from vserve.csrc_triton.paged_attention import _INTERPRETED, _dot


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,  # [rows, K]: tokens (A_BY_TOKEN) or pairs
    w_ptr,  # [E, N, K]
    c_ptr,  # [pairs, N]
    sorted_ptr,  # [tiles * BLOCK_M] pair ids by expert, padded with `num_pairs`
    tile_expert_ptr,  # [tiles] the expert of each tile, -1 past the last
    weight_ptr,  # [pairs] routing weights (MUL_WEIGHT)
    num_pairs,
    N,
    K,
    stride_am,
    stride_ak,
    stride_we,
    stride_wn,
    stride_wk,
    stride_cm,
    stride_cn,
    TOP_K: tl.constexpr,
    A_BY_TOKEN: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile).to(tl.int64)
    if expert < 0:
        return
    pair = tl.load(sorted_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    valid = pair < num_pairs
    if A_BY_TOKEN:
        row = pair // TOP_K
    else:
        row = pair
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_base = w_ptr + expert * stride_we
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + ks
        a = tl.load(
            a_ptr + row[:, None] * stride_am + kk[None, :] * stride_ak,
            mask=valid[:, None] & (kk[None, :] < K),
            other=0.0,
        )
        w = tl.load(
            w_base + cols[None, :] * stride_wn + kk[:, None] * stride_wk,
            mask=(cols[None, :] < N) & (kk[:, None] < K),
            other=0.0,
        )
        acc += _dot(a, w, PRECISION, UPCAST)
    if MUL_WEIGHT:
        acc *= tl.load(weight_ptr + pair, mask=valid, other=0.0).to(tl.float32)[:, None]
    tl.store(
        c_ptr + pair[:, None] * stride_cm + cols[None, :] * stride_cn,
        acc.to(c_ptr.dtype.element_ty),
        mask=valid[:, None] & (cols[None, :] < N),
    )


@dataclass(frozen=True)
class Alignment:
    sorted_pairs: torch.Tensor  # [tiles * block_m] int32, padded with T * k
    tile_expert: torch.Tensor  # [tiles] int32, -1 past the last expert's run
    block_m: int


def align(ids: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    """The pairs of `ids` [T, k] sorted by expert, each expert's run padded to whole tiles."""
    flat = ids.reshape(-1).to(torch.int64)
    pairs = flat.numel()
    tiles = -(-pairs // block_m) + num_experts  # a bound: each run wastes under one tile
    order = torch.argsort(flat, stable=True)
    # bincount would read the ids' range back to the host: a scatter keeps it on the device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    start = torch.cumsum(counts, 0) - counts  # each expert's first place in `order`
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    expert_of = flat[order]
    place = padded_start[expert_of] + torch.arange(pairs, device=ids.device) - start[expert_of]
    sorted_pairs = torch.full((tiles * block_m,), pairs, dtype=torch.int32, device=ids.device)
    sorted_pairs[place] = order.to(torch.int32)
    tile_start = torch.arange(tiles, device=ids.device) * block_m
    tile_expert = torch.searchsorted(padded_end, tile_start, right=True)
    tile_expert = torch.where(tile_expert < num_experts, tile_expert, -1).to(torch.int32)
    return Alignment(sorted_pairs, tile_expert, block_m)


def _grouped_gemm(
    a: torch.Tensor,
    w: torch.Tensor,  # [E, N, K]
    plan: Alignment,
    pairs: int,
    top_k: int,
    by_token: bool,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    n, k = w.shape[1], w.shape[2]
    out = torch.empty(pairs, n, dtype=a.dtype, device=a.device)
    block_n = 64 if n >= 64 else max(16, triton.next_power_of_2(n))
    block_k = 64 if k >= 64 else max(16, triton.next_power_of_2(k))
    grid = (plan.tile_expert.numel(), triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a,
        w,
        out,
        plan.sorted_pairs,
        plan.tile_expert,
        weights if weights is not None else out,
        pairs,
        n,
        k,
        a.stride(0),
        a.stride(1),
        w.stride(0),
        w.stride(1),
        w.stride(2),
        out.stride(0),
        out.stride(1),
        TOP_K=top_k,
        A_BY_TOKEN=by_token,
        MUL_WEIGHT=weights is not None,
        BLOCK_M=plan.block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        # tf32 would cost fp32 inputs ~1e-3 relative error; half types ignore the setting
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        UPCAST=_INTERPRETED and a.dtype == torch.bfloat16,
    )
    return out


def fused_experts(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2 I, H]: gate rows, then up rows
    w2: torch.Tensor,  # [E, H, I]
    weights: torch.Tensor,  # [T, k] routing weights
    ids: torch.Tensor,  # [T, k] expert ids
    activation,  # [.., 2 I] gate and up -> [.., I]
    block_m: int = 16,
) -> torch.Tensor:
    """sum over each token's k experts of weight * down(act(gate_up(x))): [T, H]."""
    tokens, top_k = ids.shape
    if tokens == 0:
        return torch.zeros_like(x)
    plan = align(ids, w13.shape[0], block_m)
    pairs = tokens * top_k
    gate_up = _grouped_gemm(x, w13, plan, pairs, top_k, by_token=True)
    h = activation(gate_up).contiguous()
    flat_weights = weights.reshape(-1).contiguous()
    down = _grouped_gemm(h, w2, plan, pairs, top_k, by_token=False, weights=flat_weights)
    return down.view(tokens, top_k, -1).sum(dim=1)


def fused_experts_reference(x, w13, w2, weights, ids, activation) -> torch.Tensor:
    """Each (token, slot) pair through its expert, one at a time, in fp32."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for t in range(ids.shape[0]):
        for s in range(ids.shape[1]):
            e = int(ids[t, s])
            h = activation(x[t].float() @ w13[e].float().T)
            out[t] += float(weights[t, s]) * (h @ w2[e].float().T)
    return out.to(x.dtype)
