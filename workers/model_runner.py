"""The model runner: turns a `SchedulerOutput` into a forward pass and sampled tokens.

Per step it applies the deltas to the persistent `InputBatch`, builds the flat inputs
(token ids, positions, slot mapping, block tables), runs the model, computes logits only for
the rows that sample, samples, and starts the host copy of the sampled ids.

On-device token feedback: the ids sampled by the previous sampling step stay on the device
(`_Feedback`). The next step takes every token the host knows from the batch, plans where the
previous step's ids go (`FeedbackPlan`), and hands both to the device's `InputPrep` (numpy +
torch scatter on CPU, one fused Triton launch on CUDA; `vserve.workers.input_prep`). Older feedback
is written back into the host rows before it is needed. On CUDA with the Triton backend,
decode-only steps replay a captured CUDA graph (`vserve.workers.cuda_graphs`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from vserve import cpu_ops
from vserve.attention import get_attention_backend
from vserve.attention.base import AttentionMetadata
from vserve.core.sched_output import RunnerOutput, SchedulerOutput, StepTiming
from vserve.distributed.tp_comm import TPShard
from vserve.models.loader import load_model
from vserve.models.stage import StageInfo
from vserve.workers import compile_count
from vserve.workers.cuda_graphs import DecodeGraphs, use_cuda_graphs
from vserve.workers.device import DeviceShim, HostCopy, device_seconds, fix_blas_thread_count
from vserve.workers.feedback import FeedbackQueue
from vserve.workers.input_batch import InputBatch
from vserve.workers.input_prep import DeviceInputs, FeedbackPlan, HostInputs, make_input_prep
from vserve.workers.kv_cache import (
    DEFAULT_CPU_KV_CACHE_BYTES,
    allocate_kv_caches,
    kv_bytes_per_block,
    num_blocks_for,
    sliding_window_layers,
)
from vserve.workers.memory_profile import (
    DummyBatch,
    dummy_host_inputs,
    dummy_sampling,
    kv_budget,
    peak_bytes,
    profile_batches,
    scratch_blocks,
)
from vserve.workers.pooling import PoolSlice, compute_pooling, plan_pooling
from vserve.workers.prompt_logprobs import (
    PromptSlice,
    compute_prompt_logprobs,
    plan_prompt_logprobs,
)
from vserve.workers.runner_config import RunnerConfig
from vserve.workers.sample_step import SampleLayout, StepSampler

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class StepInputs:
    input_ids: torch.Tensor | None  # [num_tokens] (first stage)
    meta: AttentionMetadata
    logits_idx: torch.Tensor  # [num_logits_rows]
    layout: SampleLayout  # which requests sample, where their logits are
    prompt_lp: list[PromptSlice] = field(default_factory=list)  # last stage, when asked
    prompt_lp_out: dict | None = None  # their results (RunnerOutput.prompt_logprobs)
    pool: list[PoolSlice] = field(default_factory=list)  # last stage: embeddings' rows
    pooled_out: dict | None = None  # their sums (RunnerOutput.pooled)
    start_mark: torch.cuda.Event | None = None  # CUDA: the forward's start on the device


class AsyncStepOutput:
    """What `execute_model` returns: resolves to a `RunnerOutput` once the host has the ids.
    Plain rows' ids arrive through the host copy; verified draft rows are already on the
    host; plain rows' logprobs arrive through their own copy (`pending`: the PendingLogprobs,
    its rows' request ids and that copy)."""

    def __init__(
        self,
        step_id,
        layout: SampleLayout | None,
        host: HostCopy | None,
        spec_ids: dict | None,
        logprobs: dict | None,
        timing,
        pending=None,
        prompt_logprobs: dict | None = None,
        marks: tuple = (None, None),
        pooled: dict | None = None,
    ) -> None:
        self.step_id, self.layout, self.host = step_id, layout, host
        self.spec_ids, self.logprobs, self.timing = spec_ids or {}, logprobs or {}, timing
        self.pending = pending
        self.prompt_logprobs = prompt_logprobs or {}
        self.pooled = pooled or {}
        # CUDA: the forward's start and the sampling's end on the device, read in get() once the
        # ids have come (a step without plain ids does not wait: its span may read 0)
        self.marks = marks

    def get(self) -> RunnerOutput:
        out = RunnerOutput(
            self.step_id,
            timing=self.timing,
            prompt_logprobs=self.prompt_logprobs,
            pooled=self.pooled,
        )
        if self.layout is not None and self.layout.req_ids:
            ids = self.host.wait()[0].tolist() if self.host is not None else []
            out.req_ids = list(self.layout.req_ids)
            if self.spec_ids:
                plain = iter(ids)
                out.sampled_token_ids = [
                    self.spec_ids[r] if r in self.spec_ids else [next(plain)] for r in out.req_ids
                ]
            else:
                out.sampled_token_ids = [[token] for token in ids]
            if self.pending is not None:
                lp, req_ids, copy = self.pending
                self.logprobs.update(
                    (r, d) for r, d in zip(req_ids, lp.resolve(copy.wait())) if d is not None
                )
            if self.logprobs:
                out.logprobs = [self.logprobs.get(r) for r in out.req_ids]
        self.timing.device_forward = device_seconds(*self.marks)  # (the ids came after it)
        self.timing.ready = time.perf_counter()
        return out


@dataclass
class _Prepared:
    so: SchedulerOutput
    timing: StepTiming
    inputs: StepInputs


class ModelRunner:
    def __init__(self, config: RunnerConfig, hf_config, pp_comm=None) -> None:
        self.config = config
        self.hf_config = hf_config
        self.device = torch.device(config.device)
        self.shim = DeviceShim(self.device)
        fix_blas_thread_count()  # results independent of the machine's load
        self.dtype = _DTYPES[config.dtype]
        self.stage = (
            StageInfo.from_counts(config.layer_partition, config.pp_rank)
            if config.layer_partition
            else StageInfo.split(hf_config.num_hidden_layers, config.pp_size, config.pp_rank)
        )
        self.pp = pp_comm
        # tensor parallel: every rank of the last stage computes the logits (an all-gather),
        # TP rank 0 alone samples and sends the ids to the first stage's ranks
        self.tp = TPShard(config.tp_rank, config.tp_size, pp_comm.tp if pp_comm else None)
        self.is_sampler = self.stage.is_last and config.tp_rank == 0
        max_blocks = -(-config.max_model_len // config.block_size)
        self.batch = InputBatch(
            config.max_num_seqs,
            config.max_model_len,
            max_blocks,
            1 if config.sliding_window is None else 2,
        )
        self.backend = get_attention_backend(config.attention_backend, config.block_size)
        self.step_sampler = StepSampler(self.batch, hf_config.vocab_size)
        # stage 0 of a pipeline: the last stage's ids of the pp newest steps may be pending
        self.feedback = FeedbackQueue(config.pp_size if self.stage.is_first else 1)
        self.step_sampler.feedback = self.feedback
        self._deferred = None  # a step whose sampling waits for its grammar bitmask
        self._prepared: _Prepared | None = None  # the next step's inputs, made ahead (`prepare`)
        self.model = None
        self.kv_caches: list[torch.Tensor | None] = []
        self.poison_feedback_slots = False  # tests: garbage in the host copy of fed-back ids
        self.input_prep = make_input_prep(self.shim)
        self.feedback_stats = self.input_prep.stats
        self.graphs: DecodeGraphs | None = None
        self.prompt_lp_req_ids: set[str] = set()  # rows that asked for prompt logprobs
        self.pool_req_ids: set[str] = set()  # rows that asked for an embedding
        if self.device.type == "cuda":  # where Triton compiles: count what it compiles
            compile_count.install()

    # -- set up ----------------------------------------------------------------------------------
    def load_model(self) -> None:
        self.model = load_model(
            self.config.model_path,
            self.hf_config,
            self.stage,
            self.dtype,
            self.device,
            self.config.max_model_len,
            self.config.quantization,
            self.tp,
        )
        self.windows = {
            self.model.layer_specs[i].sliding_window
            for i in range(self.stage.start_layer, self.stage.end_layer)
        }
        if hasattr(self.backend, "kernel"):  # CPU (bf16, fp32): fused decode attention
            self.backend.kernel = getattr(self.model, "kernel", None) or cpu_ops.attention_kernel(
                self.device, self.dtype
            )
        if self.stage.is_last:  # build the sampling kernel now, not on the first sampled step
            self.step_sampler.sampler.kernel_for(self.device, self.dtype)

    def _kv_layers(self) -> tuple[range, set[int]]:
        """This stage's layers, and those of them in the sliding-window KV group."""
        layers = range(self.stage.start_layer, self.stage.end_layer)
        return layers, sliding_window_layers(
            self.model.layer_specs, layers, self.config.sliding_window
        )

    def available_kv_bytes(self, step_peak: int = 0) -> int:
        """step_peak: the dummy steps' peak bytes beside the cache (`profile_run`)."""
        if self.config.kv_cache_memory_bytes is not None:
            return self.config.kv_cache_memory_bytes
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            return kv_budget(total, self.config.gpu_memory_utilization, total - free, step_peak)
        return DEFAULT_CPU_KV_CACHE_BYTES  # a ceiling: pages are committed as blocks fill

    def num_kv_blocks(self) -> int:
        """How many blocks this stage could hold (the engine takes the min over stages). On
        CUDA the dummy steps run first: their peak is counted, and they compile the Triton
        variants a run meets before the engine reports ready."""
        cfg = self.config
        step_peak = self.profile_run() if self.device.type == "cuda" else 0
        if cfg.num_gpu_blocks_override is not None:
            return cfg.num_gpu_blocks_override
        layers, local = self._kv_layers()
        full_bytes, local_bytes = kv_bytes_per_block(
            self.model.layer_specs, layers, local, cfg.block_size, self.dtype
        )
        return num_blocks_for(
            full_bytes,
            self.available_kv_bytes(step_peak),
            cfg.max_num_seqs,
            cfg.max_model_len,
            cfg.block_size,
            local_bytes,
            cfg.local_block_cap,
        )

    @torch.inference_mode()
    def profile_run(self) -> int:
        """The dummy steps of `memory_profile.profile_batches` over a scratch cache, freed
        after; returns their peak bytes (0 on the CPU, which has no such count)."""
        cfg = self.config
        batches = profile_batches(
            cfg.max_num_batched_tokens or cfg.max_model_len, cfg.max_num_seqs, cfg.max_model_len
        )
        layers, local = self._kv_layers()
        n = scratch_blocks(batches, cfg.block_size)
        scratch = allocate_kv_caches(
            self.model.layer_specs, layers, local, n, n, cfg.block_size, self.dtype, self.device
        )

        def run() -> None:
            for i, batch in enumerate(batches):  # the first samples the costliest way
                self._dummy_step(batch, scratch, dummy_sampling(cfg.max_num_seqs, i == 0))

        peak = peak_bytes(run, self.device)
        scratch.clear()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        return peak

    def _dummy_step(self, batch: DummyBatch, kv_caches: list, sampling) -> None:
        """A forward of `batch` through the step's own input preparation and, on the last
        stage, logits and sampling for `max_num_seqs` rows."""
        host = dummy_host_inputs(batch, self.config.block_size)
        dev = self.input_prep.build(host, FeedbackPlan(), None)
        meta = self._attention_metadata(host, dev)
        if self.stage.is_first:
            first = dev.input_ids
        else:
            width = self.hf_config.hidden_size
            first = torch.zeros(meta.num_tokens, width, dtype=self.dtype, device=self.device)
        hidden = self.model(first, meta.positions, kv_caches, meta, self.backend)
        if not self.stage.is_last:
            return
        rows = torch.arange(self.config.max_num_seqs, device=self.device) % meta.num_tokens
        logits = self.model.compute_logits(hidden[rows])
        if self.is_sampler:
            self.step_sampler.sampler(logits, sampling)

    def init_kv_cache(self, num_blocks: int) -> None:
        layers, local = self._kv_layers()
        self.local_null_block = min(num_blocks, self.config.local_block_cap)  # the extra one
        self.kv_caches = allocate_kv_caches(
            self.model.layer_specs,
            layers,
            local,
            num_blocks,
            self.local_null_block,
            self.config.block_size,
            self.dtype,
            self.device,
        )
        self.graphs = self._capture_graphs()
        if self.device.type == "cuda":  # the profile run's and the capture's, not a step's
            logger.info("Triton compiled %d kernel variants at start-up.", compile_count.take())

    def _capture_graphs(self) -> DecodeGraphs | None:
        """Decode CUDA graphs read the KV cache tensors, so they are captured after them."""
        cfg = self.config
        if not use_cuda_graphs(
            cfg.device, cfg.attention_backend, cfg.enforce_eager, cfg.pp_size, cfg.tp_size
        ):
            return None
        graphs = DecodeGraphs(
            self.model,
            self.kv_caches,
            self.backend,
            self.windows,
            cfg.max_num_seqs,
            self.batch.block_table.shape[1],
            cfg.max_model_len,
            self.device,
        )
        graphs.capture()
        return graphs

    # -- one step --------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(
        self, so: SchedulerOutput, defer_sampling: bool = False, hidden_in=None
    ) -> AsyncStepOutput | None:
        """Run one step. With `defer_sampling`, stop after the logits: `sample_tokens` takes
        over once the grammar bitmask is known (structured output under async scheduling).
        `hidden_in`: a later stage's input, its receive already posted (else posted here)."""
        prepared, self._prepared = self._prepared, None
        if prepared is not None:
            if prepared.so is not so:  # the batch moved on for another step: never run it
                raise RuntimeError(f"step {so.step_id}: inputs prepared for {prepared.so.step_id}")
            timing, inputs = prepared.timing, prepared.inputs
        else:
            timing = StepTiming(recv=time.perf_counter())
            self._update_states(so)
            if so.is_empty:
                return self._empty_output(so, timing)
            # a later stage posts the receive of its input first: gloo moves it only then
            if hidden_in is None and not self.stage.is_first:
                hidden_in = self.pp.post_recv_hidden(so)
            inputs = self._prepare_inputs(so)
        first, spans = (
            (inputs.input_ids, []) if hidden_in is None else hidden_in()
        )  # (with the earlier stages' forward spans)
        timing.forward_start = time.perf_counter()  # (a later stage's wait for its input is
        # not its forward: the report compares the bottleneck stage's work with the interval)
        inputs.start_mark = self.shim.mark()
        hidden = self._forward(first, inputs.meta)
        timing.stage_forwards = spans
        if not self.stage.is_last:
            spans.append((timing.forward_start, time.perf_counter()))
            self.pp.send_hidden(so, hidden, spans)
            self._expect_sampled(so, inputs)
            timing.forward_end = time.perf_counter()
            return None
        logits = self.model.compute_logits(hidden[inputs.logits_idx])
        if inputs.prompt_lp:
            inputs.prompt_lp_out = compute_prompt_logprobs(
                self.model, hidden, inputs.prompt_lp, self.step_sampler.vocab_size
            )
        if inputs.pool:
            inputs.pooled_out = compute_pooling(hidden, inputs.pool)
        if defer_sampling:
            self._deferred = (so, inputs, logits, timing)
            return None
        return self._sample(so, inputs, logits, timing, so.grammar_bitmask)

    @torch.inference_mode()
    def prepare(self, so: SchedulerOutput) -> None:
        """The host half of `execute_model(so)` ahead of it, in the gap whose other threads
        sleep (workers/host_gap.py): the batch's update and the step's inputs. A single stage
        only (a later stage posts its input's receive first); the next `execute_model` call
        with this very `so` takes them."""
        if not (self.stage.is_first and self.stage.is_last) or so.is_empty:
            return
        timing = StepTiming(recv=time.perf_counter(), parked=True)
        self._update_states(so)
        self._prepared = _Prepared(so, timing, self._prepare_inputs(so))

    @torch.inference_mode()
    def sample_tokens(self, step_id: int, grammar_bitmask) -> AsyncStepOutput | None:
        """Sampling of the deferred step (earlier stages have nothing to do)."""
        if not self.stage.is_last:
            return None
        so, inputs, logits, timing = self._deferred
        assert so.step_id == step_id, (so.step_id, step_id)
        self._deferred = None
        return self._sample(so, inputs, logits, timing, grammar_bitmask)

    def _forward(self, first: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """first: token ids [T] or hidden states [T, hidden]; -> hidden [T, hidden]."""
        if self.graphs is not None and self.graphs.can_run(meta):
            return self.graphs.run(first, meta)
        return self.model(first, meta.positions, self.kv_caches, meta, self.backend)

    def _empty_output(self, so: SchedulerOutput, timing: StepTiming):
        timing.forward_start = timing.forward_end = time.perf_counter()
        if not self.is_sampler:
            return None
        return AsyncStepOutput(so.step_id, None, None, None, None, timing)

    def _sample(self, so, inputs: StepInputs, logits, timing, bitmask) -> AsyncStepOutput | None:
        if not self.is_sampler:  # another TP rank samples; the first stage takes its ids
            self._expect_sampled(so, inputs)
            return None
        layout = inputs.layout
        result = self.step_sampler.sample(layout, logits, so.grammar_req_ids, bitmask)
        # before the host copies: the ids' copy waits for it, so it has run when they arrive
        end_mark = self.shim.mark()
        host = pending = None
        if result.pending_logprobs is not None:  # copied beside the ids, read in get()
            pending = (
                result.pending_logprobs,
                result.plain_req_ids,
                self.shim.host_copy(result.pending_logprobs.tensors),
            )
        if result.plain_ids is not None:
            plain = layout.plain
            rows = [layout.rows[i] for i in plain]
            fb = self.feedback.push(
                so.step_id, self.batch, rows, [layout.req_ids[i] for i in plain], result.plain_ids
            )
            if self.pp is not None:
                self.pp.send_sampled(so, result.plain_ids)
            host = fb.host = self.shim.host_copy([result.plain_ids])
        for req_id, tokens in result.spec_ids.items():  # verified drafts: host rows now
            self.batch.append_tokens(self.batch.row_of[req_id], tokens)
        timing.compiles = compile_count.take()
        timing.forward_end = time.perf_counter()
        if self.config.pp_size > 1:  # the last stage's own span (with its sampling)
            timing.stage_forwards.append((timing.forward_start, timing.forward_end))
        return AsyncStepOutput(
            so.step_id,
            layout,
            host,
            result.spec_ids,
            result.logprobs,
            timing,
            pending,
            inputs.prompt_lp_out,
            (inputs.start_mark, end_mark),
            inputs.pooled_out,
        )

    # -- batch state -----------------------------------------------------------------------------
    def _update_states(self, so: SchedulerOutput) -> None:
        batch = self.batch
        gone = so.finished_req_ids | so.preempted_req_ids
        for req_id in gone:
            batch.remove(req_id)
            self.prompt_lp_req_ids.discard(req_id)
            self.pool_req_ids.discard(req_id)
        for new in so.scheduled_new_reqs:
            batch.remove(new.req_id)
            batch.add(new)
            if new.sampling_params.prompt_logprobs is not None:
                self.prompt_lp_req_ids.add(new.req_id)
            if new.sampling_params.pooling is not None:
                self.pool_req_ids.add(new.req_id)
        cached = so.scheduled_cached_reqs
        rows = np.array([batch.row_of[r] for r in cached.req_ids], dtype=np.int64)
        stale = np.flatnonzero(batch.epochs[rows] != [so.req_epochs[r] for r in cached.req_ids])
        assert not len(stale), "stale row for " + cached.req_ids[stale[0]]
        batch.num_computed[rows] = cached.num_computed_tokens
        for row, block_ids in zip(rows.tolist(), cached.new_block_ids):
            if block_ids:
                batch.append_blocks(row, block_ids)
        if gone or so.scheduled_new_reqs:
            batch.condense()

    def _prepare_inputs(self, so: SchedulerOutput) -> StepInputs:
        batch = self.batch
        rows = np.array(sorted(batch.row_of[r] for r in so.num_scheduled_tokens), dtype=np.int64)
        self.feedback.settle(
            batch, self._query_spans(so, rows) if self.feedback.max_pending > 1 else None
        )
        req_ids = [batch.rows[r].req_id for r in rows.tolist()]
        for req_id, drafts in so.spec_token_ids.items():  # drafts are host-known inputs
            row = batch.row_of[req_id]
            start = int(batch.num_computed[row]) + 1
            batch.token_ids[row, start : start + len(drafts)] = drafts
        host = self._host_inputs(so, rows, req_ids)
        layout, logits_rows = self._sample_layout(so, rows, req_ids, host)
        plan = (
            self.feedback.plan(batch, host, req_ids, rows, self.poison_feedback_slots)
            if self.stage.is_first
            else FeedbackPlan()
        )
        prev = self.feedback.source.device_ids() if plan.rows else None
        dev = self.input_prep.build(host, plan, prev)
        batch.num_computed[rows] = host.seq_lens
        batch.append_placeholders(np.array([layout.rows[i] for i in layout.plain], dtype=np.int64))
        meta = self._attention_metadata(host, dev)
        logits_idx = self.shim.to_device(np.array(logits_rows, dtype=np.int64))
        # the requests that read their prompt's rows (last stage): prompt logprobs, pooling
        step = (batch, req_ids, rows, host.query_start_loc, host.num_computed, host.seq_lens)
        last = self.stage.is_last
        wanted = self.prompt_lp_req_ids
        prompt_lp = plan_prompt_logprobs(wanted, *step) if wanted and last else []
        pool = plan_pooling(self.pool_req_ids, *step) if self.pool_req_ids and last else []
        return StepInputs(
            dev.input_ids if self.stage.is_first else None,
            meta,
            logits_idx,
            layout,
            prompt_lp,
            pool=pool,
        )

    def _query_spans(self, so, rows: np.ndarray) -> dict[str, tuple[int, int, int]]:
        """req_id -> (epoch, first, end) positions this step computes for it."""
        batch, spans = self.batch, {}
        for row in rows.tolist():
            state = batch.rows[row]
            first = int(batch.num_computed[row])
            spans[state.req_id] = (
                state.epoch,
                first,
                first + so.num_scheduled_tokens[state.req_id],
            )
        return spans

    def _sample_layout(self, so, rows, req_ids, host: HostInputs):
        """Which requests sample and which logits rows they need: the last query token, or
        every query token of a request with drafts (the drafts' positions and one more)."""
        if not so.spec_token_ids:
            return self._plain_layout(so, rows, req_ids, host)
        layout, logits_rows = SampleLayout(), []
        qsl = host.query_start_loc
        for i, req_id in enumerate(req_ids):
            if req_id not in so.sampling_req_ids:
                continue
            drafts = so.spec_token_ids.get(req_id, ())
            row = int(rows[i])
            assert self.batch.num_tokens[row] + len(drafts) == host.seq_lens[i], (
                "worker lost track of " + req_id
            )
            layout.req_ids.append(req_id)
            layout.rows.append(row)
            layout.logit_start.append(len(logits_rows))
            if drafts:
                layout.drafts[req_id] = list(drafts)
                logits_rows.extend(range(int(qsl[i]), int(qsl[i + 1])))
            else:
                logits_rows.append(int(qsl[i + 1]) - 1)
        return layout, logits_rows

    def _plain_layout(self, so, rows, req_ids, host: HostInputs):
        """`_sample_layout` of a step without drafts, in numpy: the last query token each."""
        keep = np.array([r in so.sampling_req_ids for r in req_ids], dtype=bool)
        picked = rows[keep]
        lost = np.flatnonzero(self.batch.num_tokens[picked] != host.seq_lens[keep])
        assert not len(lost), "worker lost track of " + req_ids[np.flatnonzero(keep)[lost[0]]]
        layout = SampleLayout(
            [r for r, k in zip(req_ids, keep.tolist()) if k],
            picked.tolist(),
            list(range(len(picked))),
        )
        return layout, (host.query_start_loc[1:][keep] - 1).tolist()

    def _host_inputs(self, so: SchedulerOutput, rows: np.ndarray, req_ids: list[str]) -> HostInputs:
        batch = self.batch
        num_sched = np.array([so.num_scheduled_tokens[r] for r in req_ids], dtype=np.int64)
        qsl = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(num_sched, out=qsl[1:])
        computed = batch.num_computed[rows]
        rows_rep = np.repeat(rows, num_sched)
        positions = np.repeat(computed, num_sched) + (
            np.arange(int(qsl[-1])) - np.repeat(qsl[:-1], num_sched)
        )
        max_blocks = int(batch.num_blocks[rows].max()) if len(rows) else 0
        width = max(1, max_blocks)
        block_tables = np.ascontiguousarray(batch.block_table[rows, :width])
        local_tables = None
        if self.config.sliding_window is not None:  # dead entries -> the null block
            local_tables = batch.block_tables[1][rows, :width]
            dead = (
                np.arange(width)
                < np.maximum(
                    0, (computed - self.config.sliding_window + 1) // self.config.block_size
                )[:, None]
            )
            local_tables[dead | (local_tables < 0)] = self.local_null_block
        return HostInputs(
            qsl,
            computed,
            positions,
            computed + num_sched,
            block_tables,
            batch.token_ids[rows_rep, positions],
            self.config.block_size,
            local_tables,
        )

    def _attention_metadata(self, host: HostInputs, dev: DeviceInputs) -> AttentionMetadata:
        qsl, seq_lens = host.query_start_loc, host.seq_lens
        meta = AttentionMetadata(
            num_tokens=len(host.positions),
            positions=dev.positions,
            slot_mapping=dev.slot_mapping,
            query_start_loc=dev.query_start_loc,
            seq_lens=dev.seq_lens,
            block_tables=dev.block_tables,
            local_slot_mapping=dev.local_slot_mapping,
            local_block_tables=dev.local_block_tables,
            query_start_loc_cpu=qsl.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
            max_query_len=int(np.diff(qsl).max()),
            max_seq_len=int(seq_lens.max()),
        )
        fused = getattr(self.model, "fused", None)
        if fused is None or not fused.can_run(meta, self.backend):
            # (a fused decode step reads the paged cache itself: no gathers or masks to plan)
            meta.backend_data = self.backend.prepare(meta, self.windows)
        return meta

    # -- feedback --------------------------------------------------------------------------------
    def _expect_sampled(self, so, inputs: StepInputs) -> None:
        """Ranks that do not sample: the sampling rank sends its ids to the first stage."""
        layout = inputs.layout
        plain = layout.plain
        if self.stage.is_first and plain:
            buf, wait_fn = self.pp.recv_sampled(so, len(plain))
            self.feedback.push(
                so.step_id,
                self.batch,
                [layout.rows[i] for i in plain],
                [layout.req_ids[i] for i in plain],
                buf,
                wait_fn,
            )
