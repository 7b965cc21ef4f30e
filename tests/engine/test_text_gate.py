"""A structured-output constraint that starts after a text (`starts_after`, a thinking
model's `</think>`): the thoughts are free, the answer is constrained.

The gate on bytes (a tag in one token, across several, with text around it); a real xgrammar
state behind it on the tiny tokenizer, where `</think>` takes seven tokens (every token
allowed and no grammar advanced until the tag, the grammar's mask from the next token on);
then the engine, sync and async, on a tiny model whose `</think>` is one token pushed up by
`logit_bias`: the tag once, then the constrained answer.
"""

import re

import numpy as np
import pytest

from tests.support.engines import make_llm
from tests.support.tiny_models import thinking_model
from vserve import SamplingParams, StructuredOutputsParams
from vserve.engine.text_gate import TextGate

VOCAB = [b"<", b"/", b"think", b">", b"</think>", b"ab", b">x", b"</", b"think>\n"]


def _opens_at(tag: str, ids: list[int]) -> int | None:
    gate = TextGate(tag, VOCAB)
    for i, token_id in enumerate(ids):
        if gate.feed(token_id):
            return i
    return None


@pytest.mark.parametrize(
    "ids, at",
    [
        ([5, 4, 5], 1),  # the tag in one token
        ([5, 0, 1, 2, 3, 5], 4),  # across four
        ([0, 1, 2, 6, 5], 3),  # its last token carries answer text: still the last outside
        ([7, 8], 1),  # a token that begins with the tag's end
        ([5, 0, 1, 5, 2, 3], None),  # interrupted
        ([5, 999, -1], None),  # ids outside the vocabulary read as nothing
    ],
)
def test_the_gate_opens_on_the_token_that_completes_the_tag(ids, at):
    assert _opens_at("</think>", ids) == at


def test_a_starts_after_is_bounded():
    with pytest.raises(ValueError, match="starts_after must be a string of 1 to 64"):
        StructuredOutputsParams(regex="x", starts_after="")
    with pytest.raises(ValueError, match="starts_after must be a string of 1 to 64"):
        StructuredOutputsParams(regex="x", starts_after="x" * 65)


def test_a_grammar_waits_behind_its_gate(tiny_model_dir):
    from transformers import AutoTokenizer

    from vserve.engine.structured_output import StructuredOutputManager

    model = tiny_model_dir("qwen3")
    tok = AutoTokenizer.from_pretrained(model)
    manager = StructuredOutputManager(model, 384, (1,))
    try:
        params = StructuredOutputsParams(regex="[x-z]{3}")
        compiled = manager.submit(params).result(timeout=60)
        state = manager.new_state(compiled, "</think>")
        thoughts = tok.encode("ab</think>", add_special_tokens=False)
        assert len(thoughts) > 3  # the tag takes several tokens here
        for token_id in thoughts:
            bitmask = manager.allocate_bitmask(1)
            manager.fill(state, bitmask, 0)
            assert (bitmask == -1).all()  # every token allowed, the tag's pieces too
            assert not state.is_terminated()
            assert state.accept(token_id)
        bitmask = manager.allocate_bitmask(1)
        manager.fill(state, bitmask, 0)
        allowed = _allowed(bitmask[0], 384)
        assert allowed and all(re.fullmatch("[x-z]+", tok.decode([i])) for i in allowed)
        answer = tok.encode("xyz", add_special_tokens=False)
        assert all(state.accept(i) for i in answer) and state.accept(1)  # then EOS
        assert state.is_terminated()
        assert not manager.new_state(compiled, "</think>").is_terminated()
        ungated = manager.new_state(compiled)
        assert not ungated.accept(thoughts[0])  # without the gate, "a" breaks the regex
    finally:
        manager.shutdown()


def _allowed(row: np.ndarray, vocab: int) -> list[int]:
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab]
    return [int(i) for i in np.flatnonzero(bits)]


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    model = thinking_model(tiny_model_dir)
    return {
        mode: make_llm(model, max_model_len=128, async_scheduling=mode == "async")
        for mode in ("sync", "async")
    }


@pytest.mark.slow  # two engines; the server's test covers the same in the slow tier too
def test_the_engine_constrains_only_after_the_thoughts(engines):
    """`</think>` pushed up by logit_bias: it comes first, then the grammar masks it out, and
    an async step sampled before the tag's commit would repeat it."""
    llm = engines["sync"]
    end = llm.get_tokenizer().convert_tokens_to_ids("</think>")
    prompt = "<|user|>Think first.\n<|assistant|><think>"
    texts = {}
    for mode, llm in engines.items():
        for after in ("</think>", None):
            constraint = StructuredOutputsParams(regex="[x-z]{3,6}", starts_after=after)
            params = SamplingParams(
                temperature=0, max_tokens=12, logit_bias={end: 50}, structured_outputs=constraint
            )
            out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
            texts[mode, after] = out.text
            assert out.finish_reason == "stop"
    gated, plain = texts["sync", "</think>"], texts["sync", None]
    assert re.fullmatch("</think>[x-z]{3,6}", gated), gated
    assert re.fullmatch("[x-z]{3,6}", plain), plain  # from the first token, the tag masked
    assert texts["async", "</think>"] == gated and texts["async", None] == plain
