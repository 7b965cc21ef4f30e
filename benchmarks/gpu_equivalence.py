"""vserve against transformers on one model in one dtype (the GPU check's bf16 models, before
any figure is read): for every prompt position after the first, the prompt token's
log-probability (largest and mean |difference|) and the most likely next token (the share of
positions where both engines agree); then greedy continuations (how many tokens match before
the first difference, per prompt). Random prompts from a fixed seed.

    python benchmarks/gpu_equivalence.py MODEL OUT.json [--device cuda] [--dtype bfloat16]
        [--num-prompts 4] [--prompt-len 64] [--output-len 32]

bf16 kernels differ from transformers' in their order of summation, so neither the
log-probabilities nor long greedy runs need be identical: the figures say by how much.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch


def vserve_side(args, prompts: list[list[int]]):
    """(prompt token logprob per position, top-1 token per position, greedy ids) per prompt."""
    from vserve import LLM, SamplingParams

    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.prompt_len + args.output_len + 8,
        max_num_seqs=len(prompts),
    )
    try:
        sp = SamplingParams(
            temperature=0, max_tokens=args.output_len, ignore_eos=True, prompt_logprobs=1
        )
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    finally:
        llm.shutdown()
    result = []
    for prompt, out in zip(prompts, outs):
        entries = out.prompt_logprobs[1:]  # position 0 has none
        chosen = [e[t].logprob for e, t in zip(entries, prompt[1:])]
        top1 = [next(t for t, lp in e.items() if lp.rank == 1) for e in entries]
        result.append((chosen, top1, list(out.outputs[0].token_ids)))
    return result


def transformers_side(args, prompts: list[list[int]]):
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(args.device).eval()
    result = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=args.device)
            logp = model(ids).logits[0, :-1].float().log_softmax(-1)
            chosen = logp.gather(1, ids[0, 1:, None]).squeeze(1).tolist()
            top1 = logp.argmax(-1).tolist()
            gen = model.generate(
                ids,
                max_new_tokens=args.output_len,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            result.append((chosen, top1, gen[0, len(prompt) :].tolist()))
    return result


def match_length(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model")
    p.add_argument("out")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    args = p.parse_args()
    config = json.loads((Path(args.model) / "config.json").read_text())
    vocab = config.get("vocab_size") or config["text_config"]["vocab_size"]
    rng = random.Random(0)
    prompts = [
        [rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(args.num_prompts)
    ]
    ours, theirs = vserve_side(args, prompts), transformers_side(args, prompts)
    diffs = [abs(a - b) for o, t in zip(ours, theirs) for a, b in zip(o[0], t[0])]
    agree = [a == b for o, t in zip(ours, theirs) for a, b in zip(o[1], t[1])]
    result = {
        "model": args.model,
        "device": args.device,
        "dtype": args.dtype,
        "positions": len(diffs),
        "max_abs_logprob_diff": max(diffs),
        "mean_abs_logprob_diff": sum(diffs) / len(diffs),
        "top1_agreement": sum(agree) / len(agree),
        "output_len": args.output_len,
        "greedy_match_lengths": [match_length(o[2], t[2]) for o, t in zip(ours, theirs)],
    }
    print(json.dumps(result))
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
