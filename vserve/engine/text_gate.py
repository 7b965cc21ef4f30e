"""A structured-output constraint that starts after a text: a thinking model's thoughts stay
free and its answer is constrained (`StructuredOutputsParams.starts_after`, `</think>`).

The gate reads the output token by token as bytes (the tokenizer's decoded vocabulary), so a
tag written as one token (Qwen3's and DeepSeek-R1's `</think>`) or split across several opens
it alike. The token that completes the tag is the last one outside the constraint: the grammar
starts with the next token. It sees confirmed tokens only, as the grammar does, so a
preempted request's gate is already where its recomputation starts.
"""

from __future__ import annotations

from collections.abc import Sequence


class TextGate:
    """Closed until `tag` appears in the bytes of the tokens fed to it."""

    def __init__(self, tag: str, vocab: Sequence[bytes]) -> None:
        self.tag = tag.encode()
        self.vocab = vocab
        self.tail = b""  # the last bytes seen, too few to hold the tag

    def feed(self, token_id: int) -> bool:
        """Whether the tag is complete with this token (then the gate is open)."""
        piece = self.vocab[token_id] if 0 <= token_id < len(self.vocab) else b""
        text = self.tail + piece
        if self.tag in text:
            return True
        self.tail = text[len(text) - len(self.tag) + 1 :] if len(text) >= len(self.tag) else text
        return False
