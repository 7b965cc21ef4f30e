"""benchmarks/modes.py: its row syntax, the flags of a fresh row, its per-round ratios and
comparisons, and one short run of each kind on a tiny model (the table and the JSON)."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from modes import (  # noqa: E402
    SPEC,
    comparisons,
    fresh_flags,
    main,
    parse_args,
    parse_row,
    summarize,
    tables,
)


def test_parse_row():
    row = parse_row("pp2-async:VSERVE_CPU_PARK=0:spec:temperature=1:quantization=none")
    assert row.mode == "async"
    assert row.engine == {
        "async_scheduling": True,
        "pipeline_parallel_size": 2,
        "speculative_config": SPEC,
        "quantization": "none",
    }
    assert row.env == {"VSERVE_CPU_PARK": "0"}
    assert row.sampling == {"temperature": 1.0}
    assert parse_row("sync-uni").engine == {
        "async_scheduling": False,
        "distributed_executor_backend": "uni",
    }
    for bad in ("fast", "pp2-fast", "async:VSERVE_CPU_PARK", "async:colour=red"):
        with pytest.raises(SystemExit):
            parse_row(bad)


def test_fresh_flags():
    argv = ["--fresh", "--model", "/m", "--num-prompts", "4", "--input-len", "8"]
    args = parse_args(argv + ["--output-len", "16"])
    flags = " ".join(fresh_flags(args, parse_row("pp2-sync-mp:spec")))
    for part in (
        "--model /m",
        "--no-async-scheduling",
        "--distributed-executor-backend mp",
        "--pipeline-parallel-size 2",
        '--speculative-config {"method": "ngram", "num_speculative_tokens": 3}',
        "--max-model-len 40",
        "--temperature 0.0",
        "--num-prompts 4 --input-len 8 --output-len 16",
    ):
        assert part in flags
    assert fresh_flags(args, parse_row("hf"))[:2] == ["--backend", "hf"]


def test_a_workload_preset_gives_way_to_explicit_flags():
    args = parse_args(["--paired", "--workload", "host-bound", "--num-prompts", "8"])
    assert (args.model, args.num_prompts, args.input_len, args.output_len) == (
        "host-bound",
        8,
        32,
        96,
    )
    assert args.max_num_seqs == 256


@pytest.mark.parametrize(
    "argv",
    [
        ["--paired", "--rows", "async", "hf"],
        ["--fresh", "--rows", "inproc"],
        ["--fresh", "--rows", "async", "async"],
    ],
)
def test_rows_a_mode_cannot_run_are_refused_before_any_engine(argv):
    with pytest.raises(SystemExit):
        main(argv)


def _run(tok_s):
    return {
        "tok_s": tok_s,
        "forward_ms": 1.0,
        "interval_ms": 2.0,
        "overlap_efficiency": 0.5,
        "parked": 0.5,
    }


def test_ratios_are_taken_within_each_round():
    rows = [parse_row(r) for r in ("sync-uni", "async", "async:VSERVE_CPU_PARK=0")]
    runs = {
        "sync-uni": [_run(100), _run(50), _run(80)],
        "async": [_run(110), _run(60), _run(72)],
        "async:VSERVE_CPU_PARK=0": [_run(99), _run(66), _run(72)],
    }
    summary = summarize(rows, runs)
    assert summary[0]["ratio"] == 1.0
    # per round 1.1, 1.2, 0.9: the median of the ratios, not the ratio of the medians (0.9)
    assert summary[1]["ratio"] == pytest.approx(1.1)
    assert (summary[1]["min"], summary[1]["max"]) == pytest.approx((0.9, 1.2))
    assert summary[1]["tok_s"] == 72
    compared = comparisons(rows, runs)
    pairs = [(c["row"], c["against"]) for c in compared]
    assert pairs == [("async:VSERVE_CPU_PARK=0", "async"), ("async", "sync-uni")]
    assert compared[0]["ratio"] == pytest.approx(1.0)  # 0.9, 1.1, 1.0
    text = tables(summary, compared)
    assert "| async | 72.0 | 1.100 (0.900-1.200) | 1.00 | 2.00 | 0.500 | 0.50 |" in text
    assert "| async:VSERVE_CPU_PARK=0 | async | 1.000 (0.900-1.100) | - | - |" in text


def _short(model: str, out: Path, *argv: str) -> dict:
    main(
        [
            *argv,
            "--model",
            model,
            "--num-prompts",
            "2",
            "--input-len",
            "40",
            "--output-len",
            "6",
            "--output",
            str(out),
        ]
    )
    return json.loads(out.read_text())


@pytest.mark.slow  # two engines, each run twice
def test_a_short_paired_run_of_two_engines(tiny_model_dir, tmp_path, capsys):
    rows = ["sync-uni", "async:VSERVE_CPU_PARK=0"]
    data = _short(
        tiny_model_dir("llama"), tmp_path / "m.json", "--paired", "--rounds", "2", "--rows", *rows
    )
    assert [r["row"] for r in data["rows"]] == rows
    assert all(len(v) == 2 for v in data["runs"].values())
    assert all(r["parked"] == 0 for v in data["runs"].values() for r in v)  # sync; park off
    # the same prompts every round, each computed again (the prefix cache reset before it)
    assert all(r["cached_prompt_tokens"] == 0 for v in data["runs"].values() for r in v)
    assert "| async:VSERVE_CPU_PARK=0 |" in capsys.readouterr().out


@pytest.mark.slow
def test_a_short_fresh_run(tiny_model_dir, tmp_path):
    data = _short(
        tiny_model_dir("llama"),
        tmp_path / "m.json",
        "--fresh",
        "--rounds",
        "1",
        "--rows",
        "sync-uni",
    )
    (run,) = data["runs"]["sync-uni"]
    assert run["tok_s"] > 0 and run["forward_ms"] > 0
    assert run["overlap"]["num_steps"] >= 6
