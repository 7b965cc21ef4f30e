"""`vserve bench latency`: end-to-end latency of one fixed batch, with warm-up iterations."""

from __future__ import annotations

import json
import statistics
import time

from vserve.bench.compare import add_compare_arg, mode_fields, run_maybe_compared
from vserve.bench.datasets import random_samples
from vserve.bench.overlap import overlap_report
from vserve.bench.stats import percentile
from vserve.bench.trace import write_plot, write_trace
from vserve.entrypoints.cli_args import add_engine_args, engine_args_from

PERCENTILES = (10, 25, 50, 75, 90, 99)


def add_parser(sub) -> None:
    p = sub.add_parser("latency", help="latency of one batch (prefix caching off by default)")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--n", type=int, default=1)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--num-iters-warmup", type=int, default=3)
    p.add_argument("--num-iters", type=int, default=10)
    p.add_argument("--output-json", default=None)
    p.add_argument("--trace", default=None)
    p.add_argument("--plot", default=None)
    add_compare_arg(p)
    add_engine_args(p)
    p.set_defaults(func=run, enable_prefix_caching=False)


def run(args) -> int:
    engine_args = engine_args_from(args)
    result, records, spans = run_maybe_compared(
        args, engine_args, _run_once, "avg_latency", False, "s"
    )
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    if args.trace:
        write_trace(args.trace, records, spans)
    if args.plot:
        write_plot(args.plot, records)
    return 0


def _run_once(args, engine_args, calibration=None) -> tuple[dict, list, list]:
    """Warm-up and timed iterations on a fresh engine; prints the latencies and the report."""
    from vserve import LLM, SamplingParams

    llm = LLM(**vars(engine_args))
    try:
        samples = random_samples(
            llm.get_tokenizer(),
            llm.config.model.vocab_size,
            args.batch_size,
            args.input_len,
            args.output_len,
        )
        prompts = [{"prompt_token_ids": s.prompt_ids} for s in samples]
        params = SamplingParams(
            n=args.n,
            temperature=args.temperature,
            top_p=1.0,
            ignore_eos=True,
            max_tokens=args.output_len,
        )
        for _ in range(args.num_iters_warmup):
            llm.generate(prompts, params, use_tqdm=False)
        llm.engine.take_step_records()
        llm.engine.take_detokenize_spans()
        latencies, outs = [], []
        for _ in range(args.num_iters):
            start = time.perf_counter()
            outs += llm.generate(prompts, params, use_tqdm=False)
            latencies.append(time.perf_counter() - start)
        records = llm.engine.take_step_records()
        spans = llm.engine.take_detokenize_spans()
        config = llm.config
    finally:
        llm.shutdown()
    report = overlap_report(records, outs, calibration)
    result = {
        "avg_latency": statistics.fmean(latencies),
        "std_latency": statistics.pstdev(latencies),
        "latencies": latencies,
        "percentiles": {str(p): percentile(latencies, p) for p in PERCENTILES},
        **mode_fields(config),
        "overlap": report.to_dict(),
    }
    print(f"Avg latency: {result['avg_latency']:.6f} seconds")
    print(f"Std latency: {result['std_latency']:.6f} seconds")
    for p in PERCENTILES:
        print(f"{p}% percentile latency: {result['percentiles'][str(p)]:.6f} seconds")
    print(report.format())
    return result, records, spans
