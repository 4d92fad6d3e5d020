"""The core install carries the library and the commands that need no extra; a command whose
extra is missing says which one to install."""

from __future__ import annotations

import subprocess
import sys

# Makes the extras' modules unimportable in the child process, as on a core-only install.
BLOCK = ("import sys\n"
         "for name in ('fastapi', 'starlette', 'uvicorn', 'prometheus_client', 'scipy', 'matplotlib', 'ray'):\n"
         "    sys.modules[name] = None\n")


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCK + code], capture_output=True, text=True, timeout=120)


def test_the_core_imports_without_any_extra() -> None:
    done = _run("import specdec, specdec.api, specdec.cli.main, specdec.training.run, specdec.bench.cost, "
                "specdec.bench.calibrate, specdec.bench.runner\nprint('ok')")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_a_command_without_its_extra_names_the_extra() -> None:
    done = _run("sys.argv = ['specdec', 'verify', '--method', 'ngram']\n"
                "from specdec.cli.main import main\nmain()")
    assert done.returncode == 2, done.stderr
    assert "pip install 'specdec[bench]'" in done.stderr
    assert "Traceback" not in done.stderr
