"""Every test can fail: each `test_*` function holds an assert, or calls something that checks
(pytest.raises / fail / warns, jsonschema's validate, a helper named assert_* or check_*). A test
that only runs code passes whatever the code does."""

from __future__ import annotations

import ast
from pathlib import Path

CHECKS = ("assert", "raises", "fail", "warns", "validate", "check", "expect", "verify", "_assert", "_check")


def checks(function: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    for node in ast.walk(function):
        if isinstance(node, ast.Assert):
            return True
        if isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name.lower().startswith(CHECKS):
                return True
    return False


def test_every_test_function_checks_something() -> None:
    unchecked = []
    files = sorted(Path(__file__).parent.rglob("test_*.py"))
    assert len(files) > 50  # the walk found the suite
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test_") \
                    and not checks(node):
                unchecked.append(f"{path.relative_to(path.parents[1])}:{node.lineno} {node.name}")
    assert not unchecked, "tests that check nothing:\n" + "\n".join(unchecked)


def test_the_check_finds_a_test_without_an_assert() -> None:
    source = "def test_runs():\n    run()\n\ndef test_checks():\n    assert run()\n"
    found = [n.name for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef) and not checks(n)]
    assert found == ["test_runs"]
