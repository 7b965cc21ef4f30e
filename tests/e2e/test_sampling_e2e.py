"""Sampling features end to end on a tiny model: seeds, filters, penalties, logit bias,
min_tokens, stop ids and strings, logprobs, n > 1."""

import math

import pytest
import torch

from tests.support.engines import make_llm
from tests.support.hf_reference import PROMPTS
from vserve import SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return make_llm(tiny_model_dir("llama"), max_model_len=256, block_size=4)


def _gen(llm, prompts, params):
    return llm.generate(prompts, params, use_tqdm=False)


def _ids(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


def test_seeded_sampling_reproducible_and_batch_independent(llm):
    sp = SamplingParams(temperature=1.0, seed=1234, max_tokens=20, ignore_eos=True)
    alone = _gen(llm, PROMPTS[0], sp)[0].outputs[0].token_ids
    again = _gen(llm, PROMPTS[0], sp)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=0.8, seed=i, max_tokens=20 + i) for i in range(5)]
    batch = _gen(llm, [PROMPTS[0]] + PROMPTS[1:], [sp] + others)
    assert alone == again == batch[0].outputs[0].token_ids
    other_seed = _gen(llm, PROMPTS[0], sp.clone(seed=99))[0].outputs[0].token_ids
    assert other_seed != alone  # the seed matters


def test_seeded_sampling_independent_of_chunking(tiny_model_dir):
    sp = SamplingParams(
        temperature=1.0, seed=7, top_p=0.9, top_k=50, max_tokens=16, ignore_eos=True
    )
    results = []
    for budget in (None, 5):
        llm = make_llm(tiny_model_dir("llama"), max_model_len=256, max_num_batched_tokens=budget)
        results.append(_ids(_gen(llm, PROMPTS, sp)))
    assert results[0] == results[1]


def test_unseeded_sampling_differs_between_requests(llm):
    outs = _gen(
        llm, [PROMPTS[2]] * 4, SamplingParams(temperature=1.5, max_tokens=12, ignore_eos=True)
    )
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) > 1


def test_filters_that_leave_one_token_equal_greedy(llm):
    greedy = _ids(_gen(llm, PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)))
    for extra in (dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)):
        sp = SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True, **extra)
        assert _ids(_gen(llm, PROMPTS, sp)) == greedy, extra


def test_temperature_sampling_follows_the_distribution(llm):
    """Empirical next-token frequencies over many seeds match softmax(logits / T)."""
    prompt = {"prompt_token_ids": [2, 40, 41, 42]}
    lp = _gen(llm, prompt, SamplingParams(temperature=0, max_tokens=1, logprobs=5))[0]
    top = lp.outputs[0].logprobs[0]
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=1) for s in range(400)]
    outs = _gen(llm, [prompt] * 400, params)
    counts = {}
    for o in outs:
        t = o.outputs[0].token_ids[0]
        counts[t] = counts.get(t, 0) + 1
    for token, entry in top.items():
        expected = math.exp(entry.logprob) * 400
        assert abs(counts.get(token, 0) - expected) < 4 * math.sqrt(expected) + 3, (token, expected)


def test_logit_bias_forces_a_token(llm):
    sp = SamplingParams(temperature=0, max_tokens=6, logit_bias={77: 100}, ignore_eos=True)
    assert all(ids == [[77] * 6] for ids in _ids(_gen(llm, PROMPTS[:3], sp)))


def test_min_tokens_masks_eos_and_stop_ids(llm):
    eos = 1
    sp = SamplingParams(temperature=0, max_tokens=20, min_tokens=5, logit_bias={eos: 100})
    out = _gen(llm, PROMPTS[0], sp)[0].outputs[0]
    assert len(out.token_ids) == 6 and out.token_ids[-1] == eos
    assert eos not in out.token_ids[:5]
    assert out.finish_reason == "stop" and out.stop_reason is None
    sp = SamplingParams(
        temperature=0, max_tokens=20, min_tokens=3, stop_token_ids=[77], logit_bias={77: 100}
    )
    out = _gen(llm, PROMPTS[0], sp)[0].outputs[0]
    assert len(out.token_ids) == 4 and out.stop_reason == 77


def test_ignore_eos_keeps_going(llm):
    sp = SamplingParams(temperature=0, max_tokens=7, logit_bias={1: 100}, ignore_eos=True)
    out = _gen(llm, PROMPTS[0], sp)[0].outputs[0]
    assert out.token_ids == [1] * 7 and out.finish_reason == "length"


def test_penalties_change_output(llm):
    base = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    plain = _ids(_gen(llm, PROMPTS, base))
    for extra in (
        dict(repetition_penalty=5.0),
        dict(frequency_penalty=2.0),
        dict(presence_penalty=2.0),
    ):
        got = _ids(_gen(llm, PROMPTS, base.clone(**extra)))
        assert got != plain, extra
    strong = _ids(_gen(llm, PROMPTS, base.clone(presence_penalty=2.0, repetition_penalty=50.0)))
    for ids in strong:
        assert len(set(ids[0])) == len(ids[0])  # every token at most once


def test_penalty_request_joining_a_batch_does_not_change_neighbours(llm):
    base = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    alone = _ids(_gen(llm, PROMPTS, base))
    mixed = _ids(_gen(llm, PROMPTS, [base.clone(repetition_penalty=3.0)] + [base] * 5))
    assert mixed[1:] == alone[1:]


def test_logprobs_match_the_model(llm, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    sp = SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True)
    out = _gen(llm, PROMPTS[1], sp)[0]
    comp = out.outputs[0]
    assert len(comp.logprobs) == 4
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama"), dtype=torch.float32)
    ids = torch.tensor([out.prompt_token_ids + comp.token_ids])
    with torch.no_grad():
        ref = hf(ids).logits[0].log_softmax(-1)
    n = len(out.prompt_token_ids)
    total = 0.0
    for step, (token, entry) in enumerate(zip(comp.token_ids, comp.logprobs)):
        assert len(entry) in (3, 4) and entry[token].rank == 1  # greedy token ranks first
        for tid, lp in entry.items():
            assert abs(lp.logprob - ref[n - 1 + step, tid].item()) < 1e-4
        top3 = ref[n - 1 + step].topk(3).indices.tolist()
        assert set(top3) <= set(entry)
        total += entry[token].logprob
    assert abs(comp.cumulative_logprob - total) < 1e-6


def test_sampled_token_rank_in_logprobs(llm):
    sp = SamplingParams(temperature=5.0, seed=11, max_tokens=8, logprobs=0, ignore_eos=True)
    comp = _gen(llm, PROMPTS[0], sp)[0].outputs[0]
    assert all(len(e) == 1 for e in comp.logprobs)
    assert any(e[t].rank > 1 for t, e in zip(comp.token_ids, comp.logprobs))


def test_n_greater_than_one(llm):
    sp = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=10, ignore_eos=True)
    out = _gen(llm, PROMPTS[1], sp)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    single = _gen(llm, PROMPTS[1], sp.clone(n=1))[0].outputs[0]
    assert single.token_ids == out.outputs[0].token_ids  # choice 0 keeps the request seed


def test_stop_string_truncates_and_reports(llm):
    base = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    full = _gen(llm, PROMPTS[3], base)[0].outputs[0]
    text = full.text
    stop = text[5:8]
    assert stop and text.find(stop) == 5
    out = _gen(llm, PROMPTS[3], base.clone(stop=[stop]))[0].outputs[0]
    assert out.text == text[:5] and out.finish_reason == "stop" and out.stop_reason == stop
    out = _gen(llm, PROMPTS[3], base.clone(stop=[stop], include_stop_str_in_output=True))[0]
    assert out.outputs[0].text == text[:8]


def test_finish_reason_length(llm):
    out = _gen(llm, PROMPTS[0], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[
        0
    ].outputs[0]
    assert out.finish_reason == "length" and out.stop_reason is None
    assert len(out.token_ids) == 3


def test_outputs_in_input_order_with_token_prompts(llm):
    prompts = [{"prompt_token_ids": [2, 10 + i, 20 + i]} for i in range(5)] + [PROMPTS[0]]
    outs = _gen(llm, prompts, SamplingParams(temperature=0, max_tokens=2))
    assert [o.prompt_token_ids for o in outs[:5]] == [p["prompt_token_ids"] for p in prompts[:5]]
    assert outs[5].prompt == PROMPTS[0]
    assert all(o.finished for o in outs)


def test_chat_applies_template(llm):
    out = llm.chat(
        [{"role": "user", "content": "hello"}], SamplingParams(temperature=0, max_tokens=3)
    )[0]
    tok = llm.get_tokenizer()
    assert tok.decode(out.prompt_token_ids) == "<|user|>hello\n<|assistant|>"


def test_fast_argmax_equals_argmax_with_ties():
    from vserve.workers.sampler import fast_argmax

    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.randn(5, 4096 * 8, generator=gen).to(dtype)
        logits[1, 100] = logits[1, 5000] = logits[1, 30000] = 50.0  # ties: first one wins
        logits[2, -1] = 60.0
        assert torch.equal(fast_argmax(logits), logits.float().argmax(dim=-1))
        assert fast_argmax(logits)[1] == 100
