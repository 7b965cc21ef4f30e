"""`vserve bench serve` against our own server: the printed block and the saved JSON."""

import json
import re
import subprocess
import sys

import pytest

from tests.support.openai_server import TINY_ARGS, ServerProcess


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    srv = ServerProcess(
        [
            tiny_model_dir("llama"),
            *TINY_ARGS,
            "--max-model-len",
            "512",
            "--served-model-name",
            "tiny",
        ]
    ).wait_ready()
    srv.model_dir = tiny_model_dir("llama")
    yield srv
    assert srv.stop() == 0


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
    out = tmp_path / "serve.json"
    cmd = [
        sys.executable,
        "-m",
        "vserve.entrypoints.cli",
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
        *extra,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, json.loads(out.read_text())


@pytest.mark.parametrize("backend", ["openai", "openai-chat"])
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
    assert result["max_concurrent_requests"] <= 4
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    assert len(result["ttfts"]) == 12 and all(t > 0 for t in result["ttfts"])
    assert 0 < len(result["itls"]) <= 12 * 9  # pooled gaps between content chunks
    assert result["mean_tpot_ms"] > 0 and result["p99_ttft_ms"] >= result["median_ttft_ms"]


def test_bench_serve_poisson_rate(server, tmp_path):
    stdout, result = _run(server, tmp_path, "--request-rate", "20", "--seed", "1")
    assert "Request rate configured (RPS):" in stdout and "20.00" in stdout
    assert result["completed"] == 12
    assert result["total_input_tokens"] > 0


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
