"""The README's main command, `vserve generate`, and `LLM()` with no arguments: the defaults a
new user runs first (multiprocess engine, dtype auto, the embedded model's GGUF blocks).

Greedy ids of the default model are checked against transformers' fp32 greedy ids of the same
prompt (tests/e2e/test_embedded_model.py's REFERENCE_IDS). The default path multiplies bf16
activations rounded to int8 per block (as llama.cpp does), so its ids could leave the fp32
ones where two candidates are close: along these 11 tokens the smallest fp32 top-2 gap is
0.26 nats (the fifth), and the default path moved those gaps by at most 0.15 nats on an
AVX-512 Xeon and 0.17 with VSERVE_CPU_ISA=avx2 (2026-12-06), so the ids agree on both.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.e2e.test_embedded_model import REFERENCE_IDS
from tests.support.engines import make_llm
from vserve import SamplingParams

PROMPT = "The capital of France is"
CLI_MAX_TOKENS = 32  # `vserve generate`'s default


def _generate(*args: str, timeout: float = 300) -> str:
    cmd = [sys.executable, "-m", "vserve.cli", "generate", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _printed(stdout: str, prompt: str) -> str:
    """The text `vserve generate` printed after `>>> prompt`."""
    head = f"\n>>> {prompt}\n"
    assert head in stdout, stdout[-2000:]
    return stdout.split(head, 1)[1].split("\n>>> ", 1)[0].rstrip("\n")


@pytest.mark.slow  # the fast tier runs the README's own command below
def test_generate_prints_the_engines_greedy_text(tiny_model_dir):
    model = tiny_model_dir("llama")
    prompts = ["Paris is", "1 2 3"]
    stdout = _generate(*prompts, "--model", model, "--dtype", "float32", "--max-tokens", "8")
    llm = make_llm(model, max_model_len=256)
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    finally:
        llm.shutdown()
    for prompt, out in zip(prompts, outs):
        assert _printed(stdout, prompt) == out.outputs[0].text


@pytest.fixture(scope="module")
def default_llm():
    from vserve import LLM

    llm = LLM()
    yield llm
    llm.shutdown()


def test_readme_command_on_the_default_model(default_llm):
    """`vserve generate "The capital of France is"`, as the README runs it (every default),
    prints what `LLM()` generates greedily."""
    want = default_llm.generate(
        PROMPT, SamplingParams(temperature=0, max_tokens=CLI_MAX_TOKENS), use_tqdm=False
    )[0]
    assert _printed(_generate(PROMPT), PROMPT) == want.outputs[0].text


def test_llm_with_no_arguments(default_llm):
    """The defaults resolve as documented, and greedy ids are transformers' fp32 ones."""
    cfg = default_llm.config
    assert cfg.parallel.distributed_executor_backend == "mp"
    assert cfg.async_scheduling
    assert cfg.model.quantization == "gguf"
    out = default_llm.generate(
        PROMPT, SamplingParams(temperature=0, max_tokens=len(REFERENCE_IDS)), use_tqdm=False
    )[0]
    assert list(out.outputs[0].token_ids) == REFERENCE_IDS
