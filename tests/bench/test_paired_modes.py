"""benchmarks/paired_modes.py: its config syntax, its per-round ratios, and one short run of
two engines alive together on a tiny model (the table and the JSON it writes)."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from paired_modes import main, parse_config, summarize, table  # noqa: E402


def test_parse_config():
    assert parse_config("async") == ("async", {})
    assert parse_config("async:VSERVE_CPU_PARK=0:GOMP_SPINCOUNT=1000") == (
        "async",
        {"VSERVE_CPU_PARK": "0", "GOMP_SPINCOUNT": "1000"},
    )
    with pytest.raises(SystemExit):
        parse_config("fast")
    with pytest.raises(SystemExit):
        parse_config("async:VSERVE_CPU_PARK")


def _run(tok_s, fwd=1.0):
    return {"tok_s": tok_s, "forward_ms": fwd, "interval_ms": fwd + 1, "parked": 0.5}


def test_ratios_are_taken_within_each_round():
    runs = {"a": [_run(100), _run(50), _run(80)], "b": [_run(110), _run(60), _run(72)]}
    rows = summarize(["a", "b"], runs)
    assert rows[0]["ratio"] == 1.0
    # per round 1.1, 1.2, 0.9: the median of the ratios, not the ratio of the medians (0.9)
    assert rows[1]["ratio"] == pytest.approx(1.1)
    assert (rows[1]["ratio_min"], rows[1]["ratio_max"]) == pytest.approx((0.9, 1.2))
    assert rows[1]["tok_s"] == 72
    assert "| b | 72.0 | 1.100 (0.900-1.200) | 1.00 | 2.00 | 0.50 |" in table(rows, "a")


def test_a_short_run_of_two_engines(tiny_model_dir, tmp_path, monkeypatch, capsys):
    out = tmp_path / "paired.json"
    argv = ["paired_modes.py", "--model", tiny_model_dir("llama"), "--batch", "2"]
    argv += ["--rounds", "2", "--input-len", "40", "--output-len", "6", "--json", str(out)]
    monkeypatch.setattr(sys, "argv", argv + ["sync-uni", "async:VSERVE_CPU_PARK=0"])
    main()
    data = json.loads(out.read_text())
    assert [r["config"] for r in data["rows"]] == ["sync-uni", "async:VSERVE_CPU_PARK=0"]
    assert all(len(v) == 2 for v in data["runs"].values())
    assert all(r["parked"] == 0 for v in data["runs"].values() for r in v)  # sync; park off
    # the same prompts every round, each computed again (the prefix cache reset before it)
    assert all(r["cached_prompt_tokens"] == 0 for v in data["runs"].values() for r in v)
    assert "| async:VSERVE_CPU_PARK=0 |" in capsys.readouterr().out
