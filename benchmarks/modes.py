"""Engine modes compared on one workload: sync and async scheduling, in-process and
worker-process executors, PP=1 and PP=2, n-gram drafts, environment switches, transformers.

    python benchmarks/modes.py (--fresh | --paired) [--rows ROW ...]
        [--model embedded|tiny|host-bound|PATH] [--workload default|host-bound]
        [--num-prompts 32] [--input-len 128] [--output-len 128] [--temperature 0]
        [--dtype D] [--quantization Q] [--rounds 3] [--output benchmarks/results/modes.json]

`--fresh`: every row of every round is one `vserve bench throughput` process. `--paired`:
every row's engine alive at once in this process, `generate` calls alternated, the prefix
cache reset before each; an idle engine blocks and does not disturb the one running. On a VM
whose memory bandwidth drifts +-25% from one minute to the next, engines started one after
another compare the drift as much as the engines: `--paired` is the sound A/B, `--fresh` also
counts what a process pays alone (start-up, page cache, placement). In both the row order is
reversed every other round and each ratio is taken within a round (the median over rounds
and the range).

ROW is `[ppN-]MODE[:OPTION...]`:

- MODE: `sync`, `async` (each with its default executor), `sync-uni`, `sync-mp`, `async-uni`,
  `async-mp`; `inproc` (`--paired` only: sync, engine core and worker in this process); `hf`
  (`--fresh` only: transformers `generate`, batch 32).
- `ppN-`: `pipeline_parallel_size=N`.
- OPTION `NAME=VALUE` with NAME in capitals: an environment variable of the row's processes
  (`async:VSERVE_CPU_PARK=0`); `spec`: n-gram speculative decoding, 3 tokens; `name=value`: an
  engine argument (`quantization=none`) or a sampling one (`temperature`, `top_p`, `top_k`,
  `min_tokens`), over the workload's.

Per row: median output tok/s, its ratio to the first row, and the overlap report's mean
forward, launch interval, overlap efficiency and share of steps prepared in a parked gap
(`vserve.bench.overlap` defines them). Below: each row with a `ppN-` prefix or options
against its plain MODE where that is a row too (PP=2 / PP=1 with the pipeline's pace, park
off / on, drafts / none with the steps drafts held back), and each plain async row against
the best plain sync row. JSON: the rows, the comparisons and every run (`--output`).
Workloads of the mode comparisons:

    --paired --rows sync-uni sync-mp async async:VSERVE_CPU_PARK=0     # sync vs async
    --paired --workload host-bound --rows sync-uni sync-mp async       # host work large
    --paired --quantization none --rows sync-mp pp2-sync-mp async pp2-async
    --fresh --min-tokens 128 --rows async async:spec       # drafts configured, none can draft
    --fresh --rows async async:temperature=1 async:temperature=1:top_p=0.9:top_k=50 hf
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from common import RESULTS, engine_flags, fmt, make_prompts, model_kwargs, run_bench, write_json

MODES = {
    "sync": {"async_scheduling": False},
    "async": {"async_scheduling": True},
    "sync-uni": {"async_scheduling": False, "distributed_executor_backend": "uni"},
    "sync-mp": {"async_scheduling": False, "distributed_executor_backend": "mp"},
    "async-uni": {"async_scheduling": True, "distributed_executor_backend": "uni"},
    "async-mp": {"async_scheduling": True, "distributed_executor_backend": "mp"},
    "inproc": {"async_scheduling": False, "distributed_executor_backend": "uni"},
    "hf": {},
}
SYNC_MODES = ("sync", "sync-uni", "sync-mp", "inproc")
ASYNC_MODES = ("async", "async-uni", "async-mp")
SAMPLING = {"temperature": float, "top_p": float, "top_k": int, "min_tokens": int}
SPEC = {"method": "ngram", "num_speculative_tokens": 3}
WORKLOADS = {
    "default": {"model": "embedded", "num_prompts": 32, "input_len": 128, "output_len": 128},
    "host-bound": {
        "model": "host-bound",
        "num_prompts": 256,
        "input_len": 32,
        "output_len": 96,
        "max_num_seqs": 256,
    },
}
FIGURES = (
    "tok_s",
    "forward_ms",
    "interval_ms",
    "overlap_efficiency",
    "parked",
    "pp_pace",
    "draft_steps",
    "drafts",
)


@dataclass
class Row:
    label: str
    mode: str
    engine: dict = field(default_factory=dict)  # engine arguments over the workload's
    sampling: dict = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)


def parse_row(text: str) -> Row:
    """A row from its text: `pp2-async:VSERVE_CPU_PARK=0` -> mode "async", PP 2, that env."""
    from vserve.engine.arg_utils import EngineArgs

    head, *options = text.split(":")
    pp = re.fullmatch(r"pp(\d+)-(.+)", head)
    mode = pp[2] if pp else head
    if mode not in MODES:
        raise SystemExit(f"{text!r}: unknown mode {mode!r} (one of {', '.join(MODES)})")
    row = Row(text, mode, dict(MODES[mode]))
    if pp:
        row.engine["pipeline_parallel_size"] = int(pp[1])
    for option in options:
        name, sep, value = option.partition("=")
        if option == "spec":
            row.engine["speculative_config"] = SPEC
        elif not sep:
            raise SystemExit(f"{text!r}: {option!r} is neither spec nor NAME=VALUE")
        elif name.isupper():
            row.env[name] = value
        elif name in SAMPLING:
            row.sampling[name] = SAMPLING[name](value)
        elif name in EngineArgs.field_names():
            row.engine[name] = _value(value)
        else:
            raise SystemExit(f"{text!r}: {name!r} is not an engine or sampling argument")
    return row


def _value(text: str):
    if text in ("true", "false"):
        return text == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


# -- the workload ----------------------------------------------------------------------------------
def engine_kwargs(args, row: Row) -> dict:
    common = model_kwargs(args.model)
    for name in ("dtype", "quantization", "max_num_seqs"):
        if getattr(args, name) is not None:
            common[name] = getattr(args, name)
    common["max_model_len"] = args.input_len + args.output_len + 16
    return {**common, **row.engine}


def sampling_kwargs(args, row: Row) -> dict:
    common = {name: getattr(args, name) for name in SAMPLING}
    return {**common, **row.sampling}


def figures(tok_s: float, report: dict | None, drafts: int | None = None) -> dict:
    """One run's figures from its overlap report (None without one: transformers)."""
    if not report:
        return {"tok_s": tok_s}
    held = report["steps_without_overlap"]
    return {
        "tok_s": tok_s,
        "forward_ms": report["mean_forward_ms"],
        "interval_ms": report["mean_launch_interval_ms"],
        "overlap_efficiency": report["overlap_efficiency"],
        "parked": report["parked_steps"] / max(1, report["num_steps"]),
        "pp_pace": report["bottleneck_interval_over_forward"],
        "draft_steps": sum(n for why, n in held.items() if why.startswith("speculative")),
        "drafts": drafts,
        "overlap": report,
    }


# -- fresh processes -------------------------------------------------------------------------------
def fresh_flags(args, row: Row) -> list[str]:
    flags = ["--backend", "hf"] if row.mode == "hf" else []
    flags += engine_flags(engine_kwargs(args, row)) + engine_flags(sampling_kwargs(args, row))
    flags += ["--dataset-name", args.dataset, "--num-prompts", str(args.num_prompts)]
    return flags + ["--input-len", str(args.input_len), "--output-len", str(args.output_len)]


def fresh_run(args, row: Row) -> dict:
    result = run_bench("throughput", fresh_flags(args, row), row.env)
    run = figures(result["output_throughput"], result.get("overlap"), result.get("spec_num_drafts"))
    return {**run, "cached_prompt_tokens": result.get("cached_prompt_tokens")}


# -- paired in one process -------------------------------------------------------------------------
def start(args, row: Row):
    """The engine of `row`, its processes started under its environment settings."""
    from vserve import LLM

    saved = {name: os.environ.get(name) for name in row.env}
    os.environ.update(row.env)
    try:
        return LLM(multiprocess=row.mode != "inproc", **engine_kwargs(args, row))
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def paired_run(llm, prompts: list[dict], params) -> dict:
    """One timed generate of the prompts, the prefix cache reset first so that every round
    computes them (the previous round left them cached)."""
    from vserve.bench.overlap import overlap_report

    if not llm.reset_prefix_cache():
        raise RuntimeError("the prefix cache could not be reset")
    llm.engine.take_step_records()
    llm.engine.take_detokenize_spans()
    drafts = _num_drafts(llm)
    start_t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start_t
    report = overlap_report(llm.engine.take_step_records(), outs).to_dict()
    num_out = sum(len(c.token_ids) for o in outs for c in o.outputs)
    run = figures(num_out / elapsed, report, _num_drafts(llm) - drafts)
    return {**run, "cached_prompt_tokens": sum(o.num_cached_tokens for o in outs)}


def _num_drafts(llm) -> int:
    return getattr(llm.engine.last_stats, "spec_num_drafts", 0) or 0


def paired_engines(args, rows: list[Row]) -> tuple[dict, dict]:
    """Every row's engine, started, and its sampling params."""
    from vserve import SamplingParams

    engines, params = {}, {}
    try:
        for row in rows:
            engines[row.label] = start(args, row)
            sampling = sampling_kwargs(args, row)
            sampling["min_tokens"] = min(sampling["min_tokens"], args.output_len)
            params[row.label] = SamplingParams(
                max_tokens=args.output_len, ignore_eos=True, **sampling
            )
    except BaseException:
        shutdown(engines)
        raise
    return engines, params


def shutdown(engines: dict) -> None:
    for llm in engines.values():
        llm.shutdown()


# -- rounds and ratios -----------------------------------------------------------------------------
def measure(args, rows: list[Row]) -> dict[str, list[dict]]:
    """Every row's runs, round by round, in fresh processes or paired."""
    if args.fresh:
        return run_rounds(args, rows, lambda row: fresh_run(args, row))
    from vserve import SamplingParams

    engines, params = paired_engines(args, rows)
    try:
        llm = next(iter(engines.values()))
        tokenizer, vocab_size = llm.get_tokenizer(), llm.config.model.vocab_size
        prompts = make_prompts(
            tokenizer, vocab_size, args.num_prompts, args.input_len, args.dataset
        )
        for llm in engines.values():  # untimed: every prompt's prefill, 2 tokens each
            llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
        return run_rounds(
            args, rows, lambda row: paired_run(engines[row.label], prompts, params[row.label])
        )
    finally:
        shutdown(engines)


def run_rounds(args, rows: list[Row], run_one) -> dict[str, list[dict]]:
    """`run_one(row)` for every row, `args.rounds` times, the order reversed every other round."""
    runs: dict[str, list[dict]] = {row.label: [] for row in rows}
    for rnd in range(args.rounds):
        for row in rows if rnd % 2 == 0 else rows[::-1]:
            runs[row.label].append(run_one(row))
        tok_s = ", ".join(f"{label} {v[-1]['tok_s']:.1f}" for label, v in runs.items())
        print(f"round {rnd + 1}/{args.rounds}: {tok_s} output tok/s", flush=True)
    return runs


def ratio(num: list[dict], den: list[dict]) -> dict:
    """Median and range of the per-round ratios of output tok/s."""
    ratios = [a["tok_s"] / b["tok_s"] for a, b in zip(num, den)]
    return {"ratio": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


def median_of(runs: list[dict], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


def summarize(rows: list[Row], runs: dict[str, list[dict]]) -> list[dict]:
    base = runs[rows[0].label]
    return [
        {"row": row.label, **{k: median_of(runs[row.label], k) for k in FIGURES}}
        | ratio(runs[row.label], base)
        for row in rows
    ]


def comparisons(rows: list[Row], runs: dict[str, list[dict]]) -> list[dict]:
    """Rows against their plain mode, and plain async against the best plain sync."""
    pairs = [(row.label, row.mode) for row in rows if row.label != row.mode and row.mode in runs]
    syncs = [row.label for row in rows if row.label in SYNC_MODES]
    if syncs:
        best = max(syncs, key=lambda label: median_of(runs[label], "tok_s") or 0)
        pairs += [(row.label, best) for row in rows if row.label in ASYNC_MODES]
    return [
        {"row": label, "against": against, **ratio(runs[label], runs[against])}
        | {key: median_of(runs[label], key) for key in ("pp_pace", "draft_steps")}
        for label, against in pairs
    ]


def tables(summary: list[dict], compared: list[dict]) -> str:
    base = summary[0]["row"]
    lines = [
        f"| row | output tok/s | / {base} (range) | forward ms | interval ms | overlap "
        "efficiency | parked |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in summary:
        lines.append(
            f"| {s['row']} | {fmt(s['tok_s'], 1)} | {fmt(s['ratio'], 3)} ({fmt(s['min'], 3)}-"
            f"{fmt(s['max'], 3)}) | {fmt(s['forward_ms'])} | {fmt(s['interval_ms'])} | "
            f"{fmt(s['overlap_efficiency'], 3)} | {fmt(s['parked'])} |"
        )
    if compared:
        lines += ["", "| row | against | ratio (range) | PP pace | steps held back by drafts |"]
        lines.append("|---|---|---|---|---|")
    for c in compared:
        held = c.get("draft_steps")
        lines.append(
            f"| {c['row']} | {c['against']} | {fmt(c['ratio'], 3)} ({fmt(c['min'], 3)}-"
            f"{fmt(c['max'], 3)}) | {fmt(c.get('pp_pace'), 3)} | {fmt(held, 0)} |"
        )
    return "\n".join(lines)


# -- the command -----------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    how = p.add_mutually_exclusive_group(required=True)
    how.add_argument("--fresh", action="store_true", help="every row a fresh process")
    how.add_argument("--paired", action="store_true", help="every row's engine in this process")
    p.add_argument("--rows", nargs="+", default=["sync-uni", "sync-mp", "async"], help="ROW ...")
    p.add_argument("--workload", choices=WORKLOADS, default="default")
    p.add_argument("--model", help="embedded, tiny, host-bound or a path")
    p.add_argument("--num-prompts", type=int)
    p.add_argument("--input-len", type=int)
    p.add_argument("--output-len", type=int)
    p.add_argument("--dataset", choices=["random", "repetitive"], default="random")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-tokens", type=int, default=0)
    p.add_argument("--dtype")
    p.add_argument("--quantization")
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--output", default=str(RESULTS / "modes.json"), help="the JSON")
    args = p.parse_args(argv)
    for name, value in WORKLOADS[args.workload].items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    return args


def check_rows(args, rows: list[Row]) -> None:
    labels = [row.label for row in rows]
    if len(set(labels)) != len(labels):
        raise SystemExit("a row is given twice")
    for row in rows:
        if args.paired and row.mode == "hf":
            raise SystemExit("hf: transformers runs in --fresh only")
        if args.fresh and row.mode == "inproc":
            raise SystemExit("inproc: --paired only (vserve bench runs the engine core apart)")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rows = [parse_row(text) for text in args.rows]
    check_rows(args, rows)  # before any engine starts
    how = "paired in one process" if args.paired else "fresh processes"
    print(
        f"{args.num_prompts} prompts x {args.input_len} in / {args.output_len} out, model "
        f"{args.model}, temperature {args.temperature}, EOS ignored; {args.rounds} rounds, {how}",
        flush=True,
    )
    runs = measure(args, rows)
    summary, compared = summarize(rows, runs), comparisons(rows, runs)
    print("\n" + tables(summary, compared))
    write_json(
        Path(args.output),
        {"args": vars(args), "rows": summary, "comparisons": compared, "runs": runs},
    )


if __name__ == "__main__":
    main()
