"""The wheel carries everything the kernels need: built from the checkout, installed outside it
(no editable checkout to fall back on) with an empty cache, it compiles its kernels and decodes
on them (`generate --stats` names the q4 products and the kernel path)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import specdec
from specdec import kernels

CHECKOUT = Path(specdec.__file__).resolve().parents[1]


@pytest.mark.real
def test_a_wheel_installed_elsewhere_builds_and_runs_its_kernels(tmp_path: Path) -> None:
    if not kernels.available():
        pytest.skip(f"the kernels do not build here: {kernels.missing_reason()}")
    # From a copy of what the wheel is made of: a build in the checkout would leave build/ there.
    source = tmp_path / "source"
    shutil.copytree(CHECKOUT / "specdec", source / "specdec", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(CHECKOUT / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "dist"), str(source)], check=True, cwd=tmp_path)
    (wheel,) = (tmp_path / "dist").glob("specdec-*.whl")
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, cwd=tmp_path)
    assert {"cpu.h", "ops.h", "simd.h", "quant.h"} <= {p.name for p in (site / "specdec" / "kernels").iterdir()}
    env = os.environ | {"PYTHONPATH": str(site), "SPECDEC_CACHE_DIR": str(tmp_path / "cache")}
    run = subprocess.run([sys.executable, "-m", "specdec.cli.main", "generate", "Hi", "--max-tokens", "4", "--stats"],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert run.returncode == 0, run.stderr
    assert "compiling its CPU kernels" in run.stderr  # built from the wheel's own sources
    where = subprocess.run([sys.executable, "-c", "import specdec; print(specdec.__file__)"], capture_output=True,
                           text=True, env=env, cwd=tmp_path, check=True).stdout
    assert where.startswith(str(site))  # the wheel's package, not the checkout's
    assert "native q4" in run.stdout + run.stderr and f"products on {kernels.default_isa()}" in run.stdout + run.stderr
