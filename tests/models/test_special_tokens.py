"""Special tokens of GGUF-converted tokenizers: the GGUF's token types
(CONTROL, UNKNOWN, UNUSED) and the architecture's special tokens stored as USER_DEFINED
(Gemma 3's image delimiters) are marked special, so that `skip_special_tokens` drops them from
text; the embedded Gemma once wrote `<start_of_image>` into completions."""

from __future__ import annotations

import gguf
import pytest
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from vserve.models.gguf_tokens import (
    CONTROL,
    UNKNOWN,
    UNUSED,
    USER_DEFINED,
    read_special_tokens,
    special_tokens,
)

NORMAL, BYTE = 1, 6
VOCAB = [
    ("<pad>", CONTROL),
    ("<eos>", CONTROL),
    ("<bos>", CONTROL),
    ("<unk>", UNKNOWN),
    ("[multimodal]", USER_DEFINED),
    ("<start_of_turn>", CONTROL),
    ("\n", USER_DEFINED),
    ("<table>", USER_DEFINED),
    ("<0x0A>", BYTE),
    ("▁the", NORMAL),
    ("<unused0>", UNUSED),
    ("<start_of_image>", USER_DEFINED),
    ("<end_of_image>", USER_DEFINED),
]
SPECIAL = [
    "<pad>",
    "<eos>",
    "<bos>",
    "<unk>",
    "<start_of_turn>",
    "<unused0>",
    "<start_of_image>",
    "<end_of_image>",
]


def test_special_from_token_types():
    tokens, types = zip(*VOCAB)
    assert special_tokens("gemma3", list(tokens), list(types)) == SPECIAL
    # the image delimiters are Gemma 3's; elsewhere USER_DEFINED stays text, as in llama.cpp
    assert special_tokens("llama", list(tokens), list(types)) == SPECIAL[:-2]


def test_read_from_gguf_metadata(tmp_path):
    path = tmp_path / "vocab.gguf"
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_tokenizer_model("llama")
    writer.add_token_list([t for t, _ in VOCAB])
    writer.add_token_types([k for _, k in VOCAB])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert read_special_tokens(path) == SPECIAL


# the embedded model: these are special in Gemma 3's reference tokenizer
EMBEDDED_SPECIAL = [
    "<pad>",
    "<eos>",
    "<bos>",
    "<unk>",
    "<mask>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<start_of_image>",
    "<end_of_image>",
]
EMBEDDED_TEXT = ["\n", "<table>", "▁Hello"]


@pytest.fixture(scope="module")
def embedded_tokenizer() -> Tokenizer:
    from vserve.models.resolve import embedded_model_path

    return Tokenizer.from_file(str(embedded_model_path() / "tokenizer.json"))


@pytest.mark.slow
def test_embedded_special_tokens_are_skipped(embedded_tokenizer):
    tok = embedded_tokenizer
    added = tok.get_added_tokens_decoder()
    ids = {token: tok.token_to_id(token) for token in EMBEDDED_SPECIAL + EMBEDDED_TEXT}
    assert None not in ids.values(), ids
    for token in EMBEDDED_SPECIAL:
        assert added[ids[token]].special, f"{token} is not special"
    for token in ("\n", "<table>"):  # USER_DEFINED text stays text
        assert not added[ids[token]].special, token
    seq = [
        ids[t]
        for t in [
            "<bos>",
            "<start_of_turn>",
            "▁Hello",
            "<start_of_image>",
            "<end_of_image>",
            "<table>",
            "\n",
            "<end_of_turn>",
            "<eos>",
        ]
    ]
    assert tok.decode(seq, skip_special_tokens=True) == " Hello<table>\n"
    kept = tok.decode(seq, skip_special_tokens=False)
    assert "<start_of_image>" in kept and "<end_of_turn>" in kept
    # the detokenizer streams through tokenizers' DecodeStream
    stream = DecodeStream(skip_special_tokens=True)
    text = "".join(piece or "" for piece in (stream.step(tok, i) for i in seq))
    assert text == " Hello<table>\n"
