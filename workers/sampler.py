"""Sampling from logits of the rows that sample this step.

Randomness is a function of (request seed, position) only: each row draws one uniform number
from a counter-based hash and picks its token by inverse CDF. So a seeded request gives the
same tokens whatever else shares the batch, whether its prompt was chunked, and after a
preemption recomputes a position. A row's path (vocab order, or sorted when it filters with
top-k / top-p / min-p) depends only on its own parameters, for the same reason.

Nothing here makes the host wait for the device (CUDA): host values reach the device through
`vserve.workers.device.upload` (pinned, non-blocking), no shape depends on a device value, and
logprobs stay on the device (`PendingLogprobs`) until the step's host copy has landed.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

from vserve import cpu_ops
from vserve.core.outputs import LogprobsDelta
from vserve.core.seeds import uniform_for
from vserve.workers.cpu_sampling import sample_with_kernel
from vserve.workers.device import host_reads_are_free, upload

_HAS_TRITON = importlib.util.find_spec("triton") is not None


@dataclass
class SamplingMetadata:
    """Per sampling row; lists are aligned with the logits rows."""

    temperature: list[float]
    top_k: list[int]
    top_p: list[float]
    min_p: list[float]
    seeds: list[int]
    positions: list[int]  # index of the token being sampled
    num_logprobs: list[int | None]
    logit_bias: list[dict[int, float] | None]
    masked_ids: list[list[int] | None]  # stop ids hidden while output < min_tokens
    presence: list[float]
    frequency: list[float]
    repetition: list[float]
    prompt_ids: list[list[int]] | None = None  # only when some row has penalties
    output_ids: list[list[int]] | None = None
    grammar_rows: list[int] | None = None  # structured output: rows to mask ...
    grammar_mask: torch.Tensor | None = None  # ... [len(grammar_rows), vocab] bool allowed
    # output ids still on the device (the previous step's, not yet copied back), penalised
    # like `output_ids`: (rows [m], token ids [m]), both on the logits' device
    pending_output: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def all_greedy(self) -> bool:
        return all(t == 0.0 for t in self.temperature)

    @property
    def needs_penalties(self) -> bool:
        return (
            any(p != 0.0 for p in self.presence)
            or any(f != 0.0 for f in self.frequency)
            or any(r != 1.0 for r in self.repetition)
        )


@dataclass
class PendingLogprobs:
    """One step's logprobs, still tensors (on the device) until the host resolves them."""

    num_logprobs: list[int | None]  # per sampling row, as in SamplingMetadata
    rows: list[int]  # the rows that asked, in order
    tensors: list[torch.Tensor]  # sampled [m], ranks [m], ids [m], then when k > 0
    #                                          top ids [m, k], top logprobs [m, k]

    def resolve(self, host: list[torch.Tensor] | None = None) -> list[LogprobsDelta | None]:
        """Per row; `host`: `tensors` copied to the host (else read here, waiting on CUDA)."""
        lists = [t.tolist() for t in (host if host is not None else self.tensors)]
        sampled_l, ranks_l, ids_l = lists[:3]
        top_i, top_v = lists[3:] if len(lists) > 3 else (None, None)
        out: list[LogprobsDelta | None] = [None] * len(self.num_logprobs)
        for j, i in enumerate(self.rows):
            n = self.num_logprobs[i]
            ids_i = [ids_l[j]] + (top_i[j][:n] if n else [])
            vals = [sampled_l[j]] + (top_v[j][:n] if n else [])
            out[i] = LogprobsDelta([ids_i], [vals], [ranks_l[j]])
        return out


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [num_rows] int64, on the device
    pending_logprobs: PendingLogprobs | None = None

    @property
    def logprobs(self) -> list[LogprobsDelta | None] | None:
        """Resolved on the host (on CUDA this waits for the device)."""
        return None if self.pending_logprobs is None else self.pending_logprobs.resolve()


class Sampler:
    """`use_kernel`: sample CPU logits with the fused kernel (vserve/cpu_ops/sample.cpp) when it
    builds, and CUDA logits with the Triton kernels (csrc_triton/sample.py for rows without
    top-k / top-p / min-p, csrc_triton/sample_filtered.py for rows with them); False keeps
    the torch path everywhere (the oracle the kernels are tested against). `triton`: True
    takes the Triton kernels on any device (on CPU tensors under TRITON_INTERPRET=1, for
    tests), False never; None where Triton compiles (CUDA)."""

    def __init__(self, use_kernel: bool = True, triton: bool | None = None) -> None:
        self.use_kernel = use_kernel
        self.triton = triton

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """logits [rows, vocab] in the model's dtype (fp32 only where it is needed)."""
        wants_logprobs = any(n is not None for n in meta.num_logprobs)
        if meta.all_greedy and not _needs_processing(meta) and not wants_logprobs:
            return SamplerOutput(self.argmax(logits))  # no copy of a [rows, vocab] tensor
        work = logits
        if _needs_processing(meta):  # an fp32 copy: bias, penalties and masks in fp32
            work = self._process(logits.to(torch.float32, copy=True), meta)
        if meta.all_greedy:
            token_ids = self.argmax(work)
        else:
            token_ids = self._sample(work, meta)
        pending = (
            _logprobs(logits, token_ids, meta.num_logprobs, self.kernel(logits))
            if wants_logprobs
            else None
        )
        return SamplerOutput(token_ids, pending)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Row-wise first index of the maximum: one vectorized pass in the kernel on the CPU."""
        kernel = self.kernel(logits)
        if kernel is not None and logits.stride(-1) == 1:
            return kernel.argmax(logits)
        return fast_argmax(logits)

    def kernel(self, logits: torch.Tensor):
        """The fused sampling kernel for these logits, or None (torch path)."""
        return self.kernel_for(logits.device, logits.dtype)

    def kernel_for(self, device: torch.device, dtype: torch.dtype):
        """The kernel for logits on `device` in `dtype` (built on the first call), or None."""
        if (
            not self.use_kernel
            or device.type != "cpu"
            or dtype not in (torch.bfloat16, torch.float32)
        ):
            return None
        return cpu_ops.load_sampler()

    # -- logits processing -----------------------------------------------------------------------
    def _process(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        device = logits.device
        if meta.grammar_rows:
            rows = upload(meta.grammar_rows, device)
            logits[rows] = logits[rows].masked_fill(~meta.grammar_mask, float("-inf"))
        biased = [
            (i, t, v) for i, bias in enumerate(meta.logit_bias) if bias for t, v in bias.items()
        ]
        if biased:  # (a request's ids are distinct: no row gets one id twice)
            rows, ids = (upload([b[k] for b in biased], device) for k in (0, 1))
            logits[rows, ids] += upload([b[2] for b in biased], device, torch.float32)
        masked = [(i, t) for i, ids in enumerate(meta.masked_ids) if ids for t in ids]
        if masked:  # (a tensor value: a Python one is copied to the device blocking)
            logits.index_put_(
                (upload([m[0] for m in masked], device), upload([m[1] for m in masked], device)),
                torch.full((len(masked),), float("-inf"), device=device),
            )
        if meta.needs_penalties:
            _apply_penalties(logits, meta)
        return logits

    # -- random sampling -------------------------------------------------------------------------
    def _sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        if self._takes_triton(logits):
            return self._sample_triton(logits, meta)
        kernel = self.kernel(logits)
        if kernel is not None:
            return sample_with_kernel(
                kernel, logits, meta, CANDIDATES, _keep_top, _pick, _sample_filtered
            )
        return self._sample_torch(logits.float(), meta)

    def _takes_triton(self, logits: torch.Tensor) -> bool:
        if not self.use_kernel or self.triton is False or logits.stride(-1) != 1:
            return False
        return bool(self.triton) or (logits.device.type == "cuda" and _HAS_TRITON)

    def _sample_triton(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Greedy and unfiltered rows in one launch, rows with top-k / top-p / min-p in
        another, both over the logits as they are (no copy, no sort, no host read)."""
        temps = meta.temperature
        filtered = [i for i, t in enumerate(temps) if t > 0.0 and _filters(meta, i)]
        if not filtered:
            return _triton_picks(logits, meta, list(range(len(temps))), False)[1]
        plain = sorted(set(range(len(temps))) - set(filtered))
        out = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
        for group, filters in ((plain, False), (filtered, True)):
            if group:
                idx, picks = _triton_picks(logits, meta, group, filters)
                out[idx] = picks
        return out

    def _sample_torch(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        out = fast_argmax(logits)
        rows = [i for i, t in enumerate(meta.temperature) if t > 0.0]
        plain = [i for i in rows if not _filters(meta, i)]
        filtered = [i for i in rows if _filters(meta, i)]
        for group, sort in ((plain, False), (filtered, True)):
            if not group:
                continue
            idx, scaled, u = _scaled_rows(logits, meta, group)
            if sort:
                out[idx] = _sample_filtered(scaled, u, meta, group)
            else:
                out[idx] = inverse_cdf(scaled.softmax(dim=-1), u)
        return out


def _triton_picks(
    logits: torch.Tensor, meta: SamplingMetadata, group: list[int], filters: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows `group` on the device and the Triton kernels' tokens for them:
    csrc_triton/sample_filtered.py's when they filter, else csrc_triton/sample.py's."""
    from vserve.csrc_triton.sample import sample_rows
    from vserve.csrc_triton.sample_filtered import sample_filtered

    idx, temps, u = _row_inputs(meta, group, logits.device)
    if not filters:
        return idx, sample_rows(logits, idx, temps, u)
    limits = (
        _column(meta.top_k, group, logits.device, torch.long),
        _column(meta.top_p, group, logits.device, torch.float64),
        _column(meta.min_p, group, logits.device, torch.float32),
    )
    return idx, sample_filtered(logits, idx, temps, u, *limits)


def _column(values: list, group: list[int], device: torch.device, dtype=None) -> torch.Tensor:
    """values[i] for the rows i of `group`, on `device`."""
    return upload([values[i] for i in group], device, dtype)


def _row_inputs(meta: SamplingMetadata, group: list[int], device: torch.device):
    """For the rows `group`, on `device`: their ids, their temperatures in fp32 and their
    uniform numbers from (seed, position) in fp64."""
    u = [uniform_for(meta.seeds[i], meta.positions[i]) for i in group]
    return (
        upload(group, device, torch.long),
        _column(meta.temperature, group, device, torch.float32),
        upload(u, device, torch.float64),
    )


def _scaled_rows(logits: torch.Tensor, meta: SamplingMetadata, group: list[int]):
    """For the rows `group`: their ids on the device, their logits / temperature in fp32, and
    their uniform numbers from (seed, position) in fp64."""
    idx, temps, u = _row_inputs(meta, group, logits.device)
    return idx, logits[idx].float() / temps.unsqueeze(1), u


def fast_argmax(logits: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
    """Row-wise argmax in two passes (chunk maxima, then the winning chunk), several times
    faster than `argmax` over a 262k vocabulary on CPU, and exact: the first maximal index,
    as `argmax` returns it."""
    rows, vocab = logits.shape
    if vocab % chunk or vocab < 4 * chunk:
        return logits.argmax(dim=-1)
    chunk_max = logits.view(rows, vocab // chunk, chunk).amax(dim=-1)  # [rows, chunks]
    best = chunk_max.argmax(dim=-1)  # [rows]
    starts = (best * chunk).unsqueeze(1) + torch.arange(chunk, device=logits.device)
    return best * chunk + logits.gather(1, starts).argmax(dim=-1)


def _needs_processing(meta: SamplingMetadata) -> bool:
    return (
        any(meta.logit_bias)
        or any(meta.masked_ids)
        or meta.needs_penalties
        or bool(meta.grammar_rows)
    )


def unpack_bitmask(bitmask, vocab_size: int, device: torch.device) -> torch.Tensor:
    """xgrammar's packed int32 bitmask [rows, ceil(vocab / 32)] -> allowed [rows, vocab]."""
    packed = upload(bitmask, device)
    bits = (packed.unsqueeze(-1) >> torch.arange(32, device=device, dtype=packed.dtype)) & 1
    return bits.reshape(packed.shape[0], -1)[:, :vocab_size].bool()


def apply_logit_bias(logits: torch.Tensor, bias: dict[int, float] | None) -> torch.Tensor:
    """logits [n, vocab]: the same bias on every row (in place)."""
    if bias:
        ids = torch.tensor(list(bias), device=logits.device)
        logits[:, ids] += torch.tensor(
            list(bias.values()), device=logits.device, dtype=logits.dtype
        )
    return logits


CANDIDATES = 1024  # filtered rows look at this many tokens before sorting the whole vocabulary


def filtered_probs(scaled: torch.Tensor, params) -> torch.Tensor:
    """Probabilities in vocab order after one request's top-k / top-p / min-p filters;
    scaled [n, vocab] = logits / temperature."""
    probs = scaled.softmax(dim=-1)
    if params.top_k <= 0 and params.top_p >= 1.0 and params.min_p <= 0.0:
        return probs
    n, vocab = probs.shape

    def column(value):
        return torch.full((n, 1), value, device=probs.device)

    out = torch.zeros_like(probs)
    for rows, kept, ids, _ in _kept_tokens(
        probs, column(params.top_k or vocab), column(params.top_p), column(params.min_p)
    ):
        out[rows] = out[rows].scatter(1, ids, kept)
    return out


def _keep_top(sorted_p: torch.Tensor, top_k, top_p, min_p) -> torch.Tensor:
    """sorted_p [n, vocab] probabilities in descending order; limits are scalars or [n, 1].
    Zeroes what top-k / top-p / min-p drop; the most likely token always stays."""
    ranks = torch.arange(sorted_p.shape[-1], device=sorted_p.device).unsqueeze(0)
    keep = ranks < top_k
    keep &= (sorted_p.cumsum(dim=-1) - sorted_p) < top_p  # mass strictly before each token
    keep &= sorted_p >= min_p * sorted_p[:, :1]
    keep[:, 0] = True
    return torch.where(keep, sorted_p, torch.zeros_like(sorted_p))


def _filters(meta: SamplingMetadata, i: int) -> bool:
    return meta.top_k[i] > 0 or meta.top_p[i] < 1.0 or meta.min_p[i] > 0.0


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Token whose CDF interval holds u; float64 sums keep the pick exact and stable."""
    cdf = probs.double().cumsum(dim=-1)
    target = (u * cdf[:, -1]).unsqueeze(1)
    idx = torch.searchsorted(cdf, target, right=True).squeeze(1)
    return idx.clamp_(max=probs.shape[-1] - 1)


def _sample_filtered(
    scaled: torch.Tensor, u: torch.Tensor, meta: SamplingMetadata, group: list[int]
) -> torch.Tensor:
    device = scaled.device
    vocab = scaled.shape[-1]

    def column(values):
        return _column(values, group, device).unsqueeze(1)

    limits = (column([k or vocab for k in meta.top_k]), column(meta.top_p), column(meta.min_p))
    out = torch.empty(len(group), dtype=torch.long, device=device)
    for rows, kept, ids, num_kept in _kept_tokens(scaled.softmax(dim=-1), *limits):
        picked = _pick(kept, u[rows], num_kept)
        out[rows] = ids.gather(1, picked.unsqueeze(1)).squeeze(1)
    return out


def _kept_tokens(probs: torch.Tensor, top_k, top_p, min_p):
    """What top-k / top-p / min-p keep of each row ([n, vocab] probabilities, limits [n, 1]),
    without sorting the vocabulary when it can be avoided.

    A row's kept tokens are a prefix of its tokens by descending probability (ties: lower id
    first). The row's top CANDIDATES tokens give that prefix exactly whenever it ends inside
    them, strictly above the smallest candidate: then every token outside the candidates has
    a lower probability and is dropped by the full sort too. Other rows take the full sort.
    Both paths see the same probabilities in the same order, so their results are the same.
    Where the host cannot read `inside` for free (CUDA), every row takes the full sort.

    Returns up to two groups (rows [m], kept [m, W], ids [m, W], num_kept [m]): the kept
    probabilities in that order, zero past the prefix, and their token ids."""
    rows = torch.arange(probs.shape[0], device=probs.device)
    groups = []
    if probs.shape[-1] > CANDIDATES and host_reads_are_free(probs.device):
        cand_p, cand_ids = _ordered_candidates(probs, CANDIDATES)
        kept = _keep_top(cand_p, top_k, top_p, min_p)
        num_kept = (kept > 0).sum(dim=-1)
        last = cand_p.gather(1, (num_kept - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
        inside = (num_kept < CANDIDATES) & (last > cand_p[:, -1])
        if bool(inside.any()):
            groups.append((rows[inside], kept[inside], cand_ids[inside], num_kept[inside]))
        rows = rows[~inside]
    if rows.numel():
        sorted_p, order = probs[rows].sort(dim=-1, descending=True, stable=True)
        kept = _keep_top(sorted_p, top_k[rows], top_p[rows], min_p[rows])
        groups.append((rows, kept, order, (kept > 0).sum(dim=-1)))
    return groups


def _ordered_candidates(probs: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `count` most likely tokens of each row, by descending probability and, among equal
    probabilities, ascending id (the order of a stable descending sort of the whole row)."""
    _, ids = probs.topk(count, dim=-1)
    ids = ids.sort(dim=-1).values
    p = probs.gather(1, ids)
    p, pos = p.sort(dim=-1, descending=True, stable=True)
    return p, ids.gather(1, pos)


def _pick(kept: torch.Tensor, u: torch.Tensor, num_kept: torch.Tensor) -> torch.Tensor:
    """Inverse CDF over kept probabilities in order, never past the last kept token."""
    return torch.minimum(inverse_cdf(kept, u), (num_kept - 1).clamp(min=0))


def _apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> None:
    """Repetition, presence and frequency penalties of every penalised row at once (in place;
    a row's absent penalty leaves it as it is: x / 1, x - 0)."""
    rows = [
        i
        for i in range(logits.shape[0])
        if meta.repetition[i] != 1.0 or meta.presence[i] != 0.0 or meta.frequency[i] != 0.0
    ]
    counts, seen = _token_counts(logits, meta, rows)

    def column(values):
        return _column(values, rows, logits.device, logits.dtype).unsqueeze(1)

    rep, pres, freq = column(meta.repetition), column(meta.presence), column(meta.frequency)
    idx = upload(rows, logits.device)
    x = logits[idx]
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    x -= freq * counts + pres * (counts > 0).to(logits.dtype)
    logits[idx] = x


def _token_counts(
    logits: torch.Tensor, meta: SamplingMetadata, rows: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """For the penalised `rows`: output token counts [len(rows), vocab] in the logits' dtype
    (host-known ids plus `pending_output`), and seen [len(rows), vocab] bool (prompt or
    output), built on the device by scatters: no shape depends on a device value."""
    vocab, device = logits.shape[-1], logits.device
    slot = {i: k for k, i in enumerate(rows)}
    out_flat = [slot[i] * vocab + t for i in rows for t in meta.output_ids[i]]
    size = len(rows) * vocab
    flat = torch.zeros(size + 1, dtype=logits.dtype, device=device)  # + 1: a discard slot
    flat.index_add_(
        0,
        upload(out_flat, device, torch.long),
        torch.ones(len(out_flat), dtype=logits.dtype, device=device),
    )
    if meta.pending_output is not None:  # rows without penalties count into the discard slot
        pend_rows, pend_ids = meta.pending_output
        slots = upload([slot.get(i, -1) for i in range(logits.shape[0])], device)[pend_rows]
        where = torch.where(slots >= 0, slots * vocab + pend_ids, size)
        flat.index_add_(0, where, torch.ones(where.shape, dtype=logits.dtype, device=device))
    counts = flat[:size].view(len(rows), vocab)
    seen = counts > 0
    prompt_flat = [
        slot[i] * vocab + t for i in rows if meta.repetition[i] != 1.0 for t in meta.prompt_ids[i]
    ]
    seen.view(-1).index_put_(
        (upload(prompt_flat, device, torch.long),),
        torch.ones(len(prompt_flat), dtype=torch.bool, device=device),
    )
    return counts, seen


def _logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_logprobs: list[int | None], kernel=None
) -> PendingLogprobs:
    """From the raw logits (before any processing), for the rows that ask only: the fused
    kernel's one pass per fact where it runs, else log_softmax in fp32."""
    rows = [i for i, n in enumerate(num_logprobs) if n is not None]
    if len(rows) == len(num_logprobs):
        raw, ids = logits, token_ids
    else:
        idx = upload(rows, logits.device)
        raw, ids = logits[idx], token_ids[idx]
    k = max(num_logprobs[i] for i in rows)
    if kernel is not None:
        sampled, ranks, top_ids, top_vals = kernel.logprobs(raw, ids, k)
    else:
        sampled, ranks, top_ids, top_vals = _logprobs_torch(raw.float(), ids, k)
    tensors = [sampled, ranks, ids] + ([top_ids, top_vals] if k else [])
    return PendingLogprobs(num_logprobs, rows, tensors)


def _logprobs_torch(raw: torch.Tensor, ids: torch.Tensor, k: int):
    logprobs = raw.log_softmax(dim=-1)
    top_vals, top_ids = logprobs.topk(k, dim=-1) if k else (None, None)
    sampled = logprobs.gather(1, ids.unsqueeze(1)).squeeze(1)
    ranks = (logprobs > sampled.unsqueeze(1)).sum(dim=-1) + 1
    return sampled, ranks, top_ids, top_vals
