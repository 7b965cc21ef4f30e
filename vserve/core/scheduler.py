"""The scheduler: one token-budget loop over running, then waiting requests.

`schedule()` never needs the results of in-flight steps: it works on counts only
(N, C, PH; see `request.py`). `update_from_output()` commits one step's sampled tokens, in
step order, and drops outputs whose request has finished, been aborted or been preempted since
the step was scheduled (its epoch no longer matches). Chunked prefill, prefix-cache hits and
decode are one path: every scheduled request gets `num_new` tokens under the budget.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from vserve.core.kv_cache_manager import BlockIds, KVCacheManager
from vserve.core.outputs import EngineCoreOutput, LogprobsDelta, RequestError, SchedulerStats
from vserve.core.pooling import add_pooled, pooled_vector, reset_pooled
from vserve.core.request import Request, RequestStatus
from vserve.core.sched_output import (
    CachedRequestData,
    NewRequestData,
    RunnerOutput,
    SchedulerOutput,
)
from vserve.core.spec_decode import SpecDecodeStats, SpeculativeConfig, propose_ngram
from vserve.core.structured import StructuredOutputs


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 2048
    async_scheduling: bool = False  # let a request sit in consecutive in-flight steps
    pipeline_parallel_size: int = 1  # PP: a decoding request joins at most every pp-th step


@dataclass(slots=True)
class _StepPlan:
    step_id: int
    budget: int
    num_scheduled: dict[str, int] = field(default_factory=dict)
    new_reqs: list[Request] = field(default_factory=list)
    cached_reqs: list[tuple[Request, BlockIds, int]] = field(default_factory=list)
    sampling: set[str] = field(default_factory=set)
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    grammar_ids: list[str] = field(default_factory=list)
    pending_grammar: bool = False
    epochs: dict[str, int] = field(default_factory=dict)
    preempted_any: bool = False
    num_prompt_tokens: int = 0
    num_decodes: int = 0


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        spec: SpeculativeConfig | None = None,
        structured: StructuredOutputs | None = None,
    ) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.spec = spec
        self.structured = structured  # grammar states and bitmasks (xgrammar in the engine)
        self._error_outputs: list[EngineCoreOutput] = []
        self.spec_stats = SpecDecodeStats()
        self._lag_cache: dict[str, tuple[int, bool]] = {}  # req id -> (length, n-gram match)
        self.num_draft_waits = 0  # requests held back for their previous step (cumulative)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()
        self.preempted_req_ids: set[str] = set()
        self._step_ids = itertools.count(1)
        self._epochs = itertools.count(1)
        self.num_preemptions = 0
        self._num_generation_tokens = 0
        self._num_prompt_tokens = 0

    # -- queries ---------------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_requests(self) -> bool:
        """Work for a step: unfinished requests, or finished ids the workers must hear of."""
        return bool(self.requests or self.finished_req_ids or self.preempted_req_ids)

    # -- admission and aborts ----------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already running")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, request_ids, status: RequestStatus) -> list[Request]:
        """Finish (abort) requests wherever they are; unknown or finished ids are ignored."""
        done = []
        for req_id in request_ids:
            req = self.requests.get(req_id)
            if req is None:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            self._free(req, status)
            done.append(req)
        return done

    # -- schedule ----------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        plan = _StepPlan(next(self._step_ids), self.config.max_num_batched_tokens)
        self._schedule_running(plan)
        if not plan.preempted_any:
            self._schedule_waiting(plan)
        return self._build_output(plan)

    def _schedule_running(self, plan: _StepPlan) -> None:
        pp, drafting = self.config.pipeline_parallel_size > 1, self.spec is not None
        i = 0
        while i < len(self.running):
            req = self.running[i]
            decode = pp and req.num_uncomputed == 1  # counted for pipeline parallel only
            if pp and self._pp_defers(req, decode, plan):
                i += 1
                continue
            num_new = self._num_new_tokens(req, plan.budget)
            if num_new == 0:
                i += 1
                continue
            drafts = self._propose(req, num_new, plan.budget) if drafting else ()
            num_computed = req.num_computed_tokens
            block_ids = self._allocate_or_preempt(req, num_new + len(drafts), plan)
            if block_ids is None:
                continue  # req itself was preempted; the list shifted under i
            plan.cached_reqs.append((req, block_ids, num_computed))
            self._schedule_req(req, num_new, plan, drafts)
            plan.num_decodes += decode
            i += 1

    def _pp_defers(self, req: Request, decode: bool, plan: _StepPlan) -> bool:
        """Pipeline parallel: disjoint groups of decoding requests keep every stage busy.
        A request whose input is a token still in flight waits until the step sampling it is
        `pp` steps old, when stage 0 has that token (vLLM V2's decode cadence); and a step
        takes at most 1/pp of the running requests as decodes, so the groups stay even."""
        pp = self.config.pipeline_parallel_size
        if not decode:
            return False
        if req.num_output_placeholders and plan.step_id - req.inflight_step_ids[-1] < pp:
            return True
        return plan.num_decodes >= -(-len(self.running) // pp)

    def _allocate_or_preempt(self, req: Request, num_new: int, plan: _StepPlan) -> BlockIds | None:
        while True:
            block_ids = self.kv.allocate_slots(req, req.num_computed_tokens + num_new)
            if block_ids is not None:
                return block_ids
            victim = self.running[-1]
            self._preempt(victim)
            plan.preempted_any = True
            if victim is req:
                return None

    def _schedule_waiting(self, plan: _StepPlan) -> None:
        compiling: list[Request] = []  # grammars not ready yet: they keep their place
        while self.waiting and plan.budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if not self._grammar_ready(req):
                compiling.append(self.waiting.popleft())
                continue
            hits, num_hit = self.kv.get_computed_blocks(req)
            num_new = min(req.num_tokens - num_hit, plan.budget)
            if self.kv.allocate_slots(req, num_hit + num_new, hits) is None:
                break
            self.waiting.popleft()
            self.kv.record_prefix_query(req.num_tokens, num_hit)
            req.status = RequestStatus.RUNNING
            req.epoch = next(self._epochs)
            req.num_computed_tokens = num_hit
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
            self.running.append(req)
            plan.new_reqs.append(req)
            self._schedule_req(req, num_new, plan)
        self.waiting.extendleft(reversed(compiling))
        for req in [r for r in compiling if r.error is not None]:
            self.waiting.remove(req)
            self._fail(req)

    def _grammar_ready(self, req: Request) -> bool:
        """Structured output: admit only once the grammar compiled (off the busy loop)."""
        constraint = req.sampling_params.structured_outputs
        if constraint is None or req.grammar is not None:
            return True
        future = req.grammar_future
        if future is None or self.structured is None:
            req.error = "structured outputs are not available in this engine"
            return False
        if not future.done():
            return False
        try:
            req.grammar = self.structured.new_state(future.result(), constraint.starts_after)
        except RequestError as e:  # over the compile budget, or invalid: fails only this one
            req.error, req.error_kind = str(e), e.kind
            return False
        except Exception as e:  # noqa: BLE001 -- the engine's failure, still only this request's
            req.error = f"structured outputs: cannot compile the grammar: {e}"
            return False
        return True

    def _fail(self, req: Request) -> None:
        self._free(req, RequestStatus.FINISHED_ERROR)
        self._error_outputs.append(
            EngineCoreOutput(
                req.request_id,
                [],
                finish_reason="error",
                error=req.error,
                incarnation=req.incarnation,
                error_kind=req.error_kind,
            )
        )

    def _num_new_tokens(self, req: Request, budget: int) -> int:
        """Tokens to schedule for a running request; 0 when no wanted token can come of it."""
        if budget <= 0:
            return 0
        ph = req.num_output_placeholders
        num_tokens = len(req.all_token_ids)
        max_tokens = req.sampling_params.max_tokens
        if max_tokens is not None and num_tokens - len(req.prompt_token_ids) + ph >= max_tokens:
            return 0
        if num_tokens + ph >= self.config.max_model_len:
            return 0
        if self.spec is not None and ph > 0 and self._waits_for_drafts(req, ph):
            self.num_draft_waits += 1
            return 0  # its next step may carry drafts: they need every earlier id on the host
        pending = num_tokens - req.num_computed_tokens
        if self.config.async_scheduling:
            pending += ph
        if pending > budget:
            return budget
        return pending if pending > 0 else 0

    # -- n-gram drafts -----------------------------------------------------------------------------
    # Whether the step that samples position p = N + PH may carry drafts is decided from the
    # ids before p - 1 (the "lagged" match), which are on the host while one step without
    # drafts is still in flight. So a request with no match overlaps its steps as without
    # drafts, one with a match waits for its own previous step only, and sync and async runs
    # draft at the same positions (seeded sampling gives the same tokens in both).
    def _propose(self, req: Request, num_new: int, budget: int) -> list[int]:
        """N-gram drafts for a decoding request whose ids are all known (no step in flight).
        Never more than can yield wanted tokens (max_tokens, max_model_len, the budget)."""
        spec = self.spec
        if (
            spec is None
            or num_new != 1
            or req.num_output_placeholders
            or req.num_computed_tokens != req.num_tokens - 1
            or self._never_drafts(req, 0)
        ):
            return []
        room = min(self._draft_room(req, 0), budget - 1)
        if room <= 0 or not self._lagged_match(req, 0):
            return []
        return propose_ngram(
            req.all_token_ids, spec.prompt_lookup_min, spec.prompt_lookup_max, room
        )

    def _waits_for_drafts(self, req: Request, ph: int) -> bool:
        """A request with `ph` placeholders in flight waits for them iff its next step may
        carry drafts (or a step in flight may carry some: its positions are not known yet)."""
        if self._never_drafts(req, ph):
            return False  # no step of it carried drafts, and this one will not either
        if ph > 1:
            return True  # several steps in flight, or one with drafts (it reserved 1 + k)
        return self._draft_room(req, ph) > 0 and self._lagged_match(req, ph)

    def _never_drafts(self, req: Request, ph: int) -> bool:
        """No drafts at this position, nor at any earlier one: penalties, min_tokens and
        grammars read the output history (or grammar) position by position; a prefill has
        no output yet."""
        sp = req.sampling_params
        num_out = req.num_output_tokens + ph
        return num_out == 0 or num_out < sp.min_tokens or sp.needs_penalties or req.use_grammar

    def _draft_room(self, req: Request, ph: int) -> int:
        assert self.spec is not None  # asked only while drafting
        room = min(
            self.spec.num_speculative_tokens, self.config.max_model_len - (req.num_tokens + ph) - 1
        )
        if req.max_tokens is not None:
            room = min(room, req.max_tokens - (req.num_output_tokens + ph) - 1)
        return room

    def _lagged_match(self, req: Request, ph: int) -> bool:
        """An n-gram match on the ids before the one this step feeds (cached per position)."""
        length = req.num_tokens + ph - 1
        cached = self._lag_cache.get(req.request_id)
        if cached is None or cached[0] != length:
            spec = self.spec
            assert spec is not None  # asked only while drafting
            tokens = req.all_token_ids if length == req.num_tokens else req.all_token_ids[:length]
            found = bool(propose_ngram(tokens, spec.prompt_lookup_min, spec.prompt_lookup_max, 1))
            cached = self._lag_cache[req.request_id] = (length, found)
        return cached[1]

    def _schedule_req(
        self, req: Request, num_new: int, plan: _StepPlan, drafts: Sequence[int] = ()
    ) -> None:
        req_id, num_tokens = req.request_id, len(req.all_token_ids)
        prompt_left = len(req.prompt_token_ids) - req.num_computed_tokens
        if prompt_left > 0:
            plan.num_prompt_tokens += min(num_new, prompt_left)
        num_new += len(drafts)
        req.num_computed_tokens += num_new
        plan.budget -= num_new
        plan.num_scheduled[req_id] = num_new
        plan.epochs[req_id] = req.epoch
        req.inflight_step_ids.append(plan.step_id)
        if drafts:
            # placeholders for every token the step may yield: the drafts and one more
            req.num_output_placeholders += 1 + len(drafts)
            plan.sampling.add(req_id)
            plan.spec_tokens[req_id] = list(drafts)
        elif req.num_computed_tokens == num_tokens + req.num_output_placeholders:
            if req.use_grammar:
                plan.grammar_ids.append(req_id)
                # tokens in flight have not advanced the grammar yet: sample after they commit
                plan.pending_grammar |= req.num_output_placeholders > 0
            req.num_output_placeholders += 1
            plan.sampling.add(req_id)
        self.kv.cache_blocks(req)

    def _build_output(self, plan: _StepPlan) -> SchedulerOutput:
        new = [self._new_request_data(r, plan.num_scheduled[r.request_id]) for r in plan.new_reqs]
        cached = CachedRequestData(
            [req.request_id for req, _, _ in plan.cached_reqs],
            [block_ids for _, block_ids, _ in plan.cached_reqs],
            [num_computed for _, _, num_computed in plan.cached_reqs],
        )
        out = SchedulerOutput(
            step_id=plan.step_id,
            scheduled_new_reqs=new,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=plan.num_scheduled,
            total_num_scheduled_tokens=sum(plan.num_scheduled.values()),
            req_epochs=plan.epochs,
            sampling_req_ids=plan.sampling,
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids=self.preempted_req_ids,
            spec_token_ids=plan.spec_tokens,
            grammar_req_ids=plan.grammar_ids,
            pending_grammar=plan.pending_grammar,
        )
        self.finished_req_ids, self.preempted_req_ids = set(), set()
        self._num_prompt_tokens += plan.num_prompt_tokens
        return out

    def _new_request_data(self, req: Request, num_scheduled: int) -> NewRequestData:
        sp = req.sampling_params
        stop_ids = [] if sp.ignore_eos else list(req.eos_token_ids)
        stop_ids += list(sp.stop_token_ids or [])
        return NewRequestData(
            req_id=req.request_id,
            epoch=req.epoch,
            token_ids=list(req.all_token_ids),
            num_prompt_tokens=req.num_prompt_tokens,
            sampling_params=sp,
            sampling_seed=req.sampling_seed,
            stop_token_ids=stop_ids,
            block_ids=self.kv.block_ids(req.request_id),
            num_computed_tokens=req.num_computed_tokens - num_scheduled,
        )

    # -- preemption and freeing --------------------------------------------------------------------
    def _preempt(self, req: Request) -> None:
        """Recompute preemption: the request loses its blocks and in-flight outputs."""
        self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_output_placeholders = 0
        req.inflight_step_ids.clear()
        req.epoch = -1
        req.num_preemptions += 1
        reset_pooled(req)
        self.num_preemptions += 1
        self.preempted_req_ids.add(req.request_id)
        self.waiting.appendleft(req)

    def _free(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        if req.grammar_future is not None and self.structured is not None:
            self.structured.release(req.grammar_future)  # a compile nobody waits for stops
            req.grammar_future = None
        self.kv.free(req)
        self.finished_req_ids.add(req.request_id)
        del self.requests[req.request_id]
        self._lag_cache.pop(req.request_id, None)

    # -- commit ----------------------------------------------------------------------------------
    def update_from_output(self, so: SchedulerOutput, ro: RunnerOutput) -> list[EngineCoreOutput]:
        index = {req_id: i for i, req_id in enumerate(ro.req_ids)}
        outputs, self._error_outputs = self._error_outputs, []
        requests, epochs, sampling = self.requests, so.req_epochs, so.sampling_req_ids
        prompt_logprobs, pooled, drafts = ro.prompt_logprobs, ro.pooled, so.spec_token_ids
        generated = 0
        for req_id in so.num_scheduled_tokens:
            req = requests.get(req_id)
            if req is None or req.epoch != epochs[req_id]:
                continue  # finished, aborted or preempted since this step was scheduled
            assert req.inflight_step_ids.popleft() == so.step_id, "steps committed out of order"
            if prompt_logprobs and req_id in prompt_logprobs:
                _add_prompt_logprobs(req, *prompt_logprobs[req_id])
            if pooled and req_id in pooled:
                add_pooled(req, *pooled[req_id])
            if req_id not in sampling:
                continue  # a partial prefill chunk yields nothing
            i = index[req_id]
            tokens = ro.sampled_token_ids[i]
            num_drafts = len(drafts[req_id]) if drafts and req_id in drafts else 0
            if num_drafts or len(tokens) != 1:
                self._settle_placeholders(req, num_drafts, len(tokens))
            else:  # one token, no drafts: its placeholder becomes the token
                req.num_output_placeholders -= 1
            out = self._commit_tokens(req, tokens, ro.logprobs[i] if ro.logprobs else None)
            outputs.append(out)
            generated += len(out.new_token_ids)
        self._num_generation_tokens += generated
        return outputs

    def _settle_placeholders(self, req: Request, num_drafts: int, num_tokens: int) -> None:
        """A step reserved 1 + drafts placeholders and yields `num_tokens` (accepted drafts
        and one more). Rejected drafts roll back C and PH alike, so D = N + PH - C holds."""
        rejected = num_drafts + 1 - num_tokens
        assert 0 <= rejected <= num_drafts, (num_drafts, num_tokens)
        req.num_computed_tokens -= rejected
        req.num_output_placeholders -= 1 + num_drafts
        if num_drafts:
            self.spec_stats.record(num_drafts, num_tokens - 1)

    def _commit_tokens(self, req: Request, token_ids: list[int], logprobs: LogprobsDelta | None):
        emitted: list[int] = []
        status = None
        for token_id in token_ids:
            error = _grammar_accept(req.grammar, token_id) if req.grammar is not None else None
            if error is not None:
                req.error, status = error, RequestStatus.FINISHED_ERROR
                break
            req.append_output_token(token_id)
            emitted.append(token_id)
            status = self._check_stop(req, token_id)
            if status is not None:
                break
        out = EngineCoreOutput(
            req.request_id,
            emitted,
            None if logprobs is None else _logprobs_delta(logprobs, len(emitted)),
            num_cached_tokens=max(req.num_cached_tokens, 0),
            prompt_logprobs=req.prompt_logprobs,
            incarnation=req.incarnation,
        )
        req.prompt_logprobs = None
        if status is not None and req.sampling_params.pooling is not None:
            out.embedding, error = pooled_vector(req)
            if error is not None and status != RequestStatus.FINISHED_ERROR:
                req.error, status = f"embedding: {error}", RequestStatus.FINISHED_ERROR
        if status is not None:
            self.running.remove(req)
            self._free(req, status)
            out.finish_reason, out.stop_reason = req.finish_reason, req.stop_reason
            out.error = req.error
        else:
            self.kv.cache_blocks(req)
        return out

    def _check_stop(self, req: Request, token_id: int) -> RequestStatus | None:
        """Token-level stops. The first `min_tokens` outputs never stop on EOS or a stop id
        (the sampler masks those ids for them as well)."""
        sp = req.sampling_params
        if req.grammar is not None and req.grammar.is_terminated():
            return RequestStatus.FINISHED_STOPPED  # nothing can follow, whatever ignore_eos
        num_tokens = len(req.all_token_ids)
        num_output = num_tokens - len(req.prompt_token_ids)
        if num_output > sp.min_tokens:
            if not sp.ignore_eos and token_id in req.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if sp.stop_token_ids and token_id in sp.stop_token_ids:
                req.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        if sp.max_tokens is not None and num_output >= sp.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    # -- structured output -------------------------------------------------------------------------
    def fill_grammar_bitmask(self, so: SchedulerOutput) -> None:
        """Token bitmask rows for the step's sampling grammar requests. Called at once when
        no grammar request has tokens in flight, else after the previous step committed."""
        if not so.grammar_req_ids or self.structured is None:
            return
        bitmask = self.structured.allocate_bitmask(len(so.grammar_req_ids))
        for row, req_id in enumerate(so.grammar_req_ids):
            req = self.requests.get(req_id)
            if req is not None and req.grammar is not None and req.epoch == so.req_epochs[req_id]:
                try:
                    self.structured.fill(req.grammar, bitmask, row)
                except Exception as e:  # noqa: BLE001 -- fails this request only
                    req.error = f"structured outputs: cannot compute the token mask: {e}"
                    self.running.remove(req)
                    self._fail(req)  # its row's sample is dropped: the request is gone
        so.grammar_bitmask = bitmask

    def grammar_behind(self, so: SchedulerOutput) -> bool:
        """Whether a grammar request of `so` still has an older step in flight, whose tokens
        its grammar has not accepted yet (its bitmask must wait for that step's commit)."""
        for req_id in so.grammar_req_ids:
            req = self.requests.get(req_id)
            if (
                req is not None
                and req.epoch == so.req_epochs[req_id]
                and req.inflight_step_ids[0] != so.step_id
            ):
                return True
        return False

    def has_error_outputs(self) -> bool:
        return bool(self._error_outputs)

    # -- stats and checks --------------------------------------------------------------------------
    def make_stats(self, step_id: int = 0) -> SchedulerStats:
        stats = SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=self.kv.usage,
            num_kv_blocks=self.kv.num_blocks,
            prefix_cache_queries=self.kv.num_queried_tokens,
            prefix_cache_hits=self.kv.num_hit_tokens,
            num_preemptions=self.num_preemptions,
            num_prompt_tokens=self._num_prompt_tokens,
            num_generation_tokens=self._num_generation_tokens,
            step_id=step_id,
            spec_num_drafts=self.spec_stats.num_drafts,
            spec_num_draft_tokens=self.spec_stats.num_draft_tokens,
            spec_num_accepted_tokens=self.spec_stats.num_accepted_tokens,
        )
        self._num_prompt_tokens = self._num_generation_tokens = 0
        return stats

    def check_invariants(self) -> None:
        """Assert the invariants of `request.py` (PH >= 0, C - PH settled, blocks conserved);
        tests call this after every schedule and commit."""
        assert len(self.running) <= self.config.max_num_seqs
        assert set(r.request_id for r in self.running) | set(
            r.request_id for r in self.waiting
        ) == set(self.requests)
        for req in self.running:
            assert req.status == RequestStatus.RUNNING
            assert req.num_output_placeholders >= 0, req
            assert req.num_uncomputed >= 0, req
            assert req.num_computed_tokens <= self.config.max_model_len
            held = len(self.kv.req_blocks.get(req.request_id, ()))
            assert held * self.kv.block_size >= req.num_computed_tokens, req
        for req in self.waiting:
            assert req.num_computed_tokens == 0 and req.num_output_placeholders == 0, req
            assert req.request_id not in self.kv.req_blocks
        self.kv.check_invariants(set(self.requests))


def _grammar_accept(grammar, token_id: int) -> str | None:
    """None if the grammar accepted the token, else why not (an xgrammar error included)."""
    try:
        if grammar.accept(token_id):
            return None
        return f"structured outputs: the grammar rejected token {token_id}"
    except Exception as e:  # noqa: BLE001 -- fails this request only
        return f"structured outputs: the grammar failed on token {token_id}: {e}"


def _logprobs_delta(logprobs: LogprobsDelta | None, num_tokens: int) -> LogprobsDelta | None:
    if logprobs is None or len(logprobs.ranks) == num_tokens:
        return logprobs
    return LogprobsDelta(
        logprobs.token_ids[:num_tokens], logprobs.logprobs[:num_tokens], logprobs.ranks[:num_tokens]
    )


def _add_prompt_logprobs(req: Request, first: int, entries: LogprobsDelta) -> None:
    """Keep a chunk's prompt logprobs for the first output; entries that already arrived
    (a prefill recomputed after a preemption) are dropped."""
    skip = req.num_prompt_logprobs - first
    if skip >= len(entries.ranks):
        return
    if skip > 0:
        entries = LogprobsDelta(
            entries.token_ids[skip:], entries.logprobs[skip:], entries.ranks[skip:]
        )
    req.num_prompt_logprobs += len(entries.ranks)
    held = req.prompt_logprobs
    if held is None:
        req.prompt_logprobs = entries
    else:
        held.token_ids += entries.token_ids
        held.logprobs += entries.logprobs
        held.ranks += entries.ranks
