"""Where a batch-1 decode model step's time goes, phase by phase (CPU, in-process engine).

Runs one request through an in-process `LLM` (the model runner in this process) with timers
around the phases of each decode step's model step (forward start to forward end, the span
batch1_roofline.py reports): embedding, rotary tables, the decoder layers, the final norm,
the head (logits) and sampling with the rest of the runner's work.

    python benchmarks/batch1_profile.py [--model PATH] [--quantization Q] [--output-len 128]

Prints the median per step of each phase in ms.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict


def timed(record: dict, name: str, fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        record[name].append(time.perf_counter() - start)
        return out

    return wrapper


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None)
    p.add_argument("--quantization", default=None)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-iters", type=int, default=3)
    args = p.parse_args()

    from vserve import LLM, SamplingParams

    llm = LLM(
        args.model,
        quantization=args.quantization,
        multiprocess=False,
        distributed_executor_backend="uni",
        max_model_len=args.input_len + args.output_len + 16,
    )
    runner = llm.engine.client.core.executor.worker.runner
    model = runner.model
    record: dict[str, list[float]] = defaultdict(list)
    body = model.model
    body.embed_tokens.forward = timed(record, "embedding", body.embed_tokens.forward)
    for i, rotary in enumerate(model.rotaries):
        rotary.cos_sin = timed(record, f"rotary table {i}", rotary.cos_sin)
    if model.fused is not None:
        model.fused.run = timed(record, "layers (fused)", model.fused.run)
    body.norm.forward = timed(record, "final norm", body.norm.forward)
    model.compute_logits = timed(record, "head (logits)", model.compute_logits)
    runner._sample = timed(record, "sampling + output", runner._sample)
    runner._prepare_inputs = timed(record, "input prep (before the step)", runner._prepare_inputs)

    prompt = {"prompt_token_ids": list(range(1000, 1000 + args.input_len))}
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate([prompt], params, use_tqdm=False)
    llm.engine.take_step_records()
    record.clear()
    for _ in range(args.num_iters):
        llm.generate([prompt], params, use_tqdm=False)
    steps = [
        r.forward_end - r.forward_start
        for r in llm.engine.take_step_records()
        if r.num_tokens == 1 and r.forward_end > 0
    ]
    llm.shutdown()
    # decode steps only: drop each generate's prefill call (the slowest one of each phase)
    print(f"quantization {model.fused and model.fused.layers[0].quantized}; median ms per step")
    for name, times in record.items():
        decode = sorted(times)[: len(steps)] if len(times) > len(steps) else times
        print(f"  {name:32s} {statistics.median(decode) * 1e3:7.3f}")
    print(f"  {'model step (forward start..end)':32s} {statistics.median(steps) * 1e3:7.3f}")


if __name__ == "__main__":
    main()
