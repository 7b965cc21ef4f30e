"""The host-bound workload of issue 19, interleaved: sync (in-process executor), sync (worker
processes) and async, with the CPU share of every process and where the workers ended up.

    python benchmarks/host_bound_ab.py [--rounds 3] [--modes sync-uni,sync-mp,async]

A tiny fp32 Llama (tests/support/tiny_models.py, 384-token vocabulary), 256 prompts x 32 tokens in,
96 out, greedy, max_num_seqs 256. Each round starts every mode afresh (in alternating order),
warms it up, then times three generate calls; per-process CPU is user + system time over the
timed calls divided by their wall time (100% = one core). Set VSERVE_CPU_NUM_RESERVED /
VSERVE_CPU_THREADS_BIND to compare placements.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path

# the repo root, for tests.support; appended, so an installed vserve still comes first
sys.path.append(str(Path(__file__).resolve().parent.parent))

from vserve import proc_tree  # noqa: E402

MODES = {
    "sync-uni": dict(async_scheduling=False, distributed_executor_backend="uni"),
    "sync-mp": dict(async_scheduling=False, distributed_executor_backend="mp"),
    "async": dict(async_scheduling=True),
}


def cpu_seconds(pid: int) -> float:
    from vserve.cpu_affinity import process_cpu_seconds

    return process_cpu_seconds(pid)


def children(pid: int) -> list[int]:
    return [k for k in proc_tree.children(pid) if b"resource_tracker" not in proc_tree.cmdline(k)]


def run_mode(model: str, mode: str, reps: int = 3) -> list[tuple[float, dict, dict]]:
    from vserve import LLM, SamplingParams

    llm = LLM(model=model, dtype="float32", max_num_seqs=256, max_model_len=160, **MODES[mode])
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 380) for _ in range(32)]} for _ in range(256)]
    params = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
    llm.generate(
        prompts[:32], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False
    )
    core = llm.engine.client.engine.proc.pid
    pids = {"front": os.getpid(), "core": core}
    pids.update({f"worker{i}": p for i, p in enumerate(children(core))})
    results = []
    for _ in range(reps):
        cpu0 = {k: cpu_seconds(p) for k, p in pids.items()}
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        share = {k: (cpu_seconds(p) - cpu0[k]) / wall for k, p in pids.items()}
        num_out = sum(len(o.outputs[0].token_ids) for o in outs)
        cpus = {k: sorted(os.sched_getaffinity(p)) for k, p in pids.items()}
        results.append((num_out / wall, share, cpus))
    llm.shutdown()
    return results


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--modes", default="sync-uni,sync-mp,async")
    args = p.parse_args()
    from tests.support.tiny_models import build_model

    model = str(build_model("llama", Path(tempfile.gettempdir()) / "vserve-host-bound-llama"))
    modes = args.modes.split(",")
    table: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(args.rounds):
        for mode in modes if r % 2 == 0 else modes[::-1]:
            for tps, share, cpus in run_mode(model, mode):
                table[mode].append(tps)
                print(
                    f"round {r} {mode:8s} {tps:8.0f} output tok/s  CPU "
                    + " ".join(f"{k}={v * 100:.0f}%" for k, v in share.items())
                    + f"  CPUs {cpus}",
                    flush=True,
                )
    best_sync = max((max(v) for m, v in table.items() if m != "async"), default=None)
    for mode, values in table.items():
        values = sorted(values)
        line = (
            f"{mode:8s} median {values[len(values) // 2]:8.0f}  max {values[-1]:8.0f}  "
            f"min {values[0]:8.0f}"
        )
        if mode == "async" and best_sync:
            line += f"  async max / best sync max = {values[-1] / best_sync:.3f}"
        print(line)


if __name__ == "__main__":
    main()
