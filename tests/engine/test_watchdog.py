"""The watchdog (`watchdog_timeout`): a worker or engine core that stops making progress (a
SIGSTOP, a forward that never returns) is declared dead: pending requests get an error that
says so, and no process of the engine's tree is left. Every wait is bounded: a hang fails the
test, it never counts as the expected error."""

import signal
import threading
import time

import pytest

from tests.support.proc_utils import alive, descendants, kill, wait_dead, worker_pids
from vserve import LLM, SamplingParams
from vserve.engine.arg_utils import EngineArgs
from vserve.engine.mp_client import EngineDeadError

pytestmark = pytest.mark.slow  # the fast tier (-m "not slow") leaves these out

LONG = SamplingParams(temperature=0, max_tokens=3000, ignore_eos=True)
WATCHDOG_S = 3


def _model(tiny_model_dir) -> str:
    return tiny_model_dir("llama", max_position_embeddings=8192)


def _start(model_dir, **kwargs):
    return LLM(
        model_dir,
        dtype="float32",
        max_model_len=4096,
        max_num_seqs=4,
        watchdog_timeout=WATCHDOG_S,
        **kwargs,
    )


def _generate_in_thread(llm, prompts, params=LONG):
    box = {}

    def run():
        try:
            box["result"] = llm.generate(prompts, params, use_tqdm=False)
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            box["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


def _wait_generating(llm, timeout: float = 30) -> None:
    """Until the engine has run a few steps (so the fault hits a step in flight)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = llm.engine.last_stats
        if stats is not None and stats.num_running_reqs > 0:
            return
        time.sleep(0.05)
    raise AssertionError("generation did not start")


def _expect_dead(thread, box, match: str) -> None:
    thread.join(timeout=WATCHDOG_S + 30)
    assert not thread.is_alive(), "generate hung: the watchdog did not fire"
    error = box.get("error")
    assert isinstance(error, EngineDeadError), box
    assert match in str(error), str(error)


@pytest.mark.parametrize(
    "target, pp, match",
    [
        ("worker", 1, "got no reply from the workers"),  # the engine core's step deadline
        ("worker", 2, "got no reply from the workers"),  # rank 0 then waits in a collective
        ("engine core", 1, "engine core did not answer"),  # the front end's ping
    ],
)
def test_stopped_process_is_declared_dead(tiny_model_dir, target, pp, match):
    llm = _start(_model(tiny_model_dir), pipeline_parallel_size=pp)
    engine_pid = llm.engine.client.engine.proc.pid
    tree = [engine_pid, *descendants(engine_pid)]
    workers = worker_pids(engine_pid)
    assert len(workers) == pp
    stopped = workers[-1] if target == "worker" else engine_pid
    try:
        thread, box = _generate_in_thread(llm, ["one", "two", "three"])
        _wait_generating(llm)
        kill(stopped, signal.SIGSTOP)
        _expect_dead(thread, box, match)
        # the whole tree is gone before any shutdown call: the engine cleaned up after itself
        assert wait_dead(tree, timeout=15) == []
        with pytest.raises(EngineDeadError):  # and it stays dead
            llm.generate(["again"], LONG, use_tqdm=False)
    finally:
        for pid in tree:
            if alive(pid):
                kill(pid, signal.SIGCONT)
                kill(pid, signal.SIGKILL)
        llm.shutdown()


@pytest.mark.parametrize(
    "backend, match",
    [("mp", "got no reply from the workers"), ("uni", "engine core did not answer")],
)
def test_forward_that_never_returns_is_declared_dead(tiny_model_dir, monkeypatch, backend, match):
    """mp: the engine core's step deadline; uni (the forward runs in the engine core itself):
    the front end's unanswered ping."""
    monkeypatch.setenv("VSERVE_FAULT_INJECT", "execute_model_hang:5")
    llm = _start(_model(tiny_model_dir), distributed_executor_backend=backend)
    engine_pid = llm.engine.client.engine.proc.pid
    tree = [engine_pid, *descendants(engine_pid)]
    try:
        thread, box = _generate_in_thread(llm, ["a prompt"])
        _expect_dead(thread, box, match)
        assert wait_dead(tree, timeout=15) == []
    finally:
        for pid in tree:
            kill(pid, signal.SIGKILL)
        llm.shutdown()


def test_watchdog_off_waits_for_a_slow_step(tiny_model_dir):
    """watchdog_timeout=0: a stopped worker is waited for, and the step completes once it is
    continued (no false alarm)."""
    llm = LLM(_model(tiny_model_dir), dtype="float32", max_model_len=512, watchdog_timeout=0)
    engine_pid = llm.engine.client.engine.proc.pid
    worker = worker_pids(engine_pid)[0]
    try:
        short = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
        thread, box = _generate_in_thread(llm, ["x"], short)
        _wait_generating(llm)
        kill(worker, signal.SIGSTOP)
        thread.join(timeout=WATCHDOG_S + 1)  # past the other tests' step deadline
        assert thread.is_alive() and not box
        kill(worker, signal.SIGCONT)
        thread.join(timeout=120)
        assert not thread.is_alive() and "result" in box, box
    finally:
        kill(worker, signal.SIGCONT)
        llm.shutdown()


@pytest.mark.parametrize("value", [-1, float("nan"), float("inf"), "3", True])
def test_watchdog_timeout_is_validated(tiny_model_dir, value):
    with pytest.raises(ValueError, match="watchdog_timeout"):
        EngineArgs(model=_model(tiny_model_dir), watchdog_timeout=value).create_engine_config()


def test_watchdog_timeout_reaches_the_config(tiny_model_dir):
    cfg = EngineArgs(model=_model(tiny_model_dir), watchdog_timeout=7).create_engine_config()
    assert cfg.watchdog_timeout == 7.0
    assert EngineArgs(model=_model(tiny_model_dir)).create_engine_config().watchdog_timeout == 300.0


def test_step_deadline_counts_from_when_the_step_could_start(monkeypatch):
    """Two steps in flight, each running 0.6 x the timeout: the second's reply comes 1.2 x the
    timeout after it was sent, which is no hang. A step with no reply at all is one. The
    executor's clock is the test's, so nothing here depends on the machine's speed."""
    import multiprocessing as mp
    from types import SimpleNamespace

    from vserve.core.sched_output import RunnerOutput
    from vserve.executor import multiproc
    from vserve.executor.multiproc import MultiprocExecutor, WorkerError
    from vserve.workers import messages as wire

    clock = [0.0]
    monkeypatch.setattr(multiproc, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    ex = object.__new__(MultiprocExecutor)  # the reply path only: no worker processes
    ex.procs, ex.replies, ex.watchdog_timeout = [], {}, 20.0
    ex._sent_at, ex._last_reply_at, ex._closing = {1: 0.0, 2: 0.0, 3: 0.0}, 0.0, False
    ex.resp_r, resp_w = mp.Pipe(duplex=False)

    def reply(step_id, delay=0.0):
        time.sleep(delay)
        resp_w.send_bytes(wire.encode(wire.Out(RunnerOutput(step_id))))

    reply(1)
    clock[0] = 12.0  # step 1 ran 0.6 x the timeout
    assert ex._reply_for(1, None).step_id == 1
    clock[0] = 24.0  # step 2 (sent at 0) has run 12 since step 1 replied
    threading.Thread(target=reply, args=(2, 0.2), daemon=True).start()
    assert ex._reply_for(2, None).step_id == 2
    clock[0] = 44.0  # step 3: 20 since step 2 replied, and no reply
    with pytest.raises(WorkerError, match="got no reply from the workers in 20.0 s"):
        ex._reply_for(3, None)


def test_a_stalled_event_loop_does_not_kill_a_live_engine(tiny_model_dir):
    """The front end's event loop held for longer than the watchdog allows (by anything
    that blocks it) right after a ping went out, while a request streams: the engine
    answered meanwhile, its reply waits in the socket behind the outputs of hundreds of
    steps, so the engine is not declared dead and keeps serving."""
    import asyncio

    from vserve.engine.async_llm import AsyncLLM
    from vserve.engine.messages import RequestType
    from vserve.engine.mp_client import watchdog_periods

    _, limit = watchdog_periods(1.0)

    async def run():
        engine = AsyncLLM.from_engine_args(
            EngineArgs(model=_model(tiny_model_dir), dtype="float32", watchdog_timeout=1.0)
        )
        try:
            await engine.call_utility("ping")  # the client and its watchdog run
            client = engine.client
            send, stalled = client._send, asyncio.Event()

            async def send_then_stall(frames):
                await send(frames)
                is_ping = frames[0] == bytes([RequestType.UTILITY]) and b"ping" in frames[1]
                if is_ping and not stalled.is_set():
                    stalled.set()  # once the ping waits for its reply, the loop is blocked
                    asyncio.get_running_loop().call_soon(time.sleep, limit + 2)

            async def stream():
                async for _ in engine.generate({"prompt_token_ids": [2, 3]}, LONG, "long"):
                    pass

            streaming = asyncio.ensure_future(stream())
            await asyncio.sleep(1)  # outputs flow
            client._send = send_then_stall
            await asyncio.wait_for(stalled.wait(), 30)
            await asyncio.sleep(limit + 1)
            assert not engine.errored, engine.dead_error
            streaming.cancel()
            params = SamplingParams(temperature=0, max_tokens=2)
            outs = [o async for o in engine.generate({"prompt_token_ids": [2, 3]}, params, "r")]
            assert outs[-1].finished
        finally:
            engine.shutdown()

    asyncio.run(run())
