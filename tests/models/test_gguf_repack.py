"""GGUF types the kernels do not run, rewritten as Q8_0 at load (vserve/models/gguf_repack.py),
and files made by llama.cpp's own converter and quantizer (tests/fixtures/llamacpp).

Random blocks of each type: Q3_K and IQ4_NL become Q8_0 holding the same values (gguf's own
dequantization of both, bit for bit), IQ4_XS within the fp16 rounding of its 32-weight scales,
Q2_K within Q8_0's rounding. Each llama.cpp file: the types llama.cpp wrote, and the model on
its blocks against the same file dequantized (`quantization="none"`), fp32, and against
transformers reading the file itself.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from vserve.models.gguf_repack import REPACKED, to_q8_0

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "llamacpp"
# GGML type id: the offsets of its fp16 fields in a block
FP16_FIELDS = {11: [108], 20: [0], 23: [0], 10: [80, 82]}
PROMPTS = ["The quick brown fox jumps over the lazy dog", "Paris is the capital of France"]


def random_blocks(qtype: int, rows: int, k: int, seed: int = 0) -> np.ndarray:
    """Random bytes as blocks of `qtype`, their fp16 scales small and finite."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, k // block, size), dtype=np.uint8)
    for off in FP16_FIELDS[qtype]:
        half = (rng.standard_normal((rows, k // block)) * 0.01).astype(np.float16)
        raw[..., off : off + 2] = half.view(np.uint8).reshape(rows, k // block, 2)
    return raw.reshape(rows, -1)


def values(data: np.ndarray, qtype: int, k: int) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return dequantize(data, GGMLQuantizationType(qtype)).reshape(data.shape[0], k)


@pytest.mark.parametrize("qtype", list(REPACKED), ids=[v[0] for v in REPACKED.values()])
def test_repacked_as_q8_0_holds_the_values(qtype):
    rows, k = 48, 768
    data = random_blocks(qtype, rows, k)
    q8 = to_q8_0(data, qtype, k)
    assert q8.shape == (rows, k // 32 * 34) and q8.dtype == np.uint8
    got, ref = values(q8, 8, k), values(data, qtype, k)
    block_amax = np.abs(ref).reshape(rows, -1, 32).max(-1, keepdims=True)
    err = np.abs(got - ref).reshape(rows, -1, 32)
    name = REPACKED[qtype][0]
    if name in ("Q3_K", "IQ4_NL"):
        assert np.array_equal(got, ref)
    elif name == "IQ4_XS":  # the quants kept, each scale rounded to fp16
        assert (err <= block_amax * 2**-11).all() and (err > 0).any()
    else:  # Q2_K: Q8_0's own rounding, half a step of amax / 127, the step rounded to fp16
        assert (err <= block_amax * (1 / 254 + 2**-11)).all() and (err > 0).any()


def test_rows_are_repacked_in_chunks(monkeypatch):
    """Rows go through the dequantization a few at a time (a whole embedding's fp32 values
    would be GBs): any chunking gives the same bytes."""
    from vserve.models import gguf_repack

    for qtype in REPACKED:
        data = random_blocks(qtype, 13, 512, seed=5)
        whole = to_q8_0(data, qtype, 512)
        monkeypatch.setattr(gguf_repack, "_CHUNK_VALUES", 512 * 4)  # chunks of 4 rows
        assert np.array_equal(to_q8_0(data, qtype, 512), whole)
        monkeypatch.undo()


def test_q3_k_at_plus_128_d():
    """A Q3_K weight of d * (-32) * (-4) = 128 d (every scale and quant at its minimum) is one
    past int8's range: the block is written with scale -d and quants -128."""
    data = np.zeros((1, 110), dtype=np.uint8)
    data[0, 108:110] = np.array([0.5], dtype=np.float16).view(np.uint8)
    ref = values(data, 11, 256)
    assert (ref == 64.0).all()
    q8 = to_q8_0(data, 11, 256)
    assert np.array_equal(values(q8, 8, 256), ref)


def test_a_type_gguf_cannot_read_is_a_value_error():
    from vserve.models.gguf_source import TensorInfo, _dequantized

    info = TensorInfo("blk.0.ffn_up.weight", (256, 2), 9, 0)  # Q8_1: 36 bytes per 32
    with pytest.raises(ValueError, match="blk.0.ffn_up.weight has GGML type Q8_1"):
        _dequantized(np.zeros((2, 288), dtype=np.uint8), info)


def fixture(name: str) -> Path:
    path = FIXTURES / f"tiny-qwen2-{name}.gguf"
    assert path.is_file(), f"{path} is missing: tests/fixtures/llamacpp/make_fixtures.py"
    return path


# file: (the types llama.cpp wrote, bound on |logprob difference| to the dequantized model)
FILES = {
    "q3_k_m": ({"Q3_K", "Q4_K", "Q5_K", "Q6_K"}, 1e-4),  # exact values: fp32 sums' order
    "iq4_nl": ({"IQ4_NL", "Q6_K"}, 1e-4),
    "iq4_xs": ({"IQ4_XS", "Q6_K"}, 0.05),  # scales within 2^-11 (measured 0.019)
    "q2_k": ({"Q2_K", "Q3_K", "Q6_K"}, None),  # requantized: against bf16 weights, below
}


@pytest.mark.parametrize("name", list(FILES))
def test_llamacpp_files_hold_the_types(name):
    from vserve.models.gguf_source import read_tensor_table

    names = {8: "Q8_0", 10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}
    names |= {20: "IQ4_NL", 23: "IQ4_XS"}
    qtypes = {t.qtype for t in read_tensor_table(fixture(name)).tensors if t.qtype != 0}
    assert {names[q] for q in qtypes} == FILES[name][0]


def _run(path: Path, quantization: str, dtype: str = "float32"):
    from vserve import LLM, SamplingParams
    from vserve.models.quant_linear import QuantLinear

    llm = LLM(
        str(path),
        quantization=quantization,
        dtype=dtype,
        max_model_len=256,
        multiprocess=False,
        distributed_executor_backend="uni",
    )
    try:
        model = llm.engine.client.core.executor.worker.runner.model
        on_blocks = any(isinstance(m, QuantLinear) for m in model.modules())
        assert on_blocks == (quantization == "gguf")
        sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=0)
        outs = llm.generate(PROMPTS, sp, use_tqdm=False)
    finally:
        llm.shutdown()
    lps = [
        [e[t].logprob for e, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])] for o in outs
    ]
    return [list(o.outputs[0].token_ids) for o in outs], lps, [o.prompt_token_ids for o in outs]


def _worst(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FILES))
def test_llamacpp_file_on_its_blocks_is_the_dequantized_model(name):
    path = fixture(name)
    ids, lps, _ = _run(path, "gguf")
    ref_ids, ref_lps, _ = _run(path, "none")
    bound = FILES[name][1]
    if bound is not None:
        assert ids == ref_ids
        assert _worst(lps, ref_lps) < bound
        return
    # Q2_K as Q8_0 rounds within amax / 254 of each block of 32, bf16 dense weights within
    # 2^-9 of each weight (and bf16 activations): no further from fp32 than twice bf16's
    _, bf16_lps, _ = _run(path, "none", "bfloat16")
    assert _worst(lps, ref_lps) < 2 * _worst(bf16_lps, ref_lps)


def test_llamacpp_q3_k_m_greedy_equals_transformers_reading_the_file():
    """transformers dequantizes llama.cpp's file itself (gguf's code): the same greedy ids as
    vserve on the blocks (Q3_K as Q8_0, the K-quants native), fp32."""
    import torch
    from transformers import AutoModelForCausalLM

    path = fixture("q3_k_m")
    ids, _, prompts = _run(path, "gguf")
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    for prompt, ours in zip(prompts, ids):
        seq = list(prompt)
        with torch.no_grad():  # greedy past any end-of-text id, as ignore_eos does
            for _ in range(len(ours)):
                seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
        assert seq[len(prompt) :] == ours
