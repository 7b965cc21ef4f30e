"""PP=2 / PP=1 paired (issue 19's goal: >= 0.7, sync and async): the embedded model in bf16
(`quantization="none"`), batch 32, 128/128, greedy; sync (worker processes) and async, PP=1
and PP=2, all four engines alive in this process and their generates alternated round by
round (the order reversed every round, the prefix cache reset before each: paired_modes.py's
`one_run`), each ratio taken within a round. On a VM whose memory bandwidth drifts, engines
started one after another compare the drift as much as the modes.

    python benchmarks/pp_paired.py [JSON] [ROUNDS]   (default results/pp_paired.json, 3)
"""

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from paired_modes import RESULTS, make_prompts, one_run  # noqa: E402

from vserve import LLM, SamplingParams  # noqa: E402

B, IN, OUT = 32, 128, 128
CONFIGS = {
    "sync PP=1": dict(async_scheduling=False, distributed_executor_backend="mp"),
    "sync PP=2": dict(async_scheduling=False, pipeline_parallel_size=2),
    "async PP=1": dict(async_scheduling=True),
    "async PP=2": dict(async_scheduling=True, pipeline_parallel_size=2),
}


def main() -> None:
    out_json = Path(sys.argv[1]) if len(sys.argv) > 1 else RESULTS / "pp_paired.json"
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    engines = {
        k: LLM(quantization="none", max_model_len=IN + OUT + 16, **v) for k, v in CONFIGS.items()
    }
    prompts = make_prompts(next(iter(engines.values())), B, IN)
    params = SamplingParams(temperature=0, max_tokens=OUT, ignore_eos=True)
    try:
        for llm in engines.values():  # warm-up
            one_run(llm, prompts[:4], SamplingParams(temperature=0, max_tokens=4), 4)
        res: dict[str, list[float]] = {k: [] for k in engines}
        for r in range(rounds):
            for k in list(engines) if r % 2 == 0 else list(engines)[::-1]:
                res[k].append(one_run(engines[k], prompts, params, B)["tok_s"])
            print(r, {k: round(v[-1], 1) for k, v in res.items()}, flush=True)
    finally:
        for llm in engines.values():
            llm.shutdown()
    summary = {
        mode: pp_ratio(res[f"{mode} PP=1"], res[f"{mode} PP=2"]) for mode in ("sync", "async")
    }
    for mode, o in summary.items():
        print(
            f"{mode}: PP=1 {o['pp1']:.1f}, PP=2 {o['pp2']:.1f} tok/s, "
            f"PP=2 / PP=1 {o['ratio']:.3f} ({o['lo']:.3f}-{o['hi']:.3f})"
        )
    out_json.write_text(json.dumps(dict(raw=res, summary=summary), indent=1))


def pp_ratio(pp1: list[float], pp2: list[float]) -> dict:
    """Medians of each and of the per-round ratios, with the ratios' range."""
    ratios = [b / a for a, b in zip(pp1, pp2)]
    return dict(
        pp1=statistics.median(pp1),
        pp2=statistics.median(pp2),
        ratio=statistics.median(ratios),
        lo=min(ratios),
        hi=max(ratios),
    )


if __name__ == "__main__":
    main()
