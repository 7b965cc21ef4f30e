import os
import re
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VSERVE_DEBUG_INVARIANTS", "1")  # engine cores check KV blocks at idle
if not __import__("torch").cuda.is_available():
    # Triton decides at import whether to interpret: set before anything imports it
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.support.tiny_models import build_model  # noqa: E402

pytest_plugins = ["pytester", "tests.support.cpu_kernels"]  # (its fixtures: ops, two_threads)

# skip reasons of tests/cpu_ops, tests/workers/test_cpu_ops.py, test_sampler_kernel.py and
# tests/models/test_quant_linear.py when the C++ kernels cannot be built; CPU features (AVX2,
# VNNI, AMX, bf16) and devices a machine lacks are legitimate skips and do not match
_KERNEL_BUILD_SKIP = re.compile(r"no C\+\+ compiler|cannot be built|failed to build")


def is_kernel_build_skip(reason: str) -> bool:
    return _KERNEL_BUILD_SKIP.search(reason) is not None


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() not in ("", "0", "false")


def pytest_collection_modifyitems(config, items):
    """The forced-ISA build tests run last: their builds run beside the rest of the suite
    (tests/support/isa_builds.py)."""
    from tests.support.isa_builds import TEST

    builds = [item for item in items if item.nodeid.startswith(TEST)]
    if builds:
        items[:] = [item for item in items if not item.nodeid.startswith(TEST)] + builds


def pytest_collection_finish(session):
    """The selected forced-ISA builds start now, at the lowest CPU priority."""
    from tests.support import isa_builds

    if session.config.option.collectonly:
        return
    for choice in isa_builds.choices_of(session.items):
        from tests.cpu_ops.test_isa import CHILD_CODE

        isa_builds.start(choice, CHILD_CODE)


def pytest_sessionfinish(session, exitstatus):
    from tests.support import isa_builds

    isa_builds.stop()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """In CI (CI=true) a skip because the kernels could not be built fails the test: there a
    missing compiler or a build error is a broken setup, not a machine without a feature."""
    report = yield
    if not report.skipped or hasattr(report, "wasxfail") or not in_ci():
        return report
    longrepr = report.longrepr
    reason = (longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)).removeprefix(
        "Skipped: "
    )
    if is_kernel_build_skip(reason):
        report.outcome = "failed"
        report.longrepr = f"CI is set, and the C++ kernels were not built: {reason}"
    return report


def resolved(model: str) -> str:
    """`model`, its config resolved and its tokenizer checked here as a front end does it,
    into vserve's caches (and a GGUF's folder described): a server or an engine started in a
    new process on a model folder this session built finds them there, as it would for any
    model it had served before, instead of importing transformers and torch to resolve them
    (4-5 s each of the first start on a new folder)."""
    from vserve import tokenizer
    from vserve.engine.arg_utils import EngineArgs

    folder = Path(EngineArgs(model=model).create_engine_config().model.tokenizer)
    if (folder / "tokenizer.json").is_file():
        # the check's verdict on disk only, not `load_tokenizer`'s copy in this process: a
        # test may still change the folder (tiny_models.thinking_model adds tokens)
        tokenizer._load_checked(folder)
    return model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-models")
    built = {}

    def get(kind: str, **overrides) -> str:
        key = (kind, tuple(sorted(overrides.items())))
        if key not in built:
            name = kind + "".join(f"-{k}{v}" for k, v in sorted(overrides.items()))
            built[key] = resolved(str(build_model(kind, root / name, **overrides)))
        return built[key]

    return get


@pytest.fixture(scope="session")
def tiny_llama_server(tiny_model_dir):
    """`vserve serve` on the tiny llama (fp32, served as "tiny", 512 tokens of context),
    started once for the modules that test the OpenAI surface and `vserve bench serve`
    through it; its exit status is checked when the session ends. Tests that share it read
    what they caused (prompts no other test sends, counters as differences)."""
    from tests.support.openai_server import TINY_ARGS, TINY_MAX_MODEL_LEN, TINY_NAME, serving

    model_dir = tiny_model_dir("llama")
    args = [model_dir, *TINY_ARGS, "--served-model-name", TINY_NAME]
    with serving([*args, "--max-model-len", str(TINY_MAX_MODEL_LEN)]) as srv:
        srv.model_dir = model_dir
        yield srv


@pytest.fixture(scope="session")
def tiny_gguf_dir(tiny_model_dir, tmp_path_factory):
    """tiny_model_dir's model written as a GGUF model folder (tests/support/tiny_gguf.py)."""
    from tests.support.tiny_gguf import build_gguf_model

    root = tmp_path_factory.mktemp("tiny-gguf")

    built: dict[str, str] = {}

    def get(kind: str, **overrides) -> str:
        hf = tiny_model_dir(kind, **overrides)
        if hf not in built:
            built[hf] = resolved(str(build_gguf_model(hf, root / Path(hf).name)))
        return built[hf]

    return get
