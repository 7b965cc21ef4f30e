"""`vserve chat` typed into through a pipe: each line a user message, each reply the greedy
text `LLM.chat` gives for the conversation so far (the history kept, `/clear` forgetting it,
the system prompt staying), `/exit` leaving before the lines after it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.engines import make_llm
from vserve import SamplingParams

SYSTEM = "You are terse."


@pytest.mark.slow
def test_a_turn_too_long_for_the_context_is_dropped_not_fatal(tiny_model_dir):
    model = tiny_model_dir("llama")
    typed = " ".join(["word"] * 200) + "\nParis is\n"
    cmd = [sys.executable, "-m", "vserve.cli", "chat", "--model", model, "--dtype", "float32"]
    cmd += ["--temperature", "0", "--max-tokens", "4", "--max-model-len", "64"]
    proc = subprocess.run(cmd, input=typed, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, _, rest = proc.stdout.partition("\n")
    assert first.startswith("(not sent: ") and "/clear" in first
    llm = make_llm(model, max_model_len=64)
    try:  # the dropped turn is not in the history of the next one
        conversation = [{"role": "user", "content": "Paris is"}]
        want = llm.chat(conversation, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    finally:
        llm.shutdown()
    assert rest == want[0].outputs[0].text + "\n"


def test_chat_through_a_pipe_keeps_and_clears_the_history(tiny_model_dir):
    model = tiny_model_dir("llama")
    typed = "Paris is\n\n1 2 3\n/clear\nhello\n/exit\nnever sent\n"
    cmd = [sys.executable, "-m", "vserve.cli", "chat", "--model", model, "--dtype", "float32"]
    cmd += ["--temperature", "0", "--max-tokens", "8", "--system", SYSTEM]
    proc = subprocess.run(cmd, input=typed, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]

    llm = make_llm(model, max_model_len=256)
    greedy = SamplingParams(temperature=0, max_tokens=8)
    system = {"role": "system", "content": SYSTEM}

    def reply(conversation: list[dict]) -> str:
        return llm.chat(conversation, greedy, use_tqdm=False)[0].outputs[0].text

    try:
        first = [system, {"role": "user", "content": "Paris is"}]
        second = {"role": "user", "content": "1 2 3"}
        a = reply(first)
        b = reply([*first, {"role": "assistant", "content": a}, second])
        c = reply([system, {"role": "user", "content": "hello"}])
        alone = reply([system, second])
    finally:
        llm.shutdown()
    assert b != alone  # the history changed the second reply
    assert proc.stdout == f"{a}\n{b}\n{c}\n"
