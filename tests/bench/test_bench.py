"""`vserve bench throughput | latency` on a tiny model: printed fields, JSON, trace, report."""

import contextlib
import dataclasses
import io
import json
import re
import subprocess
import sys

import pytest

from vserve import cli

pytestmark = pytest.mark.slow  # the fast tier (-m "not slow") leaves these out

NUM_PROMPTS, IN_LEN, OUT_LEN = 6, 24, 12


def _bench(*args):
    """`vserve bench ...` through the CLI's own entry point, in this process (whose imports
    are done: a second each saved); its printed output."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["bench", *args]) == 0
    return out.getvalue()


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("llama")


def _common(model):
    return [
        "--model",
        model,
        "--dtype",
        "float32",
        "--max-model-len",
        "256",
        "--num-prompts",
        str(NUM_PROMPTS),
        "--input-len",
        str(IN_LEN),
        "--output-len",
        str(OUT_LEN),
    ]


def test_throughput_vserve_json_trace_plot_and_report(model, tmp_path):
    out_json, trace, png = tmp_path / "r.json", tmp_path / "trace.json", tmp_path / "steps.png"
    stdout = _bench(
        "throughput",
        *_common(model),
        "--output-json",
        str(out_json),
        "--trace",
        str(trace),
        "--plot",
        str(png),
    )
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert re.search(
        r"Throughput: [\d.]+ requests/s, [\d.]+ total tokens/s, "
        r"[\d.]+ output tokens/s",
        stdout,
    )
    assert f"Total num output tokens:  {NUM_PROMPTS * OUT_LEN}" in stdout
    for label in (
        "Mean model forward time (ms):",
        "Mean step launch interval (ms):",
        "Forward slowdown under overlap:",
        "Overlap efficiency (calibrated fwd / interval):",
        "Host time hidden, net of the slowdown:",
        "under a forward (ms):",
        "Stretched fwd / interval (old, not a score):",
        "TPOT p50 (ms):",
        "TPOT p99 (ms):",
        "Steps without overlap:",
    ):
        assert label in stdout
    r = json.loads(out_json.read_text())
    assert r["num_requests"] == NUM_PROMPTS
    assert r["total_num_output_tokens"] == NUM_PROMPTS * OUT_LEN
    assert r["total_num_tokens"] == r["total_num_prompt_tokens"] + NUM_PROMPTS * OUT_LEN
    assert r["output_throughput"] == pytest.approx(NUM_PROMPTS * OUT_LEN / r["elapsed_time"])
    assert r["requests_per_second"] == pytest.approx(NUM_PROMPTS / r["elapsed_time"])
    ov = r["overlap"]
    assert ov["num_steps"] >= OUT_LEN
    assert ov["host_hidden_ms"] + ov["host_exposed_ms"] == pytest.approx(ov["host_total_ms"])
    assert ov["schedule_exposed_ms"] <= ov["schedule_total_ms"] <= ov["host_total_ms"]
    _check_trace(json.loads(trace.read_text()), ov)


def _check_trace(trace, overlap):
    events = trace["traceEvents"]
    lanes = {e["args"]["name"] for e in events if e["ph"] == "M"}
    assert {"engine core (CPU)", "worker (device)", "schedule", "forward"} <= lanes
    forwards = [e for e in events if e["ph"] == "X" and e["name"] == "forward"]
    schedules = [e for e in events if e["ph"] == "X" and e["name"] == "schedule"]
    assert len(forwards) == len(schedules) == overlap["num_steps"]
    assert len({e["args"]["step"] for e in forwards}) == len(forwards)  # one slice per step
    mean_fwd_ms = sum(e["dur"] for e in forwards) / len(forwards) / 1e3
    assert mean_fwd_ms == pytest.approx(overlap["mean_forward_ms"], rel=1e-6)
    sched_ms = sum(e["dur"] for e in schedules) / 1e3
    assert sched_ms == pytest.approx(overlap["schedule_total_ms"], rel=1e-6)
    assert any(e["name"] == "detokenize" for e in events)


def test_throughput_hf_backend(model, tmp_path):
    out_json = tmp_path / "hf.json"
    stdout = _bench(
        "throughput",
        *_common(model),
        "--backend",
        "hf",
        "--hf-max-batch-size",
        "4",
        "--output-json",
        str(out_json),
    )
    assert "Throughput:" in stdout
    r = json.loads(out_json.read_text())
    assert r["backend"] == "hf" and r["total_num_output_tokens"] == NUM_PROMPTS * OUT_LEN


def test_prefix_repetition_dataset(model, tmp_path):
    out_json = tmp_path / "p.json"
    _bench(
        "throughput",
        "--model",
        model,
        "--dtype",
        "float32",
        "--max-model-len",
        "256",
        "--dataset-name",
        "prefix-repetition",
        "--num-prompts",
        "8",
        "--prefix-len",
        "32",
        "--num-prefixes",
        "2",
        "--input-len",
        "8",
        "--output-len",
        "4",
        "--output-json",
        str(out_json),
    )
    r = json.loads(out_json.read_text())
    assert r["total_num_prompt_tokens"] == 8 * 40 and r["total_num_output_tokens"] == 32


def test_throughput_compare_sync(model, tmp_path):
    """--compare-sync: the same workload sync, async, sync, in one process; the first sync
    run calibrates the async run's overlap report, and the JSON carries the three runs and
    async's ratio to the syncs' mean."""
    out_json = tmp_path / "cmp.json"
    stdout = _bench(
        "throughput",
        *_common(model),
        "--temperature",
        "0",
        "--compare-sync",
        "--output-json",
        str(out_json),
    )
    assert stdout.count("Overlap report") == 3 and "Async speedup over sync:" in stdout
    # the sync run's report says why nothing overlaps
    assert "async scheduling off: async_scheduling=False was requested" in stdout
    r = json.loads(out_json.read_text())
    c = r["compare_sync"]
    sync, again = c["sync_result"], c["second_sync_result"]
    # the same executor in every run: async's default (worker processes on a CPU)
    for run in (sync, again):
        assert (run["async_scheduling"], run["executor"]) == (False, "mp")
        assert run["total_num_output_tokens"] == NUM_PROMPTS * OUT_LEN
        # each engine took an untimed first batch before its timed run (not counted above),
        # with the same prompts, after which the prefix cache was reset: none comes from it
        assert run["warmup_requests"] == NUM_PROMPTS and run["cached_prompt_tokens"] == 0
    assert (r["async_scheduling"], r["executor"]) == (True, "mp")
    assert r["total_num_output_tokens"] == NUM_PROMPTS * OUT_LEN
    assert r["warmup_requests"] == NUM_PROMPTS and r["cached_prompt_tokens"] == 0
    assert c["metric"] == "output_throughput"
    figures = [sync["output_throughput"], again["output_throughput"]]
    assert c["sync_runs"] == figures and c["sync_drift"] == pytest.approx(figures[1] / figures[0])
    assert c["sync"] == pytest.approx(sum(figures) / 2) and c["async"] == r["output_throughput"]
    assert c["async_speedup"] == pytest.approx(r["output_throughput"] / c["sync"])
    assert r["overlap"]["calibration"] == "the sync run"
    assert sync["overlap"]["calibration"] == "this run's quiet steps"
    # every sync forward is quiet: it calibrates itself, step for step (but the first)
    assert sync["overlap"]["calibrated_steps"] == sync["overlap"]["num_steps"] - 1
    assert sync["overlap"]["forward_slowdown"] == pytest.approx(1.0)


def test_latency_and_compare_sync(model, tmp_path):
    """`bench latency` (printed percentiles, JSON) and its --compare-sync on one run: the async
    run is a plain latency run (the same engine args and executor), its result the JSON's."""
    out_json = tmp_path / "lat_cmp.json"
    stdout = _bench(
        "latency",
        "--model",
        model,
        "--dtype",
        "float32",
        "--max-model-len",
        "256",
        "--batch-size",
        "3",
        "--input-len",
        "16",
        "--output-len",
        "8",
        "--num-iters-warmup",
        "1",
        "--num-iters",
        "3",
        "--compare-sync",
        "--output-json",
        str(out_json),
    )
    assert len(re.findall(r"Avg latency: [\d.]+ seconds", stdout)) == 3  # sync, async, sync
    for p in (10, 25, 50, 75, 90, 99):
        assert stdout.count(f"{p}% percentile latency:") == 3
    assert "Async speedup over sync:" in stdout
    r = json.loads(out_json.read_text())
    assert len(r["latencies"]) == 3
    assert min(r["latencies"]) <= r["percentiles"]["50"] <= max(r["latencies"])
    assert r["overlap"]["num_steps"] >= 3 * 8
    c = r["compare_sync"]
    assert c["metric"] == "avg_latency" and r["async_scheduling"] is True
    assert c["sync_result"]["async_scheduling"] is False
    assert c["second_sync_result"]["async_scheduling"] is False
    syncs = [c["sync_result"]["avg_latency"], c["second_sync_result"]["avg_latency"]]
    assert c["async_speedup"] == pytest.approx(sum(syncs) / 2 / r["avg_latency"])


def test_compare_sync_refuses_a_sync_only_run(model):
    cmd = [
        sys.executable,
        "-m",
        "vserve.cli",
        "bench",
        "throughput",
        *_common(model),
        "--compare-sync",
        "--no-async-scheduling",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "--compare-sync runs both modes; drop --no-async-scheduling" in proc.stderr


def test_compare_sync_keeps_an_explicit_executor(model):
    from vserve.bench.compare import mode_engine_args
    from vserve.engine.arg_utils import EngineArgs

    sync, async_ = mode_engine_args(EngineArgs(model=model, distributed_executor_backend="uni"))
    assert (sync.async_scheduling, sync.distributed_executor_backend) == (False, "uni")
    assert (async_.async_scheduling, async_.distributed_executor_backend) == (True, "uni")
    sync, async_ = mode_engine_args(EngineArgs(model=model, dtype="float32"))
    assert sync.distributed_executor_backend == async_.distributed_executor_backend == "mp"
    assert dataclasses.replace(sync, async_scheduling=True) == async_


SPEC_OUT_LEN = 48  # a draft needs an n-gram match before the last id too: long enough to repeat


@pytest.mark.parametrize("min_tokens", [0, SPEC_OUT_LEN])
def test_min_tokens_keeps_requests_from_drafting(model, tmp_path, min_tokens):
    """The drafts row of benchmarks/modes.py: with min_tokens = the output length no request can
    draft, on prompts (a repeated run of tokens) where n-gram drafts are proposed otherwise."""
    out_json = tmp_path / "spec.json"
    common = [*_common(model)[:-1], str(SPEC_OUT_LEN)]
    _bench(
        "throughput",
        *common,
        "--dataset-name",
        "repetitive",
        "--temperature",
        "0",
        "--speculative-config",
        '{"method": "ngram", "num_speculative_tokens": 3}',
        "--min-tokens",
        str(min_tokens),
        "--output-json",
        str(out_json),
    )
    r = json.loads(out_json.read_text())
    assert r["total_num_output_tokens"] == NUM_PROMPTS * SPEC_OUT_LEN
    assert (r.get("spec_num_drafts", 0) > 0) == (min_tokens == 0)


def test_throughput_hf_backend_on_the_default_model(tmp_path):
    """The embedded model's folder holds no weights (they stay in its GGUF): transformers
    reads and dequantizes the GGUF itself."""
    out_json = tmp_path / "hf.json"
    _bench(
        "throughput",
        *("--num-prompts", "2", "--input-len", "8", "--output-len", "3"),
        *("--backend", "hf", "--hf-max-batch-size", "2", "--output-json", str(out_json)),
    )
    r = json.loads(out_json.read_text())
    assert r["backend"] == "hf" and r["total_num_output_tokens"] == 2 * 3


def test_hf_backend_model_of_a_gguf_is_transformers_reading_it():
    """The hf backend builds transformers' model of a GGUF's folder from vserve's reader: the
    same logits as transformers' own GGUF loader (a llama.cpp-made file, fp32)."""
    from pathlib import Path

    import torch
    from transformers import AutoModelForCausalLM

    from vserve.bench.hf_backend import load_hf_model
    from vserve.models.resolve import resolve_model_path

    path = Path(__file__).resolve().parents[1] / "fixtures" / "llamacpp" / "tiny-qwen2-q3_k_m.gguf"
    ours = load_hf_model(resolve_model_path(str(path)), torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    ids = torch.tensor([[2, 86, 260, 270, 86, 300, 17, 45, 400, 33]])
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, ref(ids).logits)


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"])
def test_hf_backend_model_of_a_mixture_gguf_is_llamacpps_model(kind):
    """A mixture's experts, read one by one, stacked as transformers holds them: transformers'
    greedy ids on the F32 file are llama.cpp's own (recorded by the fixture script)."""
    import torch

    from tests.support.llamacpp_files import FIXTURES, fixture
    from vserve.bench.hf_backend import load_hf_model
    from vserve.models.resolve import resolve_model_path

    name = f"tiny-{kind}-f32.gguf"
    recorded = json.loads((FIXTURES / "llamacpp_greedy.json").read_text())
    model = load_hf_model(resolve_model_path(str(fixture(name))), torch.float32)
    for prompt, expected in zip(recorded["prompts"], recorded["greedy"][name], strict=True):
        seq = list(prompt)
        with torch.no_grad():
            for _ in expected:
                seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
        assert seq[len(prompt) :] == expected
