"""The package's layers import downward only, and the core never imports torch.

Lowest first; a module may import its own layer and the layers below it, never one above
(lazy imports inside functions count too: they are dependencies all the same).

    base         sampling_params, outputs, envs, tokenizer, startup, `vserve.host` (heap,
                 affinity, placement, lifeline, ...): no vserve imports above them
    core         requests, KV blocks, the scheduler and the types they exchange
                 (`vserve.core`), the frozen configs (`vserve.config`), the host policy made
                 from them (`vserve.host.policy`); no torch
    models       `vserve.models`, `vserve.attention`, `vserve.cpu_ops`,
                 `vserve.csrc_triton` (the `csrc_triton/` folder)
    workers      `vserve.workers` (the `workers/` folder): model runner, sampler, worker
                 processes
    executor     `vserve.executor`: runs the workers for the engine
    engine       `vserve.engine`: engine core, its process and clients, front-end processing
    entrypoints  `vserve.entrypoints` (LLM, the OpenAI server), `vserve.bench`
    cli          `vserve.cli`: the `vserve` command over both

No two modules may import each other, directly or through others (an import loop): the
graph's strongly connected components are single modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# folder -> the package it installs as
FOLDERS = {"vserve": "vserve", "workers": "vserve.workers", "csrc_triton": "vserve.csrc_triton"}
LAYERS = [
    (
        "base",
        [
            "vserve.sampling_params",
            "vserve.outputs",
            "vserve.envs",
            "vserve.cache_files",
            "vserve.host",
            "vserve.tokenizer",
            "vserve.startup",
        ],
    ),
    ("core", ["vserve.core", "vserve.config", "vserve.host.policy"]),
    (
        "models",
        [
            "vserve.models",
            "vserve.attention",
            "vserve.cpu_ops",
            "vserve.csrc_triton",
            "vserve.distributed",
        ],
    ),
    ("workers", ["vserve.workers"]),
    ("executor", ["vserve.executor"]),
    ("engine", ["vserve.engine"]),
    ("entrypoints", ["vserve.entrypoints", "vserve.bench", "vserve"]),
    ("cli", ["vserve.cli"]),
]
TORCH_FREE = ["vserve.core", "vserve.config", "vserve.sampling_params", "vserve.outputs"]


def _rank(module: str) -> int:
    """The layer of a module: the longest listed prefix that owns it."""
    best, rank = -1, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, rank = len(p), i
    assert rank >= 0, f"{module} belongs to no layer: add it to LAYERS"
    return rank


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    parts[0] = FOLDERS[parts[0]]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, module: str) -> set[str]:
    """Every module the file imports, at the top or inside functions, in installed names."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level:
            base = package.split(".")[: len(package.split(".")) - node.level + 1]
            found.add(".".join(base + ([node.module] if node.module else [])))
        elif isinstance(node, ast.ImportFrom):
            found.add(node.module)
            if node.module and node.module.split(".")[0] == "vserve":
                # `from vserve.x import y` may name a submodule y: count vserve.x.y too
                found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def _graph() -> dict[str, set[str]]:
    return {
        _module_name(p): _imports(p, _module_name(p))
        for folder in FOLDERS
        for p in sorted((ROOT / folder).rglob("*.py"))
    }


GRAPH = _graph()


def test_every_module_has_a_layer():
    for module in GRAPH:
        _rank(module)


def test_no_top_level_workers_or_csrc_triton_imports():
    """`workers/` and `csrc_triton/` install as `vserve.workers` / `vserve.csrc_triton`: a
    bare `import workers` would load a second copy (or another distribution's package)."""
    bad = sorted(
        f"{m} imports {i}"
        for m, imps in GRAPH.items()
        for i in imps
        if i.split(".")[0] in ("workers", "csrc_triton")
    )
    assert not bad, bad


def test_imports_go_downward_only():
    upward = []
    for module, imports in GRAPH.items():
        for target in imports:
            if target.split(".")[0] != "vserve" or target == "vserve":
                continue
            if _rank(target) > _rank(module):
                upward.append(
                    f"{module} ({LAYERS[_rank(module)][0]}) imports {target} "
                    f"({LAYERS[_rank(target)][0]})"
                )
    assert not upward, "\n".join(sorted(upward))


@pytest.mark.parametrize("prefix", TORCH_FREE)
def test_core_imports_no_torch(prefix):
    heavy = sorted(
        f"{m} imports {i}"
        for m, imps in GRAPH.items()
        if m == prefix or m.startswith(prefix + ".")
        for i in imps
        if i.split(".")[0] in ("torch", "triton", "transformers")
    )
    assert not heavy, heavy


def _loops(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    loops: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in graph or target == node:
                continue  # not a module of the tree (a name imported from one), or itself
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                loops.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return loops


def test_no_import_loops():
    """The package face (`vserve/__init__.py` re-exports `LLM`) is left out: every module
    is imported through it, so it closes no loop of its own making."""
    graph = {m: {i for i in imps if i != "vserve"} for m, imps in GRAPH.items() if m != "vserve"}
    assert not _loops(graph), _loops(graph)


def test_the_loop_check_sees_a_loop():
    assert _loops({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _loops({"a": {"b"}, "b": set()}) == []


def test_the_check_sees_an_upward_import():
    """The walker itself: a core module that imported the engine would be caught."""
    assert _rank("vserve.engine.messages") > _rank("vserve.core.scheduler")
    assert _rank("vserve.workers.sampler") > _rank("vserve.core.outputs")
    assert _rank("vserve.executor.base") < _rank("vserve.engine.core")


def test_pyproject_installs_every_package_under_vserve():
    tomllib = pytest.importorskip("tomllib")
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {
        _module_name(p.parent / "__init__.py")
        for folder in FOLDERS
        for p in (ROOT / folder).rglob("__init__.py")
    }
    assert set(setup["packages"]) == folders
    assert setup["package-dir"] == {v: k for k, v in FOLDERS.items() if k != "vserve"}


def test_a_checkout_on_the_path_imports_its_own_workers(tmp_path):
    """Without any installer's mapping (the editable finder removed), a checkout on
    PYTHONPATH finds `vserve.workers` and `vserve.csrc_triton` in its own folders."""
    import subprocess
    import sys

    code = (
        "import sys; sys.meta_path[:] = [f for f in sys.meta_path "
        "if '__editable__' not in repr(f) and '__editable__' not in "
        "getattr(f, '__module__', '')]; "
        "import vserve.workers.messages as w, vserve.csrc_triton as c; "
        "print(w.__file__); print(c.__file__)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(ROOT), "PATH": ""},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [
        str(ROOT / "workers" / "messages.py"),
        str(ROOT / "csrc_triton" / "__init__.py"),
    ]


def _loaded_in_a_fresh_process(imports: str, names: tuple[str, ...]) -> list[str]:
    """Which of `names` a fresh interpreter has loaded after running `imports`."""
    import subprocess
    import sys

    code = f"import sys\n{imports}\nprint(sorted(m for m in {names!r} if m in sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr
    return eval(out.stdout.strip())  # noqa: S307 -- our child's list of names


def test_importing_the_core_loads_no_torch():
    """The static walk misses string imports (registries); this imports the core for real."""
    imports = "import vserve.core.scheduler, vserve.config, vserve.core.outputs"
    names = ("torch", "transformers", "triton", "xgrammar")
    assert _loaded_in_a_fresh_process(imports, names) == []


def test_the_command_line_loads_no_web_stack_before_the_engine():
    """`vserve serve` parses and checks its flags (admission limits, tool settings) before it
    starts the engine, and imports the web stack (FastAPI, pydantic, uvicorn: most of its
    imports) on a thread while the engine core and its workers start: none of it before."""
    imports = (
        "from vserve.cli import build_parser\n"
        "from vserve.entrypoints.openai.limits import AdmissionLimits\n"
        "from vserve.entrypoints.openai.run import run_server\n"
        "from vserve.entrypoints.openai.tool_settings import ToolSettings\n"
        "args = build_parser().parse_args(['serve', '--tool-call-parser', 'hermes'])\n"
        "AdmissionLimits.from_args(args); ToolSettings.from_args(args)"
    )
    names = ("fastapi", "pydantic", "starlette", "uvicorn", "torch")
    assert _loaded_in_a_fresh_process(imports, names) == []
