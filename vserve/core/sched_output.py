"""Boundary types between the scheduler and the workers.

After a request's first step only deltas cross this boundary: its new blocks and its
computed-token count. Requests that (re)enter the batch -- new ones and resumed ones after a
preemption -- are sent in full, with every confirmed token id. Nothing here holds tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from vserve.core.outputs import LogprobsDelta
from vserve.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    req_id: str
    epoch: int
    token_ids: list[int]  # prompt + confirmed outputs
    num_prompt_tokens: int
    sampling_params: SamplingParams
    sampling_seed: int
    stop_token_ids: list[int]  # EOS and stop ids, masked while output < min_tokens
    block_ids: tuple[list[int], ...]  # per KV group (full, then sliding window); -1: none
    num_computed_tokens: int  # prefix-cache hits; positions already in the KV cache


@dataclass
class CachedRequestData:
    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[tuple[list[int], ...]] = field(default_factory=list)  # per KV group
    num_computed_tokens: list[int] = field(default_factory=list)  # before this step


@dataclass
class SchedulerOutput:
    step_id: int
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    req_epochs: dict[str, int]  # epoch of each scheduled request at schedule time
    sampling_req_ids: set[str]  # scheduled requests whose step yields a token
    finished_req_ids: set[str]
    preempted_req_ids: set[str]
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)  # n-gram drafts
    grammar_req_ids: list[str] = field(default_factory=list)  # sampling, structured output
    pending_grammar: bool = False  # a grammar request has tokens in flight: defer sampling
    grammar_bitmask: np.ndarray | None = None  # int32 [len(grammar_req_ids), ceil(vocab / 32)]

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0

    @staticmethod
    def empty(step_id: int, finished: set[str], preempted: set[str]) -> SchedulerOutput:
        return SchedulerOutput(
            step_id, [], CachedRequestData(), {}, 0, {}, set(), finished, preempted
        )


@dataclass
class StepTiming:
    """Worker-side timestamps (time.perf_counter of the worker process, seconds)."""

    recv: float = 0.0
    forward_start: float = 0.0
    forward_end: float = 0.0
    ready: float = 0.0
    # PP: (start, end) of each stage's own forward, first to last (the overlap report's
    # per-stage figures); empty when the stages do not report them
    stage_forwards: list[tuple[float, float]] = field(default_factory=list)
    # the step's inputs were made in the gap before it, the worker's other threads asleep
    # (workers/host_gap.py)
    parked: bool = False
    # CUDA: the device span of the step's forward and sampling, seconds between an event before
    # the forward and one after the sampling (the timestamps above are the host's, which
    # launches ahead); it includes the device's idle time between them (kernels launched slower
    # than they run; a deferred sampling's wait for the grammar bitmask); 0.0 elsewhere
    device_forward: float = 0.0
    # Triton compiles the worker made since its previous step (workers/compile_count.py)
    compiles: int = 0


@dataclass
class RunnerOutput:
    step_id: int
    req_ids: list[str] = field(default_factory=list)
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[LogprobsDelta | None] | None = None  # per request, per token
    timing: StepTiming | None = None
    # req id -> (index of the first prompt token covered, its entries and the next ones')
    prompt_logprobs: dict[str, tuple[int, LogprobsDelta]] = field(default_factory=dict)
    # req id -> (prompt rows pooled this step, their fp32 sum as little-endian bytes)
    pooled: dict[str, tuple[int, bytes]] = field(default_factory=dict)
