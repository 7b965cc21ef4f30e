"""Turns engine-core outputs (token-id deltas) into `RequestOutput`s.

One `RequestState` per user request; `n > 1` requests have one child per choice, each an
engine request of its own. Here live detokenization, stop strings (a match finishes the choice
and asks the engine to abort it), logprob dictionaries and per-request timestamps.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from vserve.engine.detokenizer import IncrementalDetokenizer
from vserve.engine.messages import EngineCoreOutput, LogprobsDelta
from vserve.outputs import CompletionOutput, Logprob, OutputKind, RequestOutput
from vserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from vserve.engine.output_collector import OutputCollector


@dataclass
class ChildState:
    index: int
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_tokens: int = 0
    sent_logprobs: int = 0
    sent_finish: bool = False
    incarnation: int = 0  # its engine request's; outputs of another are dropped
    error_kind: str | None = None  # with finish_reason "error": whose fault (core.outputs)


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    kind: OutputKind
    children: dict[str, ChildState]
    arrival_time: float
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_cached_tokens: int = 0
    queue: OutputCollector | None = None  # AsyncLLM: one per request
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # [None, token 1, ...]
    sent_prompt_logprobs: bool = False
    embedding: list[float] | None = None  # SamplingParams.pooling: the pooled vector
    engine_index: int = 0  # the data-parallel rank of the engine that runs it

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children.values())


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}
        self.child_to_parent: dict[str, str] = {}

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_ids: list[int],
        params: SamplingParams,
        child_ids: list[str],
        kind: OutputKind,
        arrival_time: float | None = None,
        queue=None,
        incarnations: list[int] | None = None,
    ) -> RequestState:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        children = {}
        for i, child_id in enumerate(child_ids):
            detok = IncrementalDetokenizer(self.tokenizer, prompt_ids, params)
            lp: list[dict[int, Logprob]] | None = [] if params.logprobs is not None else None
            children[child_id] = ChildState(
                i,
                detok,
                logprobs=lp,
                cumulative_logprob=0.0 if lp is not None else None,
                incarnation=incarnations[i] if incarnations else 0,
            )
            self.child_to_parent[child_id] = request_id
        state = RequestState(
            request_id,
            prompt,
            prompt_ids,
            params,
            kind,
            children,
            arrival_time or time.time(),
            queue=queue,
        )
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None]
        self.requests[request_id] = state
        return state

    def abort_request(self, request_id: str) -> list[str]:
        """Forget a request (client abort); returns its unfinished engine ids."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return []
        for child_id in state.children:
            self.child_to_parent.pop(child_id, None)
        return [cid for cid, c in state.children.items() if c.finish_reason is None]

    def process_outputs(
        self, outputs: list[EngineCoreOutput]
    ) -> tuple[list[tuple[RequestState, RequestOutput]], list[str]]:
        """Returns ((state, request output) pairs to deliver, engine ids to abort)."""
        delivered: list[tuple[RequestState, RequestOutput]] = []
        to_abort: list[str] = []
        touched: dict[str, RequestState] = {}
        now = time.time()
        for out in outputs:
            parent = self.child_to_parent.get(out.request_id)
            state = self.requests.get(parent) if parent else None
            if state is None:
                continue  # the front end already finished or aborted it
            child = state.children[out.request_id]
            if child.finish_reason is not None or (
                out.incarnation and child.incarnation and out.incarnation != child.incarnation
            ):
                continue  # finished here, or a late output of an aborted request of this id
            self._apply(state, child, out, now)
            if child.finish_reason is not None and not out.finished:
                to_abort.append(out.request_id)  # stopped by a stop string
            touched[state.request_id] = state
        for state in touched.values():
            ro = self.make_output(state)
            if ro is not None:
                delivered.append((state, ro))
            if state.finished:
                self.abort_request(state.request_id)
        return delivered, to_abort

    def clear(self) -> None:
        """Forget every request (the engine died: their consumers were told)."""
        self.requests.clear()
        self.child_to_parent.clear()

    def fail_all(self, message: str) -> list[tuple[RequestState, RequestOutput]]:
        """The engine died: finish every request with reason 'error'."""
        delivered: list[tuple[RequestState, RequestOutput]] = []
        for state in list(self.requests.values()):
            for child in state.children.values():
                if child.finish_reason is None:
                    child.finish_reason, child.stop_reason = "error", message
            ro = self.make_output(state)
            assert ro is not None  # every choice is finished
            delivered.append((state, ro))
        self.requests.clear()
        self.child_to_parent.clear()
        return delivered

    def _apply(
        self, state: RequestState, child: ChildState, out: EngineCoreOutput, now: float
    ) -> None:
        if out.new_token_ids:
            if state.first_token_time is None:
                state.first_token_time = now
                state.num_cached_tokens = out.num_cached_tokens
            state.last_token_time = now
        child.token_ids.extend(out.new_token_ids)
        if out.prompt_logprobs is not None and state.prompt_logprobs is not None:
            state.prompt_logprobs += self._logprob_dicts(out.prompt_logprobs)
        if child.logprobs is not None and out.new_logprobs is not None:
            self._add_logprobs(child, out.new_logprobs)
        if out.embedding is not None:
            state.embedding = np.frombuffer(out.embedding, dtype="<f4").tolist()
        stop_terminated = out.finish_reason == "stop" and not isinstance(out.stop_reason, str)
        matched = child.detok.update(out.new_token_ids, stop_terminated)
        if out.error:
            child.finish_reason, child.stop_reason = "error", out.error
            child.error_kind = out.error_kind
        elif matched is not None:
            child.finish_reason, child.stop_reason = "stop", matched
        elif out.finished:
            child.finish_reason, child.stop_reason = out.finish_reason, out.stop_reason

    def _add_logprobs(self, child: ChildState, delta: LogprobsDelta) -> None:
        # both are set when the request asked for logprobs
        assert child.logprobs is not None and child.cumulative_logprob is not None
        child.logprobs += self._logprob_dicts(delta)
        for vals in delta.logprobs:
            child.cumulative_logprob += vals[0]

    def _logprob_dicts(self, delta: LogprobsDelta) -> list[dict[int, Logprob]]:
        """Per token: the chosen (or prompt) token with its rank, then the top-N by rank."""
        convert = self.tokenizer.convert_ids_to_tokens
        entries = []
        for ids, vals, rank in zip(delta.token_ids, delta.logprobs, delta.ranks):
            entry = {ids[0]: Logprob(vals[0], rank, convert(ids[0]))}
            for r, (tid, val) in enumerate(zip(ids[1:], vals[1:]), start=1):
                if tid not in entry:
                    entry[tid] = Logprob(val, r, convert(tid))
            entries.append(entry)
        return entries

    def make_output(self, state: RequestState) -> RequestOutput | None:
        finished = state.finished
        if state.kind == OutputKind.FINAL_ONLY and not finished:
            return None
        if (
            not finished
            and state.prompt_logprobs is not None
            and len(state.prompt_logprobs) < len(state.prompt_token_ids)
        ):
            return None  # the first output carries the prompt logprobs (also for n > 1)
        outs = []
        for child in sorted(state.children.values(), key=lambda c: c.index):
            if state.kind == OutputKind.DELTA and child.sent_finish:
                continue
            out = self._completion(state, child)
            if state.kind == OutputKind.DELTA:
                if not (out.text or out.token_ids or out.finish_reason):
                    continue
                child.sent_finish = out.finish_reason is not None
            outs.append(out)
        metrics = {"arrival_time": state.arrival_time}
        if state.first_token_time is not None:
            assert state.last_token_time is not None  # set with the first token
            metrics["first_token_time"] = state.first_token_time
            metrics["last_token_time"] = state.last_token_time
        ro = RequestOutput(
            state.request_id,
            state.prompt,
            state.prompt_token_ids,
            outs,
            finished,
            state.num_cached_tokens,
            metrics,
        )
        if (
            state.prompt_logprobs is not None
            and not state.sent_prompt_logprobs
            and len(state.prompt_logprobs) == len(state.prompt_token_ids)
        ):
            ro.prompt_logprobs = state.prompt_logprobs  # (once, when streaming)
            state.sent_prompt_logprobs = state.kind == OutputKind.DELTA
        ro.embedding = state.embedding
        return ro

    def _completion(self, state: RequestState, child: ChildState) -> CompletionOutput:
        done = child.finish_reason is not None
        if state.kind == OutputKind.DELTA:
            text = child.detok.take_delta(done)
            token_ids = child.token_ids[child.sent_tokens :]
            logprobs = child.logprobs[child.sent_logprobs :] if child.logprobs is not None else None
            child.sent_tokens = len(child.token_ids)
            child.sent_logprobs = len(child.logprobs or [])
        else:
            text, token_ids, logprobs = (
                child.detok.output_text,
                list(child.token_ids),
                child.logprobs,
            )
        return CompletionOutput(
            child.index,
            text,
            token_ids,
            child.cumulative_logprob,
            logprobs,
            child.finish_reason,
            child.stop_reason,
            child.error_kind,
        )
