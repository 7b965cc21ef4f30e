"""The model runner: turns a `SchedulerOutput` into a forward pass and sampled tokens.

Per step it applies the deltas to the persistent `InputBatch`, builds the flat inputs
(token ids, positions, slot mapping, block tables), runs the model, computes logits only for
the rows that sample, samples, and starts the host copy of the sampled ids.

On-device token feedback: the ids sampled by the previous sampling step stay on the device
(`_Feedback`). The next step takes every token the host knows from the batch, plans where the
previous step's ids go (`FeedbackPlan`), and hands both to the device's `InputPrep` (numpy +
torch scatter on CPU, one fused Triton launch on CUDA; `workers.input_prep`). Older feedback
is written back into the host rows before it is needed. On CUDA with the Triton backend,
decode-only steps replay a captured CUDA graph (`workers.cuda_graphs`).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from vserve.attention import get_attention_backend
from vserve.attention.base import AttentionMetadata
from vserve.core.sched_output import RunnerOutput, SchedulerOutput, StepTiming
from vserve.models.loader import load_model
from vserve.models.stage import StageInfo
from workers.cuda_graphs import DecodeGraphs, use_cuda_graphs
from workers.device import DeviceShim, HostCopy
from workers.input_batch import InputBatch
from workers.input_prep import DeviceInputs, FeedbackPlan, HostInputs, make_input_prep
from workers.sampler import Sampler, SamplingMetadata

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class RunnerConfig:
    model_path: str
    dtype: str
    max_model_len: int
    max_num_seqs: int
    block_size: int
    device: str = "cpu"
    attention_backend: str = "torch"
    pp_rank: int = 0
    pp_size: int = 1
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    enforce_eager: bool = False


@dataclass
class _Feedback:
    """Ids sampled by one step, kept on the device until the host has them."""

    step_id: int
    token_ids: torch.Tensor | None                 # [num_sampled] on the device
    entries: list[tuple[str, int, int]]            # (req_id, epoch, position) per id
    index: dict[str, int]                          # req_id -> index into token_ids
    host: HostCopy | None = None
    wait_fn: object = None                          # PP: waits for the ids from the last stage

    def device_ids(self) -> torch.Tensor:
        if self.wait_fn is not None:
            self.wait_fn()
            self.wait_fn = None
        return self.token_ids

    def host_ids(self) -> list[int]:
        if self.host is not None:
            return self.host.wait()[0].tolist()
        return self.device_ids().tolist()


@dataclass
class StepInputs:
    input_ids: torch.Tensor | None                 # [num_tokens] (first stage)
    meta: AttentionMetadata
    logits_idx: torch.Tensor                       # [num_sampling_rows]
    sampling_rows: list[int]                       # batch rows that sample, in order
    sampling_req_ids: list[str]
    feedback_dest: list[int] = field(default_factory=list)


class AsyncStepOutput:
    """What `execute_model` returns: resolves to a `RunnerOutput` once the host has the ids."""

    def __init__(self, step_id, req_ids, host: HostCopy | None, logprobs, timing) -> None:
        self.step_id, self.req_ids, self.host = step_id, req_ids, host
        self.logprobs, self.timing = logprobs, timing

    def get(self) -> RunnerOutput:
        ids = self.host.wait()[0].tolist() if self.host is not None else []
        self.timing.ready = time.perf_counter()
        return RunnerOutput(self.step_id, self.req_ids, [[t] for t in ids], self.logprobs,
                            self.timing)


class ModelRunner:
    def __init__(self, config: RunnerConfig, hf_config, pp_comm=None) -> None:
        self.config = config
        self.hf_config = hf_config
        self.device = torch.device(config.device)
        self.shim = DeviceShim(self.device)
        self.dtype = _DTYPES[config.dtype]
        self.stage = StageInfo.split(hf_config.num_hidden_layers, config.pp_size, config.pp_rank)
        self.pp = pp_comm
        max_blocks = -(-config.max_model_len // config.block_size)
        self.batch = InputBatch(config.max_num_seqs, config.max_model_len, max_blocks)
        self.backend = get_attention_backend(config.attention_backend, config.block_size)
        self.sampler = Sampler()
        self.feedback: deque[_Feedback] = deque()
        self.model = None
        self.kv_caches: list[torch.Tensor | None] = []
        self.poison_feedback_slots = False   # tests: garbage in the host copy of fed-back ids
        self.input_prep = make_input_prep(self.shim)
        self.feedback_stats = self.input_prep.stats
        self.graphs: DecodeGraphs | None = None

    # -- set up ----------------------------------------------------------------------------------
    def load_model(self) -> None:
        self.model = load_model(self.config.model_path, self.hf_config, self.stage, self.dtype,
                                self.device, self.config.max_model_len)
        self.windows = {self.model.layer_specs[i].sliding_window
                        for i in range(self.stage.start_layer, self.stage.end_layer)}

    def kv_bytes_per_block(self) -> int:
        per_layer = 0
        for i in range(self.stage.start_layer, self.stage.end_layer):
            spec = self.model.layer_specs[i]
            per_layer += 2 * self.config.block_size * spec.num_kv_heads * spec.head_dim
        return per_layer * self.dtype.itemsize

    def available_kv_bytes(self) -> int:
        if self.config.kv_cache_memory_bytes is not None:
            return self.config.kv_cache_memory_bytes
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            return max(0, int(total * self.config.gpu_memory_utilization) - used)
        return 4 * 1024**3

    def num_kv_blocks(self) -> int:
        """How many blocks this stage could hold (the engine takes the min over stages)."""
        if self.config.num_gpu_blocks_override is not None:
            return self.config.num_gpu_blocks_override
        by_memory = self.available_kv_bytes() // max(1, self.kv_bytes_per_block())
        per_seq = -(-self.config.max_model_len // self.config.block_size)
        return int(min(by_memory, 2 * per_seq * self.config.max_num_seqs))

    def init_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = [None] * self.hf_config.num_hidden_layers
        bs = self.config.block_size
        for i in range(self.stage.start_layer, self.stage.end_layer):
            spec = self.model.layer_specs[i]
            self.kv_caches[i] = torch.zeros(2, num_blocks, bs, spec.num_kv_heads,
                                            spec.head_dim, dtype=self.dtype, device=self.device)
        self.graphs = self._capture_graphs()

    def _capture_graphs(self) -> DecodeGraphs | None:
        """Decode CUDA graphs read the KV cache tensors, so they are captured after them."""
        cfg = self.config
        if not use_cuda_graphs(cfg.device, cfg.attention_backend, cfg.enforce_eager,
                               cfg.pp_size):
            return None
        graphs = DecodeGraphs(self.model, self.kv_caches, self.backend, self.windows,
                              cfg.max_num_seqs, self.batch.block_table.shape[1],
                              cfg.max_model_len, self.device)
        graphs.capture()
        return graphs

    # -- one step --------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> AsyncStepOutput | None:
        timing = StepTiming(recv=time.perf_counter())
        self._update_states(so)
        if so.is_empty:
            return self._empty_output(so, timing)
        inputs = self._prepare_inputs(so)
        timing.forward_start = time.perf_counter()
        first = inputs.input_ids if self.stage.is_first else self.pp.recv_hidden(so, inputs)
        hidden = self._forward(first, inputs.meta)
        if not self.stage.is_last:
            self.pp.send_hidden(so, hidden)
            self._expect_sampled(so, inputs)
            timing.forward_end = time.perf_counter()
            return None
        out = self._sample(so, inputs, hidden, timing)
        return out

    def _forward(self, first: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """first: token ids [T] or hidden states [T, hidden]; -> hidden [T, hidden]."""
        if self.graphs is not None and self.graphs.can_run(meta):
            return self.graphs.run(first, meta)
        return self.model(first, meta.positions, self.kv_caches, meta, self.backend)

    def _empty_output(self, so: SchedulerOutput, timing: StepTiming):
        timing.forward_start = timing.forward_end = time.perf_counter()
        if not self.stage.is_last:
            return None
        return AsyncStepOutput(so.step_id, [], None, None, timing)

    def _sample(self, so, inputs: StepInputs, hidden, timing) -> AsyncStepOutput:
        logits = self.model.compute_logits(hidden[inputs.logits_idx])
        if not inputs.sampling_rows:
            timing.forward_end = time.perf_counter()
            return AsyncStepOutput(so.step_id, [], None, None, timing)
        meta = self._sampling_metadata(inputs)
        sampled = self.sampler(logits, meta)
        token_ids = sampled.token_ids
        self._push_feedback(so, inputs, token_ids)
        if self.pp is not None:
            self.pp.send_sampled(so, token_ids)
        timing.forward_end = time.perf_counter()
        host = self.shim.host_copy([token_ids])
        self.feedback[-1].host = host
        return AsyncStepOutput(so.step_id, inputs.sampling_req_ids, host, sampled.logprobs,
                               timing)

    # -- batch state -----------------------------------------------------------------------------
    def _update_states(self, so: SchedulerOutput) -> None:
        batch = self.batch
        gone = so.finished_req_ids | so.preempted_req_ids
        for req_id in gone:
            batch.remove(req_id)
        for new in so.scheduled_new_reqs:
            batch.remove(new.req_id)
            batch.add(new)
        cached = so.scheduled_cached_reqs
        for req_id, block_ids, num_computed in zip(cached.req_ids, cached.new_block_ids,
                                                   cached.num_computed_tokens):
            row = batch.row_of[req_id]
            assert batch.rows[row].epoch == so.req_epochs[req_id], "stale row for " + req_id
            batch.append_blocks(row, block_ids)
            batch.num_computed[row] = num_computed
        if gone or so.scheduled_new_reqs:
            batch.condense()

    def _prepare_inputs(self, so: SchedulerOutput) -> StepInputs:
        self._flush_feedback(keep_latest=True)
        batch = self.batch
        rows = np.array(sorted(batch.row_of[r] for r in so.num_scheduled_tokens), dtype=np.int64)
        req_ids = [batch.rows[r].req_id for r in rows]
        host = self._host_inputs(so, rows, req_ids)
        sampling = [i for i, r in enumerate(req_ids) if r in so.sampling_req_ids]
        for i in sampling:
            assert batch.num_tokens[rows[i]] == host.seq_lens[i], "lost track of " + req_ids[i]
        plan = self._feedback_plan(host, req_ids, rows) if self.stage.is_first else FeedbackPlan()
        prev = self.feedback[-1].device_ids() if plan.rows else None
        dev = self.input_prep.build(host, plan, prev)
        batch.num_computed[rows] = host.seq_lens
        sampling_rows = [int(rows[i]) for i in sampling]
        for r in sampling_rows:
            batch.append_placeholder(r)
        meta = self._attention_metadata(host, dev)
        logits_idx = self.shim.to_device(host.query_start_loc[1:][sampling] - 1)
        return StepInputs(dev.input_ids if self.stage.is_first else None, meta, logits_idx,
                          sampling_rows, [req_ids[i] for i in sampling], plan.dest)

    def _host_inputs(self, so: SchedulerOutput, rows: np.ndarray,
                     req_ids: list[str]) -> HostInputs:
        batch = self.batch
        num_sched = np.array([so.num_scheduled_tokens[r] for r in req_ids], dtype=np.int64)
        qsl = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(num_sched, out=qsl[1:])
        computed = batch.num_computed[rows]
        rows_rep = np.repeat(rows, num_sched)
        positions = np.repeat(computed, num_sched) + (np.arange(int(qsl[-1]))
                                                      - np.repeat(qsl[:-1], num_sched))
        max_blocks = int(batch.num_blocks[rows].max()) if len(rows) else 0
        block_tables = np.ascontiguousarray(batch.block_table[rows, :max(1, max_blocks)])
        return HostInputs(qsl, computed, positions, computed + num_sched, block_tables,
                          batch.token_ids[rows_rep, positions], self.config.block_size)

    def _feedback_plan(self, host: HostInputs, req_ids: list[str],
                       rows: np.ndarray) -> FeedbackPlan:
        """Where the previous step's ids go; asserts that they cover every unknown token."""
        latest = self.feedback[-1] if self.feedback else None
        plan = FeedbackPlan()
        computed, qsl = host.num_computed, host.query_start_loc
        for i, req_id in enumerate(req_ids if latest is not None else ()):
            j = latest.index.get(req_id)
            if j is None:
                continue
            _, epoch, pos = latest.entries[j]
            offset = int(pos - computed[i])
            if epoch == self.batch.rows[rows[i]].epoch and 0 <= offset < qsl[i + 1] - qsl[i]:
                plan.add(i, j, offset, int(qsl[i] + offset))
        if self.poison_feedback_slots and plan.dest:
            host.host_tokens[plan.dest] = 0
        unknown = host.host_tokens < 0
        unknown[plan.dest] = False
        assert not unknown.any(), "a token the host does not know was not fed back"
        return plan

    def _attention_metadata(self, host: HostInputs, dev: DeviceInputs) -> AttentionMetadata:
        qsl, seq_lens = host.query_start_loc, host.seq_lens
        meta = AttentionMetadata(
            num_tokens=len(host.positions), positions=dev.positions,
            slot_mapping=dev.slot_mapping, query_start_loc=dev.query_start_loc,
            seq_lens=dev.seq_lens, block_tables=dev.block_tables,
            query_start_loc_cpu=qsl.tolist(), seq_lens_cpu=seq_lens.tolist(),
            max_query_len=int(np.diff(qsl).max()), max_seq_len=int(seq_lens.max()))
        meta.backend_data = self.backend.prepare(meta, self.windows)
        return meta

    # -- feedback --------------------------------------------------------------------------------
    def _push_feedback(self, so, inputs: StepInputs, token_ids: torch.Tensor | None,
                       wait_fn=None) -> None:
        entries = []
        for r, req_id in zip(inputs.sampling_rows, inputs.sampling_req_ids):
            state = self.batch.rows[r]
            entries.append((req_id, state.epoch, int(self.batch.num_tokens[r]) - 1))
        index = {req_id: j for j, req_id in enumerate(inputs.sampling_req_ids)}
        self.feedback.append(_Feedback(so.step_id, token_ids, entries, index, wait_fn=wait_fn))

    def _expect_sampled(self, so, inputs: StepInputs) -> None:
        """Non-last PP stages: the last stage sends the sampled ids back to stage 0."""
        if self.stage.is_first and inputs.sampling_rows:
            buf, wait_fn = self.pp.recv_sampled(so, len(inputs.sampling_rows))
            self._push_feedback(so, inputs, buf, wait_fn)

    def _flush_feedback(self, keep_latest: bool) -> None:
        while len(self.feedback) > (1 if keep_latest else 0):
            fb = self.feedback.popleft()
            for (req_id, epoch, pos), token in zip(fb.entries, fb.host_ids()):
                self.batch.write_token(req_id, epoch, pos, token)

    # -- sampling metadata -----------------------------------------------------------------------
    def _sampling_metadata(self, inputs: StepInputs) -> SamplingMetadata:
        batch = self.batch
        states = [batch.rows[r] for r in inputs.sampling_rows]
        params = [s.sampling_params for s in states]
        positions = [int(batch.num_tokens[r]) - 1 for r in inputs.sampling_rows]
        masked = []
        for s, r, pos in zip(states, inputs.sampling_rows, positions):
            num_out = pos - s.num_prompt_tokens
            masked.append(s.stop_token_ids if num_out < s.sampling_params.min_tokens else None)
        meta = SamplingMetadata(
            temperature=[p.temperature for p in params], top_k=[p.top_k for p in params],
            top_p=[p.top_p for p in params], min_p=[p.min_p for p in params],
            seeds=[s.sampling_seed for s in states], positions=positions,
            num_logprobs=[p.logprobs for p in params],
            logit_bias=[p.logit_bias for p in params], masked_ids=masked,
            presence=[p.presence_penalty for p in params],
            frequency=[p.frequency_penalty for p in params],
            repetition=[p.repetition_penalty for p in params])
        if meta.needs_penalties:
            self._flush_feedback(keep_latest=False)
            meta.prompt_ids = [batch.prompt_ids(r) for r in inputs.sampling_rows]
            meta.output_ids = [batch.output_ids(r)[:-1] for r in inputs.sampling_rows]
        return meta
