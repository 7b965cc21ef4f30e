"""Data parallel offline: `LLM(data_parallel_size=2)` runs two engine cores (each with its
own worker) whose greedy outputs equal one engine's; both serve, pinning works, and with
`data_parallel_keep_serving` a killed engine fails only its own requests and leaves no
process behind. Also: external load balancing (`data_parallel_rank`) and two "hosts" on
127.0.0.1, one `--headless`, over CURVE-encrypted TCP.

One DP engine for the module (started once); the headless pair starts its own."""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.support.engines import make_llm
from tests.support.proc_utils import descendants, kill, wait_dead
from vserve import LLM, SamplingParams
from vserve.engine.mp_client import EngineDeadError
from vserve.executor.multiproc import free_port

pytestmark = pytest.mark.slow

PROMPTS = [[2, 10 + i, 20 + 2 * i, 30 + 3 * i] for i in range(12)]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
ARGS = dict(dtype="float32", max_model_len=1024, num_gpu_blocks_override=512)


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def _prompts(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def expected(model):
    llm = make_llm(model, **ARGS)
    ids = _ids(llm.generate(_prompts(PROMPTS), GREEDY, use_tqdm=False))
    llm.shutdown()
    return ids


@pytest.fixture(scope="module")
def dp_llm(model):
    # every step sleeps 5 ms: long requests are surely in flight when an engine is killed
    saved = os.environ.get("VSERVE_FAULT_INJECT")
    os.environ["VSERVE_FAULT_INJECT"] = "execute_model_delay:5"
    try:
        llm = LLM(model, data_parallel_size=2, data_parallel_keep_serving=True, **ARGS)
    finally:
        if saved is None:
            del os.environ["VSERVE_FAULT_INJECT"]
        else:
            os.environ["VSERVE_FAULT_INJECT"] = saved
    yield llm
    llm.shutdown()


def test_two_engines_equal_one_and_both_serve(dp_llm, expected):
    router = dp_llm.engine.client.router
    before = dict(router.num_assigned)
    assert _ids(dp_llm.generate(_prompts(PROMPTS), GREEDY, use_tqdm=False)) == expected
    assigned = {r: router.num_assigned[r] - before[r] for r in before}
    assert assigned == {0: 6, 1: 6}  # a burst alternates: its own counts, between figures


def test_a_request_may_name_its_engine(dp_llm, expected):
    router = dp_llm.engine.client.router
    before = router.num_assigned[1]
    outs = dp_llm.generate(_prompts(PROMPTS[:4]), GREEDY, use_tqdm=False, data_parallel_rank=1)
    assert _ids(outs) == expected[:4]
    assert router.num_assigned[1] - before == 4
    with pytest.raises(ValueError, match="data_parallel_rank must be one of"):
        dp_llm.generate(_prompts(PROMPTS[:1]), GREEDY, data_parallel_rank=2)


def test_killed_engine_fails_its_requests_the_other_serves_on(dp_llm, expected):
    """data_parallel_keep_serving: engine 1 is SIGKILLed mid-run; its requests end with
    finish_reason "error", engine 0's finish, later work runs on engine 0, and nothing of
    engine 1's tree survives."""
    victim = dp_llm.engine.client.clients[1].engine.proc.pid
    tree = [victim, *descendants(victim)]
    long = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
    box = {}
    thread = threading.Thread(
        target=lambda: box.update(outs=dp_llm.generate(_prompts(PROMPTS[:4]), long, use_tqdm=False))
    )
    thread.start()
    time.sleep(1.0)
    kill(victim, signal.SIGKILL)
    thread.join(timeout=30)
    assert not thread.is_alive()
    reasons = [o.outputs[0].finish_reason for o in box["outs"]]
    assert sorted(reasons) == ["error", "error", "length", "length"]
    assert wait_dead(tree, timeout=10) == []
    assert _ids(dp_llm.generate(_prompts(PROMPTS[:3]), GREEDY, use_tqdm=False)) == expected[:3]
    with pytest.raises(ValueError, match="engine 1 is dead"):
        dp_llm.generate(_prompts(PROMPTS[:1]), GREEDY, data_parallel_rank=1)


def test_external_lb_rank_is_one_plain_engine(model):
    llm = make_llm(model, data_parallel_size=2, data_parallel_rank=1, **ARGS)
    assert llm.config.data_parallel.engine_index == 1
    assert _ids(llm.generate(_prompts(PROMPTS[:2]), GREEDY, use_tqdm=False, data_parallel_rank=1))
    with pytest.raises(ValueError, match="data_parallel_rank must be one of"):
        llm.generate(_prompts(PROMPTS[:1]), GREEDY, data_parallel_rank=0)
    llm.shutdown()


def test_bad_data_parallel_arguments(model):
    with pytest.raises(ValueError, match=r"data_parallel_size must be in \[1, 1024\]"):
        LLM(model, data_parallel_size=0, **ARGS)
    with pytest.raises(ValueError, match="must lie in"):
        LLM(model, data_parallel_size=2, data_parallel_size_local=2, data_parallel_start_rank=1)
    with pytest.raises(ValueError, match="data-parallel-rpc-port"):
        LLM(model, data_parallel_size=2, data_parallel_size_local=1, **ARGS)
    with pytest.raises(ValueError, match="VSERVE_DP_SECRET"):
        LLM(
            model,
            data_parallel_size=2,
            data_parallel_size_local=1,
            data_parallel_address="10.1.2.3",
            data_parallel_rpc_port=free_port(),
            **ARGS,
        )


@pytest.mark.parametrize(
    "args, message",
    [
        # 10**23 engines were spawned one by one: the start-up hung with no output
        ({"data_parallel_size": 10**23}, r"data_parallel_size must be in \[1, 1024\]"),
        ({"data_parallel_size": "2"}, "data_parallel_size must be in"),
        # zmq bound 70000 as port 4464 (70000 mod 65536)
        (
            {
                "data_parallel_size": 2,
                "data_parallel_size_local": 1,
                "data_parallel_rpc_port": 70000,
            },
            r"data_parallel_rpc_port must be a TCP port in \[0, 65535\]",
        ),
        ({"data_parallel_rpc_port": -1}, "data_parallel_rpc_port must be a TCP port"),
        ({"master_port": 2**64}, "master_port must be a TCP port"),
        # a string compared with an int: TypeError, not a clear refusal
        ({"data_parallel_size": 2, "data_parallel_rank": "1"}, "data_parallel_rank must be an"),
        (
            {"data_parallel_size": 2, "data_parallel_size_local": "1"},
            "data_parallel_size_local must be an integer",
        ),
        ({"data_parallel_start_rank": 1.5}, "data_parallel_start_rank must be an integer"),
    ],
)
def test_out_of_range_scale_out_arguments_are_refused(model, args, message):
    from vserve.engine.arg_utils import EngineArgs

    with pytest.raises(ValueError, match=message):
        EngineArgs(model=model, **ARGS, **args).create_engine_config()


def _headless_pair(model, port, **head_args):
    """A `--headless` host (rank 1, its own process) and the head's `LLM` (rank 0)."""
    dp = [
        "--data-parallel-size",
        "2",
        "--data-parallel-size-local",
        "1",
        "--data-parallel-address",
        "127.0.0.1",
        "--data-parallel-rpc-port",
        str(port),
    ]
    cmd = [sys.executable, "-m", "vserve.cli", "serve", model, "--headless", *dp]
    tiny = ["--dtype", "float32", "--max-model-len", "1024", "--num-gpu-blocks-override", "512"]
    host1 = subprocess.Popen([*cmd, *tiny, "--data-parallel-start-rank", "1"], env=os.environ)
    try:
        llm = LLM(
            model,
            data_parallel_size=2,
            data_parallel_size_local=1,
            data_parallel_address="127.0.0.1",
            data_parallel_rpc_port=port,
            **ARGS,
            **head_args,
        )
    except BaseException:
        host1.kill()
        host1.wait()
        raise
    return host1, llm


def test_two_hosts_headless(model, expected, monkeypatch):
    """Host 1 runs `vserve serve --headless` (rank 1), host 0 the front end and rank 0, over
    TCP on 127.0.0.1 with CURVE keys from VSERVE_DP_SECRET; both ranks serve, the tokens equal
    one engine's, and the headless host exits 0 with its engine once the head shuts down."""
    monkeypatch.setenv("VSERVE_DP_SECRET", "a-test-secret-of-32-characters!!")
    host1, llm = _headless_pair(model, free_port())
    try:
        tree = descendants(host1.pid)
        assert len(tree) >= 2  # its engine core and that core's worker
        outs = llm.generate(_prompts(PROMPTS), GREEDY, use_tqdm=False)
        assert llm.engine.client.router.num_assigned == {0: 6, 1: 6}
        assert _ids(outs) == expected
        llm.shutdown()
        assert host1.wait(timeout=30) == 0
        assert wait_dead(tree, timeout=10) == []
    finally:
        if host1.poll() is None:
            host1.kill()
            host1.wait()


def test_data_parallel_times_tensor_parallel(model, expected):
    """DP 2 x TP 2: two engines of two TP ranks each (six processes) give one engine's
    tokens, and both serve."""
    llm = LLM(model, data_parallel_size=2, tensor_parallel_size=2, **ARGS)
    try:
        assert _ids(llm.generate(_prompts(PROMPTS), GREEDY, use_tqdm=False)) == expected
        assert llm.engine.client.router.num_assigned == {0: 6, 1: 6}
    finally:
        llm.shutdown()


def test_remote_engine_death_is_seen_at_once(model):
    """The remote engine core SIGKILLed: its host reports the exit, the head fails the work
    (no keep-serving: the whole engine is dead) within moments; the headless host exits 1 and
    leaves nothing behind. Loopback with no secret set (the per-run one)."""
    host1, llm = _headless_pair(model, free_port())
    try:
        tree = descendants(host1.pid)
        core = next(p for p in tree if b"core_proc" in _cmdline(p))
        kill(core, signal.SIGKILL)
        start = time.monotonic()
        long = SamplingParams(temperature=0, max_tokens=900, ignore_eos=True)
        with pytest.raises(EngineDeadError, match="engine 1 .remote. disconnected"):
            llm.generate(_prompts(PROMPTS[:4]), long, use_tqdm=False)
        assert time.monotonic() - start < 5
        llm.shutdown()
        assert host1.wait(timeout=30) == 1
        assert wait_dead(tree, timeout=10) == []
    finally:
        if host1.poll() is None:
            host1.kill()
            host1.wait()


def test_remote_engine_death_with_keep_serving(model, expected):
    """--data-parallel-keep-serving with the remote engine SIGKILLed: the head marks rank 1
    dead, naming it is a ValueError, and every later request runs on rank 0 with one
    engine's tokens; the headless host exits 1 and leaves nothing behind."""
    host1, llm = _headless_pair(model, free_port(), data_parallel_keep_serving=True)
    try:
        tree = descendants(host1.pid)
        core = next(p for p in tree if b"core_proc" in _cmdline(p))
        kill(core, signal.SIGKILL)
        assert host1.wait(timeout=30) == 1
        remote = llm.engine.client.clients[1]
        deadline = time.monotonic() + 10
        while remote.dead_message is None and time.monotonic() < deadline:
            time.sleep(0.05)  # the death is seen from the host's report, not by a request
        assert remote.dead_message is not None and "exited on its host" in remote.dead_message
        with pytest.raises(ValueError, match="engine 1 is dead"):
            llm.generate(_prompts(PROMPTS[:1]), GREEDY, data_parallel_rank=1)
        assert _ids(llm.generate(_prompts(PROMPTS), GREEDY, use_tqdm=False)) == expected
        llm.shutdown()
        assert wait_dead(tree, timeout=10) == []
    finally:
        if host1.poll() is None:
            host1.kill()
            host1.wait()


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""
