"""Which tokens of a GGUF's vocabulary are special (skipped in text when
`skip_special_tokens` is true), and marking them so in a converted tokenizer.

A GGUF stores a type per token (`tokenizer.ggml.token_type`, llama.cpp's `llama_token_type`):

| type | name         | special here | why                                                      |
|------|--------------|--------------|----------------------------------------------------------|
| 1    | NORMAL       | no           | text                                                     |
| 2    | UNKNOWN      | yes          | `<unk>`; llama.cpp does not render it as text            |
| 3    | CONTROL      | yes          | `<bos>`, `<eos>`, `<start_of_turn>`, `<end_of_turn>`...  |
| 4    | USER_DEFINED | no, but      | text kept whole (`\\n\\n`, `<table>`); see the table below |
| 5    | UNUSED       | yes          | never text                                               |
| 6    | BYTE         | no           | byte fallback (`<0x0A>`)                                 |

Files converted from sentencepiece models keep sentencepiece's types, in which some tokens the
model's reference tokenizer marks special are USER_DEFINED: Gemma 3's image delimiters
(`<start_of_image>`, `<end_of_image>`, `<image_soft_token>`, the `boi`/`eoi`/`image` tokens of its
processor). `USER_DEFINED_SPECIAL` names them per architecture (`general.architecture`);
the other USER_DEFINED tokens stay text, as in llama.cpp.
"""

from __future__ import annotations

from pathlib import Path

UNKNOWN, CONTROL, USER_DEFINED, UNUSED = 2, 3, 4, 5
SPECIAL_TYPES = frozenset({UNKNOWN, CONTROL, UNUSED})

# special in the reference tokenizer, USER_DEFINED in GGUF files (from sentencepiece)
USER_DEFINED_SPECIAL: dict[str, frozenset[str]] = {
    "gemma3": frozenset({"<start_of_image>", "<end_of_image>", "<image_soft_token>"}),
}


def special_tokens(architecture: str, tokens: list[str], token_types: list[int]) -> list[str]:
    """The tokens to mark special, in vocabulary order."""
    extra = USER_DEFINED_SPECIAL.get(architecture, frozenset())
    return [
        token
        for token, kind in zip(tokens, token_types)
        if kind in SPECIAL_TYPES or (kind == USER_DEFINED and token in extra)
    ]


def read_special_tokens(gguf: Path) -> list[str]:
    """`special_tokens` of a GGUF file, from its metadata (no tensor is read)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf))
    fields = reader.fields
    if "tokenizer.ggml.token_type" not in fields:
        return []
    architecture = fields["general.architecture"].contents()
    return special_tokens(
        architecture,
        fields["tokenizer.ggml.tokens"].contents(),
        fields["tokenizer.ggml.token_type"].contents(),
    )


def mark_special(tokenizer, tokens: list[str]) -> None:
    """Mark `tokens` special in a fast tokenizer's backend (what `tokenizer.json` saves and
    what decoding with `skip_special_tokens` consults). Tokens already in the vocabulary keep
    their ids; the flag of a token already added as plain text is turned on."""
    from tokenizers import AddedToken

    vocab = tokenizer.get_vocab()
    tokenizer.backend_tokenizer.add_special_tokens(
        [AddedToken(token, special=True, normalized=False) for token in tokens if token in vocab]
    )
