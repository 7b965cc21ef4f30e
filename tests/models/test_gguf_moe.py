"""Mixture-of-experts GGUF files made by llama.cpp (tests/fixtures/llamacpp): Qwen3-MoE,
Qwen2-MoE, Mixtral (`llama` with experts, its q/k rows permuted) and OLMoE, their experts
stacked in 3-D tensors. The config comes from the file's keys, the
experts stay in their blocks and a decode step runs only the routed ones; the model on its
blocks is the same file dequantized, and with fp32 weights vserve's greedy ids are
llama.cpp's own (recorded by the fixture script from `llama-server`)."""

from __future__ import annotations

import pytest
import torch

from tests.support.llamacpp_files import (
    ENGINE,
    PROMPTS,
    fixture,
    greedy_and_logprobs,
    greedy_of_recorded_prompts,
    make_llm,
    runner_model,
    worst_difference,
)

KINDS = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"]


@pytest.mark.parametrize("kind", KINDS)
def test_config_is_the_files(kind):
    """transformers' GGUF mapping leaves the experts' size at its default (768) and reads a
    Mixtral file as a dense Llama: the file's keys set the experts, and Qwen3-MoE renormalizes
    its top k as llama.cpp does."""
    from transformers import AutoConfig

    from vserve.models.resolve import resolve_model_path

    cfg = AutoConfig.from_pretrained(resolve_model_path(str(fixture(f"tiny-{kind}-q4_k_m.gguf"))))
    assert cfg.model_type == kind
    if kind == "olmoe":  # a family transformers' GGUF reader does not know (gguf_config)
        experts = (cfg.num_experts, cfg.num_experts_per_tok, cfg.intermediate_size)
        assert experts == (4, 2, 256) and not cfg.norm_topk_prob
        return
    if kind == "mixtral":  # each expert's size is the file's feed_forward_length
        experts = (cfg.num_local_experts, cfg.num_experts_per_tok, cfg.intermediate_size)
        assert experts == (4, 2, 256)
        return
    assert (cfg.num_experts, cfg.num_experts_per_tok) == (4, 2)
    assert cfg.moe_intermediate_size == 256
    if kind == "qwen3_moe":
        assert cfg.norm_topk_prob is True
    else:
        assert cfg.shared_expert_intermediate_size == 256


def _run(path, quantization: str):
    from vserve.models.quant_linear import QuantLinear

    llm = make_llm(path, quantization)
    experts = [m for m in runner_model(llm).modules() if type(m).__name__ == "Experts"]
    on_blocks = [e.q13 is not None and isinstance(e.q13[0], QuantLinear) for e in experts]
    assert on_blocks == [quantization == "gguf"] * 2
    return greedy_and_logprobs(llm)


@pytest.mark.parametrize("kind", KINDS)
def test_experts_on_their_blocks_are_the_dequantized_model(kind):
    """The same greedy ids, and prompt logprobs within fp32's summation order (the K-quant
    kernels run the exact path at these batch sizes in fp32)."""
    path = fixture(f"tiny-{kind}-q4_k_m.gguf")
    ids, lps = _run(path, "gguf")
    ref_ids, ref_lps = _run(path, "none")
    assert ids == ref_ids
    assert worst_difference(lps, ref_lps) < 1e-4


@pytest.mark.parametrize("kind", KINDS)
def test_fp32_greedy_equals_llamacpp(kind):
    """llama.cpp's own greedy continuation of each prompt (token ids in and out, fp32 weights
    and KV cache): the same ids, so routing, renormalization and the shared expert's gate are
    llama.cpp's."""
    ours, llamacpp = greedy_of_recorded_prompts(f"tiny-{kind}-f32.gguf")
    assert ours == llamacpp


def test_a_token_runs_only_its_routed_experts():
    """One token through a sparse layer: the quantized linears of its top-k experts run, no
    other expert's (a decode step reads k of E experts' blocks)."""
    llm = make_llm(fixture("tiny-qwen3_moe-q4_k_m.gguf"))
    try:
        layer = runner_model(llm).model.layers[0]
        moe = layer.mlp
        ran: list[int] = []
        for e, (q13, q2) in enumerate(zip(moe.experts.q13, moe.experts.q2, strict=True)):
            for linear in (q13, q2):
                linear.register_forward_hook(lambda *_, e=e: ran.append(e))
        torch.manual_seed(0)
        for _ in range(8):
            x = torch.randn(1, moe.experts.q13[0].in_features)
            routed = torch.topk(moe.gate(x), moe.spec.top_k, dim=-1).indices[0].tolist()
            ran.clear()
            moe(x)
            assert sorted(ran) == sorted(routed * 2)
    finally:
        llm.shutdown()


def test_tensor_parallel_checks_the_experts_blocks():
    """Each rank takes half of every expert's 256 intermediate rows, so the down projection's
    inputs would cut Q4_K's blocks of 256: the start-up check names the experts' weight (this
    file's o_proj is refused first, for the same reason)."""
    from vserve.models.gguf_source import check_tp_blocks
    from vserve.models.resolve import resolve_model_path

    folder = resolve_model_path(str(fixture("tiny-qwen3_moe-q4_k_m.gguf")))
    with pytest.raises(ValueError, match=r"o_proj.*whole blocks of 256"):
        make_llm(fixture("tiny-qwen3_moe-q4_k_m.gguf"), tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"experts\.down_proj.*whole blocks of 256"):
        check_tp_blocks(folder, 2, (".down_proj.weight",))
    check_tp_blocks(folder, 1, (".down_proj.weight",))


@pytest.mark.slow  # a pipeline of two worker processes
def test_pipeline_parallel_on_blocks_equals_one_stage():
    from vserve import LLM, SamplingParams

    path = fixture("tiny-qwen3_moe-q4_k_m.gguf")
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    got = []
    for kw in (ENGINE, dict(max_model_len=256, pipeline_parallel_size=2)):
        llm = LLM(str(path), quantization="gguf", dtype="float32", **kw)
        try:
            got.append([o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False)])
        finally:
            llm.shutdown()
    assert got[0] == got[1]
