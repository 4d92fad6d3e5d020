"""Every kernel test with an `isa` argument runs once per path (kernels.PATHS); a path this machine
lacks is skipped with its reason (the CPU's, or Linux's for AMX), never dropped from the run."""

from __future__ import annotations

import pytest

from specdec import kernels


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "isa" not in metafunc.fixturenames:
        return
    have = kernels.instruction_sets() if kernels.available() else []
    params = []
    for path in kernels.PATHS:
        why = "" if path in have else kernels.missing_reason(path) if kernels.available() else "no kernels"
        params.append(pytest.param(path, marks=pytest.mark.skipif(bool(why), reason=f"no {path} path here: {why}")))
    metafunc.parametrize("isa", params)
