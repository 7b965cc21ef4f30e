"""Start-up: the phase log, resident memory per process (log and /metrics), the tokenizer
loaded once per process (and through `tokenizers` only where proven equal), the resolved
config read back without transformers, and the memory-mapped weight cache (hit, miss,
invalidation) with unchanged outputs."""

from __future__ import annotations

import logging
import os
import re
from importlib.metadata import version

import httpx
import pytest

from tests.support.engines import make_llm
from tests.support.openai_server import TINY_ARGS, serving
from vserve import SamplingParams

pytestmark = pytest.mark.slow  # the fast tier (-m "not slow") leaves these out

PROMPTS = ["The quick brown fox", "Paris is the capital of"]


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    home = tmp_path / "cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(home))
    return home


def _greedy(llm) -> list[list[int]]:
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False)]


# -- the phase log -------------------------------------------------------------------------------
def test_phase_lines_in_process(tiny_model_dir, caplog):
    caplog.set_level(logging.INFO, logger="vserve.startup")
    llm = make_llm(tiny_model_dir("llama"))
    try:
        text = caplog.text
        for process, name in [
            ("frontend", "config"),
            ("frontend", "tokenizer"),
            ("frontend", "engine core and workers ready"),
            ("engine_core", "workers started, model loaded"),
            ("engine_core", "KV cache"),
            ("worker_0", "model config"),
            ("worker_0", "load weights"),
            ("worker_0", "KV cache"),
        ]:
            assert re.search(rf"start-up {process}: {name} \d+\.\d\d s", text), (process, name)
        memory = llm.engine.process_memory()
        assert list(memory) == ["frontend"] and memory["frontend"] > 0  # all in one process
    finally:
        llm.shutdown()


def test_metrics_export_resident_memory_per_process(tiny_model_dir):
    from vserve.models.hf_config import load_hf_config
    from vserve.tokenizer import load_tokenizer

    model_dir = tiny_model_dir("llama")
    load_hf_config(model_dir)  # warm caches, as on any start after the first
    load_tokenizer(model_dir)
    with serving([model_dir, *TINY_ARGS]) as srv:
        text = httpx.get(srv.url + "/metrics", timeout=30).text
        values = {
            m.group(1): float(m.group(2))
            for m in re.finditer(
                r'^vserve:process_resident_memory_bytes\{[^}]*process="(\w+)"[^}]*\} (\S+)$',
                text,
                re.M,
            )
        }
        assert set(values) == {"frontend", "engine_core", "worker_0"}, text[-2000:]
        assert all(v > 10 * 2**20 for v in values.values()), values
        log = srv.log_tail(50000)  # the multiprocess start-up: every process's phases
        maps = {
            name: open(f"/proc/{pid}/maps").read()
            for name, pid in (("frontend", srv.pid), ("engine_core", *srv.engine_pids))
        }
    # neither the front end nor the engine core has a use for torch (until a structured-output
    # request imports xgrammar, which imports it)
    for name, text in maps.items():
        if name == "engine_core" or version("torch").endswith("+cpu"):
            assert "libtorch" not in text, name
    for process in ("frontend", "engine_core", "worker_0"):
        assert re.search(rf"start-up {process}: \w", log), (process, log[-3000:])
    assert re.search(r"start-up worker_0: load weights \d+\.\d\d s", log)
    assert re.search(r"start-up frontend: ready \d+\.\d\d s after the process started", log)
    line = re.search(r"resident memory: (.*)", log).group(1)
    for process in ("frontend", "engine_core", "worker_0"):
        assert re.search(rf"{process} [1-9]\d* MB", line), line


# -- tokenizer -----------------------------------------------------------------------------------
def test_tokenizer_loaded_once_per_process(tiny_model_dir, cache_home):
    from vserve import tokenizer as tok_module

    tok_module.load_tokenizer.cache_clear()
    before = tok_module.NUM_LOADS[0]
    llm = make_llm(tiny_model_dir("llama"))
    try:
        _greedy(llm)
        llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=2), use_tqdm=False)
        assert tok_module.NUM_LOADS[0] - before == 1
    finally:
        llm.shutdown()


def test_fast_tokenizer_only_where_proven_equal(tiny_model_dir, cache_home, monkeypatch):
    from transformers import AutoTokenizer

    from vserve import tokenizer as tok_module

    path = tiny_model_dir("llama")
    tok_module.load_tokenizer.cache_clear()
    first = tok_module.load_tokenizer(path)  # checks the fast load, records the verdict
    assert len(list((cache_home / "vserve" / "tokenizers").iterdir())) == 1
    tok_module.load_tokenizer.cache_clear()
    monkeypatch.setattr(tok_module, "_load_auto", _refuse)  # proven: AutoTokenizer not needed
    fast = tok_module.load_tokenizer(path)
    auto = AutoTokenizer.from_pretrained(path)
    assert type(fast).__name__ != type(first).__name__ or fast is not first
    assert tok_module.fingerprint(fast) == tok_module.fingerprint(auto)
    texts = ["The quick brown fox", "héllo wörld 🙂 <s></s><pad>", " 1 2  3\n\n", ""]
    for text in texts:
        for special in (True, False):
            assert fast.encode(text, add_special_tokens=special) == auto.encode(
                text, add_special_tokens=special
            )
    ids = auto.encode(texts[1]) + [0, 1, 2]
    for skip in (True, False):
        assert fast.decode(ids, skip_special_tokens=skip) == auto.decode(
            ids, skip_special_tokens=skip
        )
    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert fast.apply_chat_template(
        conv, tokenize=False, add_generation_prompt=True
    ) == auto.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    assert (fast.bos_token_id, fast.eos_token_id, fast.all_special_ids) == (
        auto.bos_token_id,
        auto.eos_token_id,
        auto.all_special_ids,
    )


def test_tokenizer_with_methods_of_its_own_keeps_auto(tiny_model_dir, cache_home, monkeypatch):
    """A model class that overrides behaviour (here: a decode of its own) is not replaced."""
    from transformers import PreTrainedTokenizerFast

    from vserve import tokenizer as tok_module

    class Custom(PreTrainedTokenizerFast):
        def decode(self, *args, **kwargs):
            return super().decode(*args, **kwargs).upper()

    path = tiny_model_dir("llama")
    monkeypatch.setattr(tok_module, "_load_auto", lambda p: Custom.from_pretrained(p))
    tok_module.load_tokenizer.cache_clear()
    tok_module.load_tokenizer(path)
    tok_module.load_tokenizer.cache_clear()
    assert type(tok_module.load_tokenizer(path)) is Custom
    tok_module.load_tokenizer.cache_clear()


def _refuse(*args, **kwargs):
    raise AssertionError("AutoTokenizer was loaded")


# -- config --------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "gemma3", "mistral"])
def test_cached_config_equals_transformers(tiny_model_dir, cache_home, monkeypatch, kind):
    from transformers import AutoConfig

    from vserve.models import hf_config

    path = tiny_model_dir(kind)
    ref = AutoConfig.from_pretrained(path)
    hf_config.load_hf_config(path)  # resolves and caches
    monkeypatch.setattr(hf_config, "_resolve", _refuse)  # read back without transformers
    cached = hf_config.load_hf_config(path)
    for name, value in ref.to_dict().items():
        assert getattr(cached, name) == value, name
    for name in (
        "layer_types",
        "rope_parameters",
        "head_dim",
        "sliding_window",
        "num_key_value_heads",
        "tie_word_embeddings",
        "architectures",
        "model_type",
    ):
        assert getattr(cached, name, None) == getattr(ref, name, None), name


# -- weight cache --------------------------------------------------------------------------------
def _weight_files(home, model_dir) -> list:
    return (
        sorted((home / "vserve" / "weights").glob("vserve-weights-*.pt"))
        if (home / "vserve" / "weights").is_dir()
        else []
    )


def test_weight_cache_hit_miss_invalidation_same_outputs(tiny_model_dir, cache_home, monkeypatch):
    from vserve.models import weight_cache

    monkeypatch.setattr(weight_cache, "MIN_BYTES", 0)
    path = tiny_model_dir("gemma3")
    calls = []
    real = weight_cache.load_into
    monkeypatch.setattr(
        weight_cache, "load_into", lambda m, p: calls.append(real(m, p)) or calls[-1]
    )

    def run(**env) -> list[list[int]]:
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        llm = make_llm(path, dtype="bfloat16")
        try:
            return _greedy(llm)
        finally:
            llm.shutdown()
            for key in env:
                monkeypatch.delenv(key)

    plain = run(VSERVE_WEIGHT_CACHE="0")
    assert calls == [] and _weight_files(cache_home, path) == []
    assert run() == plain and calls == [False]  # miss: loaded, then saved
    files = _weight_files(cache_home, path)
    assert len(files) == 1
    assert run() == plain and calls == [False, True]  # hit: memory-mapped
    safetensors = next(p for p in os.listdir(path) if p.endswith(".safetensors"))
    stat = os.stat(os.path.join(path, safetensors))
    os.utime(os.path.join(path, safetensors), ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert run() == plain and calls[-1] is False  # the checkpoint changed: a new key
    assert len(_weight_files(cache_home, path)) == 2


def test_weight_cache_that_does_not_fit_is_rewritten(tiny_model_dir, cache_home, monkeypatch):
    import torch

    from vserve.models import weight_cache

    monkeypatch.setattr(weight_cache, "MIN_BYTES", 0)
    path = tiny_model_dir("llama")
    llm = make_llm(path, dtype="bfloat16")
    expected = _greedy(llm)
    llm.shutdown()
    (file,) = _weight_files(cache_home, path)
    torch.save(
        {"tensors": {"model.norm.weight": torch.zeros(3)}, "aliases": {}}, file
    )  # another layout
    llm = make_llm(path, dtype="bfloat16")
    try:
        assert _greedy(llm) == expected
    finally:
        llm.shutdown()
    assert set(torch.load(file, weights_only=True)["tensors"]) != {"model.norm.weight"}
