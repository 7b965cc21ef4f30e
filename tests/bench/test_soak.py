"""The soak benchmark's short mode in CI: half a minute of mixed chaos traffic against a tiny model
(benchmarks/soak.py) ends with no error, no KV block in use, bounded RSS growth and a clean
exit; and its histogram arithmetic."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.openai_server import TINY_ARGS

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from soak import KINDS, _warm, histogram_p99, scrape  # noqa: E402

pytestmark = pytest.mark.slow  # the fast tier (-m "not slow") leaves these out


def test_histogram_p99_interpolates_inside_its_bucket():
    before = {"x_bucket{0.1}": 10, "x_bucket{0.2}": 10, "x_bucket{+Inf}": 10}
    after = {"x_bucket{0.1}": 100, "x_bucket{0.2}": 110, "x_bucket{+Inf}": 110}
    p99, count = histogram_p99(before, after, "x")  # 100 new: 90 <= 0.1, 10 in (0.1, 0.2]
    assert count == 100 and p99 == pytest.approx(0.19)
    assert histogram_p99(after, after, "x") == (None, 0)


def test_scrape_keeps_bucket_edges_and_sums_labels():
    text = (
        '# HELP x\nvserve:a{model_name="m"} 2.0\nvserve:h_bucket{le="0.5",model_name="m"} 3'
        '\nvserve:r{reason="x"} 1\nvserve:r{reason="y"} 2\nother 5\n'
    )
    assert scrape(text) == {"vserve:a": 2.0, "vserve:h_bucket{0.5}": 3.0, "vserve:r": 3.0}


def test_warm_up_waits_for_every_kind_of_request():
    """RSS is first read once each kind has been served: the first structured request grows
    the engine core by its grammar state, which is not a leak."""
    from collections import Counter
    from types import SimpleNamespace

    args = SimpleNamespace(concurrency=2)
    served = Counter({k: 5 for k in KINDS if k not in ("disconnect", "abort", "json_schema")})
    traffic = SimpleNamespace(served=served, chaos=Counter(abort=3), errors=Counter())
    assert not _warm(traffic, elapsed=20, warmup=10, duration=60, args=args)
    assert _warm(traffic, elapsed=30, warmup=10, duration=60, args=args)  # half the run
    served["json_schema"] = 1
    assert _warm(traffic, elapsed=20, warmup=10, duration=60, args=args)
    assert not _warm(traffic, elapsed=5, warmup=10, duration=60, args=args)


@pytest.mark.slow
def test_soak_short_mode(tiny_model_dir, tmp_path):
    result = tmp_path / "soak.json"
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "soak.py"),
        "--short",
        "--model",
        tiny_model_dir("llama"),
        "--result",
        str(result),
        "--",
        *TINY_ARGS,
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=420, env=env)
    except subprocess.TimeoutExpired as e:  # a hang is a failure, not a pass
        pytest.fail(f"soak did not finish in 420 s:\n{(e.stdout or b'')[-3000:]!r}")
    out = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, out
    r = json.loads(result.read_text())
    assert r["minutes"] == 0.5 and r["traffic_s"] >= 30, out
    assert r["passed"] and all(r["checks"].values()), r["checks"]
    assert r["errors"] == {}, r["error_examples"]
    assert r["kv_cache_usage_end"] == 0
    assert r["served"] > 50, out
    for kind in (
        "completion",
        "completion_stream",
        "chat",
        "chat_stream",
        "guided_choice",
        "json_schema",
    ):
        assert r["served_by_kind"].get(kind, 0) > 0, (kind, r["served_by_kind"])
    assert r["chaos"].get("disconnect", 0) > 0 and r["chaos"].get("abort", 0) > 0, r["chaos"]
    assert len(r["rss"]) >= 3, r["rss"]  # server, engine core, worker
    assert all(r_["growth"] < 0.05 for r_ in r["rss"])
    assert r["windows"] and all(w["forward_steps"] > 0 for w in r["windows"]), r["windows"]
    assert r["server_exit_code"] == 0 and r["leftover_processes"] == []
