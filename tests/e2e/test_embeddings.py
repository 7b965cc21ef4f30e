"""`LLM.embed`: each prompt's pooled last hidden state equals transformers' (the base model's
`last_hidden_state`, after the final norm) pooled the same way, in fp32, through chunked
prefill and prefix caching, for a Llama and a Gemma 3 (whose norm scales by 1 + w); the
pooling a model folder names (sentence-transformers' files) is the one used."""

import json
import shutil

import pytest
import torch

from tests.support.engines import make_llm
from vserve.entrypoints.embedding import PoolingConfig, pooling_config

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. " * 3,  # longer than a chunk
    "Paris is the capital of France",
    "1 2 3",
]


def _reference(model: str, ids: list[int], pooling: str, normalize: bool = True):
    from transformers import AutoModel

    hf = AutoModel.from_pretrained(model, dtype=torch.float32)
    with torch.no_grad():
        hidden = hf(torch.tensor([ids])).last_hidden_state[0]
    vector = hidden[-1] if pooling == "last" else hidden.mean(0)
    return vector / vector.norm() if normalize else vector


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_embeddings_equal_transformers(tiny_model_dir, kind):
    model = tiny_model_dir(kind)
    llm = make_llm(model, max_model_len=256, max_num_batched_tokens=16)
    try:
        for pooling in ("last", "mean"):
            for out in llm.embed(PROMPTS * 2, pooling=pooling, use_tqdm=False):  # 2nd: hits
                ref = _reference(model, out.prompt_token_ids, pooling)
                got = torch.tensor(out.outputs.embedding)
                assert torch.cosine_similarity(got, ref, dim=0) > 0.9999
                torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
        assert len(PROMPTS[0]) > 16 and llm.engine.last_stats.prefix_cache_hits > 0
    finally:
        llm.shutdown()


def _with_modules(src: str, dst, pooling_key: str | None, normalize: bool):
    shutil.copytree(src, dst)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}
    ]
    if pooling_key is not None:
        modules.append(
            {
                "idx": 1,
                "name": "1",
                "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling",
            }
        )
        (dst / "1_Pooling").mkdir()
        (dst / "1_Pooling" / "config.json").write_text(json.dumps({pooling_key: True}))
    if normalize:
        modules.append(
            {
                "idx": 2,
                "name": "2",
                "path": "2_Normalize",
                "type": "sentence_transformers.models.Normalize",
            }
        )
    (dst / "modules.json").write_text(json.dumps(modules))
    return str(dst)


def test_the_model_folder_names_its_pooling(tiny_model_dir, tmp_path):
    model = tiny_model_dir("llama")
    assert pooling_config(model) == PoolingConfig("last", True)  # a decoder's default
    mean = _with_modules(model, tmp_path / "mean", "pooling_mode_mean_tokens", False)
    assert pooling_config(mean) == PoolingConfig("mean", False)
    last = _with_modules(model, tmp_path / "last", "pooling_mode_lasttoken", True)
    assert pooling_config(last) == PoolingConfig("last", True)
    cls = _with_modules(model, tmp_path / "cls", "pooling_mode_cls_token", True)
    with pytest.raises(ValueError, match="pooling_mode_cls_token.*not supported"):
        pooling_config(cls)
    llm = make_llm(mean, max_model_len=128)
    try:
        out = llm.embed(PROMPTS[1], use_tqdm=False)[0]
    finally:
        llm.shutdown()
    ref = _reference(model, out.prompt_token_ids, "mean", normalize=False)
    torch.testing.assert_close(torch.tensor(out.outputs.embedding), ref, rtol=1e-4, atol=1e-5)
