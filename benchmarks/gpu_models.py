"""Random-weight models for the GPU check, built where they run (nothing large travels): a
Llama-shaped ~1.1B model and a Gemma-3-270M-shaped one (the embedded model's config: 18
layers, 5 sliding : 1 global, 262k vocabulary), each with a word-level tokenizer exactly as
large as its vocabulary, so every id a random model samples decodes.

    python benchmarks/gpu_models.py DEST [--small]   # --small: CPU-sized, same shapes' kinds

Prints one JSON line per model: {"name", "path", "params"}.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def llama_config(small: bool):
    from transformers import LlamaConfig

    size = (
        dict(
            hidden_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=256,
            vocab_size=4096,
        )
        if small
        else dict(
            hidden_size=2048,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            intermediate_size=8192,
            vocab_size=32000,
        )
    )
    return LlamaConfig(
        **size,
        max_position_embeddings=4096,
        bos_token_id=2,
        eos_token_id=1,
        pad_token_id=0,
        tie_word_embeddings=False,
    )


def gemma_config(small: bool):
    from transformers import Gemma3TextConfig

    layers = 6 if small else 18
    size = (
        dict(
            hidden_size=64,
            intermediate_size=128,
            head_dim=32,
            vocab_size=8192,
            sliding_window=16,
            query_pre_attn_scalar=32,
        )
        if small
        else dict(
            hidden_size=640,
            intermediate_size=2048,
            head_dim=256,
            vocab_size=262144,
            sliding_window=512,
            query_pre_attn_scalar=256,
        )
    )
    return Gemma3TextConfig(
        **size,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=1,
        layer_types=[
            "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)
        ],
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        bos_token_id=2,
        eos_token_id=1,
        pad_token_id=0,
        tie_word_embeddings=True,
        hidden_activation="gelu_pytorch_tanh",
    )


def word_tokenizer(vocab_size: int, folder: Path) -> None:
    """Ids 0-2 are <pad>, </s>, <s>; every other id is a word 'w<id>' (whitespace-split)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "<s>": 2}
    vocab.update({f"w{i}": i for i in range(3, vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    fast.save_pretrained(str(folder))


def build(name: str, config, dest: Path, device: str) -> dict:
    from transformers import AutoModelForCausalLM

    folder = dest / name
    if not (folder / ".complete").is_file():
        torch.manual_seed(0)
        with torch.device(device):  # initialising 1.1B weights on a GPU takes a second
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.save_pretrained(str(folder))
        word_tokenizer(config.vocab_size, folder)
        params = sum(p.numel() for p in model.parameters())
        (folder / ".complete").write_text(str(params))
        del model
    return {"name": name, "path": str(folder), "params": int((folder / ".complete").read_text())}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("dest")
    p.add_argument("--small", action="store_true", help="CPU-sized models")
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dest = Path(args.dest)
    for name, cfg in (
        ("llama-1b", llama_config(args.small)),
        ("gemma3-270m-shape", gemma_config(args.small)),
    ):
        start = time.perf_counter()
        info = build(name, cfg, dest, device)
        info["build_s"] = round(time.perf_counter() - start, 1)
        print(json.dumps(info), flush=True)


if __name__ == "__main__":
    main()
