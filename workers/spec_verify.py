"""Verifying n-gram drafts in one forward: greedy match or rejection sampling.

A request with k drafts gets logits at k + 1 positions. Greedy: accept drafts while each
equals the argmax at its position, then emit the argmax at the first mismatch (or after the
last draft). Random: accept draft d at a position with probability p(d) under the request's
processed distribution; on rejection, sample from p with d removed (renormalized), which is
exactly p's distribution for a deterministic draft. Uniforms come from (seed, position), on a
separate stream for the accept tests, so results do not depend on the batch.
"""

from __future__ import annotations

import torch

from vserve.core.outputs import LogprobsDelta
from vserve.core.seeds import uniform_for
from vserve.sampling_params import SamplingParams
from vserve.workers.sampler import filtered_probs, inverse_cdf

_ACCEPT_STREAM = 0x5BD1E995


def verify(
    logits: torch.Tensor, drafts: list[int], params: SamplingParams, seed: int, first_position: int
) -> list[int]:
    """logits [k + 1, vocab] (processed: bias applied); returns the emitted token ids."""
    if params.greedy:
        targets = logits.argmax(dim=-1).tolist()
        out = []
        for draft, target in zip(drafts + [None], targets):
            out.append(target)
            if target != draft:
                break
        return out
    probs = filtered_probs(logits / params.temperature, params)  # [k + 1, vocab]
    for i, draft in enumerate(drafts):
        pos = first_position + i
        if uniform_for(seed ^ _ACCEPT_STREAM, pos) < probs[i, draft].item():
            continue
        residual = probs[i].clone()
        residual[draft] = 0.0
        return drafts[:i] + [_pick(residual, seed, pos)]
    last = first_position + len(drafts)
    return drafts + [_pick(probs[len(drafts)], seed, last)]


def _pick(probs: torch.Tensor, seed: int, position: int) -> int:
    u = torch.tensor([uniform_for(seed, position)], dtype=torch.float64, device=probs.device)
    return int(inverse_cdf(probs.unsqueeze(0), u)[0])


def logprobs_for(raw: torch.Tensor, tokens: list[int], num: int) -> LogprobsDelta:
    """Raw logprobs of the emitted tokens (one per verified position), with the top-`num`."""
    lp = raw[: len(tokens)].float().log_softmax(dim=-1)
    idx = torch.tensor(tokens, device=raw.device)
    chosen = lp.gather(1, idx.unsqueeze(1)).squeeze(1)
    ranks = ((lp > chosen.unsqueeze(1)).sum(dim=-1) + 1).tolist()
    top_v, top_i = lp.topk(num, dim=-1) if num else (None, None)
    ids, vals = [], []
    for k, token in enumerate(tokens):
        ids.append([token] + (top_i[k].tolist() if num else []))
        vals.append([chosen[k].item()] + (top_v[k].tolist() if num else []))
    return LogprobsDelta(ids, vals, ranks)
