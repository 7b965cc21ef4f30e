"""Linear layers and embeddings on GGUF blocks (vserve/models/quant_linear.py): outputs equal
the dense layer on gguf's own dequantization, for one row (gemv) and many (matmul), for fused
projections whose parts have different formats, and Q8_0 blocks made at load equal gguf's.
Tensor parallel's slices of blocks (rows, whole blocks of inputs, padded vocabulary rows)
dequantize to exactly the slices of the whole weight's dequantization."""

import mmap
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from torch import nn

from tests.cpu_ops.test_quant_kernels import FORMATS, random_weight
from vserve import cpu_ops
from vserve.models import quant_linear
from vserve.models.gguf_source import QuantBlocks
from vserve.models.parallel_layers import _vocab_blocks
from vserve.models.quant_linear import (
    QuantEmbedding,
    QuantLinear,
    install,
    park_int8,
    quantize_q8_0,
)
from vserve.models.stage import FusedLinear
from vserve.models.weight_arena import arena_copy


@pytest.fixture(autouse=True)
def exact_kernels():
    """These tests check the layers' plumbing against dense math: the kernels' fp32 path
    (their int8-activation path has its own error bounds, tests/cpu_ops)."""
    q = cpu_ops.load_quant()
    if q is None:
        yield
        return
    loaded = q.options()
    q.set_options(exact=True)
    yield
    q.set_options(**loaded)


@pytest.fixture(scope="module")
def kernel():
    k = cpu_ops.load_quant()
    if k is None:
        pytest.skip("the quantized CPU kernels cannot be built here")
    return k


def _blocks(qtype: Q, n: int, k: int, seed: int) -> tuple[QuantBlocks, torch.Tensor]:
    rng = np.random.default_rng(seed)
    dense = rng.standard_normal((n, k)).astype(np.float32) * 0.1
    data = quantize(dense, qtype)
    deq = torch.from_numpy(dequantize(data, qtype).astype(np.float32))
    return QuantBlocks(int(qtype), torch.from_numpy(data), (n, k)), deq


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
def test_tp_slices_of_blocks_dequantize_to_the_slices(qtype):
    """Rows (column-parallel q/k/v, gate/up), inputs in whole blocks (row-parallel o, down:
    each of 2 ranks' half, and one block inside) and vocabulary rows padded with zero bytes
    (the last rank's embedding / lm_head): bitwise the slice of the whole dequantization. A
    range that cuts a block is refused."""
    n, k = 6, 1024  # 4 blocks of a K-quant, 32 of the others
    data = random_weight(qtype, n, k, seed=3)
    blocks = QuantBlocks(int(qtype), torch.from_numpy(data), (n, k))
    full = dequantize(data, qtype).reshape(n, k)
    block = blocks.block_size
    assert block == (256 if qtype.name.endswith("_K") else 32)

    def same(part: QuantBlocks, expected: np.ndarray) -> None:
        assert part.qtype == int(qtype) and part.data.shape[0] == part.shape[0]
        got = dequantize(part.data.numpy(), qtype).reshape(part.shape)
        assert got.shape == expected.shape
        assert np.array_equal(got.view(np.uint32), expected.view(np.uint32))  # -0.0 too

    same(blocks.rows(2, 3), full[2:5])
    for rank in range(2):
        same(blocks.cols(rank * k // 2, k // 2), full[:, rank * k // 2 : (rank + 1) * k // 2])
    same(blocks.cols(block, block), full[:, block : 2 * block])
    padded = _vocab_blocks(blocks, 4, 4, n, "embed")  # rank 1 of 2 over a vocabulary of 6
    same(padded.rows(0, 2), full[4:])
    assert padded.shape == (4, k) and not dequantize(padded.data[2:].numpy(), qtype).any()
    assert _vocab_blocks(blocks, 0, 3, n, "embed").data.data_ptr() == blocks.data.data_ptr()
    assert not dequantize(_vocab_blocks(blocks, 8, 2, n, "embed").data.numpy(), qtype).any()
    for start, count in ((block // 2, block), (0, block + 16), (0, k + block)):
        with pytest.raises(ValueError, match=f"not whole blocks of {block}"):
            blocks.cols(start, count)
    with pytest.raises(ValueError, match="rows"):
        blocks.rows(4, 3)


def test_tp_ranks_load_their_slices_of_the_blocks(kernel, tiny_gguf_dir):
    """Each rank of a TP=2 GGUF model holds exactly its slice of each weight, still in blocks:
    its q rows and the one KV head's k / v (replicated), its gate / up rows, its inputs of o
    and down (o's bias whole, added after the sum), its vocabulary rows of the embedding and
    of the tied head (one copy)."""
    from transformers import AutoConfig

    from vserve.distributed.tp_comm import TPShard
    from vserve.models.loader import load_model
    from vserve.models.stage import StageInfo

    path = tiny_gguf_dir("gemma3", num_key_value_heads=1, attention_bias=True)
    cfg = AutoConfig.from_pretrained(path)
    stage = StageInfo.whole(cfg.num_hidden_layers)

    def dense(module) -> torch.Tensor:
        blocks = module.parts if isinstance(module, QuantLinear) else [module.blocks]
        assert all(isinstance(p, QuantBlocks) for p in blocks)
        return torch.cat([kernel.dequantize(p.data, p.qtype, p.shape[1]) for p in blocks])

    def weights(tp: TPShard) -> dict[str, torch.Tensor]:
        model = load_model(path, cfg, stage, torch.float32, torch.device("cpu"), 64, "gguf", tp)
        attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
        o, down, head = attn.o_proj, mlp.down_proj, model.lm_head
        if tp.size > 1:
            assert o.bias is not None and o.linear.bias is None
            o, down, head = o.linear, down.linear, head.linear
            assert head.parts[0].data.data_ptr() == model.model.embed_tokens.blocks.data.data_ptr()
        named = dict(qkv=attn.qkv_proj, o=o, gate_up=mlp.gate_up_proj, down=down, head=head)
        out = {name: dense(m) for name, m in named.items()}
        return {**out, "embed": dense(model.model.embed_tokens), "o_bias": attn.o_proj.bias}

    full = weights(TPShard())
    q, k, v = full["qkv"].split([128, 32, 32])
    gate, up = full["gate_up"].split([128, 128])
    for rank in (0, 1):
        mine = weights(TPShard(rank, 2))
        half = slice(rank * 64, (rank + 1) * 64)
        assert torch.equal(mine["qkv"], torch.cat([q[half], k, v]))
        assert torch.equal(mine["gate_up"], torch.cat([gate[half], up[half]]))
        for name in ("o", "down"):
            assert torch.equal(mine[name], full[name][:, half])
        for name in ("embed", "head"):
            assert torch.equal(mine[name], full[name][rank * 192 : (rank + 1) * 192])
        assert torch.equal(mine["o_bias"], full["o_bias"])


def test_int8_tp_rank_quantizes_its_slices(kernel, tiny_model_dir):
    """int8 under TP: each rank quantizes its own slices (the vocabulary-parallel embedding
    too), and its tied head takes its embedding rows' blocks: the one-rank model's blocks,
    sliced."""
    from transformers import AutoConfig

    from vserve.distributed.tp_comm import TPShard
    from vserve.models.loader import load_model
    from vserve.models.stage import StageInfo

    path = tiny_model_dir("gemma3")
    cfg = AutoConfig.from_pretrained(path)
    stage = StageInfo.whole(cfg.num_hidden_layers)

    def load(tp: TPShard):
        return load_model(path, cfg, stage, torch.float32, torch.device("cpu"), 64, "int8", tp)

    one, rank1 = load(TPShard()), load(TPShard(1, 2))
    embed = rank1.model.embed_tokens
    assert isinstance(embed, QuantEmbedding) and embed.shard is not None
    assert rank1.lm_head.linear.parts[0].data.data_ptr() == embed.blocks.data.data_ptr()
    assert torch.equal(embed.blocks.data, one.model.embed_tokens.blocks.data[192:])
    down = rank1.model.layers[0].mlp.down_proj.linear.parts[0]
    assert torch.equal(down.data, one.model.layers[0].mlp.down_proj.parts[0].cols(64, 64).data)


def test_quantize_q8_0_is_ggufs():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((48, 256)).astype(np.float32)
    w[3, :32] = 0.0  # an all-zero block: scale 0, values 0
    mine = quantize_q8_0(torch.from_numpy(w))
    assert mine.shape == (48, 256) and mine.qtype == int(Q.Q8_0)
    assert np.array_equal(mine.data.numpy(), quantize(w, Q.Q8_0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 20])
def test_linear_equals_dense_on_dequantized_weights(kernel, dtype, rows):
    q8, w8 = _blocks(Q.Q8_0, 64, 128, 0)
    q5, w5 = _blocks(Q.Q5_0, 96, 128, 1)  # Q5_0 of gguf's python quantizer: shape checks only
    dense = torch.randn(32, 128) * 0.1
    layer = QuantLinear([q8, q5, dense.to(dtype)], 128, None, kernel)
    x = torch.randn(rows, 128).to(dtype)
    ref = F.linear(x.float(), torch.cat([w8, w5, dense.to(dtype).float()]))
    out = layer(x)
    assert out.shape == (rows, 192) and out.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)


def test_parts_of_one_format_merge():
    a, _ = _blocks(Q.Q8_0, 8, 64, 0)
    b, _ = _blocks(Q.Q8_0, 4, 64, 1)
    c, _ = _blocks(Q.Q5_0, 4, 64, 2)
    layer = QuantLinear([a, b, c], 64, None, None)
    assert [p.shape for p in layer.parts] == [(12, 64), (4, 64)]
    assert torch.equal(layer.parts[0].data, torch.cat([a.data, b.data]))
    assert layer.out_features == 16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embedding_reads_only_its_rows(kernel, dtype):
    blocks, deq = _blocks(Q.Q8_0, 100, 64, 3)
    emb = QuantEmbedding(blocks, dtype, kernel)
    ids = torch.tensor([[5, 0], [99, 5]])
    out = emb(ids)
    assert out.shape == (2, 2, 64) and out.dtype == dtype
    assert torch.equal(out, deq[ids].to(dtype))


def test_install_fused_and_plain_linears(kernel):
    model = nn.Module()
    model.qkv = FusedLinear(64, [16, 8, 8], bias=False)
    model.o = nn.Linear(64, 64, bias=True)
    model.norm = nn.LayerNorm(64)
    q, wq = _blocks(Q.Q8_0, 16, 64, 4)
    v, wv = _blocks(Q.Q5_0, 8, 64, 5)
    model.qkv.quant_shards.update({0: q, 2: v})  # k stays dense: its weight rows are used
    o, wo = _blocks(Q.Q8_0, 64, 64, 6)
    model.o.quant_weight = o
    k_dense = model.qkv.weight[16:24].detach().clone()
    bias = model.o.bias.detach().clone()
    assert install(model, kernel, torch.float32) == 2
    assert isinstance(model.qkv, QuantLinear) and isinstance(model.o, QuantLinear)
    assert isinstance(model.norm, nn.LayerNorm)
    x = torch.randn(3, 64)
    torch.testing.assert_close(model.qkv(x), x @ torch.cat([wq, k_dense, wv]).T)
    torch.testing.assert_close(model.o(x), x @ wo.T + bias)


def test_install_moves_streamed_blocks_into_one_arena(kernel):
    """The linears' blocks are copied, in module order, into one huge-page arena (a step
    streams them from 2 MB pages, not the GGUF's mapped 4 KB ones); a tied embedding reads
    the head's copy; outputs are unchanged."""
    model = nn.Module()
    model.embed = nn.Embedding(96, 64)
    model.o = nn.Linear(64, 64, bias=False)
    model.lm_head = nn.Linear(64, 96, bias=False)
    o, wo = _blocks(Q.Q8_0, 64, 64, 7)
    head, w_head = _blocks(Q.Q5_0, 96, 64, 8)
    model.o.quant_weight = o
    model.lm_head.quant_weight = head
    model.embed.quant_weight = head  # tied: the same blocks
    assert install(model, kernel, torch.float32) == 3
    o_data, head_data = model.o.parts[0].data, model.lm_head.parts[0].data
    assert o_data.data_ptr() != o.data.data_ptr() and torch.equal(o_data, o.data)
    rewritten = model.lm_head.parts[0].qtype != Q.Q5_0  # as Q8_0 (AVX2's int8 products)
    assert torch.equal(head_data, kernel.q5_0_as_q8_0(head.data, 64) if rewritten else head.data)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        assert o_data.data_ptr() % (2 << 20) == 0  # the arena starts on a huge page
    assert head_data.data_ptr() == o_data.data_ptr() + o_data.numel()  # 64 x 34: aligned
    assert model.embed.blocks.data.data_ptr() == head_data.data_ptr()
    x = torch.randn(3, 64)
    torch.testing.assert_close(model.o(x), x @ wo.T)
    torch.testing.assert_close(model.lm_head(x), x @ w_head.T)
    torch.testing.assert_close(model.embed(torch.tensor([5])), w_head[5:6])


@pytest.mark.parametrize("repack", [True, False])
def test_install_repacks_streamed_q5_0_for_the_quad_gemv(kernel, monkeypatch, repack):
    """Where the gemv reads Q5_0R, a linear's Q5_0 rows of whole quads (K % 128 == 0) are
    repacked into it on their way into the arena, a tied head's too (the embedding then
    looks its rows up in them); rows of K % 128 != 0 stay Q5_0. Where the int8 products are
    the 256-bit ones (AVX2, AVX-VNNI), every Q5_0 linear becomes Q8_0 (34 bytes a block).
    VSERVE_QUANT_REPACK=0 keeps them all. The outputs are the dense layers' either way."""
    monkeypatch.setattr(quant_linear, "ENV", replace(quant_linear.ENV, quant_repack=repack))
    model = nn.Module()
    model.embed = nn.Embedding(96, 128)
    model.up = nn.Linear(128, 64, bias=False)
    model.down = nn.Linear(64, 128, bias=False)
    model.lm_head = nn.Linear(128, 96, bias=False)
    up, w_up = _blocks(Q.Q5_0, 64, 128, 9)
    down, w_down = _blocks(Q.Q5_0, 128, 64, 10)
    head, w_head = _blocks(Q.Q5_0, 96, 128, 11)
    model.up.quant_weight, model.down.quant_weight = up, down
    model.lm_head.quant_weight = model.embed.quant_weight = head  # tied
    assert install(model, kernel, torch.float32) == 4
    as_q8_0 = (
        repack and not kernel.q5_0r_supported() and kernel.int8_gemv() in quant_linear.Q8_0_FOR_Q5_0
    )
    name = "Q5_0R" if repack and kernel.q5_0r_supported() else "Q8_0" if as_q8_0 else "Q5_0"
    assert model.up.parts[0].name == name and model.lm_head.parts[0].name == name
    if as_q8_0:
        assert model.up.parts[0].data.shape == (64, 128 // 32 * 34)
    else:
        assert model.up.parts[0].data.shape == up.data.shape  # as many bytes, reordered
    assert model.down.parts[0].name == ("Q8_0" if as_q8_0 else "Q5_0")
    assert model.embed.blocks is model.lm_head.parts[0]
    x = torch.randn(3, 128)
    for dtype in (torch.float32, torch.bfloat16):  # (bf16 outside the exact path: int8 gemv)
        kernel.set_options(exact=dtype == torch.float32)
        xd, tol = x.to(dtype), {} if dtype == torch.float32 else {"atol": 0.05, "rtol": 0.05}
        torch.testing.assert_close(model.up(xd).float(), xd.float() @ w_up.T, **tol)
        torch.testing.assert_close(
            model.down(xd[:, :64]).float(), xd[:, :64].float() @ w_down.T, **tol
        )
        torch.testing.assert_close(model.lm_head(xd).float(), xd.float() @ w_head.T, **tol)
    torch.testing.assert_close(model.embed(torch.tensor([5])), w_head[5:6])


def test_arena_copy_transforms_one_tensor_at_a_time():
    seen = []

    def double(t):
        seen.append(t.numel())
        return t * 2

    a, b = torch.arange(8, dtype=torch.uint8).reshape(2, 4), torch.arange(3, dtype=torch.uint8)
    copies = arena_copy([a, b], [double, None])
    assert torch.equal(copies[0], a * 2) and torch.equal(copies[1], b) and seen == [8]


def test_arena_copy_takes_transforms_that_change_the_size():
    a, b = torch.arange(8, dtype=torch.uint8).reshape(2, 4), torch.arange(3, dtype=torch.uint8)
    widen = lambda t: torch.cat([t, t + 100], dim=1)  # noqa: E731
    copies = arena_copy([a, b], [widen, None], [(2, 8), None])
    assert torch.equal(copies[0], widen(a)) and torch.equal(copies[1], b)
    assert copies[1].data_ptr() == copies[0].data_ptr() + 64  # 16 bytes, aligned to 64


def test_arena_copy_aligns_each_tensor():
    tensors = [torch.arange(n, dtype=torch.uint8) for n in (1, 100, 64, 0)]
    copies = arena_copy([t.reshape(-1, 1) for t in tensors])
    for t, c in zip(tensors, copies, strict=True):
        assert c.shape == (t.numel(), 1) and torch.equal(c.flatten(), t)
        assert c.data_ptr() % 64 == 0 or c.numel() == 0
    assert arena_copy([]) == []


def test_park_int8_quantizes_whole_block_linears():
    model = nn.Module()
    model.a = nn.Linear(64, 8)
    model.b = nn.Linear(40, 8)  # 40 inputs: not whole blocks of 32, stays dense
    model.fused = FusedLinear(64, [8, 8], bias=False)
    assert park_int8(model) == 2
    assert model.a.quant_weight.shape == (8, 64)
    assert not hasattr(model.b, "quant_weight")
    assert sorted(model.fused.quant_shards) == [0, 1]
    expected = quantize(model.fused.weight.detach().numpy(), Q.Q8_0)
    assert np.array_equal(model.fused.quant_shards[1].data.numpy(), expected[8:])


@pytest.mark.parametrize("rows", [1, 20])
def test_runs_under_inference_mode(kernel, rows):
    """The worker runs the model under torch.inference_mode: matmul's tiles write the output
    from the thread pool, whose threads do not inherit the mode (regression)."""
    q8, w8 = _blocks(Q.Q8_0, 4096, 128, 7)
    layer = QuantLinear([q8], 128, None, kernel)
    x = torch.randn(rows, 128)
    with torch.inference_mode():
        out = layer(x)
    torch.testing.assert_close(out, x @ w8.T, rtol=1e-4, atol=1e-4)


def test_no_rows(kernel):
    """A step can hand a linear zero rows (prompt logprobs of no request): an empty result,
    not an error (regression)."""
    q8, _ = _blocks(Q.Q8_0, 16, 64, 8)
    out = QuantLinear([q8], 64, None, kernel)(torch.zeros(0, 64))
    assert out.shape == (0, 16)
    assert kernel.matmul(torch.zeros(0, 64), q8.data, q8.qtype, 64).shape == (0, 16)


# -- the engine argument ------------------------------------------------------------------------
def _config(model, **kwargs):
    from vserve.engine.arg_utils import EngineArgs

    return EngineArgs(model=model, device="cpu", **kwargs).create_engine_config().model


def test_quantization_defaults_and_refusals(tiny_model_dir, tmp_path):
    import json
    import shutil

    from vserve.models.gguf_source import MANIFEST

    path = tiny_model_dir("llama")
    assert _config(path).quantization == "none"  # a safetensors model
    assert _config(path, quantization="int8").quantization == "int8"
    with pytest.raises(ValueError, match="needs a GGUF model"):
        _config(path, quantization="gguf")
    for wrong in ("awq", "", 8, "GGUF"):
        with pytest.raises(ValueError, match="quantization must be one of"):
            _config(path, quantization=wrong)
    gguf_like = tmp_path / "described"
    shutil.copytree(path, gguf_like)
    (gguf_like / MANIFEST).write_text(json.dumps({"file": "m.gguf"}))
    assert _config(str(gguf_like)).quantization == "gguf"  # a GGUF model's default
    assert _config(str(gguf_like), quantization="none").quantization == "none"


@pytest.mark.parametrize(("bf16", "int8_gemv"), [(False, True), (False, False), (True, True)])
def test_auto_dtype_of_quantized_models(tiny_model_dir, monkeypatch, bf16, int8_gemv):
    """dtype="auto" on an fp32 checkpoint: bf16 where the CPU has bf16 instructions; on one
    without them, bf16 for quantized weights where an int8 gemv takes bf16 activations (the
    fused decode kernels run only in bf16), fp32 for dense ones and without the gemv."""
    from vserve.engine import arg_utils

    monkeypatch.setattr(arg_utils, "cpu_has_bf16", lambda: bf16)
    monkeypatch.setattr(arg_utils, "cpu_has_int8_gemv", lambda: int8_gemv)
    path = tiny_model_dir("llama")
    assert _config(path).dtype == ("bfloat16" if bf16 else "float32")
    quantized = _config(path, quantization="int8").dtype
    assert quantized == ("bfloat16" if bf16 or int8_gemv else "float32")
    assert _config(path, quantization="int8", dtype="float32").dtype == "float32"


def test_int8_model_generates(tiny_model_dir):
    """int8 on a safetensors model: every linear and the embedding on Q8_0 blocks, the tied
    head sharing the embedding's, greedy ids equal the dense fp32 model's on a tiny model."""
    from tests.support.engines import make_llm
    from vserve import SamplingParams

    path = tiny_model_dir("gemma3")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = {}
    for q in ("none", "int8"):
        llm = make_llm(path, quantization=q, max_model_len=64)
        try:
            model = llm.engine.client.core.executor.worker.runner.model
            if q == "int8":
                assert isinstance(model.model.embed_tokens, QuantEmbedding)
                assert model.lm_head.parts[0] is model.model.embed_tokens.blocks
                linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
                assert len(linears) == 4 * len(model.model.layers) + 1
            outs[q] = llm.generate([[5, 17, 99, 3]], params, use_tqdm=False)[0]
        finally:
            llm.shutdown()
    assert outs["int8"].outputs[0].token_ids == outs["none"].outputs[0].token_ids


def test_without_the_kernels_weights_are_dequantized(tiny_model_dir, monkeypatch, caplog):
    """No compiler (or VSERVE_CPU_OPS=0): a quantized model still loads, dense, and says so."""
    from tests.support.engines import make_llm
    from vserve import SamplingParams
    from vserve.models import loader

    monkeypatch.setattr(loader.cpu_ops, "load_quant", lambda: None)
    llm = make_llm(tiny_model_dir("llama"), quantization="int8", max_model_len=64)
    try:
        model = llm.engine.client.core.executor.worker.runner.model
        assert not any(isinstance(m, (QuantLinear, QuantEmbedding)) for m in model.modules())
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4), use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 4
    finally:
        llm.shutdown()
    assert "weights dequantized at load" in caplog.text
