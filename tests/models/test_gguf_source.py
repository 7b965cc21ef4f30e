"""A GGUF as a model's weights: the tensor table, names, and the two fixes llama.cpp's converter
made (Llama q/k rows permuted, Gemma norms stored as 1 + w), against gguf's and transformers'
own readings."""

import json

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from gguf.quants import dequantize, quantize

from vserve.models import gguf_source
from vserve.models.gguf_source import QuantBlocks, iter_gguf_weights, read_tensor_table


def _write(path, arch="llama", alignment=None):
    """A small GGUF: string-array metadata (as a vocabulary), one F32, one F16, one Q8_0."""
    rng = np.random.default_rng(0)
    w = GGUFWriter(str(path), arch)
    if alignment:
        w.data_alignment = alignment
    w.add_array("tokenizer.ggml.tokens", [f"tok{i}" for i in range(300)])
    w.add_array("tokenizer.ggml.scores", [float(i) for i in range(300)])
    w.add_uint32(f"{arch}.block_count", 1)
    tensors = {
        "output_norm.weight": rng.standard_normal(64).astype(np.float32),
        "blk.0.ffn_down.weight": rng.standard_normal((16, 64)).astype(np.float16),
        "blk.0.attn_q.weight": rng.standard_normal((8, 64)).astype(np.float32),
    }
    for name, values in tensors.items():
        if name == "blk.0.attn_q.weight":
            q = quantize(values, Q.Q8_0)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=Q.Q8_0)
        else:
            w.add_tensor(name, values)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tensors


def _folder(tmp_path, arch="llama", alignment=None, heads=(2, 2)):
    tensors = _write(tmp_path / "m.gguf", arch, alignment)
    names = {
        "output_norm.weight": "model.norm.weight",
        "blk.0.ffn_down.weight": "model.layers.0.mlp.down_proj.weight",
        "blk.0.attn_q.weight": "model.layers.0.self_attn.q_proj.weight",
    }
    manifest = {
        "file": str(tmp_path / "m.gguf"),
        "architecture": arch,
        "names": names,
        "num_heads": heads[0],
        "num_kv_heads": heads[1],
    }
    (tmp_path / gguf_source.MANIFEST).write_text(json.dumps(manifest))
    return tensors


@pytest.mark.parametrize("alignment", [None, 64])
def test_tensor_table_matches_gguf_reader(tmp_path, alignment):
    from gguf import GGUFReader

    _write(tmp_path / "m.gguf", alignment=alignment)
    table = read_tensor_table(tmp_path / "m.gguf")
    reader = GGUFReader(str(tmp_path / "m.gguf"))
    assert table.architecture == "llama"
    assert [(t.name, t.qtype, t.offset, t.dims) for t in table.tensors] == [
        (t.name, int(t.tensor_type), t.data_offset, tuple(int(d) for d in t.shape))
        for t in reader.tensors
    ]


def test_a_header_longer_than_the_first_read(tmp_path, monkeypatch):
    _write(tmp_path / "m.gguf")
    expected = read_tensor_table(tmp_path / "m.gguf")
    monkeypatch.setattr(gguf_source, "HEAD_BYTES", 40)  # inside the metadata
    assert read_tensor_table(tmp_path / "m.gguf") == expected


def test_not_a_gguf(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"NOPE" + bytes(100))
    with pytest.raises(ValueError, match="not a GGUF"):
        read_tensor_table(tmp_path / "x.gguf")


def test_weights_quantized_and_dequantized(tmp_path):
    tensors = _folder(tmp_path, arch="qwen2")  # no permutation, no norm fix
    dense = dict(iter_gguf_weights(tmp_path, torch.float32, quantized=False))
    blocks = dict(iter_gguf_weights(tmp_path, torch.float32, quantized=True))
    assert torch.equal(dense["model.norm.weight"], torch.from_numpy(tensors["output_norm.weight"]))
    down = torch.from_numpy(tensors["blk.0.ffn_down.weight"].astype(np.float32))
    assert torch.equal(dense["model.layers.0.mlp.down_proj.weight"], down)
    q = blocks["model.layers.0.self_attn.q_proj.weight"]
    assert isinstance(q, QuantBlocks) and q.qtype == Q.Q8_0 and q.shape == (8, 64)
    deq = dequantize(q.data.numpy(), Q.Q8_0)
    assert torch.equal(dense["model.layers.0.self_attn.q_proj.weight"], torch.from_numpy(deq))
    # float tensors come dense either way
    assert torch.equal(blocks["model.norm.weight"], dense["model.norm.weight"])


def test_llama_rows_unpermuted_as_transformers_does(tmp_path):
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    _folder(tmp_path, arch="llama", heads=(2, 2))
    dense = dict(iter_gguf_weights(tmp_path, torch.float32, quantized=False))
    blocks = dict(iter_gguf_weights(tmp_path, torch.float32, quantized=True))
    raw = read_tensor_table(tmp_path / "m.gguf").tensors[2]
    stored = np.memmap(tmp_path / "m.gguf", dtype=np.uint8, mode="r")[raw.offset :]
    stored = dequantize(np.array(stored[: 8 * 68]).reshape(8, 68), Q.Q8_0)
    processor = LlamaTensorProcessor({"num_attention_heads": 2, "num_key_value_heads": 2})
    expected = processor.process(stored, "blk.0.attn_q.weight").weights
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not np.array_equal(expected, stored)  # the permutation moved rows
    assert torch.equal(dense[name], torch.from_numpy(expected))
    # the same permutation applied to whole rows of blocks
    assert np.array_equal(dequantize(blocks[name].data.numpy(), Q.Q8_0), expected)


def test_gemma_norms_stored_as_one_plus_w(tmp_path):
    tensors = _folder(tmp_path, arch="gemma3")
    dense = dict(iter_gguf_weights(tmp_path, torch.float32, quantized=False))
    expected = torch.from_numpy(tensors["output_norm.weight"]) - 1.0
    assert torch.equal(dense["model.norm.weight"], expected)


@pytest.mark.slow
def test_embedded_manifest_and_table():
    from gguf import GGUFReader

    from vserve.models.resolve import _plain_view_reader, embedded_model_path

    folder = embedded_model_path()
    manifest = json.loads((folder / gguf_source.MANIFEST).read_text())
    # gguf's reader with plain views (the same tensors, tested below): 3 s, not 8, here
    reader = _plain_view_reader(GGUFReader)(manifest["file"])
    table = read_tensor_table(gguf_source.gguf_file(folder))
    assert [(t.name, t.offset) for t in table.tensors] == [
        (t.name, t.data_offset) for t in reader.tensors
    ]
    assert set(manifest["names"]) == {t.name for t in reader.tensors}  # every tensor is used
    assert manifest["names"]["blk.3.attn_q.weight"] == "model.layers.3.self_attn.q_proj.weight"
    assert manifest["names"]["token_embd.weight"] == "model.embed_tokens.weight"
    assert not list(folder.glob("*.safetensors"))  # no weight was converted


def test_plain_view_reader_reads_what_gguf_reader_reads(tmp_path):
    from gguf import GGUFReader

    from vserve.models.resolve import _plain_view_reader

    _write(tmp_path / "m.gguf")
    fast = _plain_view_reader(GGUFReader)(str(tmp_path / "m.gguf"))
    ref = GGUFReader(str(tmp_path / "m.gguf"))
    assert list(fast.fields) == list(ref.fields)
    for name, field in ref.fields.items():
        mine = fast.fields[name]
        assert (mine.data, mine.types, mine.offset) == (field.data, field.types, field.offset)
        assert all(np.array_equal(a, b) for a, b in zip(mine.parts, field.parts, strict=True))
        assert mine.contents() == field.contents()
    for mine, t in zip(fast.tensors, ref.tensors, strict=True):
        assert (mine.name, mine.tensor_type) == (t.name, t.tensor_type)
        assert mine.data_offset == t.data_offset
        assert np.array_equal(mine.data, t.data)


def test_a_truncated_or_corrupt_header_is_a_value_error(tmp_path):
    _write(tmp_path / "m.gguf")
    data = (tmp_path / "m.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:200])  # inside the metadata
    with pytest.raises(ValueError, match="not a readable GGUF header"):
        read_tensor_table(tmp_path / "cut.gguf")
    bad = bytearray(data)
    bad[24 + 8 + len("general.architecture") : 24 + 12 + len("general.architecture")] = (
        77
    ).to_bytes(4, "little")  # the first value's type: no such GGUF type
    (tmp_path / "bad.gguf").write_bytes(bytes(bad))
    with pytest.raises(ValueError, match="not a readable GGUF header"):
        read_tensor_table(tmp_path / "bad.gguf")


@pytest.mark.parametrize(
    "name", ["tiny-qwen2-q3_k_m.gguf", "tiny-qwen2_moe-q4_k_m.gguf", "tiny-granite-q8_0.gguf"]
)
def test_the_kernels_dequantize_as_gguf_does(name):
    """Dequantized through the CPU kernels (Q4_K, Q5_K, Q6_K, Q8_0 here; Q3_K stays gguf's),
    a file's weights are gguf's own, bit for bit: a mixture's experts, Llama-family rows."""
    from pathlib import Path

    from vserve import cpu_ops
    from vserve.models.resolve import resolve_model_path

    kernels = cpu_ops.load_quant()
    if kernels is None:
        pytest.skip("the CPU kernels are not built (no compiler)")
    path = Path(__file__).resolve().parents[1] / "fixtures" / "llamacpp" / name
    folder = resolve_model_path(str(path))
    ours = iter_gguf_weights(folder, torch.float32, quantized=False, kernels=kernels)
    theirs = dict(iter_gguf_weights(folder, torch.float32, quantized=False))
    seen = 0
    for weight_name, values in ours:
        assert torch.equal(values, theirs.pop(weight_name)), weight_name
        seen += 1
    assert seen > 10 and not theirs
