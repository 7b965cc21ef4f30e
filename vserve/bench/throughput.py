"""`vserve bench throughput`: offline throughput on a dataset, vserve or transformers."""

from __future__ import annotations

import json
import time

from vserve.bench.compare import add_compare_arg, mode_fields, run_maybe_compared
from vserve.bench.datasets import add_dataset_args, load_samples
from vserve.bench.overlap import overlap_report
from vserve.bench.trace import write_plot, write_trace
from vserve.entrypoints.cli_args import add_engine_args, engine_args_from


def add_parser(sub) -> None:
    p = sub.add_parser("throughput", help="offline throughput (vserve or transformers)")
    p.add_argument("--backend", default="vserve", choices=["vserve", "hf"])
    p.add_argument("--hf-max-batch-size", type=int, default=32)
    p.add_argument("--n", type=int, default=1)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0: off")
    p.add_argument(
        "--min-tokens",
        type=int,
        default=0,
        help="min_tokens of every request (below it a request gets no drafts)",
    )
    p.add_argument("--output-json", default=None)
    p.add_argument("--trace", default=None, help="write a Chrome trace (JSON) of the run")
    p.add_argument("--plot", default=None, help="PNG of forward time and launch interval")
    add_compare_arg(p)
    add_dataset_args(p)
    add_engine_args(p)
    p.set_defaults(func=run)


def run(args) -> int:
    engine_args = engine_args_from(args)
    if args.backend == "hf":
        if args.compare_sync:
            raise ValueError("--compare-sync needs --backend vserve")
        return _run_hf(args, engine_args)
    result, records, spans = run_maybe_compared(
        args, engine_args, _run_vserve, "output_throughput", True, "output tok/s"
    )
    _write_outputs(args, result, records, spans)
    return 0


def _run_vserve(args, engine_args, calibration=None) -> tuple[dict, list, list]:
    """One timed run on a fresh engine; prints its summary and overlap report."""
    from vserve import LLM, SamplingParams

    llm = LLM(**vars(engine_args))
    try:
        samples = load_samples(args, llm.get_tokenizer(), llm.config.model.vocab_size)
        _check_lengths(samples, llm.config.model.max_model_len)
        params = [
            SamplingParams(
                n=args.n,
                temperature=args.temperature,
                top_p=args.top_p,
                top_k=args.top_k,
                ignore_eos=True,
                max_tokens=s.output_len,
                min_tokens=min(args.min_tokens, s.output_len),
            )
            for s in samples
        ]
        prompts = [{"prompt_token_ids": s.prompt_ids} for s in samples]
        warmup = _warm_up(llm, prompts, params) if args.compare_sync else 0
        llm.engine.take_step_records()
        llm.engine.take_detokenize_spans()
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=True)
        elapsed = time.perf_counter() - start
        records = llm.engine.take_step_records()
        spans = llm.engine.take_detokenize_spans()
        stats = llm.engine.last_stats
        config = llm.config
    finally:
        llm.shutdown()
    num_in = sum(len(o.prompt_token_ids) for o in outs)
    num_out = sum(len(c.token_ids) for o in outs for c in o.outputs)
    report = overlap_report(records, outs, calibration)
    result = summary(elapsed, len(outs), num_in, num_out, "vserve", engine_args)
    result.update(mode_fields(config))
    result["warmup_requests"] = warmup
    result["cached_prompt_tokens"] = sum(o.num_cached_tokens for o in outs)
    result["overlap"] = report.to_dict()
    result.update(spec_figures(stats))
    print_summary(result)
    print(report.format())
    return result, records, spans


def _warm_up(llm, prompts: list, params: list) -> int:
    """An untimed run of the timed workload itself before a compared run, so that each
    engine has met every shape the timed run meets (batch sizes, prefill chunks, decode
    lengths) and has paid its one-time costs outside it (on CUDA, Triton compiles a variant
    per new specialization; start-up warms the known ones, and the run reports any it still
    met). The prefix cache is reset after it, so the timed run computes every prompt."""
    llm.generate(prompts, params, use_tqdm=False)
    if not llm.reset_prefix_cache():  # the timed run must compute its prompts as before
        raise RuntimeError("warm-up: the prefix cache could not be reset")
    return len(prompts)


def _run_hf(args, engine_args) -> int:
    from vserve.bench.hf_backend import run_hf
    from vserve.tokenizer import load_tokenizer

    config = engine_args.create_engine_config()
    tokenizer = load_tokenizer(config.model.tokenizer)
    samples = load_samples(args, tokenizer, config.model.vocab_size)
    elapsed, num_out = run_hf(
        config.model.model, config.model.dtype, samples, args.hf_max_batch_size, args.temperature
    )
    num_in = sum(len(s.prompt_ids) for s in samples)
    result = summary(elapsed, len(samples), num_in, num_out, "hf", engine_args)
    result["hf_max_batch_size"] = args.hf_max_batch_size
    print_summary(result)
    _write_outputs(args, result, None, None)
    return 0


def summary(
    elapsed: float, num_requests: int, num_in: int, num_out: int, backend: str, engine_args
) -> dict:
    return {
        "backend": backend,
        "model": engine_args.model or "gemma-3-270m",
        "elapsed_time": elapsed,
        "num_requests": num_requests,
        "total_num_tokens": num_in + num_out,
        "total_num_prompt_tokens": num_in,
        "total_num_output_tokens": num_out,
        "requests_per_second": num_requests / elapsed,
        "tokens_per_second": (num_in + num_out) / elapsed,
        "output_throughput": num_out / elapsed,
    }


def spec_figures(stats) -> dict:
    """Acceptance of n-gram drafts over the run (the engine's counters are cumulative)."""
    if stats is None or not stats.spec_num_drafts:
        return {}
    return {
        "spec_num_drafts": stats.spec_num_drafts,
        "spec_num_draft_tokens": stats.spec_num_draft_tokens,
        "spec_num_accepted_tokens": stats.spec_num_accepted_tokens,
        "spec_acceptance_rate": stats.spec_num_accepted_tokens
        / max(1, stats.spec_num_draft_tokens),
        "spec_mean_accepted_per_draft": stats.spec_num_accepted_tokens / stats.spec_num_drafts,
    }


def print_summary(r: dict) -> None:
    print(
        f"Throughput: {r['requests_per_second']:.2f} requests/s, "
        f"{r['tokens_per_second']:.2f} total tokens/s, "
        f"{r['output_throughput']:.2f} output tokens/s"
    )
    print(f"Total num prompt tokens:  {r['total_num_prompt_tokens']}")
    print(f"Total num output tokens:  {r['total_num_output_tokens']}")
    if "spec_acceptance_rate" in r:
        print(
            f"Draft acceptance rate:    {r['spec_acceptance_rate']:.3f} "
            f"({r['spec_num_accepted_tokens']} of {r['spec_num_draft_tokens']} draft tokens, "
            f"{r['spec_mean_accepted_per_draft']:.2f} per speculative step)"
        )


def _check_lengths(samples, max_model_len: int) -> None:
    for s in samples:
        if len(s.prompt_ids) + s.output_len > max_model_len:
            raise ValueError(
                f"a request needs {len(s.prompt_ids) + s.output_len} tokens, more "
                f"than max_model_len={max_model_len}"
            )


def _write_outputs(args, result: dict, records, spans) -> None:
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    if records is not None and args.trace:
        write_trace(args.trace, records, spans)
    if records is not None and args.plot:
        write_plot(args.plot, records)
