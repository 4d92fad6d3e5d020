"""The drafter contract holds across the package: outside `specdec/drafters/` and the registry
(`specdec/methods.py`) no code names a method (a string literal equal to a registered method's
name) and none probes a drafter (`hasattr`/`getattr` on something called a drafter, `isinstance`
against a drafter class): it reads the registry and the hooks of `specdec.drafters.base.Drafter`.
Every drafter class is a `Drafter`, every registry entry says what the CLI, `tune` and the config
read of it and names a factory that exists, and the registry and the config load no model code."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import specdec
from specdec import drafters, methods
from specdec.drafters.base import Drafter
from specdec.drafters.head_parts import TrainableHead

PACKAGE = Path(specdec.__file__).parent
OUTSIDE = sorted(p for p in PACKAGE.rglob("*.py")
                 if "drafters" not in p.relative_to(PACKAGE).parts and p != PACKAGE / "methods.py")
DRAFTER_MODULES = [importlib.import_module(f"specdec.drafters.{m.name}") for m in pkgutil.iter_modules(drafters.__path__)]


def _where(path: Path, node: ast.AST) -> str:
    return f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"


FIELD = "# a field name"  # a line's mark: its literal names a request field that shares a method's name


def _method_literals(path: Path, names: set[str]) -> list[str]:
    text = path.read_text(encoding="utf-8")
    lines = text.split("\n")
    return [f"{_where(path, node)} {node.value!r}" for node in ast.walk(ast.parse(text))
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names
            and FIELD not in lines[node.lineno - 1]]


def _drafter_probes(path: Path, drafter_classes: set[str]) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args):
            continue
        subject = ast.unparse(node.args[0]).lower()
        if node.func.id in ("hasattr", "getattr") and "drafter" in subject:
            found.append(f"{_where(path, node)} {ast.unparse(node)}")
        if node.func.id == "isinstance" and len(node.args) == 2:
            kinds = {n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(node.args[1])
                     if isinstance(n, (ast.Name, ast.Attribute))}
            if kinds & drafter_classes:
                found.append(f"{_where(path, node)} {ast.unparse(node)}")
    return found


def _drafter_classes() -> set[str]:
    return {name for module in DRAFTER_MODULES
            for name, obj in vars(module).items() if inspect.isclass(obj) and issubclass(obj, Drafter)}


def test_no_method_name_outside_the_drafters() -> None:
    names = set(methods.registered_methods())
    found = [hit for path in OUTSIDE for hit in _method_literals(path, names)]
    assert not found, "method names outside specdec/drafters/ (read them from the registry):\n" + "\n".join(found)


def test_no_code_outside_the_drafters_probes_a_drafter() -> None:
    classes = _drafter_classes() - {"Drafter"}
    found = [hit for path in OUTSIDE for hit in _drafter_probes(path, classes)]
    assert not found, "drafters probed outside specdec/drafters/ (add a hook to Drafter):\n" + "\n".join(found)


@pytest.mark.parametrize("source, expected", [
    ('x = "ngram"', ["'ngram'"]),
    ('f(method="suffix")', ["'suffix'"]),
    ('"""prose that mentions ngram"""', []),
    ('body.get("suffix")  # a field name: OpenAI\'s', []),
])
def test_the_literal_check_can_fail(tmp_path: Path, source: str, expected: list[str]) -> None:
    path = PACKAGE / "_probe_for_test.py"
    try:
        path.write_text(source, encoding="utf-8")
        assert [hit.split(" ", 1)[1] for hit in _method_literals(path, set(methods.registered_methods()))] == expected
    finally:
        path.unlink()


def test_the_probe_check_can_fail() -> None:
    path = PACKAGE / "_probe_for_test.py"
    try:
        path.write_text('hasattr(seq.drafter, "resume")\nisinstance(d, SuffixDrafter)\nisinstance(x, str)\n', encoding="utf-8")
        assert len(_drafter_probes(path, _drafter_classes())) == 2
    finally:
        path.unlink()


def test_every_drafter_class_keeps_the_contract() -> None:
    classes = [obj for module in DRAFTER_MODULES for obj in vars(module).values() if inspect.isclass(obj) and issubclass(obj, Drafter) and obj is not Drafter]
    assert len({c.__name__ for c in classes}) >= 8
    for cls in classes:
        for hook in ("begin", "propose", "commit", "fork"):
            assert getattr(cls, hook) is not getattr(Drafter, hook), f"{cls.__name__} does not define {hook}"


def test_every_method_says_what_the_tools_read() -> None:
    for m in methods.methods():
        assert m.summary and m.summary == m.summary.strip(), m.name
        assert m.default_k >= 1 and m.tune_ks and all(k >= 1 for k in m.tune_ks), m.name
        assert m.tuned is None or "method" not in m.tuned, m.name
        assert callable(methods.resolve(m.factory)), m.name
        assert m.pin is None or callable(methods.resolve(m.pin)), m.name
        assert m.head is None or m.head in methods.trainable_heads(), m.name
    assert methods.DEFAULT_METHOD in methods.registered_methods()
    for name in methods.trainable_heads():
        family = methods.head_family(name)
        assert issubclass(family.head_class(), TrainableHead) and family.summary, name
    assert methods.DEFAULT_HEAD in methods.trainable_heads()


def test_the_config_and_the_registry_load_no_model_code() -> None:
    # `python -X importtime -c "import specdec.config"`: neither torch nor transformers (nor
    # a drafter's module) is among what it imports.
    probe = ("import sys, specdec.config, specdec.methods; "
             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'numpy') "
             "or m.startswith('specdec.drafters')))")
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.strip()
    assert loaded == "[]", loaded


def test_a_training_option_of_another_head_family_is_refused() -> None:
    # The registry says which train-draft options each family reads: its own options dataclass.
    own = {name: set(methods.head_family(name).keys()) for name in methods.trainable_heads()}
    for arch, keys in own.items():
        family = methods.head_family(arch)
        assert issubclass(family.options, methods.TrainOptions) and dataclasses.is_dataclass(family.options)
        assert family.make_options({}) == family.options()  # every option has a default
        for other, other_keys in own.items():
            for key in other_keys - keys:
                default = getattr(methods.head_family(other).options(), key)
                with pytest.raises(specdec.SpecDecError, match=f"{key} is an option of {other} heads"):
                    family.make_options({key: default})  # given at all: this family would not read it
        with pytest.raises(specdec.SpecDecError, match="unknown training option"):
            family.make_options({"no_such_option": 1})
    # A flag names one family: no two families share a key.
    every = [key for name in own for key in methods.head_family(name).keys()]
    assert len(every) == len(set(every)) and sorted(every) == methods.train_option_keys()
    assert any(own.values())
