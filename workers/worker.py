"""A worker: one pipeline stage (or one TP shard of it) on one device. The executor calls
these methods, in process (uni-process executor) or through `vserve.workers.worker_proc`
(multiprocess executor)."""

from __future__ import annotations

import os
import time

import torch

from vserve.core.sched_output import SchedulerOutput
from vserve.host import heap
from vserve.startup import phase
from vserve.workers.model_runner import AsyncStepOutput, ModelRunner
from vserve.workers.runner_config import RunnerConfig

# a step is prompt-heavy (a prefill chunk) from this many tokens, and this many per request
PREFILL_STEP_TOKENS = 128
PREFILL_TOKENS_PER_REQUEST = 8


class Worker:
    def __init__(
        self,
        config: RunnerConfig,
        pp_comm=None,
        num_threads: int | None = None,
        prefill_threads: int | None = None,
    ):
        from vserve.models.hf_config import load_hf_config

        self.config = config
        heap.keep_freed_pages()
        self.threads: tuple[int, int] | None = None  # (decode, prompt-heavy) steps
        if num_threads:
            self.set_threads(num_threads, prefill_threads or num_threads)
        if config.device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", config.local_rank)))
        self.name = f"worker_{config.rank}"
        with phase("model config", self.name):
            hf_config = load_hf_config(config.model_path)
        self.runner = ModelRunner(config, hf_config, pp_comm)
        self._num_steps = 0
        self._fail_at, self._hang, self._delay_s = _fault_step()

    def load_model(self) -> None:
        with phase("load weights", self.name):
            self.runner.load_model()

    def num_kv_blocks(self) -> int:
        return self.runner.num_kv_blocks()

    def init_kv_cache(self, num_blocks: int) -> None:
        with phase("KV cache", self.name):
            self.runner.init_kv_cache(num_blocks)
        heap.trim()  # start-up is over: what loading the weights freed goes back

    def execute_model(
        self, so: SchedulerOutput, defer_sampling: bool = False, hidden_in=None
    ) -> AsyncStepOutput | None:
        self._num_steps += 1
        if self._fail_at is not None and self._num_steps == self._fail_at:
            while self._hang:  # a forward that never returns (watchdog tests)
                time.sleep(3600)
            raise RuntimeError(f"injected fault at step {self._num_steps} (VSERVE_FAULT_INJECT)")
        if self._delay_s:
            time.sleep(self._delay_s)  # a slow step (tests that need requests in flight)
        if self.threads is not None and self.threads[0] != self.threads[1]:
            self._use_threads(self.threads[1] if _prompt_heavy(so) else self.threads[0])
        return self.runner.execute_model(so, defer_sampling, hidden_in)

    def prepare(self, so: SchedulerOutput) -> None:
        """`execute_model(so)`'s host half ahead of it (ModelRunner.prepare)."""
        self.runner.prepare(so)

    def set_threads(self, num_threads: int, prefill_threads: int) -> None:
        """torch threads for decode steps and for prompt-heavy ones (vserve.host.placement:
        a PP stage prefills on its share of the host's cores)."""
        self.threads = (num_threads, max(num_threads, prefill_threads))
        self._use_threads(num_threads)

    def _use_threads(self, n: int) -> None:
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)

    def sample_tokens(self, step_id: int, grammar_bitmask) -> AsyncStepOutput | None:
        return self.runner.sample_tokens(step_id, grammar_bitmask)


def _prompt_heavy(so: SchedulerOutput) -> bool:
    tokens = so.total_num_scheduled_tokens
    return tokens >= PREFILL_STEP_TOKENS and tokens >= PREFILL_TOKENS_PER_REQUEST * max(
        1, len(so.num_scheduled_tokens)
    )


def _fault_step() -> tuple[int | None, bool, float]:
    """(step to fail at, hang there instead of raising, seconds every step sleeps first) from
    VSERVE_FAULT_INJECT ("execute_model:N", "execute_model_hang:N", "execute_model_delay:MS")."""
    from vserve.envs import read_env

    spec = read_env().fault_inject or ""
    if spec.startswith("execute_model_delay:"):
        return None, False, int(spec.split(":", 1)[1]) / 1000
    for kind, hang in (("execute_model:", False), ("execute_model_hang:", True)):
        if spec.startswith(kind):
            return int(spec.split(":", 1)[1]), hang, 0.0
    return None, False, 0.0
