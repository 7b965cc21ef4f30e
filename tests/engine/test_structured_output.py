"""Structured output (xgrammar) end to end: JSON schemas validate, sync == async (where
sampling is deferred until the grammar has seen the in-flight tokens), free requests in a
mixed batch are untouched, and a bad grammar fails only its request."""

import json

import pytest

from tests.support.engines import make_llm
from tests.support.hf_reference import PROMPTS
from vserve import SamplingParams, StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "enum": ["yes", "no", "maybe"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {
            "type": "array",
            "items": {"type": "string", "enum": ["a", "b", "c"]},
            "maxItems": 3,
        },
    },
    "required": ["answer", "count", "tags"],
    "additionalProperties": False,
}


def _validate(obj) -> None:
    assert set(obj) == {"answer", "count", "tags"}
    assert obj["answer"] in ("yes", "no", "maybe")
    assert isinstance(obj["count"], int) and 0 <= obj["count"] <= 99
    assert isinstance(obj["tags"], list) and len(obj["tags"]) <= 3
    assert all(t in ("a", "b", "c") for t in obj["tags"])


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    model = tiny_model_dir("llama")
    return {
        mode: make_llm(model, max_model_len=256, async_scheduling=mode == "async")
        for mode in ("sync", "async")
    }


def _json_params(**kw):
    return SamplingParams(
        max_tokens=80,
        structured_outputs=StructuredOutputsParams(json=SCHEMA),
        **{"temperature": 0, **kw},
    )


def test_json_schema_outputs_validate_sync_and_async_equal(engines):
    results = {}
    for mode, llm in engines.items():
        outs = llm.generate(PROMPTS, _json_params(), use_tqdm=False)
        for out in outs:
            comp = out.outputs[0]
            assert comp.finish_reason == "stop", comp
            _validate(json.loads(comp.text))
        results[mode] = [o.outputs[0].token_ids for o in outs]
    assert results["sync"] == results["async"]


def _record_steps(core) -> tuple[list[tuple[str, int]], list[int]]:
    """Log, in order, each step's launch (its forward), sampling and commit; and list the
    steps that sample a grammar request."""
    events, grammar_steps, executor = [], [], core.executor
    execute, sample, commit = executor.execute_model, executor.sample_tokens, core._commit

    def on_execute(so, defer_sampling=False):
        events.append(("launch", so.step_id))
        if so.grammar_req_ids:
            grammar_steps.append(so.step_id)
        if not defer_sampling:
            events.append(("sample", so.step_id))
        return execute(so, defer_sampling)

    def on_sample(so):
        events.append(("sample", so.step_id))
        return sample(so)

    def on_commit(so, runner_output):
        events.append(("commit", so.step_id))
        return commit(so, runner_output)

    executor.execute_model, executor.sample_tokens = on_execute, on_sample
    core._commit = on_commit
    return events, grammar_steps


def _deferred_steps(events: list[tuple[str, int]]) -> list[int]:
    """Steps launched before an older step committed and sampled only after that commit: the
    forward overlapped the older step, the grammar bitmask waited for its tokens."""
    at = {(kind, step): i for i, (kind, step) in enumerate(events)}
    return [
        step
        for kind, step in events
        if kind == "launch"
        and any(
            at[("launch", step)] < i < at[("sample", step)]
            for i, (k, older) in enumerate(events)
            if k == "commit" and older < step
        )
    ]


def _fake_grammar_core():
    from tests.support.fakes import FakeExecutor, FakeRunner, FakeStructured, fake_engine_config
    from vserve.engine.core import EngineCore

    runner = FakeRunner(check_grammar=True)  # raises on a bitmask filled too early
    core = EngineCore(fake_engine_config(async_scheduling=True), FakeExecutor(runner=runner))
    core.structured = core.scheduler.structured = FakeStructured()
    return core


def _run_fake(core, params) -> list[int]:
    from tests.support.fakes import core_request

    core.add_request(core_request("g", [4, 5, 6], max_tokens=10, **params))
    tokens = []
    for _ in range(200):
        if not core.has_work():
            return tokens
        for out in core.step_fn() or []:
            tokens += out.new_token_ids
    raise AssertionError("the engine did not drain")


@pytest.mark.parametrize("engine", ["fake", "real"])
def test_async_defers_sampling_of_grammar_steps(request, engine):
    """Async scheduling with a grammar request: every step after its first launches its
    forward while the previous step is in flight, and samples (with the bitmask) only after
    that step committed. Neither a stale bitmask nor a step waiting for the previous one's
    commit before its forward would pass."""
    llm = request.getfixturevalue("engines")["async"] if engine == "real" else None
    core = _fake_grammar_core() if llm is None else llm.engine.client.core
    events, grammar_steps = _record_steps(core)
    try:
        if engine == "fake":
            grammar = StructuredOutputsParams(regex="[a-z]+")
            num_tokens = len(_run_fake(core, {"structured_outputs": grammar}))
        else:
            out = llm.generate(PROMPTS[0], _json_params(), use_tqdm=False)[0]
            _validate(json.loads(out.outputs[0].text))
            num_tokens = len(out.outputs[0].token_ids)
    finally:
        for obj, name in (
            (core.executor, "execute_model"),
            (core.executor, "sample_tokens"),
            (core, "_commit"),
        ):
            vars(obj).pop(name, None)
    assert core.depth == 2 and num_tokens >= 8 and len(grammar_steps) >= num_tokens
    # all but the first (no token of its request is in flight before it)
    assert _deferred_steps(events) == grammar_steps[1:]


def test_seeded_sampling_with_schema_validates(engines):
    for seed in range(4):
        out = engines["async"].generate(
            PROMPTS[1], _json_params(temperature=1.0, seed=seed), use_tqdm=False
        )[0]
        _validate(json.loads(out.outputs[0].text))


BOUNDED = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 6},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
    },
    "required": ["name", "tags"],
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    "text, ok",
    [
        ('"ab"', True),
        ('"a\\nb"', True),
        ('"\\u0041"', True),
        ('"a\\""', True),
        ('"a\x01"', False),
        ('"a\tb"', False),
        ('"a\nb"', False),
        ('"abcdefg"', False),
    ],
)
def test_bounded_string_follows_json_string_rules(text, ok):
    """xgrammar writes minLength / maxLength strings with a class that lets raw control
    characters in and escapes out; the mended grammar takes JSON strings, an escape counting
    as one character."""
    from xgrammar.testing import _is_grammar_accept_string

    from vserve.engine.grammars import json_schema_grammar

    schema = {"type": "string", "minLength": 1, "maxLength": 6}
    assert _is_grammar_accept_string(json_schema_grammar(json.dumps(schema)), text) is ok


NESTED = {
    "type": "object",
    "properties": {
        "a": {"type": "string", "maxLength": 2},
        "b": {"type": "array", "items": {"type": "string", "minLength": 3}, "maxItems": 2},
        "c": {
            "type": "object",
            "properties": {"d": {"type": "string", "maxLength": 40}},
            "required": ["d"],
        },
    },
    "required": ["a", "b", "c"],
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    "obj, ok",
    [
        ({"a": "xy", "b": ["abc", "\n\t\u0001"], "c": {"d": 'q"' * 10}}, True),
        ({"a": "", "b": [], "c": {"d": ""}}, True),
        ({"a": "xyz", "b": [], "c": {"d": ""}}, False),  # a: over its maxLength
        ({"a": "", "b": ["ab"], "c": {"d": ""}}, False),  # b[0]: under its minLength
        ({"a": "", "b": [], "c": {"d": "q" * 41}}, False),
    ],
)
def test_every_bounded_string_of_a_schema_is_mended(obj, ok):
    """Several bounded strings, in arrays and nested objects, each with its own bounds: each
    takes escapes (one character each) and no raw control character."""
    from xgrammar.testing import _is_grammar_accept_string

    from vserve.engine.grammars import json_schema_grammar

    grammar = json_schema_grammar(json.dumps(NESTED))
    text = json.dumps(obj, separators=(", ", ": "))  # the compact form the grammar writes
    assert _is_grammar_accept_string(grammar, text) is ok
    if ok:  # the same document with a raw control character inside a bounded string
        raw = text.replace('"c": {"d": "', '"c": {"d": "\x01', 1)
        assert not _is_grammar_accept_string(grammar, raw)


def test_sampled_bounded_strings_are_valid_json(engines):
    """Temperature 1 over a random model picks control-character tokens whenever the grammar
    lets it: every output must parse and keep its lengths."""
    params = [
        SamplingParams(
            temperature=1.0,
            seed=seed,
            max_tokens=80,
            structured_outputs=StructuredOutputsParams(json=BOUNDED),
        )
        for seed in range(12)
    ]
    outs = engines["async"].generate(
        [PROMPTS[seed % len(PROMPTS)] for seed in range(12)], params, use_tqdm=False
    )
    for out in outs:
        obj = json.loads(out.outputs[0].text)
        assert 1 <= len(obj["name"]) <= 6 and all(len(t) <= 3 for t in obj["tags"])


def test_free_requests_unchanged_by_grammar_neighbours(engines):
    free = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    for llm in engines.values():
        alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, free, use_tqdm=False)]
        mixed = llm.generate(
            PROMPTS + PROMPTS[:3], [free] * len(PROMPTS) + [_json_params()] * 3, use_tqdm=False
        )
        assert [o.outputs[0].token_ids for o in mixed[: len(PROMPTS)]] == alone
        for out in mixed[len(PROMPTS) :]:
            _validate(json.loads(out.outputs[0].text))


@pytest.mark.parametrize(
    "kind, value, check",
    [
        (
            "regex",
            r"[a-z]{3,6}@[a-z]{2,4}\.(com|org)",
            lambda t: __import__("re").fullmatch(r"[a-z]{3,6}@[a-z]{2,4}\.(com|org)", t),
        ),
        ("choice", ["red", "green", "blue"], lambda t: t in ("red", "green", "blue")),
        (
            "grammar",
            'root ::= "(" digit+ ")"\ndigit ::= [0-9]',
            lambda t: __import__("re").fullmatch(r"\(\d+\)", t),
        ),
    ],
)
def test_regex_choice_grammar_json_object(engines, kind, value, check):
    params = SamplingParams(
        temperature=0.8,
        seed=3,
        max_tokens=60,
        structured_outputs=StructuredOutputsParams(**{kind: value}),
    )
    for out in engines["async"].generate(PROMPTS[:3], params, use_tqdm=False):
        assert out.outputs[0].finish_reason == "stop", out.outputs[0]
        assert check(out.outputs[0].text), out.outputs[0].text


def _json_matcher(llm):
    """A fresh matcher of xgrammar's own JSON grammar (not the engine's) over llm's vocabulary."""
    import xgrammar as xgr

    from vserve.tokenizer import load_tokenizer

    m = llm.engine.config.model
    info = xgr.TokenizerInfo.from_huggingface(
        load_tokenizer(m.tokenizer), vocab_size=m.vocab_size, stop_token_ids=m.eos_token_ids
    )
    compiled = xgr.GrammarCompiler(info).compile_builtin_json_grammar()
    return lambda: xgr.GrammarMatcher(compiled)


def test_json_object(engines):
    """Any JSON object, every output: a random model may write endless keys, so one cut at
    max_tokens must be a prefix of JSON (each token accepted by xgrammar's JSON grammar) that
    opens an object; one that finished must parse as an object. Some must finish."""
    params = SamplingParams(
        temperature=0, max_tokens=200, structured_outputs=StructuredOutputsParams(json_object=True)
    )
    outs = engines["async"].generate(PROMPTS, params, use_tqdm=False)
    matcher = _json_matcher(engines["async"])
    m = matcher()  # the check can fail: text that is no JSON is refused
    assert not all(m.accept_token(t) for t in engines["async"].get_tokenizer().encode("hello x"))
    for c in (o.outputs[0] for o in outs):
        m = matcher()
        assert all(m.accept_token(t) for t in c.token_ids), c.text
        assert c.text.lstrip().startswith("{"), c.text
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.text), dict)
        else:
            assert c.finish_reason == "length" and len(c.token_ids) == 200
    assert any(o.outputs[0].finish_reason == "stop" for o in outs)


@pytest.mark.parametrize(
    "kind, value, match",
    [
        ("grammar", 'root ::= "unterminated', "invalid grammar"),
        ("regex", "[a-", "invalid regex"),
        ("json", {"type": 5}, "invalid JSON schema"),
        ("json", "[1, 2]", "invalid JSON schema"),
    ],
)
def test_invalid_grammar_raises_before_the_engine(engines, kind, value, match):
    llm = engines["async"]
    bad = SamplingParams(max_tokens=5, structured_outputs=StructuredOutputsParams(**{kind: value}))
    with pytest.raises(ValueError, match=match):
        llm.generate([PROMPTS[0], PROMPTS[1]], bad, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_bad_grammar_fails_its_request_only(engines, monkeypatch):
    """A grammar the up-front parse lets through but the engine cannot compile."""
    monkeypatch.setattr("vserve.engine.processor.check_grammar", lambda params: None)
    llm = engines["async"]
    bad = SamplingParams(
        max_tokens=5, structured_outputs=StructuredOutputsParams(grammar='root ::= "unterminated')
    )
    good = SamplingParams(temperature=0, max_tokens=5)
    outs = llm.generate([PROMPTS[0], PROMPTS[1]], [bad, good], use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error"
    assert "cannot compile the grammar" in outs[0].outputs[0].stop_reason
    assert len(outs[1].outputs[0].token_ids) == 5
    assert llm.engine.client.core.scheduler.kv.pool.num_used_blocks == 0


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_ignore_eos_with_a_grammar_stops_when_the_grammar_ends(engines, mode):
    """The grammar accepted EOS and terminated, ignore_eos kept the request going,
    and the next mask fill raised in the busy loop (the engine died). A finished grammar now
    finishes its request, whatever ignore_eos says."""
    llm = engines[mode]
    choice = SamplingParams(
        temperature=0,
        max_tokens=16,
        ignore_eos=True,
        structured_outputs=StructuredOutputsParams(choice=["yes", "no"]),
    )
    schema = _json_params(ignore_eos=True)
    outs = llm.generate(PROMPTS[:2] + PROMPTS[:2], [choice] * 2 + [schema] * 2, use_tqdm=False)
    for out in outs[:2]:
        assert out.outputs[0].finish_reason == "stop" and out.outputs[0].text in ("yes", "no")
    for out in outs[2:]:
        assert out.outputs[0].finish_reason == "stop"
        _validate(json.loads(out.outputs[0].text))
    after = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    assert len(after[0].outputs[0].token_ids) == 5


class _FailingGrammar:
    """Accepts everything; raises from accept or fill after `limit` calls (an xgrammar error)."""

    def __init__(self, where: str, limit: int = 2) -> None:
        self.where, self.limit = where, limit

    def _tick(self, where: str) -> None:
        if where == self.where:
            self.limit -= 1
            if self.limit < 0:
                raise RuntimeError(f"{where} blew up")

    def accept(self, token_id: int) -> bool:
        self._tick("accept")
        return True

    def is_terminated(self) -> bool:
        return False


class _FailingStructured:
    def new_state(self, compiled, starts_after=None):
        return _FailingGrammar(compiled)

    def allocate_bitmask(self, num_rows):
        return [[-1] for _ in range(num_rows)]

    def fill(self, state, bitmask, row):
        state._tick("fill")

    def release(self, compiling):
        pass


@pytest.mark.parametrize("where", ["accept", "fill"])
@pytest.mark.parametrize("depth", [1, 2])
def test_grammar_exception_fails_only_its_request(where, depth):
    """An exception from a grammar call (accept or the mask fill) ends that request with an
    error; before, it escaped the busy loop and killed the engine core."""
    from concurrent.futures import Future

    from tests.support.fakes import Driver, expected_tokens, make_request, make_scheduler

    sched = make_scheduler(async_scheduling=depth > 1)
    sched.structured = _FailingStructured()
    schedule = sched.schedule

    def schedule_and_fill():  # as the engine does (the fake grammar has no real state)
        so = schedule()
        sched.fill_grammar_bitmask(so)
        return so

    sched.schedule = schedule_and_fill
    driver = Driver(sched, depth=depth)
    req = make_request(
        "g", [1, 2, 3], max_tokens=10, structured_outputs=StructuredOutputsParams(regex="a+")
    )
    req.grammar_future = Future()
    req.grammar_future.set_result(where)
    driver.add(req)
    driver.add(make_request("free", [4, 5, 6], max_tokens=6))
    driver.run()
    assert driver.finish["g"] == "error" and len(driver.outputs["g"]) <= 3
    assert driver.outputs["free"] == expected_tokens([4, 5, 6], 6)
    assert sched.kv.pool.num_used_blocks == 0


def test_structured_params_validation():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="not a valid schema"):
        StructuredOutputsParams(json="{not json")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(regex=123), "regex must be a string"),
        (dict(grammar={"a": 1}), "grammar must be a string"),
        (dict(choice="abc"), "choice must be a list"),
        (dict(choice=[1, 2]), "choice must be a list of non-empty strings"),
        (dict(json=5), "json must be a string or an object"),
        (dict(json_object=0), "json_object must be a boolean"),
    ],
)
def test_structured_params_types(kwargs, match):
    """Wrong types raise at once (msgspec checks none in __init__; before, they reached the
    engine core and killed its input thread)."""
    with pytest.raises(ValueError, match=match):
        StructuredOutputsParams(**kwargs)


def test_structured_outputs_request_keeps_json_on_the_wire():
    """The request field is `json` on the wire, under another attribute name: `json` shadowed
    BaseModel.json and pydantic warned at every import of the protocol module."""
    import subprocess
    import sys

    from pydantic import ValidationError

    from vserve.entrypoints.openai.protocol import CompletionRequest

    proc = subprocess.run(
        [
            sys.executable,
            "-W",
            "error::UserWarning",
            "-c",
            "import vserve.entrypoints.openai.protocol",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    req = CompletionRequest(model="m", prompt="x", structured_outputs={"json": SCHEMA})
    assert req.structured_params() == StructuredOutputsParams(json=SCHEMA)
    assert req.structured_outputs.as_dict() == {"json": SCHEMA}
    with pytest.raises(ValidationError, match="json_schema"):
        CompletionRequest(model="m", prompt="x", structured_outputs={"json_schema": SCHEMA})


@pytest.mark.parametrize("bound", [6, 10**6, 2**62])
def test_no_bounded_string_class_is_left_and_no_false_warning(bound, caplog):
    """Small and large bounds alike: the mended grammar holds no raw-control-character class,
    and the warning for an unknown form stays quiet (a huge bound is written unbounded)."""
    from vserve.engine import grammars as so

    so._warn_unmended.cache_clear()
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": bound}}}
    grammar = so.json_schema_grammar(json.dumps(schema))
    assert so._BOUNDED_CLASS not in str(grammar)
    assert "does not mend" not in caplog.text
