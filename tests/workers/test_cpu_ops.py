"""The fused bf16 CPU kernels (vserve/cpu_ops/decode.cpp) against the torch code they replace.

Elementwise kernels (rotary, activations) round where the eager ops round and must be bitwise
equal; kernels with reductions (norms, attention, gemv) accumulate in fp32 in their own order
and may differ in the last bf16 bit, never more. End to end: the fused one-call-per-layer decode is
bitwise the per-op path with the same kernels, and the kernel path generates the eager path's
greedy tokens.
"""

import functools
import shutil

import pytest
import torch
import torch.nn.functional as F

from tests.support.engines import greedy_with_logprobs, make_llm
from vserve import cpu_ops
from vserve.attention.base import AttentionLayerSpec
from vserve.attention.torch_backend import _attend_matmul, _gather_blocks, _visible
from vserve.models import loader
from vserve.models.fused_decode import FusedDecode
from vserve.models.layers import _rotate
from vserve.models.loader import load_model
from vserve.models.packed_linear import can_pack
from vserve.models.stage import StageInfo

BF = torch.bfloat16
needs_compiler = pytest.mark.skipif(
    shutil.which("c++") is None and shutil.which("g++") is None,
    reason="no C++ compiler: the eager path runs instead",
)
needs_packing = pytest.mark.skipif(
    not can_pack(torch.device("cpu"), BF), reason="no native bf16 on this CPU: no packed linears"
)
pytestmark = needs_compiler


@pytest.fixture(scope="module")
def ops():
    module = cpu_ops.load()
    assert module is not None, "the CPU kernels failed to build (see the log)"
    return module


def _one_ulp_close(
    out: torch.Tensor, ref: torch.Tensor, max_diff_frac: float = 0.02, atol: float = 1e-6
) -> None:
    """Equal up to one bf16 rounding step, and equal for all but a few elements."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    torch.testing.assert_close(out.float(), ref.float(), rtol=2**-7, atol=atol)
    assert (out != ref).sum().item() <= max_diff_frac * out.numel()


@pytest.mark.parametrize("shape", [(1, 640), (7, 64), (3, 4, 256), (2, 1, 48)])
def test_rms_norm_gemma_and_llama_styles(ops, shape):
    torch.manual_seed(0)
    x = (torch.randn(shape) * 3).to(BF)
    n = shape[-1]
    scale = 1 + torch.randn(n) * 0.2  # Gemma: fp32 (1 + w)
    ref = F.rms_norm(x.float(), (n,), scale, 1e-6).type_as(x)
    _one_ulp_close(ops.rms_norm(x, scale, 1, 1e-6), ref)
    weight = (1 + torch.randn(n) * 0.2).to(BF)  # Llama: bf16 weight
    ref = weight * F.rms_norm(x.float(), (n,), None, 1e-5).to(BF)
    _one_ulp_close(ops.rms_norm(x, weight, 0, 1e-5), ref)


def test_rms_norm_reads_heads_of_a_fused_projection_in_place(ops):
    torch.manual_seed(1)
    qkv = torch.randn(5, 4 * 32 + 2 * 2 * 32).to(BF)
    q = qkv[:, :128].view(5, 4, 32)  # token stride 256, not 128
    scale = 1 + torch.randn(32) * 0.1
    ref = F.rms_norm(q.float(), (32,), scale, 1e-6).type_as(q)
    out = ops.rms_norm(q, scale, 1, 1e-6)
    assert out.is_contiguous()
    _one_ulp_close(out, ref)


def test_rms_norm_rejects_wrong_inputs(ops):
    with pytest.raises(RuntimeError, match="dtype"):
        ops.rms_norm(torch.randn(2, 8).to(BF), torch.ones(8, dtype=BF), 1, 1e-6)
    with pytest.raises(RuntimeError, match="bf16"):
        ops.rms_norm(torch.randn(2, 8), torch.ones(8), 1, 1e-6)


@pytest.mark.parametrize("rot", [32, 16])  # full and partial rotary
def test_rotary_is_bitwise_the_eager_rotation(ops, rot):
    torch.manual_seed(2)
    t, h, d = 6, 4, 32
    qkv = torch.randn(t, (h + 4) * d).to(BF)
    q = qkv[:, : h * d].view(t, h, d)  # strided view, as the model has
    cos, sin = torch.randn(t, 1, rot).to(BF), torch.randn(t, 1, rot).to(BF)
    assert torch.equal(ops.rotary(q, cos, sin), _rotate(q, cos, sin))


@pytest.mark.parametrize("act,fn", [(0, F.silu), (1, lambda g: F.gelu(g, approximate="tanh"))])
def test_act_mul_is_bitwise_the_eager_activation(ops, act, fn):
    torch.manual_seed(3)
    gate_up = (torch.randn(5, 2 * 96) * 2).to(BF)
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(ops.act_mul(gate_up, act), fn(gate) * up)


def _decode_case(dtype, heads, kv_heads, d, window, softcap, seq_lens, seed):
    """A paged cache, block tables and queries in `dtype`, the kernel's output, and the
    gathered two-matmul path's output on the same inputs."""
    torch.manual_seed(seed)
    block, num_blocks, nb = 16, 40, -(-max(seq_lens) // 16)
    k_cache = torch.randn(num_blocks, block, kv_heads, d).to(dtype)
    v_cache = torch.randn(num_blocks, block, kv_heads, d).to(dtype)
    seq_lens = torch.tensor(seq_lens)
    tables = torch.randperm(num_blocks)[: len(seq_lens) * nb].view(-1, nb).to(torch.int32)
    q = torch.randn(len(seq_lens), heads, d).to(dtype)
    spec = AttentionLayerSpec(heads, kv_heads, d, d**-0.5, window, softcap)
    k, v = _gather_blocks(k_cache, tables.long()), _gather_blocks(v_cache, tables.long())
    hidden = ~_visible(seq_lens.view(-1, 1, 1, 1) - 1, torch.arange(nb * block), window)
    ref = _attend_matmul(
        q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2), hidden, spec
    ).squeeze(2)
    out = cpu_ops.load().decode_attention(
        q, k_cache, v_cache, tables, seq_lens, window or -1, spec.scale, softcap or 0.0
    )
    return out, ref, (q, k_cache, v_cache, tables, seq_lens)


@pytest.mark.parametrize("heads,kv_heads", [(4, 1), (4, 2), (2, 2)])
@pytest.mark.parametrize("window,softcap", [(None, None), (9, None), (None, 20.0)])
def test_decode_attention_matches_the_gathered_two_matmul_path(
    ops, heads, kv_heads, window, softcap
):
    # block edges and a full table
    out, ref, (_, _, v_cache, _, _) = _decode_case(
        BF, heads, kv_heads, 64, window, softcap, [1, 16, 17, 80, 43], seed=4
    )
    # a probability that rounds the other way moves a sum of values near zero by one of its
    # bf16 steps (<= 2^-8 of a value), so the absolute tolerance is on that scale
    _one_ulp_close(out, ref, max_diff_frac=0.05, atol=2**-8 * v_cache.abs().max().item())


@pytest.mark.parametrize("heads,kv_heads,d", [(4, 2, 16), (4, 1, 256), (8, 2, 24), (2, 2, 64)])
@pytest.mark.parametrize("window,softcap", [(None, None), (9, None), (None, 20.0)])
def test_fp32_decode_attention_matches_the_gathered_two_matmul_path(
    ops, heads, kv_heads, d, window, softcap
):
    """fp32 models use this kernel alone: it equals the eager fp32 path up to the order of its
    fp32 sums, for head dims on (16, 256, 64) and off (24) the 16-lane path."""
    out, ref, (q, k_cache, v_cache, tables, seq_lens) = _decode_case(
        torch.float32, heads, kv_heads, d, window, softcap, [1, 16, 17, 80, 43, 96], seed=5
    )
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="caches must have q's dtype"):
        ops.decode_attention(q, k_cache.to(BF), v_cache.to(BF), tables, seq_lens, -1, 0.2, 0.0)


@pytest.mark.parametrize("dtype", [BF, torch.float32])
@pytest.mark.parametrize("window,softcap", [(None, None), (40, 20.0)])
def test_decode_attention_split_across_threads_is_bitwise_one_thread(ops, dtype, window, softcap):
    """One row and one KV head (batch-1 decode of Gemma 3): fewer items than threads, so the
    kernel splits the positions and the value sums across threads; the result is bitwise
    the one-thread kernel's, and the gathered path's as before."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one, ref, args = _decode_case(dtype, 4, 1, 256, window, softcap, [200], seed=6)
        torch.set_num_threads(2)
        q, k_cache, v_cache, tables, seq_lens = args
        split = ops.decode_attention(
            q, k_cache, v_cache, tables, seq_lens, window or -1, 256**-0.5, softcap or 0.0
        )
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(split, one)
    if dtype == torch.float32:
        torch.testing.assert_close(split, ref, rtol=1e-5, atol=1e-5)


def test_fp32_models_take_only_the_decode_attention_kernel(tiny_model_dir):
    """An fp32 CPU model keeps its eager ops (no fused layers, no packed linears) and its
    attention backend reads the paged cache through the kernel on decode steps."""
    from vserve.attention.torch_backend import TorchAttentionBackend

    assert cpu_ops.attention_kernel(torch.device("cpu"), torch.float32) is not None
    assert cpu_ops.attention_kernel(torch.device("cpu"), BF) is None  # bf16: the model's own
    assert cpu_ops.attention_kernel(torch.device("meta"), torch.float32) is None
    llm = make_llm(tiny_model_dir("llama"), dtype="float32", max_model_len=128)
    runner = llm.engine.client.core.executor.worker.runner
    assert isinstance(runner.backend, TorchAttentionBackend)
    assert runner.backend.kernel is not None
    assert runner.model.kernel is None and runner.model.fused is None
    llm.shutdown()


def test_decode_attention_reads_sliced_int64_block_tables(ops):
    torch.manual_seed(7)
    k_cache = torch.randn(12, 4, 1, 32).to(BF)
    v_cache = torch.randn(12, 4, 1, 32).to(BF)
    big = torch.randperm(12).view(2, 6)  # int64, rows 6 apart
    tables, seq_lens = big[:, :3], torch.tensor([9, 12])  # a non-contiguous slice
    q = torch.randn(2, 2, 32).to(BF)
    want = ops.decode_attention(
        q, k_cache, v_cache, tables.contiguous().to(torch.int32), seq_lens, -1, 0.2, 0.0
    )
    assert torch.equal(
        ops.decode_attention(q, k_cache, v_cache, tables, seq_lens, -1, 0.2, 0.0), want
    )
    with pytest.raises(RuntimeError, match="longer than its block table"):
        ops.decode_attention(q, k_cache, v_cache, tables, torch.tensor([9, 13]), -1, 0.2, 0.0)
    with pytest.raises(RuntimeError, match="one block-table row"):
        ops.decode_attention(q, k_cache, v_cache, tables[:1], seq_lens, -1, 0.2, 0.0)
    with pytest.raises(RuntimeError, match="rot <= head dim"):
        ops.rotary(q, torch.ones(2, 1, 64, dtype=BF), torch.ones(2, 1, 64, dtype=BF))


@pytest.mark.parametrize("k", [64, 640, 100])  # 100: a tail past the lanes
def test_gemv_rounds_the_exact_product_once(ops, k):
    torch.manual_seed(5)
    x, w, bias = torch.randn(1, k).to(BF), torch.randn(300, k).to(BF), torch.randn(300).to(BF)
    for b in (None, bias):
        exact = x.double() @ w.double().T + (0 if b is None else b.double())
        out = ops.gemv(x, w, b)
        assert out.dtype == BF and out.shape == (1, 300)
        # fp32 accumulation then one rounding: within one bf16 step of the exact result
        torch.testing.assert_close(out.double(), exact, rtol=2**-7, atol=1e-3)
        # a sum that cancels to near 0 may round two steps apart in two fp32 orders (AMX's
        # F.linear: 3.3e-4 against 3.26e-4 at k = 640): absolute slack far below the terms
        _one_ulp_close(out, F.linear(x, w, b), max_diff_frac=0.05, atol=1e-4)
    with pytest.raises(RuntimeError, match=r"\[1, K\]"):
        ops.gemv(torch.randn(2, k).to(BF), w, None)


@needs_packing
def test_linear_takes_gemv_for_one_row_and_onednn_otherwise(ops):
    torch.manual_seed(6)
    w, bias = torch.randn(96, 64).to(BF), torch.randn(96).to(BF)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 1)
    one = torch.randn(1, 64).to(BF)
    assert torch.equal(ops.linear(one, packed, w, bias), ops.gemv(one, w, bias))
    _one_ulp_close(ops.linear(one, packed, w, bias), F.linear(one, w, bias), max_diff_frac=0.05)
    for x in (torch.randn(2, 64).to(BF), torch.randn(17, 64).to(BF), torch.randn(1, 3, 64).to(BF)):
        want = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
        assert torch.equal(ops.linear(x, packed, w, bias), want)  # oneDNN, bitwise


def test_build_failure_falls_back_to_eager(monkeypatch, caplog):
    monkeypatch.setattr(cpu_ops, "_state", {})
    monkeypatch.setattr(cpu_ops, "_build", lambda: (_ for _ in ()).throw(OSError("no cc")))
    assert cpu_ops.load() is None
    assert "no cc" in caplog.text
    monkeypatch.setattr(cpu_ops, "_state", {})
    monkeypatch.setenv("VSERVE_CPU_OPS", "0")
    assert cpu_ops.load() is None


# -- end to end ---------------------------------------------------------------------------------
PROMPTS = [[5, 17, 99, 3, 42, 7], [8] * 20, list(range(30, 60))]


def _generate(model_dir, prompts, fused=True, batch=True, max_tokens=24, **engine):
    llm = make_llm(model_dir, dtype="bfloat16", max_model_len=128, **engine)
    kernel = None
    if not engine.get("multiprocess"):  # in-process runner: inspect and switch the path
        model = llm.engine.client.core.executor.worker.runner.model
        kernel = model.kernel
        if not fused:
            model.fused = None
    result = greedy_with_logprobs(llm, prompts, max_tokens, one_at_a_time=not batch)
    llm.shutdown()
    return kernel, result


@functools.lru_cache(maxsize=None)
def _fused_one_at_a_time(model_dir: str):
    """The default path (kernels, fused decode) on PROMPTS one request at a time, run once
    per model for the two tests that compare it: whether the kernels loaded, how many
    decode steps took the fused call, and the greedy ids and top-3 logprobs."""
    calls = []
    run = FusedDecode.run
    FusedDecode.run = lambda self, *a: calls.append(1) or run(self, *a)
    try:
        kernel, result = _generate(model_dir, PROMPTS, batch=False)
    finally:
        FusedDecode.run = run
    return kernel is not None, len(calls), result


@needs_packing
@pytest.mark.parametrize("kind", ["llama", "qwen3", "gemma3", "mistral", "phi3", "gemma2"])
def test_fused_decode_is_bitwise_the_per_op_kernel_path(kind, tiny_model_dir, monkeypatch):
    # one request at a time: every decode step has one row, the gemv row count
    kernel, fused_steps, fused = _fused_one_at_a_time(tiny_model_dir(kind))
    assert kernel and fused_steps == len(PROMPTS) * 23  # every decode step
    calls = []
    run = FusedDecode.run
    monkeypatch.setattr(FusedDecode, "run", lambda self, *a: calls.append(1) or run(self, *a))
    _, per_op = _generate(tiny_model_dir(kind), PROMPTS, fused=False, batch=False)
    assert calls == []
    assert fused == per_op  # token ids and every top-3 logprob, exactly
    _, fused_b = _generate(tiny_model_dir(kind), PROMPTS)
    _, per_op_b = _generate(tiny_model_dir(kind), PROMPTS, fused=False)
    assert fused_b == per_op_b


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_fused_decode_on_quantized_weights_is_bitwise_the_per_op_path(
    kind, tiny_model_dir, monkeypatch
):
    """decoder_layer_q (GGUF blocks: here Q8_0 made at load) against QuantLinear's own calls."""
    calls = []
    run = FusedDecode.run
    monkeypatch.setattr(FusedDecode, "run", lambda self, *a: calls.append(1) or run(self, *a))
    path = tiny_model_dir(kind)
    kernel, fused = _generate(path, PROMPTS, batch=False, quantization="int8")
    assert kernel is not None and len(calls) == len(PROMPTS) * 23
    _, per_op = _generate(path, PROMPTS, fused=False, batch=False, quantization="int8")
    assert fused == per_op
    _, fused_b = _generate(path, PROMPTS, quantization="int8")
    _, per_op_b = _generate(path, PROMPTS, fused=False, quantization="int8")
    assert fused_b == per_op_b
    llm = make_llm(path, dtype="bfloat16", max_model_len=128, quantization="int8")
    try:
        fused = llm.engine.client.core.executor.worker.runner.model.fused
        assert fused.layers and all(f.quantized for f in fused.layers)
        assert fused.stack is not None  # the fused runs above took the one-call stack
    finally:
        llm.shutdown()


@needs_packing
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "gemma3", "mistral"])
def test_kernels_generate_the_eager_greedy_tokens(kind, tiny_model_dir, monkeypatch):
    kernel, _, with_kernels = _fused_one_at_a_time(tiny_model_dir(kind))
    monkeypatch.setattr(loader.cpu_ops, "load", lambda: None)
    no_kernel, eager = _generate(tiny_model_dir(kind), PROMPTS, batch=False)
    assert kernel and no_kernel is None
    for (ids_k, lps_k), (ids_e, lps_e) in zip(with_kernels, eager):
        assert ids_k == ids_e
        # bf16 rounding differences only: measured at most 0.06 (qwen2), 0.03 (llama) and
        # 0.004 (gemma3) over these 72 tokens; the runner-up tokens may swap on near ties
        for token, a, b in zip(ids_k, lps_k, lps_e):
            assert abs(a[token] - b[token]) < 0.1


@needs_packing
@pytest.mark.parametrize("kind", ["gemma3", "llama"])
def test_fused_plan_of_each_pipeline_stage(kind, tiny_model_dir):
    from transformers import AutoConfig

    path = tiny_model_dir(kind)
    hf_config = AutoConfig.from_pretrained(path)
    n = hf_config.num_hidden_layers
    for rank in (0, 1):
        stage = StageInfo.split(n, 2, rank)
        model = load_model(path, hf_config, stage, BF, torch.device("cpu"), 128)
        assert [f.layer_idx for f in model.fused.layers] == list(
            range(stage.start_layer, stage.end_layer)
        )
        head = getattr(model, "lm_head", None)
        if head is not None and getattr(model, "tie", False) and stage.is_first:
            assert head.plain is model.model.embed_tokens.weight  # no second copy


@needs_packing
@pytest.mark.parametrize("quantization", ["none", pytest.param("int8", marks=pytest.mark.slow)])
def test_pipeline_parallel_with_kernels_is_bitwise_one_stage(tiny_model_dir, quantization):
    """int8: each stage quantizes its own layers; the last one its tied head from the table.
    The one-stage run takes the kernels, and kernels and eager ops differ in the last bits of
    the logprobs: stages that fell back to eager do not match it."""
    path = tiny_model_dir("gemma3")
    kernel, one = _generate(path, PROMPTS, batch=False, max_tokens=12, quantization=quantization)
    assert kernel is not None
    _, two = _generate(
        path,
        PROMPTS,
        batch=False,
        max_tokens=12,
        multiprocess=True,
        distributed_executor_backend="mp",
        pipeline_parallel_size=2,
        quantization=quantization,
    )
    assert one == two


class _StandInComm:
    """Rank 0's view of a TP group of 2 whose other rank adds x + 1 to every sum: a fixed
    function that a missed all-reduce, a bias added before it or a norm applied before it
    does not reproduce. The logits' all-gather repeats this rank's half."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 + 1

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, x], dim=-1)


TP_CASES = {  # biases on o and down (added after the sum), one KV head for 2 ranks
    "llama-biases-kv1": ("llama", dict(attention_bias=True, mlp_bias=True, num_key_value_heads=1)),
    "gemma3": ("gemma3", {}),  # post-attention / post-feedforward norms after the sum
    # GGUF blocks (decoder_layer_q), o's bias random (tests/support/tiny_gguf.py)
    "gemma3-gguf-biases-kv1": ("gemma3-gguf", dict(attention_bias=True, num_key_value_heads=1)),
}


@pytest.mark.slow  # four in-process engines per case (about 15 s)
@needs_packing
@pytest.mark.parametrize("case", list(TP_CASES))
def test_fused_decode_on_a_tp_shard_is_bitwise_the_per_op_path(
    case, tiny_model_dir, tiny_gguf_dir, monkeypatch
):
    """One rank's shard of a TP=2 model, in process, its comm a stand-in: the fused layers
    call the all-reduce where RowParallelLinear does and add the biases after it."""
    from vserve.distributed.tp_comm import TPShard
    from workers.model_runner import ModelRunner

    load = ModelRunner.load_model

    def load_shard(self) -> None:
        self.tp = TPShard(0, 2, _StandInComm())  # type: ignore[arg-type]
        load(self)

    monkeypatch.setattr(ModelRunner, "load_model", load_shard)
    calls = []
    run = FusedDecode.run
    monkeypatch.setattr(FusedDecode, "run", lambda self, *a: calls.append(1) or run(self, *a))
    kind, overrides = TP_CASES[case]
    if kind.endswith("-gguf"):
        path = tiny_gguf_dir(kind.removesuffix("-gguf"), **overrides)
    else:
        path = tiny_model_dir(kind, **overrides)
    _, fused = _generate(path, PROMPTS, batch=False, max_tokens=12)
    assert len(calls) == len(PROMPTS) * 11  # every decode step ran fused
    _, per_op = _generate(path, PROMPTS, fused=False, batch=False, max_tokens=12)
    assert fused == per_op
    _, fused_b = _generate(path, PROMPTS, max_tokens=12)
    _, per_op_b = _generate(path, PROMPTS, fused=False, max_tokens=12)
    assert fused_b == per_op_b


@needs_packing
def test_fused_plan_of_each_tp_rank(tiny_model_dir):
    """Each rank plans its own shard: 2 of the 4 query heads, the one KV head replicated,
    the MLP's half, and the TP group's all-reduce."""
    from transformers import AutoConfig

    from vserve.distributed.tp_comm import TPShard

    path = tiny_model_dir("llama", num_key_value_heads=1)
    hf_config = AutoConfig.from_pretrained(path)
    stage = StageInfo.split(hf_config.num_hidden_layers, 1, 0)
    for rank in (0, 1):
        comm = _StandInComm()
        tp = TPShard(rank, 2, comm)  # type: ignore[arg-type]
        model = load_model(path, hf_config, stage, BF, torch.device("cpu"), 128, tp=tp)
        assert model.fused is not None and model.fused.all_reduce == comm.all_reduce
        assert model.fused.stack is None
        for f in model.fused.layers:
            assert (f.consts.num_heads, f.consts.num_kv_heads) == (2, 1)
            assert f.plain[2].shape[0] == hf_config.intermediate_size  # gate and up halves
            assert f.plain[3].shape[1] == hf_config.intermediate_size // 2
