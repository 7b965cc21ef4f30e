"""Random sampling on the CPU through the fused kernel (vserve/cpu_ops/sample.cpp).

The kernel reads each row's logits once or twice in the model's dtype: greedy rows get their
argmax, plain rows (temperature only) their inverse-CDF token, and rows with top-k / top-p /
min-p their best C tokens in the order of a stable descending sort of the row (C = top_k, at
most `CANDIDATES`), with probabilities normalised by the whole row. The filters then run here
on those candidates, exactly as the torch sampler runs them on its own candidates, and a row
whose kept tokens may reach past the candidates takes the torch sampler's path. The torch
sampler (`workers/sampler.py`) is the fallback and the oracle: for the same (seed, position)
both pick the same token, up to float rounding when u falls at a CDF edge.
"""

from __future__ import annotations

import torch

from vserve.core.seeds import uniform_for


def num_candidates(top_k: int, top_p: float, min_p: float, vocab: int, limit: int) -> int:
    """0 for a row without filters; otherwise how many best tokens the kernel returns."""
    if top_k <= 0 and top_p >= 1.0 and min_p <= 0.0:
        return 0
    return min(top_k if top_k > 0 else limit, limit, vocab)


def sample_with_kernel(
    kernel, logits: torch.Tensor, meta, limit: int, keep_top, pick, sample_filtered
) -> torch.Tensor:
    """Token ids [rows] for logits [rows, vocab] (bf16 or fp32, on the CPU); `keep_top`,
    `pick` and `sample_filtered` are the torch sampler's (one rule for both paths)."""
    rows, vocab = logits.shape
    counts = [
        0 if t == 0.0 else num_candidates(k, p, m, vocab, limit)
        for t, k, p, m in zip(meta.temperature, meta.top_k, meta.top_p, meta.min_p)
    ]
    u = [
        uniform_for(s, pos) if t > 0.0 else 0.0
        for s, pos, t in zip(meta.seeds, meta.positions, meta.temperature)
    ]
    u = torch.tensor(u, dtype=torch.float64)
    tokens, cand_ids, cand_p = kernel.sample(
        logits,
        torch.tensor(meta.temperature, dtype=torch.float32),
        u,
        torch.tensor(counts, dtype=torch.long),
    )
    filtered = [i for i, c in enumerate(counts) if c > 0]
    if filtered:
        _pick_filtered(
            tokens,
            cand_ids,
            cand_p,
            u,
            meta,
            filtered,
            counts,
            vocab,
            keep_top,
            pick,
            sample_filtered,
            logits,
        )
    return tokens


def _pick_filtered(
    tokens, cand_ids, cand_p, u, meta, rows, counts, vocab, keep_top, pick, sample_filtered, logits
) -> None:
    idx = torch.tensor(rows)
    top_k = _column([k if k > 0 else vocab for k in meta.top_k], rows)
    kept = keep_top(cand_p[idx], top_k, _column(meta.top_p, rows), _column(meta.min_p, rows))
    num_kept = (kept > 0).sum(dim=-1)
    width = _column(counts, rows).squeeze(1)
    # the kept prefix ended inside the candidates, or the candidates are every token top-k keeps
    fits = (num_kept < width) | (width >= top_k.squeeze(1).clamp(max=vocab))
    picked = pick(kept, u[idx], num_kept)
    chosen = cand_ids[idx].gather(1, picked.unsqueeze(1)).squeeze(1)
    tokens[idx[fits]] = chosen[fits]
    rest = [r for r, ok in zip(rows, fits.tolist()) if not ok]
    if rest:  # the torch sampler's own path: its candidates, else the full sort
        ridx = torch.tensor(rest)
        scaled = logits[ridx].float() / _column(meta.temperature, rest)
        tokens[ridx] = sample_filtered(scaled, u[ridx], meta, rest)


def _column(values, rows: list[int]) -> torch.Tensor:
    """values at rows, as a [len(rows), 1] tensor (int64 or fp32, as torch.tensor infers)."""
    return torch.tensor([values[i] for i in rows]).unsqueeze(1)
