"""The same prompts through transformers' `generate`: static batches, EOS ignored."""

from __future__ import annotations

import re
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
    """transformers' model of a model folder. A GGUF's folder (the embedded model's) holds no
    weights: transformers' model is built from the folder's config and takes the GGUF's
    tensors dequantized by vserve's reader (under transformers' own names, its fixes of
    llama.cpp's storage undone), not through transformers' GGUF loader, which parses the
    whole vocabulary again and dequantizes in a slower loop (33 s against a few for the
    embedded model); the same values (tests/bench/test_bench.py). A mixture's experts, read
    one by one, are stacked as transformers holds them."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    from vserve import cpu_ops
    from vserve.models.gguf_source import gguf_file, iter_gguf_weights

    if gguf_file(model_path) is None:
        return AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval()
    config = AutoConfig.from_pretrained(model_path)
    with no_init_weights():  # every weight is about to be assigned
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    kernels = cpu_ops.load_quant()  # gguf's values, dequantized in a fraction of its time
    state = dict(iter_gguf_weights(model_path, dtype, quantized=False, kernels=kernels))
    state = _stacked_experts(state, set(model.state_dict()))
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    result = model.load_state_dict(state, strict=False)
    model.tie_weights()
    missing = [
        n
        for n in result.missing_keys
        if not (n == "lm_head.weight" and model.config.tie_word_embeddings)
    ]
    if missing or result.unexpected_keys:
        raise ValueError(
            f"{gguf_file(model_path)}: transformers' model misses {missing[:4]}, "
            f"does not know {result.unexpected_keys[:4]}"
        )
    return model.eval()


_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


def _stacked_experts(state: dict, names: set[str]) -> dict:
    """Per-expert tensors (`...experts.3.up_proj.weight`) as transformers' stacked experts
    (`...experts.gate_up_proj` [E, 2 I, H], gate rows first, and `...experts.down_proj`)
    where its model has them."""
    pieces: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    out = {}
    for name, tensor in state.items():
        found = _EXPERT.match(name)
        if found is None or f"{found[1]}.gate_up_proj" not in names:
            out[name] = tensor
            continue
        pieces.setdefault(found[1], {})[(int(found[2]), found[3])] = tensor
    for prefix, parts in pieces.items():
        experts = range(1 + max(e for e, _ in parts))
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([parts[(e, "gate")], parts[(e, "up")]]) for e in experts]
        )
        out[f"{prefix}.down_proj"] = torch.stack([parts[(e, "down")] for e in experts])
    return out


def _left_pad(prompts: list[list[int]], pad: int):
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.tensor(p)
        mask[row, width - len(p) :] = 1
    return ids, mask
