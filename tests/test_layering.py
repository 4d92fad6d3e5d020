"""Dependencies point down: the module import graph of the package has no cycle, and engine code
never imports benchmark code. Only imports that run are counted (not those under
`if TYPE_CHECKING:`); an import inside a function counts too, so a cycle cannot hide there."""

from __future__ import annotations

import ast
from pathlib import Path

import specdec

PACKAGE = Path(specdec.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_imports(path: Path) -> set[str]:
    """The specdec modules a file imports when it runs."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            skipped.update(id(child) for stmt in node.body for child in ast.walk(stmt))
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("specdec"):
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)  # `from pkg import module`
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("specdec"))
    return found


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: {m for m in _runtime_imports(path) if m in files and m != name} for name, path in files.items()}


def _package_edges(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    # Importing a.b.c runs a/__init__ and a/b/__init__ first: count those as imported too.
    edges = {}
    for name, targets in graph.items():
        full = set()
        for target in targets:
            parts = target.split(".")
            full.update(".".join(parts[:i]) for i in range(2, len(parts) + 1))
        edges[name] = {t for t in full if t in graph and t != name and not name.startswith(t + ".")}
    return edges


def test_no_import_cycle_below_the_api() -> None:
    # specdec/__init__ re-exports the API, so every module "imports" the top package; the
    # graph below it must be acyclic.
    graph = {name: {t for t in targets if t != "specdec"} for name, targets in _package_edges(_graph()).items()
             if name != "specdec"}
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                cycle = path[path.index(target):] + [target]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_the_cycle_check_can_fail(tmp_path: Path) -> None:
    # The parser sees a runtime import inside a function and ignores one under TYPE_CHECKING.
    module = tmp_path / "m.py"
    module.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from specdec.config import X\n"
                      "def f():\n    from specdec.bench import tune\n")
    assert _runtime_imports(module) == {"specdec.bench", "specdec.bench.tune"}


def test_engine_code_never_imports_benchmark_code() -> None:
    lower = ("specdec.engine", "specdec.models", "specdec.drafters", "specdec.sampling", "specdec.config", "specdec.api",
             "specdec.server", "specdec.training")
    for name, targets in _graph().items():
        if name.startswith(lower):
            assert not {t for t in targets if t.startswith("specdec.bench")}, name


def test_kernels_are_the_bottom_layer() -> None:
    # The kernels serve the models; they import nothing of specdec's but where to build and
    # whether torch's OpenMP spin is bounded.
    for name, targets in _graph().items():
        if name.startswith("specdec.kernels"):
            assert targets <= {"specdec.paths", "specdec._openmp", "specdec.kernels", "specdec.kernels.packing"}, \
                (name, targets)


# The layers of docs/architecture.md, bottom up: a package imports only from lower ones (and
# itself). The faces (cli) sit on the tools, the tools (bench, server, training) on the library;
# no tool imports another, and the server does not use the library's LLM.
LAYERS = [
    ("errors", "paths", "data", "_openmp"),  # data: packaged files (prompts, profiles, heads), no code
    ("methods",),  # the registry: each method's options, and its factory by name (imported to build)
    ("kernels",),
    ("models", "sampling"),
    ("config",),  # validates a SpeculativeConfig's options against the registry; no model code
    ("drafters",),
    ("engine",),
    ("api",),
    ("bench", "server", "training"),
    ("cli",),
]


def _rank(module: str) -> int | None:
    parts = module.split(".")
    if len(parts) < 2:
        return None  # the top package: it re-exports the API, and `from specdec import x` names x
    return next(i for i, layer in enumerate(LAYERS) if parts[1] in layer)


def _upward(graph: dict[str, set[str]]) -> list[str]:
    """Every import of a module from its own layer or one above it (other than its own package)."""
    found = []
    for name, targets in graph.items():
        low = _rank(name)
        for target in targets:
            high = _rank(target)
            if low is None or high is None or target.split(".")[1] == name.split(".")[1]:
                continue
            if high >= low:
                found.append(f"{name} imports {target}")
    return found


def test_imports_point_down_the_layers() -> None:
    assert _upward(_graph()) == []


def test_the_layer_check_can_fail() -> None:
    graph = {"specdec.engine.batch": {"specdec.server.app", "specdec.models.runner"},
             "specdec.bench.tune": {"specdec.server.metrics", "specdec.bench.report"}}
    assert _upward(graph) == ["specdec.engine.batch imports specdec.server.app",
                              "specdec.bench.tune imports specdec.server.metrics"]


def test_every_package_has_a_layer() -> None:
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists() or p.suffix == ".py"}
    named = {name.removesuffix(".py") for name in packages} - {"__init__", "__main__", "__pycache__"}
    assert named <= {m for layer in LAYERS for m in layer}, named - {m for layer in LAYERS for m in layer}
