"""Pipeline parallel, and TP x PP, across two "hosts" on 127.0.0.1: node 1 runs `vserve
worker`, node 0 runs the engine; the tokens equal a single-host run. With TP x PP each host
holds a whole stage (its TP group all-reduces in shared memory); with TP alone the TP group
spans the hosts (gloo)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.engines import make_llm
from tests.support.hf_reference import PROMPTS
from tests.support.proc_utils import kill, wait_dead, worker_pids
from vserve import LLM, SamplingParams
from vserve.executor.multiproc import free_port

pytestmark = pytest.mark.slow  # the fast tier (-m "not slow") leaves these out

PARAMS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def expected(tiny_model_dir):
    """The single-host tokens, the same for every layout: one in-process run for the module
    (shut down before the two-host runs, which start engines of their own)."""
    single = make_llm(tiny_model_dir("gemma3"), max_model_len=256)
    try:
        return [o.outputs[0].token_ids for o in single.generate(PROMPTS, PARAMS, use_tqdm=False)]
    finally:
        single.shutdown()


@pytest.mark.parametrize("pp, tp", [(2, 1), (2, 2), (1, 2)])
def test_two_hosts_equal_one(tiny_model_dir, expected, pp, tp):
    model = tiny_model_dir("gemma3")
    port = free_port()
    common = [
        "--model",
        model,
        "--dtype",
        "float32",
        "--max-model-len",
        "256",
        "--pipeline-parallel-size",
        str(pp),
        "--tensor-parallel-size",
        str(tp),
        "--nnodes",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
    ]
    node1 = subprocess.Popen(
        [sys.executable, "-m", "vserve.cli", "worker", *common, "--node-rank", "1"]
    )
    try:
        llm = LLM(
            model,
            dtype="float32",
            max_model_len=256,
            pipeline_parallel_size=pp,
            tensor_parallel_size=tp,
            nnodes=2,
            node_rank=0,
            master_addr="127.0.0.1",
            master_port=port,
        )
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
        llm.shutdown()
        assert got == expected
        assert node1.wait(timeout=30) == 0  # node 1's stages exit with the engine
    finally:
        if node1.poll() is None:
            node1.kill()
    assert wait_dead([node1.pid], timeout=5) == []


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
def test_worker_host_stops_on_ctrl_c_and_sigterm(tiny_model_dir, sig):
    """`vserve worker` waiting for its engine stops, ranks included, on Ctrl-C (SIGINT to the
    terminal's process group) or SIGTERM; killed, its ranks leave with it. A hang fails the
    bounded wait."""
    common = [
        "--model",
        tiny_model_dir("gemma3"),
        "--dtype",
        "float32",
        "--max-model-len",
        "256",
        "--pipeline-parallel-size",
        "2",
        "--nnodes",
        "2",
        "--master-port",
        str(free_port()),
        "--node-rank",
        "1",
    ]
    node1 = subprocess.Popen(
        [sys.executable, "-m", "vserve.cli", "worker", *common],
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    ranks = []
    try:
        for line in node1.stderr:  # the ranks are started once this is logged
            if "waiting for the engine" in line:
                break
        deadline = time.monotonic() + 30  # a spawned rank shows its own command line soon
        while not (ranks := worker_pids(node1.pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(ranks) == 1
        _wait_ignoring_sigint(ranks[0])  # in worker_main, on its way to the rendezvous
        if sig == signal.SIGINT:
            os.killpg(node1.pid, sig)
        else:
            node1.send_signal(sig)
        code = node1.wait(timeout=10)
        assert wait_dead(ranks, timeout=5) == []
        assert code == (-sig if sig == signal.SIGKILL else 128 + sig)
    finally:
        for pid in [node1.pid, *ranks]:
            kill(pid, signal.SIGKILL)
        node1.wait()


def _wait_ignoring_sigint(pid: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = Path(f"/proc/{pid}/status").read_text().splitlines()
        ignored = int(next(li for li in status if li.startswith("SigIgn:")).split()[1], 16)
        if ignored & (1 << (signal.SIGINT - 1)):
            return
        time.sleep(0.05)
    raise AssertionError("the rank never reached worker_main")
