"""Benchmark workloads: random token prompts, ShareGPT conversations, shared-prefix prompts.

Every sample is (prompt token ids, output length). Random prompts use token ids that are not
special tokens, so they decode to text and back the way a real prompt would.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass


@dataclass
class Sample:
    prompt_ids: list[int]
    output_len: int
    prompt_text: str | None = None


def _normal_ids(tokenizer, vocab_size: int) -> list[int]:
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    limit = min(vocab_size, len(tokenizer)) if hasattr(tokenizer, "__len__") else vocab_size
    return [i for i in range(limit) if i not in special]


def random_samples(
    tokenizer,
    vocab_size: int,
    num: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    seed: int = 0,
) -> list[Sample]:
    rng = random.Random(seed)
    ids = _normal_ids(tokenizer, vocab_size)
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    out = []
    for _ in range(num):
        n_in = _vary(rng, input_len, range_ratio)
        n_out = _vary(rng, output_len, range_ratio)
        out.append(Sample(bos + [rng.choice(ids) for _ in range(max(1, n_in - len(bos)))], n_out))
    return out


def prefix_repetition_samples(
    tokenizer,
    vocab_size: int,
    num: int,
    prefix_len: int,
    suffix_len: int,
    num_prefixes: int,
    output_len: int,
    seed: int = 0,
) -> list[Sample]:
    rng = random.Random(seed)
    ids = _normal_ids(tokenizer, vocab_size)
    prefixes = [[rng.choice(ids) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    return [
        Sample(
            prefixes[i % num_prefixes] + [rng.choice(ids) for _ in range(suffix_len)], output_len
        )
        for i in range(num)
    ]


def repetitive_samples(
    tokenizer,
    vocab_size: int,
    num: int,
    input_len: int,
    output_len: int,
    period: int = 16,
    seed: int = 0,
) -> list[Sample]:
    """Prompts made of one random run of `period` tokens repeated: text a model continues by
    repeating it, where n-gram drafts get accepted."""
    rng = random.Random(seed)
    ids = _normal_ids(tokenizer, vocab_size)
    out = []
    for _ in range(num):
        unit = [rng.choice(ids) for _ in range(period)]
        out.append(Sample((unit * (input_len // period + 1))[:input_len], output_len))
    return out


def sharegpt_samples(
    path: str, tokenizer, num: int, output_len: int | None = None, seed: int = 0
) -> list[Sample]:
    """First human turn as the prompt, the reply's length as the output length; drops samples
    as the reference benchmark does (prompt or output < 4 tokens, prompt > 1024,
    prompt + output > 2048)."""
    with open(path) as f:
        data = json.load(f)
    rng = random.Random(seed)
    rng.shuffle(data)
    out = []
    for entry in data:
        turns = entry.get("conversations") or entry.get("conversation") or []
        if len(turns) < 2:
            continue
        prompt, reply = turns[0].get("value", ""), turns[1].get("value", "")
        p_ids = tokenizer.encode(prompt)
        n_out = output_len or len(tokenizer.encode(reply, add_special_tokens=False))
        if len(p_ids) < 4 or n_out < 4 or len(p_ids) > 1024 or len(p_ids) + n_out > 2048:
            continue
        out.append(Sample(p_ids, n_out, prompt))
        if len(out) == num:
            break
    if not out:
        raise ValueError(f"no usable conversations in {path}")
    return out


def _vary(rng: random.Random, value: int, ratio: float) -> int:
    if ratio <= 0:
        return value
    lo, hi = int(value * (1 - ratio)), int(value * (1 + ratio))
    return max(1, rng.randint(lo, hi))


def load_samples(args, tokenizer, vocab_size: int) -> list[Sample]:
    name = args.dataset_name
    if name == "random":
        return random_samples(
            tokenizer,
            vocab_size,
            args.num_prompts,
            args.input_len,
            args.output_len,
            args.random_range_ratio,
            args.dataset_seed,
        )
    if name == "sharegpt":
        if not args.dataset_path:
            raise ValueError("--dataset-name sharegpt needs --dataset-path")
        return sharegpt_samples(
            args.dataset_path,
            tokenizer,
            args.num_prompts,
            args.sharegpt_output_len,
            args.dataset_seed,
        )
    if name == "repetitive":
        return repetitive_samples(
            tokenizer,
            vocab_size,
            args.num_prompts,
            args.input_len,
            args.output_len,
            seed=args.dataset_seed,
        )
    if name == "prefix-repetition":
        return prefix_repetition_samples(
            tokenizer,
            vocab_size,
            args.num_prompts,
            args.prefix_len,
            args.input_len,
            args.num_prefixes,
            args.output_len,
            args.dataset_seed,
        )
    raise ValueError(f"unknown dataset {name!r}")


def add_dataset_args(p) -> None:
    p.add_argument(
        "--dataset-name",
        default="random",
        choices=["random", "sharegpt", "prefix-repetition", "repetitive"],
    )
    p.add_argument("--dataset-path", default=None)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", "--random-input-len", dest="input_len", type=int, default=128)
    p.add_argument("--output-len", "--random-output-len", dest="output_len", type=int, default=128)
    p.add_argument(
        "--sharegpt-output-len",
        type=int,
        default=None,
        help="sharegpt: every output this long (default: each reply's own length)",
    )
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument(
        "--prefix-len",
        type=int,
        default=256,
        help="prefix-repetition: tokens shared by the prompts of one prefix",
    )
    p.add_argument("--num-prefixes", type=int, default=4)
    p.add_argument("--dataset-seed", type=int, default=0)
