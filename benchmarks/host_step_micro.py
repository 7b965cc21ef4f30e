"""Per-step host CPU time of the pieces around the forward, at a steady decode batch: the
worker's feedback bookkeeping (push, write back, plan), the torch attention backend's
`prepare`, and the scheduler's `schedule` + `update_from_output`.

    python benchmarks/host_step_micro.py [--batch 256]

CPU time of this thread (time.thread_time), best or median of repeats, so other load on the
machine moves it little. Run it with PYTHONPATH at two checkouts to compare them.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import numpy as np
import torch


def feedback_us(n: int) -> float:
    from vserve.core.sched_output import NewRequestData
    from vserve.sampling_params import SamplingParams
    from vserve.workers.feedback import FeedbackQueue
    from vserve.workers.input_batch import InputBatch
    from vserve.workers.input_prep import HostInputs

    batch = InputBatch(n, 160, 10)
    for k in range(n):
        batch.add(
            NewRequestData(f"r{k}", 1, list(range(1, 33)), 32, SamplingParams(), 0, [], ([],), 0)
        )
    rows, req_ids, queue, ids = (
        np.arange(n),
        [f"r{k}" for k in range(n)],
        FeedbackQueue(),
        torch.arange(n),
    )

    def step() -> float:
        if batch.num_tokens[0] > 150:
            batch.num_tokens[:] = 40
        for r in rows.tolist():
            batch.append_placeholder(r)
        start = time.thread_time()
        queue.push(1, batch, rows.tolist(), req_ids, ids)
        queue.settle(batch, None)
        computed = batch.num_tokens[rows] - 1
        host = HostInputs(
            np.arange(n + 1),
            computed,
            computed.copy(),
            computed + 1,
            np.zeros((n, 1), np.int32),
            batch.token_ids[rows, computed],
            16,
        )
        queue.plan(batch, host, req_ids, rows)
        return time.thread_time() - start

    for _ in range(20):
        step()
    return statistics.median(step() for _ in range(200)) * 1e6


def attention_prepare_us(n: int) -> float:
    from vserve.attention.base import AttentionMetadata
    from vserve.attention.torch_backend import TorchAttentionBackend

    seq = np.random.RandomState(0).randint(33, 128, n)
    qsl = np.arange(n + 1)
    meta = AttentionMetadata(
        num_tokens=n,
        positions=torch.tensor(seq - 1),
        slot_mapping=torch.zeros(n, dtype=torch.long),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq, dtype=torch.int32),
        block_tables=torch.arange(n * 10, dtype=torch.int32).view(n, 10),
        query_start_loc_cpu=qsl.tolist(),
        seq_lens_cpu=seq.tolist(),
        max_query_len=1,
        max_seq_len=int(seq.max()),
    )
    backend = TorchAttentionBackend(16)
    best = float("inf")
    for _ in range(7):
        start = time.thread_time()
        for _ in range(200):
            backend.prepare(meta, {None})
        best = min(best, (time.thread_time() - start) / 200)
    return best * 1e6


def scheduler_us(n: int) -> tuple[float, float]:
    from vserve.core.kv_cache_manager import KVCacheManager
    from vserve.core.request import Request
    from vserve.core.sched_output import RunnerOutput
    from vserve.core.scheduler import Scheduler, SchedulerConfig
    from vserve.sampling_params import SamplingParams

    def run() -> tuple[float, float]:
        cfg = SchedulerConfig(max_num_seqs=n, max_num_batched_tokens=8192, max_model_len=160)
        sched = Scheduler(cfg, KVCacheManager(n * 12, 16, True))
        rng = random.Random(0)
        params = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
        for i in range(n):
            sched.add_request(
                Request(
                    f"r{i}", [rng.randrange(3, 380) for _ in range(32)], params, eos_token_ids=(1,)
                )
            )
        schedule = commit = 0.0
        steps = 0
        while sched.has_unfinished_requests():
            t0 = time.thread_time()
            so = sched.schedule()
            t1 = time.thread_time()
            ro = RunnerOutput(
                so.step_id,
                list(so.sampling_req_ids),
                [[rng.randrange(3, 380)] for _ in so.sampling_req_ids],
            )
            t2 = time.thread_time()
            sched.update_from_output(so, ro)
            commit += time.thread_time() - t2
            schedule += t1 - t0
            steps += 1
        return schedule / steps * 1e6, commit / steps * 1e6

    runs = [run() for _ in range(5)]
    return min(r[0] for r in runs), min(r[1] for r in runs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=256)
    n = p.parse_args().batch
    torch.set_num_threads(1)
    feedback, prepare = feedback_us(n), attention_prepare_us(n)
    print(f"worker feedback push + write back + plan: {feedback:7.0f} us/step")
    print(f"torch attention prepare (decode only):    {prepare:7.0f} us/step")
    schedule, commit = scheduler_us(n)
    print(f"scheduler schedule / update_from_output:  {schedule:7.0f} / {commit:.0f} us/step")
    total = feedback + prepare + schedule + commit
    print(f"host loop in all:                         {total:7.0f} us/step")


if __name__ == "__main__":
    main()
