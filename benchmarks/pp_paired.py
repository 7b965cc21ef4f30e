"""PP=2 / PP=1 paired (issue 19's goal: >= 0.7, sync and async): the embedded model in bf16
(`quantization="none"`), batch 32, 128/128, greedy; sync (worker processes) and async, PP=1
and PP=2, all four engines alive in this process and their generates alternated round by
round (the order reversed every round), each ratio taken within a round. On a VM whose memory
bandwidth drifts, engines started one after another compare the drift as much as the modes.

    python benchmarks/pp_paired.py [JSON] [ROUNDS]   (default results/pp_paired.json, 3)
"""

import json
import statistics
import sys
import time
from pathlib import Path

from vserve import LLM, SamplingParams

OUT_JSON = (
    Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent / "results" / "pp_paired.json"
)
B, IN, OUT, R = 32, 128, 128, int(sys.argv[2]) if len(sys.argv) > 2 else 3


def main() -> None:
    common = dict(quantization="none", max_model_len=IN + OUT + 16)
    cfgs = {
        "sync PP=1": dict(async_scheduling=False, distributed_executor_backend="mp"),
        "sync PP=2": dict(async_scheduling=False, pipeline_parallel_size=2),
        "async PP=1": dict(async_scheduling=True),
        "async PP=2": dict(async_scheduling=True, pipeline_parallel_size=2),
    }
    engines = {k: LLM(**common, **v) for k, v in cfgs.items()}
    prompts = [
        {"prompt_token_ids": [(1000 + 7 * i + j) % 30000 + 10 for j in range(IN)]} for i in range(B)
    ]
    p = SamplingParams(temperature=0, max_tokens=OUT, ignore_eos=True)
    for llm in engines.values():
        llm.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    res = {k: [] for k in engines}
    for r in range(R):
        order = list(engines) if r % 2 == 0 else list(engines)[::-1]
        for k in order:
            assert engines[k].reset_prefix_cache()  # every round computes its prompts
            t0 = time.perf_counter()
            engines[k].generate(prompts, p, use_tqdm=False)
            dt = time.perf_counter() - t0
            engines[k].engine.take_step_records()
            res[k].append(B * OUT / dt)
        print(r, {k: round(v[-1], 1) for k, v in res.items()}, flush=True)
    out = {}
    for mode in ("sync", "async"):
        ratios = [a / b for a, b in zip(res[f"{mode} PP=2"], res[f"{mode} PP=1"])]
        out[mode] = dict(
            pp1=statistics.median(res[f"{mode} PP=1"]),
            pp2=statistics.median(res[f"{mode} PP=2"]),
            ratio=statistics.median(ratios),
            lo=min(ratios),
            hi=max(ratios),
        )
        o = out[mode]
        print(
            f"{mode}: PP=1 {o['pp1']:.1f}, PP=2 {o['pp2']:.1f} tok/s, "
            f"PP=2 / PP=1 {o['ratio']:.3f} ({o['lo']:.3f}-{o['hi']:.3f})"
        )
    OUT_JSON.write_text(json.dumps(dict(raw=res, summary=out), indent=1))
    for llm in engines.values():
        llm.shutdown()


if __name__ == "__main__":
    main()
