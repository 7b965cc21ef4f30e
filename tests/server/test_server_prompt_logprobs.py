"""Prompt logprobs on `/v1/completions`: `echo` + `logprobs` in OpenAI's legacy format (the
call evaluation harnesses make), `max_tokens=0` with `echo`, vLLM's `prompt_logprobs` field,
streaming, bad values (400); and lm-evaluation-harness's `local-completions` model against
the server scoring a multiple-choice and a `generate_until` task exactly as its own `hf`
model does on the same tiny fp32 model."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.e2e.test_prompt_logprobs import _hf_logprobs
from tests.support.openai_server import TINY_ARGS, serving

pytestmark = pytest.mark.slow  # the fast tier (-m "not slow") leaves these out

MODEL = "tiny-llama"
PROMPT = "Paris is the capital of France, and Berlin is"


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    # a chunk budget of 7 splits every prompt's logprobs across steps
    with serving(
        [
            model_dir,
            *TINY_ARGS,
            "--served-model-name",
            MODEL,
            "--max-model-len",
            "256",
            "--max-num-batched-tokens",
            "7",
        ]
    ) as srv:
        srv.model_dir = model_dir
        yield srv


def _post(server, **body) -> httpx.Response:
    return httpx.post(server.url + "/v1/completions", json={"model": MODEL, **body}, timeout=60)


def _ids(server, text: str) -> list[int]:
    return httpx.post(server.url + "/tokenize", json={"prompt": text}).json()["tokens"]


def test_echo_logprobs_legacy_format(server):
    ids = _ids(server, PROMPT)
    ref = _hf_logprobs(server.model_dir, ids)
    body = _post(server, prompt=PROMPT, echo=True, logprobs=2, max_tokens=3, temperature=0).json()
    choice = body["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 3 == len(lp["token_logprobs"])
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for t in range(1, len(ids)):
        assert abs(lp["token_logprobs"][t] - ref[t - 1, ids[t]].item()) < 1e-4
        top = lp["top_logprobs"][t]
        assert lp["tokens"][t] in top and 1 <= len(top) <= 3  # (tokens may decode alike)
        assert abs(max(top.values()) - ref[t - 1].max().item()) < 1e-4
    # offsets run over the echoed text: the prompt's tokens, then the generated ones
    assert lp["text_offset"][0] == 0
    for t in range(1, len(lp["tokens"])):
        assert lp["text_offset"][t] == lp["text_offset"][t - 1] + len(lp["tokens"][t - 1])
    assert lp["tokens"][0] == "<s>" and "".join(lp["tokens"][1:]) == choice["text"]
    assert choice["text"].startswith(PROMPT)
    assert choice["prompt_logprobs"] is None  # vLLM's field only when asked
    assert body["usage"]["completion_tokens"] == 3


def test_echo_max_tokens_zero_returns_the_prompt_only(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    ids = _ids(server, PROMPT)
    out = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=1, max_tokens=0)
    choice = out.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert len(choice.logprobs.tokens) == len(ids)
    assert choice.logprobs.token_logprobs[0] is None
    assert out.usage.completion_tokens == 0 and out.usage.prompt_tokens == len(ids)
    # echo without logprobs: no engine call, the same text
    plain = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, max_tokens=0)
    assert plain.choices[0].text == PROMPT


def test_vllm_prompt_logprobs_field(server):
    ids = _ids(server, PROMPT)
    ref = _hf_logprobs(server.model_dir, ids)
    body = _post(server, prompt=ids, prompt_logprobs=3, max_tokens=2, temperature=0).json()
    plp = body["choices"][0]["prompt_logprobs"]
    assert body["choices"][0]["logprobs"] is None
    assert len(plp) == len(ids) and plp[0] is None
    for t in range(1, len(ids)):
        entry = plp[t]
        own = entry[str(ids[t])]
        assert abs(own["logprob"] - ref[t - 1, ids[t]].item()) < 1e-4
        assert own["rank"] == int((ref[t - 1] > ref[t - 1, ids[t]]).sum()) + 1
        ranks = sorted(e["rank"] for k, e in entry.items() if k != str(ids[t]) or e["rank"] <= 3)
        assert ranks[:3] == [1, 2, 3] and len(entry) <= 4


def test_streamed_echo_logprobs_equal_the_response(server):
    body = dict(prompt=PROMPT, echo=True, logprobs=1, max_tokens=4, temperature=0)
    whole = _post(server, **body).json()["choices"][0]
    text, tokens, values, offsets = "", [], [], []
    with httpx.stream(
        "POST",
        server.url + "/v1/completions",
        timeout=60,
        json={"model": MODEL, "stream": True, **body},
    ) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for c in json.loads(line[6:])["choices"]:
                text += c["text"]
                tokens += c["logprobs"]["tokens"]
                values += c["logprobs"]["token_logprobs"]
                offsets += c["logprobs"]["text_offset"]
    assert text == whole["text"] and tokens == whole["logprobs"]["tokens"]
    assert values == whole["logprobs"]["token_logprobs"]
    assert offsets == whole["logprobs"]["text_offset"]


@pytest.mark.parametrize(
    "body, param",
    [
        (dict(prompt_logprobs=-1), "prompt_logprobs"),
        (dict(prompt_logprobs=21), "prompt_logprobs"),
        (dict(echo=True, logprobs=21), "logprobs"),
        (dict(echo=True, logprobs=-1), "logprobs"),
        (dict(echo=False, max_tokens=0), "max_tokens"),
    ],
)
def test_bad_prompt_logprobs_are_400(server, body, param):
    r = _post(server, prompt=PROMPT, **body)
    assert r.status_code == 400, r.text
    assert param in r.json()["error"]["message"]


# -- lm-evaluation-harness ---------------------------------------------------------------------
MC_DOCS = [
    {
        "question": "The quick brown fox jumps over the",
        "choices": [" lazy dog", " cat", " moon"],
        "answer": 0,
    },
    {"question": "Paris is the capital of", "choices": [" France", " Germany"], "answer": 0},
    {"question": "1 2 3 4 5", "choices": [" 6", " 7 8", " 10"], "answer": 0},
    {"question": "def add(a, b):", "choices": ["\n    return a + b", " pass"], "answer": 0},
]
GEN_DOCS = [
    {"question": "Once upon a time there was", "answer": " a little engine"},
    {"question": "1 2 3 4", "answer": " 5 6"},
    {"question": "The quick brown", "answer": " fox"},
]


def _tasks(folder) -> list[str]:
    """Two tasks on local jsonl files (no hub): multiple choice and generate_until."""
    for name, docs in (("mc", MC_DOCS), ("gen", GEN_DOCS)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    common = (
        "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {path}\n"
        'test_split: test\ndoc_to_text: "{{{{question}}}}"\n'
    )
    (folder / "vserve_mc.yaml").write_text(
        "task: vserve_mc\n"
        + common.format(path=folder / "mc.jsonl")
        + 'output_type: multiple_choice\ndoc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{answer}}"\nmetric_list:\n  - metric: acc\n'
    )
    (folder / "vserve_gen.yaml").write_text(
        "task: vserve_gen\n"
        + common.format(path=folder / "gen.jsonl")
        + 'output_type: generate_until\ndoc_to_target: "{{answer}}"\n'
        'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 6\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n"
    )
    return ["vserve_mc", "vserve_gen"]


def _evaluate(model: str, model_args: dict, folder) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    tasks = _tasks(folder)
    out = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=tasks,
        # our two tasks alone: indexing lm-eval's own thousands of tasks takes 10 s a call
        task_manager=TaskManager(include_path=str(folder), include_defaults=False),
        log_samples=True,
        batch_size=1,
        random_seed=0,
        numpy_random_seed=0,
        torch_random_seed=0,
    )
    samples = {
        t: [s["resps"] for s in sorted(out["samples"][t], key=lambda s: s["doc_id"])] for t in tasks
    }
    return {"results": {t: out["results"][t] for t in tasks}, "samples": samples}


def test_lm_eval_local_completions_equals_hf(server, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    served = _evaluate(
        "local-completions",
        {
            "model": MODEL,
            "base_url": server.url + "/v1/completions",
            "tokenizer": server.model_dir,
            "tokenizer_backend": "huggingface",
            "add_bos_token": True,
            "num_concurrent": 2,
            "max_retries": 1,
            "timeout": 60,
        },
        tmp_path,
    )
    ref = _evaluate(
        "hf",
        {
            "pretrained": server.model_dir,
            "dtype": "float32",
            "device": "cpu",
            "add_bos_token": True,
        },
        tmp_path,
    )
    for task in ("vserve_mc", "vserve_gen"):
        got, want = served["results"][task], ref["results"][task]
        metric = "acc,none" if task == "vserve_mc" else "exact_match,none"
        assert got[metric] == want[metric], (task, got, want)
    # per choice: the same log-likelihood (1e-4) and greediness; the same generated text
    for got_doc, want_doc in zip(
        served["samples"]["vserve_mc"], ref["samples"]["vserve_mc"], strict=True
    ):
        for (got_ll, got_greedy), (want_ll, want_greedy) in zip(
            [r[0] for r in got_doc], [r[0] for r in want_doc], strict=True
        ):
            assert abs(got_ll - want_ll) < 1e-4 and got_greedy == want_greedy
    # (a generation cut mid-character: transformers' decode writes U+FFFD for the dangling
    # bytes, the server's incremental detokenizer -- like vLLM's -- withholds them)
    assert _texts(served["samples"]["vserve_gen"]) == _texts(ref["samples"]["vserve_gen"])
    assert any(_texts(served["samples"]["vserve_gen"]))


def _texts(samples) -> list[str]:
    return [doc[0][0].rstrip("\ufffd") for doc in samples]
