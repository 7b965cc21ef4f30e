"""Sync, async, pipeline parallel, in-process and multiprocess engines produce the same tokens
(greedy and seeded sampling) on one workload with staggered arrivals, chunked prefill, prefix
hits, preemption by a small KV cache, aborts and stop strings (scenarios 29, 31, 32, 36, 39),
and embeddings (mean and last-token pooling) batched with the generation, whose vectors
agree within fp32 rounding (a batch's shape may change a matmul's order of sums).
The stop string is a piece of g3's greedy text, so it fires: "stop" repeats g3's prompt and
arrives once g3's streamed text holds that piece.
PP=3 runs the cost-balanced split of the 4-layer model (2, 1, 1) and, sync, a split whose
first stage holds no layer (VSERVE_PP_LAYER_PARTITION)."""

import dataclasses
import os

import pytest

from tests.support.engines import assert_worker_drained
from tests.support.hf_reference import PREFIX_PROMPTS, PROMPTS
from vserve import envs
from vserve.engine.arg_utils import EngineArgs
from vserve.engine.llm_engine import LLMEngine
from vserve.outputs import OutputKind
from vserve.sampling_params import SamplingParams

pytestmark = pytest.mark.slow  # the fast tier (-m "not slow") leaves these out

ENGINE = dict(
    dtype="float32",
    max_model_len=128,
    block_size=4,
    num_gpu_blocks_override=40,
    max_num_batched_tokens=24,
    max_num_seqs=8,
)

MODES = {
    "sync-inproc": dict(
        multiprocess=False, async_scheduling=False, distributed_executor_backend="uni"
    ),
    "async-inproc": dict(
        multiprocess=False, async_scheduling=True, distributed_executor_backend="uni"
    ),
    "async-inproc-mpexec": dict(
        multiprocess=False, async_scheduling=True, distributed_executor_backend="mp"
    ),
    "async-mp": dict(multiprocess=True, async_scheduling=True),
    "sync-mp": dict(multiprocess=True, async_scheduling=False, distributed_executor_backend="mp"),
    "pp2-async": dict(multiprocess=True, async_scheduling=True, pipeline_parallel_size=2),
    "pp2-sync": dict(multiprocess=True, async_scheduling=False, pipeline_parallel_size=2),
    "pp3-async": dict(multiprocess=True, async_scheduling=True, pipeline_parallel_size=3),
    "pp3-sync": dict(multiprocess=True, async_scheduling=False, pipeline_parallel_size=3),
}
PARTITION = {"pp3-sync": "0,3,1"}  # VSERVE_PP_LAYER_PARTITION per mode (default: by cost)


def _workload():
    """(request id, prompt, params, wave); wave 1 arrives after the engine has started."""
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    items = []
    prompts = (
        PROMPTS
        + PREFIX_PROMPTS
        + [{"prompt_token_ids": [2] + list(range(30, 30 + n))} for n in (3, 17, 40, 64)]
    )
    for i, p in enumerate(prompts):
        items.append((f"g{i}", p, greedy, 0))
    for i, p in enumerate(prompts[:8]):
        sp = SamplingParams(
            temperature=0.9, top_p=0.9, top_k=40, seed=100 + i, max_tokens=16, ignore_eos=True
        )
        items.append((f"s{i}", p, sp, i % 2))
    for i, p in enumerate(prompts[:6]):  # w5 outlives "stop" (see _add_stop_request)
        items.append((f"w{i}", p, greedy.clone(max_tokens=28 if i == 5 else 12 + i), 1))
    items.append(
        (
            "n2",
            PROMPTS[1],
            SamplingParams(n=2, temperature=1.0, seed=9, max_tokens=10, ignore_eos=True),
            1,
        )
    )
    for i, p in enumerate([prompts[-1], PREFIX_PROMPTS[1], PROMPTS[0]]):
        for pooling in ("mean", "last"):
            embed = SamplingParams(temperature=0, max_tokens=1, pooling=pooling)
            items.append((f"e-{pooling}{i}", p, embed, i % 2))
    items.append(("abort-a", PROMPTS[0], greedy.clone(max_tokens=100), 0))
    items.append(("abort-b", PROMPTS[2], greedy.clone(max_tokens=100), 1))
    return items


@dataclasses.dataclass(frozen=True, eq=False)
class _Vector:
    """An embedding, equal to another within fp32 rounding."""

    values: tuple[float, ...]

    def __eq__(self, other) -> bool:
        if not isinstance(other, _Vector) or len(other.values) != len(self.values):
            return False
        scale = max(1.0, max(abs(v) for v in other.values))
        return max(abs(a - b) for a, b in zip(self.values, other.values)) <= 1e-5 * scale


def _stop_string(text: str) -> str | None:
    """3 characters of a greedy text a few characters in, where they first occur (so that they
    stop a greedy run of the same prompt there); None while the text is too short."""
    start = next((i for i in range(5, len(text) - 2) if text.find(text[i : i + 3]) == i), None)
    return None if start is None else text[start : start + 3]


def _add_stop_request(engine: LLMEngine, g3_text: str) -> bool:
    """Adds "stop" (g3's prompt, greedy, stopped by a piece of g3's text) once there is one.
    It ends in the front end, which then aborts it in the engine core; a run may end on it
    (`_settled_stats` then waits for the core's stats after the abort)."""
    stop = _stop_string(g3_text)
    if stop is not None:
        sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop])
        engine.add_request("stop", PROMPTS[3], sp)
    return stop is not None


def _run(engine: LLMEngine):
    items = _workload()
    results, added_wave1, added_stop, steps = {}, False, False, 0
    for rid, prompt, sp, wave in items:
        if wave == 0:  # g3 (the greedy run of PROMPTS[3]) streams its text for "stop"
            kind = OutputKind.CUMULATIVE if rid == "g3" else OutputKind.FINAL_ONLY
            engine.add_request(rid, prompt, sp, kind)
    while engine.has_unfinished_requests() or not added_wave1:
        if (
            steps == 3
            and not added_wave1
            or (not engine.has_unfinished_requests() and not added_wave1)
        ):
            for rid, prompt, sp, wave in items:
                if wave == 1:
                    engine.add_request(rid, prompt, sp)
            added_wave1 = True
        if steps == 6:
            engine.abort_request(["abort-a", "abort-b"])
        for out in engine.step():
            if out.request_id == "g3" and not added_stop:
                added_stop = _add_stop_request(engine, out.outputs[0].text)
            if out.finished:
                results[out.request_id] = [
                    (c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in out.outputs
                ]
                if out.embedding is not None:
                    results[out.request_id].append(_Vector(tuple(out.embedding)))
        steps += 1
    return results, _settled_stats(engine)


def _settled_stats(engine: LLMEngine):
    """The core's stats once it has applied the front end's last aborts. A request the front
    end ends (a stop string) is aborted in the core after the output the loop read last, so
    those stats may still count it; the core publishes its stats once more on going idle."""
    stats = engine.last_stats
    for _ in range(8):
        if stats is None or stats.num_running_reqs == 0:
            break
        engine.step()
        stats = engine.last_stats
    return stats


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    engine = _engine(tiny_model_dir("qwen3"), MODES["sync-inproc"])
    results, stats = _run(engine)
    assert_worker_drained(engine)
    engine.shutdown()
    return results


def _engine(model_dir, mode):
    mode = dict(mode)
    multiprocess = mode.pop("multiprocess")
    return LLMEngine.from_engine_args(
        EngineArgs(model=model_dir, **ENGINE, **mode), multiprocess=multiprocess
    )


def _worker_in_process(mode: dict) -> bool:
    return not mode["multiprocess"] and mode.get("distributed_executor_backend") == "uni"


def _check_parked_gaps(records, mode: dict) -> None:
    """Only async steps of a single worker process may run parked (workers/host_gap.py); how
    many depends on the placement the controller picks (a reserved core pins the worker)."""
    if not (
        mode.get("async_scheduling", True)
        and mode.get("distributed_executor_backend", "mp") == "mp"
        and mode.get("pipeline_parallel_size", 1) == 1
    ):
        assert not any(r.parked for r in records)


def _check_stage_forwards(records, pp: int) -> None:
    """With PP every step with tokens reports each stage's own forward, in pipeline order:
    a stage starts after the stage before it ended (it waited for its hidden states)."""
    busy = [r for r in records if r.num_tokens]
    assert busy
    for r in busy:
        spans = r.stage_forwards
        assert len(spans) == (pp if pp > 1 else 0), (r.step_id, spans)
        for start, end in spans:
            assert start <= end
        for (_, end), (start, _) in zip(spans, spans[1:]):
            assert end <= start, (r.step_id, spans)
        if spans:
            assert tuple(spans[-1]) == (r.forward_start, r.forward_end)


def test_reference_exercises_the_workload(reference):
    assert "abort-a" not in reference and "abort-b" not in reference
    ids, text, _, _ = reference["g3"][0]
    stop_ids, stop_text, reason, stop = reference["stop"][0]
    assert reason == "stop" and stop == _stop_string(text)  # it fired, where g3 has it
    assert text.startswith(stop_text + stop) and stop_ids == ids[: len(stop_ids)]
    assert len(reference["n2"]) == 2 and reference["n2"][0][0] != reference["n2"][1][0]
    for pooling in ("mean", "last"):
        vectors = [reference[f"e-{pooling}{i}"][1] for i in range(3)]
        assert all(isinstance(v, _Vector) and len(v.values) == 64 for v in vectors)
        assert vectors[0] != vectors[1]
    assert len(reference) == len(_workload()) - 2 + 1  # less the aborted, plus "stop"


@pytest.mark.parametrize("mode", [m for m in MODES if m != "sync-inproc"])
def test_mode_matches_sync_reference(tiny_model_dir, reference, mode, monkeypatch):
    if mode in PARTITION:
        monkeypatch.setattr(
            envs, "ENV", dataclasses.replace(envs.ENV, pp_layer_partition=PARTITION[mode])
        )
    engine = _engine(tiny_model_dir("qwen3"), MODES[mode])
    try:
        results, stats = _run(engine)
        records = engine.take_step_records()
        if _worker_in_process(MODES[mode]):
            assert_worker_drained(engine)
    finally:
        engine.shutdown()
    assert results == reference
    _check_stage_forwards(records, MODES[mode].get("pipeline_parallel_size", 1))
    _check_parked_gaps(records, MODES[mode])
    # an engine core in this process (async-inproc-mpexec) leaves its scheduling policy alone
    assert {os.sched_getscheduler(int(t)) for t in os.listdir("/proc/self/task")} == {
        os.SCHED_OTHER
    }
    assert stats.num_preemptions > 0  # the small KV cache forced recomputation
    assert stats.prefix_cache_hits > 0
    assert stats.kv_cache_usage == 0.0 and stats.num_running_reqs == 0


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one CPU: one thread, no park")
def test_async_worker_parks_its_gaps(tiny_model_dir, reference, monkeypatch):
    """With no core reserved (a fixed placement: the adaptive one reserves a core for this
    tiny model's large host share, and a pinned worker does not park) the worker's gaps run
    parked: the next step is already there when a forward ends. Outputs as sync's."""
    monkeypatch.setenv("VSERVE_CPU_NUM_RESERVED", "0")  # read by the engine core process
    engine = _engine(tiny_model_dir("qwen3"), MODES["async-mp"])
    try:
        results, _ = _run(engine)
        records = engine.take_step_records()
    finally:
        engine.shutdown()
    assert results == reference
    parked = sum(r.parked for r in records)
    assert parked > len(records) // 2, (parked, len(records))


def test_stats_settle_after_a_run_that_ends_on_a_stop_string(tiny_model_dir):
    """The last output of a run stopped by a stop string carries stats from before the front
    end's abort (one request running); the stats the check above reads are the core's after it
    (CI saw kv_cache_usage 0.375 with the stale ones, async-mp)."""
    engine = _engine(tiny_model_dir("qwen3"), MODES["async-mp"])
    try:
        first = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        engine.add_request("probe", PROMPTS[3], first)
        text = ""
        while engine.has_unfinished_requests():
            for out in engine.step():
                text = out.outputs[0].text
        stop = _stop_string(text)
        assert stop is not None, text
        sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop])
        engine.add_request("stop", PROMPTS[3], sp)
        finished = []
        while engine.has_unfinished_requests():
            finished += [o.outputs[0].stop_reason for o in engine.step() if o.finished]
        assert finished == [stop]
        assert engine.last_stats.num_running_reqs == 1  # (stale: before the abort)
        stats = _settled_stats(engine)
    finally:
        engine.shutdown()
    assert stats.num_running_reqs == 0 and stats.kv_cache_usage == 0.0
