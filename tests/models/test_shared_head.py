"""The fp32 CPU lm_head in row shares (vserve/models/shared_head.py, `cpu_ops.shared_linear`):
the same product however its tiles are claimed, close to F.linear's at the shapes a head sees
(one row to a prefill's worth, hidden sizes of tiny and real models, a vocabulary that is no
multiple of a tile) and bitwise it on the tiny models' heads; an fp32 model loads with it, a
bf16 one keeps its packed head."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.support.cpu_kernels import needs_kernels
from vserve.models.shared_head import SharedHead, share_head

pytestmark = needs_kernels


SHAPES = [(1, 50021, 64), (32, 40000, 64), (5, 30011, 640), (130, 9000, 896), (3, 7, 64)]


def _product(ops, m, n, k, threads, fn):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(m * n + k)
        x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) * 0.05
        with torch.inference_mode():  # as the runner calls it
            return fn(x, w)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("m, n, k", SHAPES)
def test_the_same_whoever_claims_a_tile_and_close_to_f_linear(ops, m, n, k):
    """Each tile is one ATen product whichever thread claims it: repeated runs on a thread
    count are equal, though the threads take the tiles in another order each time. (Across
    thread counts the BLAS may plan a tile's sums another way, as it plans F.linear's.)"""
    runs = [_product(ops, m, n, k, 2, ops.shared_linear) for _ in range(3)]
    assert all(torch.equal(runs[0], r) for r in runs[1:])
    for threads in (1, 2):
        torch.testing.assert_close(
            _product(ops, m, n, k, threads, ops.shared_linear),
            _product(ops, m, n, k, threads, F.linear),
            rtol=1e-5,
            atol=1e-5,
        )


@pytest.mark.parametrize("m, n, k", [(1, 262144, 64), (32, 262144, 64), (7, 384, 64)])
def test_bitwise_f_linear_on_the_tiny_models_heads(ops, m, n, k):
    """Where fp32 outputs must equal transformers': the heads of the test models (384 x 64)
    and the benchmarks' tiny Llama (262144 x 64). (A vocabulary that ends in a partial tile
    may differ from F.linear in the last bit there: F.linear treats its columns otherwise.)"""
    for t in (1, 2):
        assert torch.equal(
            _product(ops, m, n, k, t, ops.shared_linear), _product(ops, m, n, k, t, F.linear)
        )


def test_bad_shapes_raise(ops):
    with pytest.raises(RuntimeError, match="shared_linear"):
        ops.shared_linear(torch.randn(2, 8), torch.randn(4, 9))
    with pytest.raises(RuntimeError, match="shared_linear"):
        ops.shared_linear(torch.randn(2, 8), torch.randn(4, 8).bfloat16())
    assert ops.shared_linear(torch.randn(0, 8), torch.randn(4, 8)).shape == (0, 4)


def test_share_head_takes_plain_fp32_heads_only(ops):
    class M(nn.Module):
        def __init__(self, head):
            super().__init__()
            self.lm_head = head

    fp32 = M(nn.Linear(16, 100, bias=False)).requires_grad_(False)  # as loaded models are
    assert share_head(fp32, ops) and isinstance(fp32.lm_head, SharedHead)
    x = torch.randn(3, 16)
    assert torch.equal(fp32.lm_head(x), F.linear(x, fp32.lm_head.weight))
    assert fp32.lm_head(x[None]).shape == (1, 3, 100)  # not 2-D: F.linear
    assert "lm_head.weight" in dict(fp32.named_parameters())
    for other in (
        nn.Linear(16, 100, bias=False).bfloat16(),
        nn.Linear(16, 100, bias=True),
        nn.Identity(),
    ):
        assert not share_head(M(other), ops)


def test_fp32_models_load_with_it_and_bf16_ones_without(tiny_model_dir):
    from vserve import LLM

    for dtype, shared in (("float32", True), ("bfloat16", False)):
        llm = LLM(
            tiny_model_dir("llama"),
            dtype=dtype,
            multiprocess=False,
            distributed_executor_backend="uni",
            max_model_len=64,
        )
        try:
            model = llm.engine.client.core.executor.worker.runner.model
            assert isinstance(model.lm_head, SharedHead) is shared
        finally:
            llm.shutdown()
