"""Sampling one step's logits: ordinary rows through the `Sampler`, rows with n-gram drafts
through the verifier, grammar bitmasks applied to structured-output rows.

Logits come in the order the runner laid them out: one row per ordinary sampling request,
k + 1 consecutive rows for a request with k drafts (`SampleLayout`).

Plain rows never make the host wait for the device: indices and masks are uploaded through
`vserve.workers.device.upload`, the previous step's ids that penalties count are read on the device
(`FeedbackQueue.device_ids_at`), and logprobs leave as `PendingLogprobs` for the runner's
host copy. Draft rows are verified on the host (their tokens decide the next step's layout).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vserve.core.outputs import LogprobsDelta
from vserve.workers.device import upload
from vserve.workers.input_batch import InputBatch
from vserve.workers.sampler import (
    PendingLogprobs,
    Sampler,
    SamplingMetadata,
    apply_logit_bias,
    unpack_bitmask,
)
from vserve.workers.spec_verify import logprobs_for, verify


@dataclass
class SampleLayout:
    req_ids: list[str] = field(default_factory=list)  # every sampling request, in order
    rows: list[int] = field(default_factory=list)  # their batch rows
    logit_start: list[int] = field(default_factory=list)  # first logits row of each
    drafts: dict[str, list[int]] = field(default_factory=dict)

    @property
    def plain(self) -> list[int]:
        """Indices (into req_ids) of requests without drafts."""
        return [i for i, r in enumerate(self.req_ids) if r not in self.drafts]


@dataclass
class SampleResult:
    plain_ids: torch.Tensor | None  # [num plain] on the device (fed back)
    spec_ids: dict[str, list[int]]  # verified tokens, on the host
    logprobs: dict[str, LogprobsDelta]
    pending_logprobs: PendingLogprobs | None = None  # of the plain rows, still tensors
    plain_req_ids: list[str] = field(default_factory=list)  # ... their rows' requests


class StepSampler:
    def __init__(self, batch: InputBatch, vocab_size: int) -> None:
        self.batch = batch
        self.vocab_size = vocab_size
        self.sampler = Sampler()
        self.feedback = None  # set by the runner: its FeedbackQueue (ids not yet on the host)

    def sample(
        self, layout: SampleLayout, logits: torch.Tensor, grammar_req_ids: list[str], bitmask
    ) -> SampleResult:
        plain = layout.plain
        result = SampleResult(None, {}, {})
        if plain:
            starts = [layout.logit_start[i] for i in plain]
            meta = self.metadata([layout.rows[i] for i in plain], logits.device)
            self._grammar(
                meta, [layout.req_ids[i] for i in plain], grammar_req_ids, bitmask, logits.device
            )
            if starts == list(range(len(logits))):  # no drafts in this step: no gather
                plain_logits = logits
            else:
                plain_logits = logits[upload(starts, logits.device)]
            out = self.sampler(plain_logits, meta)
            result.plain_ids = out.token_ids
            result.pending_logprobs = out.pending_logprobs
            result.plain_req_ids = [layout.req_ids[i] for i in plain]
        for i, req_id in enumerate(layout.req_ids):
            if req_id in layout.drafts:
                self._verify(layout, i, logits, result)
        return result

    def _verify(
        self, layout: SampleLayout, i: int, logits: torch.Tensor, result: SampleResult
    ) -> None:
        req_id, row = layout.req_ids[i], layout.rows[i]
        drafts = layout.drafts[req_id]
        state = self.batch.rows[row]
        raw = logits[layout.logit_start[i] : layout.logit_start[i] + len(drafts) + 1].float()
        processed = apply_logit_bias(raw.clone(), state.sampling_params.logit_bias)
        first = int(self.batch.num_tokens[row])  # index of the first token it yields
        tokens = verify(processed, drafts, state.sampling_params, state.sampling_seed, first)
        result.spec_ids[req_id] = tokens
        if state.sampling_params.logprobs is not None:
            result.logprobs[req_id] = logprobs_for(raw, tokens, state.sampling_params.logprobs)

    def _grammar(
        self,
        meta: SamplingMetadata,
        req_ids: list[str],
        grammar_req_ids: list[str],
        bitmask,
        device,
    ) -> None:
        if not grammar_req_ids or bitmask is None:
            return
        where = {r: k for k, r in enumerate(req_ids)}
        pairs = [(where[r], g) for g, r in enumerate(grammar_req_ids) if r in where]
        if pairs:
            meta.grammar_rows = [p[0] for p in pairs]
            mask = unpack_bitmask(bitmask, self.vocab_size, device)
            meta.grammar_mask = mask[upload([p[1] for p in pairs], device)]

    def metadata(self, rows: list[int], device: torch.device) -> SamplingMetadata:
        """Per-row sampling parameters; positions are those of the tokens being sampled
        (each row already holds a placeholder for it)."""
        batch = self.batch
        states = [batch.rows[r] for r in rows]
        params = [s.sampling_params for s in states]
        positions = [int(batch.num_tokens[r]) - 1 for r in rows]
        masked = []
        for s, pos in zip(states, positions):
            num_out = pos - s.num_prompt_tokens
            masked.append(s.stop_token_ids if num_out < s.sampling_params.min_tokens else None)
        meta = SamplingMetadata(
            temperature=[p.temperature for p in params],
            top_k=[p.top_k for p in params],
            top_p=[p.top_p for p in params],
            min_p=[p.min_p for p in params],
            seeds=[s.sampling_seed for s in states],
            positions=positions,
            num_logprobs=[p.logprobs for p in params],
            logit_bias=[p.logit_bias for p in params],
            masked_ids=masked,
            presence=[p.presence_penalty for p in params],
            frequency=[p.frequency_penalty for p in params],
            repetition=[p.repetition_penalty for p in params],
        )
        if meta.needs_penalties:
            meta.prompt_ids = [batch.prompt_ids(r) for r in rows]
            meta.output_ids, meta.pending_output = self._output_ids(rows, device)
        return meta

    def _output_ids(self, rows: list[int], device: torch.device):
        """Each row's output ids before the one being sampled that the host has, and those it
        lacks (-1: sampled by a step whose ids have not come back) as (rows, ids) on the
        device, gathered there from the feedback queue."""
        batch, known, keys, key_rows = self.batch, [], [], []
        for i, r in enumerate(rows):
            state, ids = batch.rows[r], batch.output_ids(r)[:-1]
            known.append([t for t in ids if t >= 0])
            for k, t in enumerate(ids):
                if t < 0:
                    keys.append((state.req_id, state.epoch, state.num_prompt_tokens + k))
                    key_rows.append(i)
        if not keys:
            return known, None
        found, ids = self.feedback.device_ids_at(keys)
        assert len(found) == len(keys), "an output id is neither on the host nor pending"
        return known, (upload([key_rows[k] for k in found], device), ids)
