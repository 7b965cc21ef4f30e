"""The same prompts through transformers' `generate`: static batches, EOS ignored."""

from __future__ import annotations

import time

import torch
from tqdm.auto import tqdm

from vserve.bench.datasets import Sample

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def run_hf(
    model_path: str, dtype: str, samples: list[Sample], max_batch_size: int, temperature: float
) -> tuple[float, int]:
    """Returns (elapsed seconds, output tokens)."""
    model = load_hf_model(model_path, _DTYPES[dtype])
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    num_out = 0
    bar = tqdm(total=len(samples), desc="transformers generate")
    start = time.perf_counter()
    for i in range(0, len(samples), max_batch_size):
        batch = samples[i : i + max_batch_size]
        out_len = max(s.output_len for s in batch)
        ids, mask = _left_pad([s.prompt_ids for s in batch], pad)
        kwargs = (
            dict(do_sample=True, temperature=temperature, top_p=1.0, top_k=0)
            if temperature > 0
            else dict(do_sample=False)
        )
        with torch.inference_mode():
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=out_len,
                min_new_tokens=out_len,
                pad_token_id=pad,
                **kwargs,
            )
        num_out += out_len * len(batch)
        bar.update(len(batch))
    bar.close()
    return time.perf_counter() - start, num_out


def load_hf_model(model_path: str, dtype: torch.dtype):
    """transformers' model of a model folder; a GGUF's folder (the embedded model's) holds no
    weights, so transformers reads and dequantizes the GGUF it names."""
    from transformers import AutoModelForCausalLM

    from vserve.models.gguf_source import gguf_file
    from vserve.models.resolve import gguf_parsed_once

    gguf = gguf_file(model_path)
    if gguf is None:
        return AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval()
    with gguf_parsed_once():
        return AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=dtype
        ).eval()


def _left_pad(prompts: list[list[int]], pad: int):
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.tensor(p)
        mask[row, width - len(p) :] = 1
    return ids, mask
