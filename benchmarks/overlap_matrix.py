"""Where async scheduling and pipeline parallelism pay: three groups of rows, each cell one
fresh `vserve bench throughput` process, greedy, EOS ignored.

    python benchmarks/overlap_matrix.py [--rows overlap,host-bound,spec]
        [--models embedded,tiny] [--batches 1,32] [--repeats 1]

* overlap: sync (in-process and worker-process executors) and async, PP=1 and PP=2, at each
  batch (one batch of `batch` prompts, 128/128), on the embedded model (bf16) and a tiny fp32
  Llama with the embedded vocabulary. Per (model, batch): async / best sync at PP=1, and PP=2 /
  PP=1 sync and async, with the PP=2 bottleneck stage's launch interval over its forward.
* host-bound: a tinier fp32 Llama (hidden 64, 2 layers, vocab 4096), 256 prompts x 32 in /
  96 out, max_num_seqs 256, where host work is large next to the forward: sync in-process,
  sync worker processes, async (run with --compare-sync: its overlap report is calibrated on
  a sync run with the same executor in the same process). Async / best sync.
* spec: async with and without an n-gram `speculative_config`, on a workload where no request
  can draft (min_tokens = output length, in both cells); spec / plain output tok/s, and the
  steps the spec cell ran without overlap because of drafts.

Each cell reports output tok/s, mean forward and launch interval, and the overlap report's
forward slowdown and efficiency (`vserve.bench.overlap` defines them). With --repeats N the
cells of a group run round-robin N times and the tables show medians. JSON per group in
benchmarks/results/ (overlap_matrix.json, overlap_host_bound.json, overlap_spec.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
ASYNC, SYNC = ["--async-scheduling"], ["--no-async-scheduling"]
UNI, MP = ["--distributed-executor-backend", "uni"], ["--distributed-executor-backend", "mp"]
PP2 = ["--pipeline-parallel-size", "2"]

PP1_MODES = [("sync, PP=1, uni", SYNC + UNI), ("sync, PP=1, mp", SYNC + MP), ("async, PP=1", ASYNC)]
PP2_MODES = [("sync, PP=2", SYNC + PP2), ("async, PP=2", ASYNC + PP2)]
HOST_BOUND_MODES = [
    ("sync, uni", SYNC + UNI),
    ("sync, mp", SYNC + MP),
    ("async", ASYNC + ["--compare-sync"]),
]


# -- models ----------------------------------------------------------------------------------------
def build_llama(
    folder: Path, vocab_size: int, hidden: int, layers: int, tokenizer: str = "embedded"
) -> str:
    """A random fp32 Llama. Tokenizer "embedded": the embedded model's (prompts look like real
    ones; only with its full vocabulary, see `bpe_tokenizer`); "bpe": a byte-level BPE trained
    to `vocab_size` tokens."""
    if (folder / "config.json").is_file():
        return str(folder)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from vserve.models.resolve import embedded_model_path

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=2,
        eos_token_id=1,
        pad_token_id=0,
    )
    AutoModelForCausalLM.from_config(cfg).save_pretrained(str(folder))
    if tokenizer == "bpe":
        bpe_tokenizer(vocab_size).save_pretrained(str(folder))
    else:
        AutoTokenizer.from_pretrained(str(embedded_model_path())).save_pretrained(str(folder))
    return str(folder)


def bpe_tokenizer(vocab_size: int):
    """Byte-level BPE on made-up words. A small model cannot take the embedded tokenizer's
    first `vocab_size` ids: those hold its byte-fallback tokens, and random ids of them make
    invalid UTF-8 that stops the front end's stream decoder."""
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    words = [
        "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
        for _ in range(6000)
    ]
    corpus = [" ".join(rng.choice(words) for _ in range(50)) + ". " for _ in range(2000)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        corpus,
        trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=["<pad>", "</s>", "<s>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )


def model_args(name: str) -> list[str]:
    tmp = Path(tempfile.gettempdir())
    if name == "embedded":
        return []  # the default dtype: bf16 on CPUs with bf16 instructions
    if name == "tiny":
        return [
            "--model",
            build_llama(tmp / "vserve-tiny-llama", 262144, 64, 2),
            "--dtype",
            "float32",
        ]
    if name == "host-bound":
        return [
            "--model",
            build_llama(tmp / "vserve-host-bound-llama", 4096, 64, 2, "bpe"),
            "--dtype",
            "float32",
        ]
    raise ValueError(f"unknown model {name!r}")


# -- cells -----------------------------------------------------------------------------------------
def run_cell(args: list[str], num_prompts: int, in_len: int, out_len: int) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [
        sys.executable,
        "-m",
        "vserve.entrypoints.cli",
        "bench",
        "throughput",
        *args,
        "--num-prompts",
        str(num_prompts),
        "--input-len",
        str(in_len),
        "--output-len",
        str(out_len),
        "--temperature",
        "0",
        "--max-model-len",
        str(in_len + out_len + 16),
        "--output-json",
        out,
    ]
    print("+", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if proc.returncode:
        sys.stderr.write(proc.stderr[-5000:])
        raise SystemExit(f"cell failed with exit status {proc.returncode}")
    return json.loads(Path(out).read_text())


def run_group(cells: list[tuple[str, list[str]]], repeats: int, **workload) -> dict[str, list]:
    """Round-robin over the cells `repeats` times: label -> one result per repeat."""
    results: dict[str, list] = {label: [] for label, _ in cells}
    for _ in range(repeats):
        for label, args in cells:
            results[label].append(run_cell(args, **workload))
    return results


def median_of(runs: list[dict], path: str) -> float | None:
    values = [_get(r, path) for r in runs]
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _get(d: dict, path: str):
    for key in path.split("."):
        if not isinstance(d, dict) or d.get(key) is None:
            return None
        d = d[key]
    return d


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def _f(value, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def cell_line(prefix: str, label: str, runs: list[dict]) -> str:
    return (
        f"| {prefix} | {label} | {_f(median_of(runs, 'overlap.mean_forward_ms'))} | "
        f"{_f(median_of(runs, 'overlap.mean_launch_interval_ms'))} | "
        f"{_f(median_of(runs, 'overlap.forward_slowdown'), 3)} | "
        f"{_f(median_of(runs, 'overlap.overlap_efficiency'), 3)} | "
        f"{_f(median_of(runs, 'output_throughput'), 1)} |"
    )


CELL_HEADER = [
    "| row | mode | forward (ms) | launch interval (ms) | forward slowdown "
    "| overlap efficiency | output tok/s |",
    "|---|---|---|---|---|---|---|",
]


# -- groups ----------------------------------------------------------------------------------------
def overlap_rows(args) -> dict:
    lines, cells, summary = list(CELL_HEADER), [], []
    for name in args.models.split(","):
        margs = model_args(name)
        for batch in (int(b) for b in args.batches.split(",")):
            modes = PP1_MODES + PP2_MODES
            res = run_group(
                [(label, margs + extra) for label, extra in modes],
                args.repeats,
                num_prompts=batch,
                in_len=args.input_len,
                out_len=args.output_len,
            )
            for label, runs in res.items():
                lines.append(cell_line(f"{name}, batch {batch}", label, runs))
                cells += [{"model": name, "batch": batch, "mode": label, **r} for r in runs]
            summary.append({"model": name, "batch": batch, **pp_summary(res)})
    print("\n".join(lines))
    print(
        "\n| model | batch | async / best sync (PP=1) | PP=2 / PP=1 sync | PP=2 / PP=1 "
        "async | PP=2 bottleneck interval / forward (sync, async) |\n|---|---|---|---|---|---|"
    )
    for s in summary:
        print(
            f"| {s['model']} | {s['batch']} | {_f(s['async_over_best_sync'], 3)} | "
            f"{_f(s['pp2_over_pp1_sync'], 3)} | {_f(s['pp2_over_pp1_async'], 3)} | "
            f"{_f(s['pp2_sync_bottleneck_interval_over_forward'], 3)}, "
            f"{_f(s['pp2_async_bottleneck_interval_over_forward'], 3)} |"
        )
    return {"cells": cells, "summary": summary}


def pp_summary(res: dict[str, list]) -> dict:
    tput = {label: median_of(runs, "output_throughput") for label, runs in res.items()}
    best_sync = max(tput["sync, PP=1, uni"] or 0, tput["sync, PP=1, mp"] or 0) or None
    out = {
        "async_over_best_sync": ratio(tput["async, PP=1"], best_sync),
        "pp2_over_pp1_sync": ratio(tput["sync, PP=2"], best_sync),
        "pp2_over_pp1_async": ratio(tput["async, PP=2"], tput["async, PP=1"]),
    }
    for mode in ("sync", "async"):
        out[f"pp2_{mode}_bottleneck_interval_over_forward"] = statistics.median(
            [bottleneck_ratio(r) for r in res[f"{mode}, PP=2"]]
        )
    return out


def bottleneck_ratio(result: dict) -> float:
    """The pipeline's pace: each step's interval on its slowest stage over that forward
    (the report's `bottleneck_interval_over_forward`; the first stage paces prefill, the
    lm_head's decode). Without per-stage spans: the one stage's interval over its forward."""
    ov = result["overlap"]
    if ov.get("bottleneck_interval_over_forward") is not None:
        return ov["bottleneck_interval_over_forward"]
    stage = ov["stages"][ov["bottleneck_stage"]]
    return stage["mean_interval_ms"] / max(stage["mean_forward_ms"], 1e-9)


def host_bound_rows(args) -> dict:
    workload = dict(
        num_prompts=args.hb_prompts, in_len=args.hb_input_len, out_len=args.hb_output_len
    )
    margs = model_args("host-bound") + ["--max-num-seqs", "256"]
    res = run_group(
        [(label, margs + extra) for label, extra in HOST_BOUND_MODES], args.repeats, **workload
    )
    lines = list(CELL_HEADER)
    lines += [cell_line("host-bound", label, runs) for label, runs in res.items()]
    tput = {label: median_of(runs, "output_throughput") for label, runs in res.items()}
    best = max(tput["sync, uni"] or 0, tput["sync, mp"] or 0) or None
    summary = {
        "async_over_best_sync": ratio(tput["async"], best),
        "async_over_sync_same_process": median_of(res["async"], "compare_sync.async_speedup"),
        **{f"output_throughput[{k}]": v for k, v in tput.items()},
    }
    print("\n".join(lines))
    print(
        f"\nhost-bound: async / best sync = {_f(summary['async_over_best_sync'], 3)} "
        f"(async / sync mp in the async cell's own process: "
        f"{_f(summary['async_over_sync_same_process'], 3)})"
    )
    return {
        "cells": [{"mode": k, **r} for k, runs in res.items() for r in runs],
        "summary": summary,
    }


DRAFT_REASON = "speculative decoding"


def spec_rows(args) -> dict:
    spec = ["--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": 3})]
    # min_tokens = the output length: no request can draft, in either cell
    common = ASYNC + ["--min-tokens", str(args.output_len)]
    lines, cells, summary = list(CELL_HEADER), [], []
    for name in args.models.split(","):
        margs = model_args(name) + common
        res = run_group(
            [("async", margs), ("async, speculative_config", margs + spec)],
            args.repeats,
            num_prompts=args.spec_batch,
            in_len=args.input_len,
            out_len=args.output_len,
        )
        for label, runs in res.items():
            lines.append(cell_line(f"{name}, batch {args.spec_batch}", label, runs))
            cells += [{"model": name, "mode": label, **r} for r in runs]
        spec_runs = res["async, speculative_config"]
        summary.append(
            {
                "model": name,
                "batch": args.spec_batch,
                "spec_over_plain": ratio(
                    median_of(spec_runs, "output_throughput"),
                    median_of(res["async"], "output_throughput"),
                ),
                "draft_caused_steps": statistics.median(draft_steps(r) for r in spec_runs),
                "spec_num_drafts": statistics.median(
                    r.get("spec_num_drafts", 0) for r in spec_runs
                ),
            }
        )
    print("\n".join(lines))
    for s in summary:
        print(
            f"spec, {s['model']}: spec / plain = {_f(s['spec_over_plain'], 3)}, steps "
            f"without overlap because of drafts: {s['draft_caused_steps']}, drafts: "
            f"{s['spec_num_drafts']}"
        )
    return {"cells": cells, "summary": summary}


def draft_steps(result: dict) -> int:
    reasons = result["overlap"]["steps_without_overlap"]
    return sum(n for reason, n in reasons.items() if reason.startswith(DRAFT_REASON))


GROUPS = {
    "overlap": (overlap_rows, "overlap_matrix.json"),
    "host-bound": (host_bound_rows, "overlap_host_bound.json"),
    "spec": (spec_rows, "overlap_spec.json"),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default=",".join(GROUPS), help="groups to run: " + ", ".join(GROUPS))
    p.add_argument("--models", default="embedded,tiny", help="overlap and spec groups")
    p.add_argument("--batches", default="1,32")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--spec-batch", type=int, default=32)
    p.add_argument("--hb-prompts", type=int, default=256)
    p.add_argument("--hb-input-len", type=int, default=32)
    p.add_argument("--hb-output-len", type=int, default=96)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--results-dir", type=Path, default=RESULTS, help="where the JSON goes")
    args = p.parse_args()
    args.results_dir.mkdir(parents=True, exist_ok=True)
    for group in args.rows.split(","):
        if group not in GROUPS:
            raise SystemExit(f"unknown row group {group!r}; choose from {', '.join(GROUPS)}")
        run, filename = GROUPS[group]
        print(f"\n## {group}", flush=True)
        result = run(args)
        (args.results_dir / filename).write_text(
            json.dumps(
                {"args": {**vars(args), "results_dir": str(args.results_dir)}, **result}, indent=2
            )
        )


if __name__ == "__main__":
    main()
