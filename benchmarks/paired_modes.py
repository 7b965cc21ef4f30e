"""Engine configurations compared in pairs: every engine alive at once in this process,
`generate` calls alternated between them round by round (the order reversed every round), each
ratio taken within a round. On a VM whose memory bandwidth drifts +-25% from one minute to the
next, engines started one after another (benchmarks/overlap_matrix.py) compare the drift as
much as the engines; an idle engine here blocks and does not disturb the one running.

    python benchmarks/paired_modes.py [--model embedded|tiny|PATH] [--batch 32] [--rounds 10]
        [--input-len 128] [--output-len 128] [--temperature 0] CONFIG [CONFIG ...]

CONFIG: `inproc` (engine and worker in this process, sync), `sync-uni` (engine core process,
worker in it), `sync-mp` (worker process), `async` (the default), each with optional
`:NAME=VALUE` environment settings for its processes, e.g. `async:VSERVE_CPU_PARK=0`. The
first CONFIG is the baseline of the ratios. Per config: median output tok/s, the median and
range of its per-round ratio to the baseline, the worker's median forward and launch interval
over full decode steps, and the share of steps prepared in a parked gap (workers/host_gap.py).
JSON: benchmarks/results/paired_modes.json (or --json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from overlap_matrix import model_args  # noqa: E402

RESULTS = Path(__file__).parent / "results"
MODES = {
    "inproc": dict(multiprocess=False, distributed_executor_backend="uni", async_scheduling=False),
    "sync-uni": dict(distributed_executor_backend="uni", async_scheduling=False),
    "sync-mp": dict(distributed_executor_backend="mp", async_scheduling=False),
    "async": dict(async_scheduling=True),
}


def parse_config(text: str) -> tuple[str, dict[str, str]]:
    """ "async:VSERVE_CPU_PARK=0:GOMP_SPINCOUNT=10000" -> ("async", {...})"""
    mode, *settings = text.split(":")
    if mode not in MODES:
        raise SystemExit(f"unknown mode {mode!r} (one of {', '.join(MODES)})")
    env = {}
    for s in settings:
        name, sep, value = s.partition("=")
        if not sep:
            raise SystemExit(f"{s!r}: expected NAME=VALUE")
        env[name] = value
    return mode, env


def model_kwargs(name: str) -> dict:
    """LLM arguments of a model named as overlap_matrix.py names them, or of a path."""
    if name not in ("embedded", "tiny", "host-bound"):
        return dict(model=name)
    args = model_args(name)  # the same models as the matrix: ["--model", PATH, "--dtype", ...]
    return {flag.lstrip("-"): value for flag, value in zip(args[::2], args[1::2])}


def start(config: str, model: dict, max_len: int):
    """The engine of `config`, its processes started under its environment settings."""
    from vserve import LLM

    mode, env = parse_config(config)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return LLM(max_model_len=max_len, max_num_seqs=256, **model, **MODES[mode])
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def make_prompts(llm, batch: int, input_len: int) -> list[dict]:
    """`batch` distinct prompts of `input_len` token ids, inside the model's vocabulary."""
    ids = min(30000, llm.engine.config.model.vocab_size - 10)
    return [
        {"prompt_token_ids": [(1000 + 7 * i + j) % ids + 10 for j in range(input_len)]}
        for i in range(batch)
    ]


def one_run(llm, prompts, params, batch: int) -> dict:
    """One timed generate of the same prompts, which the previous round left in the prefix
    cache: it is reset first, so every round computes its prompts."""
    if not llm.reset_prefix_cache():
        raise RuntimeError("the prefix cache could not be reset")
    start_t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start_t
    records = llm.engine.take_step_records()
    decode = [r for r in records if r.num_tokens == batch and r.forward_end > 0]
    intervals = [r.launch_interval for r in decode if r.launch_interval > 0]
    return {
        "tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / elapsed,
        "forward_ms": statistics.median(r.forward_end - r.forward_start for r in decode) * 1e3
        if decode
        else None,
        "interval_ms": statistics.median(intervals) * 1e3 if intervals else None,
        "parked": sum(r.parked for r in records) / max(1, len(records)),
        "cached_prompt_tokens": sum(o.num_cached_tokens for o in outs),
    }


def summarize(configs: list[str], runs: dict[str, list[dict]]) -> list[dict]:
    base = runs[configs[0]]
    rows = []
    for c in configs:
        ratios = [a["tok_s"] / b["tok_s"] for a, b in zip(runs[c], base)]

        def med(key: str, c=c):
            values = [r[key] for r in runs[c] if r[key] is not None]
            return statistics.median(values) if values else None

        rows.append(
            {
                "config": c,
                "tok_s": med("tok_s"),
                "ratio": statistics.median(ratios),
                "ratio_min": min(ratios),
                "ratio_max": max(ratios),
                "forward_ms": med("forward_ms"),
                "interval_ms": med("interval_ms"),
                "parked": med("parked"),
            }
        )
    return rows


def table(rows: list[dict], base: str) -> str:
    def f(v, d=2):
        return "-" if v is None else f"{v:.{d}f}"

    lines = [
        f"| config | out tok/s | / {base} (range) | forward ms | interval ms | parked |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['config']} | {f(r['tok_s'], 1)} | {f(r['ratio'], 3)} "
            f"({f(r['ratio_min'], 3)}-{f(r['ratio_max'], 3)}) | {f(r['forward_ms'])} | "
            f"{f(r['interval_ms'])} | {f(r['parked'])} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("configs", nargs="+")
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--json", type=Path, default=RESULTS / "paired_modes.json")
    args = ap.parse_args()
    from tqdm import tqdm

    from vserve import SamplingParams

    for c in args.configs:
        parse_config(c)  # fail before any engine starts
    model = model_kwargs(args.model)
    max_len = args.input_len + args.output_len + 16
    llms = {c: start(c, model, max_len) for c in args.configs}
    prompts = make_prompts(next(iter(llms.values())), args.batch, args.input_len)
    params = SamplingParams(
        temperature=args.temperature,
        max_tokens=args.output_len,
        ignore_eos=True,
        seed=0 if args.temperature else None,
    )
    runs: dict[str, list[dict]] = {c: [] for c in args.configs}
    try:
        for llm in llms.values():  # warm-up
            one_run(llm, prompts, params, args.batch)
        for rnd in tqdm(range(args.rounds), desc="rounds"):
            order = args.configs if rnd % 2 == 0 else args.configs[::-1]
            for c in order:
                runs[c].append(one_run(llms[c], prompts, params, args.batch))
    finally:
        for llm in llms.values():
            llm.shutdown()
    rows = summarize(args.configs, runs)
    print(table(rows, args.configs[0]))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps(
            {"args": vars(args) | {"json": str(args.json)}, "rows": rows, "runs": runs}, indent=1
        )
    )
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
