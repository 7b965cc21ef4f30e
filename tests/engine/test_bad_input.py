"""Bad input raises ValueError with a useful message and never reaches the engine."""

import pytest

from tests.support.engines import make_llm
from vserve import LLM, SamplingParams, StructuredOutputsParams


def _so(**kw) -> StructuredOutputsParams:
    return StructuredOutputsParams(**kw)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return make_llm(tiny_model_dir("qwen2"), max_model_len=64)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(temperature=-0.5), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(min_p=2.0), "min_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(n=0), "n must"),
        (dict(n=2, temperature=0), "n > 1"),
        (dict(presence_penalty=3.0), "presence_penalty"),
        (dict(frequency_penalty=-3.0), "frequency_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(min_tokens=5, max_tokens=2), "min_tokens"),
        (dict(logprobs=-1), "logprobs"),
        (dict(stop=[""]), "stop"),
        (dict(seed=2**70), "seed"),
        # beyond 64 bits: msgpack and torch cannot carry them (a worker crash before)
        (dict(top_k=2**63), "top_k"),
        (dict(top_k=2**70), "top_k"),
        (dict(n=2**64), "n must"),
        (dict(max_tokens=2**70), "max_tokens"),
        (dict(min_tokens=2**64), "min_tokens"),
        (dict(stop_token_ids=[2**64]), "stop_token_ids"),
        (dict(logit_bias={2**64: 1.0}), "logit_bias keys"),
        (dict(logit_bias={"1.5": 1.0}), "logit_bias keys"),
        (dict(logit_bias={7: float("nan")}), "logit_bias values"),
        (dict(logit_bias={7: float("inf")}), "logit_bias values"),
        (dict(logit_bias={7: 2**2000}), "logit_bias values"),
        (dict(logit_bias=[7]), "logit_bias must be a dict"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(temperature=2**2000), "temperature"),
        (dict(repetition_penalty=float("inf")), "repetition_penalty"),
        # finite in float64, not in the sampler's float32: inf or 0 there, then NaN logits
        (dict(temperature=1e39), "temperature"),
        (dict(repetition_penalty=1e-46), "repetition_penalty"),
        (dict(repetition_penalty=1e5), "repetition_penalty"),
        # wrong types that msgspec would find only in the engine core
        (dict(stop=5), "stop must be"),
        (dict(stop_token_ids=7), "stop_token_ids must be a list"),
        (dict(ignore_eos=1), "ignore_eos must be a boolean"),
        (dict(structured_outputs={"regex": "a"}), "structured_outputs must be"),
    ],
)
def test_invalid_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_schema_text_nested_too_deeply_is_a_value_error():
    """Python's parser gives up on deep nesting with RecursionError: it must read as bad
    input (a 400), not as a failure of the server."""
    with pytest.raises(ValueError, match="nested too deeply"):
        StructuredOutputsParams(json="[" * 50_000 + "]" * 50_000)


@pytest.mark.parametrize(
    "prompt, params, match",
    [
        ("", None, "empty"),
        ({"prompt_token_ids": []}, None, "non-empty"),
        ({"prompt_token_ids": [1, 10**6]}, None, "out of vocabulary"),
        ({"prompt_token_ids": [1, -3]}, None, "out of vocabulary"),
        ({"prompt_token_ids": list(range(2, 70))}, None, "maximum context length is 64"),
        ("a prompt", SamplingParams(logit_bias={10**6: 1.0}), "out of vocabulary"),
        ("a prompt", SamplingParams(stop_token_ids=[10**6]), "out of vocabulary"),
        ("a prompt", SamplingParams(logprobs=50), "max_logprobs"),
        (12.5, None, "unsupported prompt"),
        ("ab\ud800cd", None, "lone surrogate"),
        ({"prompt_token_ids": [1, True]}, None, "out of vocabulary"),
        ("a prompt", SamplingParams(structured_outputs=_so(regex="a" * 300_000)), "characters"),
        ({"foo": 1}, None, "prompt_token_ids"),
    ],
)
def test_bad_requests_raise_and_engine_stays_usable(llm, prompt, params, match):
    with pytest.raises(ValueError, match=match):
        llm.generate([prompt, "fine prompt"], params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate("still works", SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_params_changed_after_construction_raise(llm):
    """msgspec checks nothing on assignment; the engine core re-runs the checks when it
    decodes, so the front end does it first (before, the engine's input thread died)."""
    for name, value, match in (
        ("top_p", 0.0, "top_p"),
        ("top_k", 2**64, "serialize"),
        ("temperature", "hot", "temperature"),
    ):
        params = SamplingParams(max_tokens=3)
        setattr(params, name, value)
        with pytest.raises(ValueError, match=match):
            llm.generate("a prompt", params, use_tqdm=False)
        assert not llm.engine.has_unfinished_requests()
    out = llm.generate("still works", SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_top_k_at_or_above_vocab_means_off(llm):
    """As in vLLM: top_k >= vocabulary size keeps every token, the same as top_k=0."""
    vocab = llm.engine.config.model.vocab_size
    outs = [
        llm.generate(
            "seeded prompt",
            SamplingParams(max_tokens=8, temperature=1.0, seed=7, top_k=k),
            use_tqdm=False,
        )[0]
        .outputs[0]
        .token_ids
        for k in (0, vocab, 2**63 - 1)
    ]
    assert outs[0] == outs[1] == outs[2] and len(outs[0]) == 8


def test_params_list_length_mismatch(llm):
    with pytest.raises(ValueError, match="sampling params"):
        llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)


def test_chat_without_messages(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.chat([], use_tqdm=False)


def test_unknown_model_path():
    with pytest.raises(ValueError, match="not found"):
        LLM("/nonexistent/model", multiprocess=False)


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(
        '{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 10}'
    )
    with pytest.raises(ValueError, match="unsupported model architecture"):
        LLM(str(tmp_path), multiprocess=False)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(dtype="int8"), "dtype"),
        (dict(max_model_len=10**7), "max_model_len"),
        (dict(block_size=3), "block_size"),
        (dict(max_num_seqs=0), "max_num_seqs"),
        # 10**23 stages: the partition's table took every byte of memory (the OOM killer)
        (dict(pipeline_parallel_size=10**23), r"pipeline_parallel_size must be in \[1, 5\]"),
        (dict(pipeline_parallel_size=6), "pipeline_parallel_size must be in"),
        (dict(master_port=70000), "master_port must be a TCP port"),
        (dict(bogus_arg=1), "unknown engine argument"),
        (dict(num_gpu_blocks_override=2, block_size=4), "KV cache holds 2 blocks"),
    ],
)
def test_bad_engine_args(tiny_model_dir, kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_llm(tiny_model_dir("qwen2"), max_model_len=kwargs.pop("max_model_len", 64), **kwargs)


def test_tensor_parallel_gguf_blocks_must_split_whole(tiny_gguf_dir, tiny_model_dir):
    """Under TP, o and down split their inputs over the ranks, in whole blocks of their GGUF
    format: a shape that does not split so is refused up front, naming the tensor and the
    block size. int8 blocks are made from each rank's own slice: always accepted."""
    from vserve.engine.arg_utils import EngineArgs

    def config(model, **kwargs):
        return EngineArgs(model=model, dtype="float32", **kwargs).create_engine_config()

    narrow = tiny_gguf_dir("qwen3", head_dim=16)  # o_proj: 64 inputs in Q4_0 (blocks of 32)
    assert config(narrow, tensor_parallel_size=2).model.quantization == "gguf"
    message = (
        r"tensor_parallel_size 4 cannot split model\.layers\.0\.self_attn\.o_proj\.weight "
        r"\(model\.layers\.0\.self_attn\.o_proj\.weight, Q4_0, 64 inputs\) by whole blocks of "
        r"32 inputs \(16 per rank\)"
    )
    with pytest.raises(ValueError, match=message):
        config(narrow, tensor_parallel_size=4)
    assert config(narrow, tensor_parallel_size=4, quantization="none").parallel.world_size == 4
    int8 = config(tiny_model_dir("qwen3"), tensor_parallel_size=2, quantization="int8")
    assert int8.model.quantization == "int8"
