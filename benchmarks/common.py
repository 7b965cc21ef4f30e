"""What the benchmark scripts share: the models they name (the embedded model, random Llamas
built with transformers), the prompts of a workload, engine arguments as `vserve` flags, and
the runner of `vserve bench throughput | latency` in a fresh process with its `--output-json`
read back.

A script in this folder imports it as `common` (Python puts a script's own folder first on
`sys.path`).

| model name   | what it is                                                          |
|--------------|---------------------------------------------------------------------|
| `embedded`   | the embedded Gemma-3-270M at its default dtype and weights          |
| `tiny`       | a random fp32 Llama, hidden 64, 2 layers, the embedded tokenizer    |
|              | (262144 tokens): a small model whose lm_head and sampler are large  |
| `host-bound` | a random fp32 Llama, hidden 64, 2 layers, a 4096-token BPE: host    |
|              | work (schedule, commit, detokenize) large next to the forward       |
| a path       | a model folder or GGUF, as `--model` takes it                       |
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
MODELS = ("embedded", "tiny", "host-bound")


# -- models ----------------------------------------------------------------------------------------
def model_kwargs(name: str) -> dict:
    """Engine arguments (`LLM(**kwargs)`) of a model named as the table above names it."""
    tmp = Path(tempfile.gettempdir())
    if name == "embedded":
        return {}  # the default dtype: bf16 on CPUs with bf16 instructions
    if name == "tiny":
        return {"model": build_llama(tmp / "vserve-tiny-llama", 262144), "dtype": "float32"}
    if name == "host-bound":
        folder = tmp / "vserve-host-bound-llama"
        return {"model": build_llama(folder, 4096, tokenizer="bpe"), "dtype": "float32"}
    return {"model": name}


def build_llama(
    folder: Path, vocab_size: int, hidden: int = 64, layers: int = 2, tokenizer: str = "embedded"
) -> str:
    """A random fp32 Llama saved as a Hugging Face folder (once: an existing one is reused).
    Tokenizer "embedded": the embedded model's (only with its full vocabulary, see
    `bpe_tokenizer`); "bpe": a byte-level BPE trained to `vocab_size` tokens."""
    if (folder / "config.json").is_file():
        return str(folder)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from vserve.models.resolve import embedded_model_path

    torch.manual_seed(0)
    config = LlamaConfig(
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
    AutoModelForCausalLM.from_config(config).save_pretrained(str(folder))
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


# -- prompts ---------------------------------------------------------------------------------------
def make_prompts(
    tokenizer, vocab_size: int, num: int, input_len: int, dataset: str = "random"
) -> list[dict]:
    """`num` prompts of `input_len` token ids: the ones `vserve bench throughput
    --dataset-name DATASET` makes for the same model (seed 0)."""
    from vserve.bench.datasets import random_samples, repetitive_samples

    make = {"random": random_samples, "repetitive": repetitive_samples}[dataset]
    samples = make(tokenizer, vocab_size, num, input_len, 1)
    return [{"prompt_token_ids": s.prompt_ids} for s in samples]


# -- engine arguments as flags ---------------------------------------------------------------------
def engine_flags(kwargs: dict) -> list[str]:
    """`vserve` flags of engine arguments: {"async_scheduling": False, "dtype": "float32"} ->
    ["--no-async-scheduling", "--dtype", "float32"]."""
    flags = []
    for name, value in kwargs.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, dict):
            flags += [flag, json.dumps(value)]
        elif value is not None:
            flags += [flag, str(value)]
    return flags


# -- the bench runner ------------------------------------------------------------------------------
def run_bench(
    kind: str, flags: list[str], env: dict[str, str] | None = None, echo: bool = True
) -> dict:
    """`vserve bench KIND FLAGS` in a fresh process (`env` added to this one's environment);
    returns its `--output-json`. Its own output is dropped; on failure the tail of its stderr
    is shown and the script stops."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "vserve.cli", "bench", kind, *flags, "--output-json", str(out)]
        if echo:
            settings = [f"{k}={v}" for k, v in (env or {}).items()]
            print("+", shlex.join(settings + cmd), flush=True)
        proc = subprocess.run(
            cmd,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
        )
        if proc.returncode:
            sys.stderr.write(proc.stderr[-5000:])
            raise SystemExit(f"vserve bench {kind} failed with exit status {proc.returncode}")
        return json.loads(out.read_text())


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float, log_tail=lambda: "") -> None:
    """Until `vserve serve` at `url` answers /health with 200; an error if it exits first or
    takes longer than `timeout` seconds (`log_tail()`: the end of its log, for the message)."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}):\n{log_tail()}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the server was not ready in {timeout} s:\n{log_tail()}")


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=str))
    print(f"wrote {path}")


def fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"
