"""`vserve serve --data-parallel-size 2`: one front end over two engine cores. A burst of 100
requests splits no worse than 35/65 (counted per engine by `/metrics`' `engine` label), the
texts equal one engine's, `X-data-parallel-rank` pins a request, and killing one engine
(without `--data-parallel-keep-serving`) fails the server: exit 1, no process left.

One server for the module; the kill test runs last and ends it."""

import asyncio
import re
import signal
import threading
import time

import httpx
import pytest

from tests.support.engines import make_llm
from tests.support.openai_server import TINY_ARGS, ServerProcess
from tests.support.proc_utils import kill
from vserve import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [[2, 10 + i, 20 + 2 * i, 30 + 3 * i] for i in range(10)]
MAX_TOKENS = 4
# every step sleeps 5 ms: a long request is surely in flight when an engine is killed
SLOW_STEPS = {"VSERVE_FAULT_INJECT": "execute_model_delay:5"}


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def server(model):
    srv = ServerProcess(
        [model, *TINY_ARGS, "--max-model-len", "1024", "--data-parallel-size", "2"], SLOW_STEPS
    ).wait_ready()
    yield srv
    if srv.proc.poll() is None:
        srv.stop()


@pytest.fixture(scope="module")
def expected(model):
    llm = make_llm(model, dtype="float32", max_model_len=1024)
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
    llm.shutdown()
    return [o.outputs[0].text for o in outs]


def _body(prompt, max_tokens=MAX_TOKENS):
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


def _per_engine(srv) -> dict[str, float]:
    """Finished requests by engine, from /metrics."""
    text = httpx.get(srv.url + "/metrics").text
    counts = {"0": 0.0, "1": 0.0}
    for engine, value in re.findall(
        r'^vserve:request_success_total\{engine="(\d)",finished_reason="length"[^}]*\} (\S+)',
        text,
        re.M,
    ):
        counts[engine] += float(value)
    return counts


def test_100_requests_split_evenly_and_equal_one_engine(server, expected):
    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            calls = [
                client.post("/v1/completions", json=_body(PROMPTS[i % 10])) for i in range(100)
            ]
            return await asyncio.gather(*calls)

    before = _per_engine(server)
    responses = asyncio.run(run())
    assert [r.status_code for r in responses] == [200] * 100
    texts = [r.json()["choices"][0]["text"] for r in responses]
    assert texts == [expected[i % 10] for i in range(100)]
    after = _per_engine(server)
    split = {e: after[e] - before[e] for e in after}
    assert sum(split.values()) == 100
    assert min(split.values()) >= 35, split


def test_metrics_carry_the_engine_label(server):
    text = httpx.get(server.url + "/metrics").text
    for engine in ("0", "1"):
        assert re.search(rf'^vserve:num_requests_running\{{engine="{engine}"', text, re.M)
        assert re.search(rf'^vserve:generation_tokens_total\{{engine="{engine}"', text, re.M)
    assert "engine_core_dp1" in text  # each engine's processes' memory


def test_header_pins_the_engine(server, expected):
    before = _per_engine(server)
    for _ in range(3):
        r = httpx.post(
            server.url + "/v1/completions",
            json=_body(PROMPTS[0]),
            headers={"X-data-parallel-rank": "1"},
        )
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected[0]
    after = _per_engine(server)
    assert (after["0"] - before["0"], after["1"] - before["1"]) == (0, 3)
    for bad in ("2", "one"):
        r = httpx.post(
            server.url + "/v1/completions",
            json=_body(PROMPTS[0]),
            headers={"X-data-parallel-rank": bad},
        )
        assert r.status_code == 400, r.text


def test_killed_engine_stops_the_server(server):
    """Last: one engine core SIGKILLed with a request in flight; the request fails, the
    server exits 1, and no engine or worker process of either engine survives."""
    server.remember_tree()
    engines = server.engine_pids = [p for p in server.tree if _is_engine_core(p)]
    assert len(engines) == 2
    box = {}

    def long_request():
        try:
            box["status"] = httpx.post(
                server.url + "/v1/completions", json=_body(PROMPTS[1], 900), timeout=60
            ).status_code
        except httpx.HTTPError as e:  # the server may close first
            box["status"] = type(e).__name__

    thread = threading.Thread(target=long_request)
    thread.start()
    time.sleep(1.0)
    kill(engines[0], signal.SIGKILL)
    thread.join(timeout=30)
    assert box["status"] != 200
    assert server.wait_exit(30) == 1
    assert server.survivors() == []


def _is_engine_core(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"vserve.engine.core_proc" in f.read()
    except OSError:
        return False


def test_keep_serving_fails_only_the_dead_engines_requests(model, expected):
    """--data-parallel-keep-serving: one engine killed with a long request pinned to each;
    the dead engine's request fails (500, naming it), the other's finishes, /health stays
    200, new requests succeed, naming the dead rank is a 400, and the server still stops
    cleanly (exit 0, nothing left)."""
    srv = ServerProcess(
        [model, *TINY_ARGS, "--max-model-len", "1024", "--data-parallel-size", "2"]
        + ["--data-parallel-keep-serving"],
        SLOW_STEPS,
    ).wait_ready()
    try:
        results: dict[str, httpx.Response] = {}

        def pinned_long_request(rank: str) -> None:
            results[rank] = httpx.post(
                srv.url + "/v1/completions",
                json=_body(PROMPTS[1], 400),
                headers={"X-data-parallel-rank": rank},
                timeout=60,
            )

        engines = [p for p in srv.remember_tree() if _is_engine_core(p)]
        threads = [threading.Thread(target=pinned_long_request, args=(r,)) for r in "01"]
        for thread in threads:
            thread.start()
        time.sleep(1.0)
        kill(engines[0], signal.SIGKILL)
        for thread in threads:
            thread.join(timeout=60)
        statuses = sorted(r.status_code for r in results.values())
        assert statuses == [200, 500]
        dead = next(rank for rank, r in results.items() if r.status_code == 500)
        assert f"data-parallel engine {dead}" in results[dead].text
        assert httpx.get(srv.url + "/health").status_code == 200
        r = httpx.post(srv.url + "/v1/completions", json=_body(PROMPTS[0]))
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected[0]
        pinned = httpx.post(
            srv.url + "/v1/completions",
            json=_body(PROMPTS[0]),
            headers={"X-data-parallel-rank": dead},
        )
        assert pinned.status_code == 400 and "dead" in pinned.text
    finally:
        assert srv.stop() == 0
