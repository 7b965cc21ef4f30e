"""`vserve bench serve` against our own server: the printed block and the saved JSON."""

import argparse
import json
import random
import re
import subprocess
import sys

import pytest

from vserve.bench.serve import RequestResult, compute_metrics


@pytest.fixture(scope="module")
def server(tiny_llama_server):
    return tiny_llama_server


LABELS = [
    "Successful requests:",
    "Failed requests:",
    "Benchmark duration (s):",
    "Total input tokens:",
    "Total generated tokens:",
    "Request throughput (req/s):",
    "Output token throughput (tok/s):",
    "Peak output token throughput (tok/s):",
    "Peak concurrent requests:",
    "Total token throughput (tok/s):",
    "Mean TTFT (ms):",
    "Median TTFT (ms):",
    "P99 TTFT (ms):",
    "Mean TPOT (ms):",
    "Median TPOT (ms):",
    "P99 TPOT (ms):",
    "Mean ITL (ms):",
    "Median ITL (ms):",
    "P99 ITL (ms):",
]


def _run(server, tmp_path, *extra):
    cmd = [*_bench_args(server, tmp_path), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, json.loads((tmp_path / "serve.json").read_text())


def _bench_args(server, tmp_path) -> list[str]:
    out = tmp_path / "serve.json"
    return [
        sys.executable,
        "-m",
        "vserve.cli",
        "bench",
        "serve",
        "--base-url",
        server.url,
        "--tokenizer",
        server.model_dir,
        "--num-prompts",
        "12",
        "--input-len",
        "32",
        "--output-len",
        "10",
        "--ignore-eos",
        "--disable-tqdm",
        "--result-filename",
        str(out),
    ]


@pytest.mark.parametrize("backend", ["openai", pytest.param("openai-chat", marks=pytest.mark.slow)])
def test_bench_serve_prints_reference_labels(server, tmp_path, backend):
    stdout, result = _run(
        server,
        tmp_path,
        "--backend",
        backend,
        "--max-concurrency",
        "4",
        "--goodput",
        "ttft:100000",
        "tpot:100000",
    )
    for label in LABELS + ["Maximum request concurrency:", "Request goodput (req/s):"]:
        assert re.search(rf"^{re.escape(label)}\s+\S+", stdout, re.M), label
    assert result["completed"] == 12 and result["failed"] == 0
    assert result["total_output_tokens"] == 12 * 10  # ignore_eos: exactly max_tokens
    assert 2 <= result["max_concurrent_requests"] <= 4
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    assert len(result["ttfts"]) == 12 and all(t > 0 for t in result["ttfts"])
    assert 0 < len(result["itls"]) <= 12 * 9  # pooled gaps between content chunks
    assert result["mean_tpot_ms"] > 0 and result["p99_ttft_ms"] >= result["median_ttft_ms"]


@pytest.mark.slow
def test_bench_serve_reads_a_local_sharegpt_file(server, tmp_path):
    """--dataset-name sharegpt: the first human turn of each conversation is a prompt, the
    reply's token count its output length (ignore_eos: exactly that); the too-short ones are
    dropped as the reference benchmark drops them."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(server.model_dir)
    replies = ["The quick brown fox jumps over the lazy dog.", "1 2 3 4 5 6 7 8 9 10 11 12"]
    data = [
        {
            "conversations": [
                {"from": "human", "value": f"Tell me {i}: " + "Paris is " * 4},
                {"from": "gpt", "value": replies[i % 2]},
            ]
        }
        for i in range(6)
    ] + [{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "ok"}]}]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    sharegpt = ("--dataset-name", "sharegpt", "--dataset-path", str(path))
    _, result = _run(server, tmp_path, *sharegpt)  # (--output-len is the random set's)
    assert result["completed"] == 6 and result["failed"] == 0  # "hi" / "ok": too short
    want = sorted(len(tok.encode(replies[i % 2], add_special_tokens=False)) for i in range(6))
    assert sorted(result["output_lens"]) == want
    _, result = _run(server, tmp_path, *sharegpt, "--sharegpt-output-len", "5")
    assert result["output_lens"] == [5] * 6


@pytest.mark.slow
def test_bench_serve_poisson_rate(server, tmp_path):
    stdout, result = _run(server, tmp_path, "--request-rate", "20", "--seed", "1")
    assert "Request rate configured (RPS):" in stdout and "20.00" in stdout
    assert result["completed"] == 12
    assert result["total_input_tokens"] > 0
    # the gaps the run slept after each of its 12 requests (vserve.bench.serve._drive)
    rng = random.Random(1)
    gaps = [rng.gammavariate(1.0, 1.0 / 20) for _ in range(12)]
    assert result["duration"] >= sum(gaps)


def _synthetic(i: int) -> RequestResult:
    """Request i of 1..100: TTFT i ms, then 10 more tokens i/2 ms apart; groups of 4 start
    together, 10 s apart."""
    start, ttft, tpot = 10.0 * (i // 4), i * 1e-3, i * 0.5e-3
    chunks = [start + ttft + j * tpot for j in range(11)]
    return RequestResult(
        success=True,
        prompt_len=5,
        output_tokens=11,
        ttft=ttft,
        latency=ttft + 10 * tpot,
        itl=[tpot] * 10,
        start=start,
        chunk_times=chunks,
    )


def test_compute_metrics_on_known_requests():
    failed = RequestResult(start=1000.0, error="HTTP 500")
    results = [_synthetic(i) for i in range(1, 101)] + [failed]
    args = argparse.Namespace(metric_percentiles="50,99", goodput=["ttft:50"])
    m = compute_metrics(results, 10.0, args)
    assert (m["completed"], m["failed"], m["errors"]) == (100, 1, ["HTTP 500"])
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (500, 1100)
    assert m["request_throughput"] == pytest.approx(10.0)
    assert m["output_throughput"] == pytest.approx(110.0)
    assert m["total_token_throughput"] == pytest.approx(160.0)
    assert m["request_goodput"] == pytest.approx(5.0)  # TTFT <= 50 ms: requests 1..50
    expected = {  # TTFT i, TPOT i/2 (ITL: 10 gaps each), E2EL 6i over i = 1..100, in ms
        "ttft": (50.5, 50.5, 99.01),
        "tpot": (25.25, 25.25, 49.505),
        "itl": (25.25, 25.25, 49.505),
        "e2el": (303.0, 303.0, 594.06),
    }
    for name, (mean, median, p99) in expected.items():
        got = (m[f"mean_{name}_ms"], m[f"median_{name}_ms"], m[f"p99_{name}_ms"])
        assert got == pytest.approx((mean, median, p99)), name
        assert m[f"p50_{name}_ms"] == pytest.approx(median), name
    assert len(m["itls"]) == 1000
    assert m["max_concurrent_requests"] == 4
    assert m["max_output_tokens_per_s"] == pytest.approx(44.0)  # requests 96..99, one second


# -- SSE parsing (no server) -------------------------------------------------------------------
ODD = "a\u2028b\u2029c\x85d"  # str.splitlines (httpx's aiter_lines) breaks at each of these


def _response(pieces: list[bytes]):
    import httpx

    async def body():
        for piece in pieces:
            yield piece

    return httpx.Response(200, content=body())


def _lines(pieces: list[bytes]) -> list[str]:
    import asyncio

    from vserve.bench.sse import sse_lines

    async def collect():
        return [line async for line in sse_lines(_response(pieces))]

    return asyncio.run(collect())


def test_sse_lines_break_only_at_cr_and_lf():
    event = json.dumps({"text": ODD}, ensure_ascii=False)
    assert _lines([f"data: {event}\n\ndata: [DONE]\n\n".encode()]) == [
        f"data: {event}",
        "",
        "data: [DONE]",
        "",
    ]
    # read 1 ends inside "é", read 2 between the CR and the LF of a CRLF; then a CR alone,
    # and a last line with no end
    raw = "data: é\r\n: c\rdata: x".encode()
    cut = raw.index(b"\r") + 1
    assert _lines([raw[:7], raw[7:cut], raw[cut:]]) == ["data: é", ": c", "data: x"]


def test_bench_serve_parses_chunks_with_line_separators_in_their_text():
    """A model may emit U+2028 / U+0085 raw in a JSON string; the chunk is still one event
    (with httpx's aiter_lines the request failed with a JSON error)."""
    import argparse
    import asyncio

    import httpx

    from vserve.bench.serve import _one

    chunks = [{"choices": [{"index": 0, "text": t}]} for t in ("x", ODD, "y")]
    chunks.append({"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 3}})
    body = "".join(f"data: {json.dumps(c, ensure_ascii=False)}\n\n" for c in chunks)
    body += "data: [DONE]\n\n"
    transport = httpx.MockTransport(lambda request: httpx.Response(200, text=body))
    args = argparse.Namespace(ignore_eos=False, backend="openai", temperature=0.0)

    async def run():
        async with httpx.AsyncClient(transport=transport, base_url="http://x") as client:
            return await _one(client, "/v1/completions", args, "m", ("hi", 4, 3), None)

    result = asyncio.run(run())
    assert result.success, result.error
    assert result.output_tokens == 3 and len(result.chunk_times) == 3 and len(result.itl) == 2
