"""Prometheus metrics of the server (prefix `vserve:`, labels `model_name` and `engine`, the
data-parallel rank of the engine a figure or a request belongs to), vLLM's V1 names.

Two feeds from the engine: `SchedulerStats` (every step commit, once more when the engine goes
idle, and on each scrape through the `stats` utility call, so gauges read 0 after an abort
storm) and per-request outputs (TTFT, inter-token latency, end-to-end latency, finish reasons,
aborts included). Each scrape also sets the resident memory of every process
(`process_resident_memory_bytes{process=...}`). Counters that the engine reports cumulatively
(prefix cache, preemptions) are turned into increments here. A stats message drains the
engine's per-step lists, so each step's overlap figures are observed exactly once whichever
path delivers them.
"""

from __future__ import annotations

import asyncio
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from vserve.engine.messages import SchedulerStats

_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
_ITL_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
_STEP_BUCKETS = (
    0.0001,
    0.0005,
    0.001,
    0.002,
    0.005,
    0.01,
    0.02,
    0.05,
    0.1,
    0.2,
    0.5,
    1.0,
    2.0,
    5.0,
)
_CUMULATIVE = (
    "prefix_cache_queries",
    "prefix_cache_hits",
    "num_preemptions",
    "spec_num_drafts",
    "spec_num_draft_tokens",
    "spec_num_accepted_tokens",
    "triton_compiles",
)


class ServerMetrics:
    def __init__(self, model_name: str, engines: tuple[int, ...] = (0,)) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.gauges = {
            name: self._labelled(Gauge, name, doc)
            for name, doc in (
                ("num_requests_running", "Requests in the model-execution batch"),
                ("num_requests_waiting", "Requests waiting to be scheduled (preempted included)"),
                ("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1)"),
            )
        }
        self.counters = {
            name: self._labelled(Counter, name, doc)
            for name, doc in (
                ("prompt_tokens", "Prefill tokens processed"),
                ("generation_tokens", "Generation tokens produced"),
                ("prefix_cache_queries", "Tokens looked up in the prefix cache"),
                ("prefix_cache_hits", "Tokens found in the prefix cache"),
                ("num_preemptions", "Requests preempted (recomputed later)"),
                ("spec_num_drafts", "Speculative steps (requests verified with n-gram drafts)"),
                ("spec_num_draft_tokens", "Draft tokens proposed"),
                ("spec_num_accepted_tokens", "Draft tokens accepted"),
                ("triton_compiles", "Triton kernel variants compiled after start-up (CUDA)"),
            )
        }
        self.no_overlap = Counter(
            "vserve:steps_without_overlap",
            "Steps launched with no other step in flight, by reason",
            ["model_name", "engine", "reason"],
            registry=self.registry,
        )
        self.histograms = {
            name: self._labelled(Histogram, name, doc, buckets=buckets)
            for name, doc, buckets in (
                ("time_to_first_token_seconds", "Arrival to first token", _LATENCY_BUCKETS),
                ("inter_token_latency_seconds", "Time between output batches", _ITL_BUCKETS),
                ("e2e_request_latency_seconds", "Arrival to last token", _E2E_BUCKETS),
                ("model_forward_time_seconds", "Device forward time per step", _STEP_BUCKETS),
                ("step_launch_interval_seconds", "Time between step launches", _STEP_BUCKETS),
                ("scheduler_busy_time_seconds", "Scheduler time per step", _STEP_BUCKETS),
                (
                    "scheduler_exposed_time_seconds",
                    "Scheduler time per step not hidden under a forward",
                    _STEP_BUCKETS,
                ),
            )
        }
        self.memory = Gauge(
            "vserve:process_resident_memory_bytes",
            "Resident memory of each process (frontend, engine_core, worker_N)",
            ["model_name", "process"],
            registry=self.registry,
        )
        self.ignored_fields = Counter(
            "vserve:request_ignored_fields",
            "Unknown top-level request fields ignored (logged at DEBUG)",
            registry=self.registry,
        )
        self.request_success = Counter(
            "vserve:request_success",
            "Finished requests by reason",
            ["model_name", "engine", "finished_reason"],
            registry=self.registry,
        )
        self._seen: dict[int, dict[str, int]] = {}  # engine -> cumulative figures seen
        self._last_token_time: dict[str, float] = {}
        self.totals = {"prompt_tokens": 0, "generation_tokens": 0}  # for the log line
        self.last_stats: dict[int, SchedulerStats] = {}  # engine -> its latest figures
        self._pending: asyncio.Future | None = None
        for engine in engines:  # every engine's series exist from the start (at 0)
            self._engine(engine)

    def _labelled(self, kind, name: str, doc: str, **kwargs):
        return kind(
            f"vserve:{name}", doc, ["model_name", "engine"], registry=self.registry, **kwargs
        )

    def _engine(self, engine: int) -> str:
        """The `engine` label value, its series made on first use."""
        label = str(engine)
        if engine not in self._seen:
            self._seen[engine] = dict.fromkeys(_CUMULATIVE, 0)
            for family in (self.gauges, self.counters, self.histograms):
                for metric in family.values():
                    metric.labels(self.model_name, label)
        return label

    def attach(self, engine) -> None:
        engine.stats_listeners.append(self.on_stats)
        engine.output_listeners.append(self.on_output)

    # -- feeds ---------------------------------------------------------------------------------
    def on_stats(self, stats: SchedulerStats, engine: int = 0) -> None:
        label = self._engine(engine)
        self.last_stats[engine] = stats
        for name, value in (
            ("num_requests_running", stats.num_running_reqs),
            ("num_requests_waiting", stats.num_waiting_reqs),
            ("kv_cache_usage_perc", stats.kv_cache_usage),
        ):
            self.gauges[name].labels(self.model_name, label).set(value)
        self._add("prompt_tokens", stats.num_prompt_tokens, label)
        self._add("generation_tokens", stats.num_generation_tokens, label)
        seen = self._seen[engine]
        for name in _CUMULATIVE:
            value = getattr(stats, name)
            self._add(name, max(0, value - seen[name]), label)
            seen[name] = max(seen[name], value)
        for reason, count in stats.no_overlap_steps.items():
            self.no_overlap.labels(self.model_name, label, reason).inc(count)
        for name, values in (
            ("model_forward_time_seconds", stats.forward_times),
            ("step_launch_interval_seconds", stats.launch_intervals),
            ("scheduler_busy_time_seconds", stats.schedule_times),
            ("scheduler_exposed_time_seconds", stats.schedule_exposed),
        ):
            for value in values:
                self.histograms[name].labels(self.model_name, label).observe(value)

    def _add(self, name: str, amount: int, label: str) -> None:
        if amount:
            self.counters[name].labels(self.model_name, label).inc(amount)
            if name in self.totals:
                self.totals[name] += amount

    def on_output(self, state, out) -> None:
        times = out.metrics
        request_id = out.request_id
        label = self._engine(getattr(state, "engine_index", 0))

        def observe(name: str, value: float) -> None:
            self.histograms[name].labels(self.model_name, label).observe(value)

        first = times.get("first_token_time")
        has_tokens = any(c.token_ids for c in out.outputs)
        if first is not None and has_tokens:
            last = times["last_token_time"]
            previous = self._last_token_time.get(request_id)
            if previous is None:
                observe("time_to_first_token_seconds", first - times["arrival_time"])
            else:
                observe("inter_token_latency_seconds", last - previous)
            self._last_token_time[request_id] = last
        reasons = [c.finish_reason for c in out.outputs if c.finish_reason is not None]
        for reason in reasons:
            self.request_success.labels(self.model_name, label, reason).inc()
        if out.finished:
            self._last_token_time.pop(request_id, None)
            if "abort" not in reasons and first is not None:
                observe(
                    "e2e_request_latency_seconds", times["last_token_time"] - times["arrival_time"]
                )

    async def refresh(self, engine, timeout: float = 0.25) -> None:
        """Ask the engine for fresh stats and wait briefly. A busy engine answers between
        steps; a late answer is still applied (it carries drained counters), and only one
        call is in flight at a time."""
        if engine.errored or (self._pending is not None and not self._pending.done()):
            return
        self._pending = asyncio.ensure_future(self._fetch(engine))
        self._pending.add_done_callback(self._apply_utility)
        await asyncio.wait({self._pending}, timeout=timeout)

    @staticmethod
    async def _fetch(engine) -> tuple[dict, dict[str, int]]:
        return await engine.call_utility_each("stats"), await engine.process_memory()

    def _apply_utility(self, task: asyncio.Future) -> None:
        if not task.cancelled() and task.exception() is None:
            each, memory = task.result()
            for rank, stats in each.items():
                self.on_stats(SchedulerStats(**stats), rank)
            for process, value in memory.items():
                self.memory.labels(self.model_name, process).set(value)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class StatsLogger:
    """The periodic log line users paste into bug reports (throughput, queue, KV usage)."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self.last_time = time.monotonic()
        self.last_totals = dict(metrics.totals)

    def line(self) -> str:
        now = time.monotonic()
        elapsed = max(now - self.last_time, 1e-9)
        totals = self.metrics.totals
        rates = {k: (totals[k] - self.last_totals[k]) / elapsed for k in totals}
        self.last_time, self.last_totals = now, dict(totals)
        each = list(self.metrics.last_stats.values()) or [SchedulerStats()]
        queries = sum(s.prefix_cache_queries for s in each)
        hit = sum(s.prefix_cache_hits for s in each) / queries if queries else 0.0
        usage = sum(s.kv_cache_usage for s in each) / len(each)
        return (
            f"Avg prompt throughput: {rates['prompt_tokens']:.1f} tokens/s, "
            f"Avg generation throughput: {rates['generation_tokens']:.1f} tokens/s, "
            f"Running: {sum(s.num_running_reqs for s in each)} reqs, "
            f"Waiting: {sum(s.num_waiting_reqs for s in each)} reqs, "
            f"KV cache usage: {100 * usage:.1f}%, "
            f"Prefix cache hit rate: {100 * hit:.1f}%"
        )
