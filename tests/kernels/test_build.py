"""Where the kernels build, and what a killed build leaves behind."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from specdec import kernels


# A process that takes the build lock, leaves torch's build lock file as a build in progress
# does, says so, then waits to be killed (or for `seconds`).
HOLDER = """
import sys, time
from pathlib import Path
from specdec import kernels
directory = Path(sys.argv[1])
with kernels._build_lock(directory):
    (directory / "lock").touch()
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
"""


def _holder(directory: Path, seconds: float) -> subprocess.Popen:
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(directory), str(seconds)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    return holder


def test_a_killed_build_leaves_nothing_that_stalls_the_next(tmp_path: Path) -> None:
    # Killed mid-build (Ctrl-C, OOM): its OS lock dies with it, and the next start removes the
    # torch lock file it left instead of waiting on it.
    holder = _holder(tmp_path, 600)
    holder.kill()
    holder.wait()
    assert (tmp_path / "lock").exists()
    start = time.monotonic()
    with kernels._build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()
    assert time.monotonic() - start < 5


def test_a_live_build_is_waited_for(tmp_path: Path) -> None:
    # A build in progress in another process is not disturbed: the next one waits for its lock.
    holder = _holder(tmp_path, 2)
    start = time.monotonic()
    with kernels._build_lock(tmp_path):
        waited = time.monotonic() - start
    holder.wait()
    assert waited > 1.0 and holder.returncode == 0


def test_a_first_build_says_so_on_stderr(tmp_path: Path) -> None:
    # Nobody should kill a silent minute-long start: a build announces itself (one line), a load
    # of a finished build says nothing. The build is made to fail at once (no compiler).
    script = "from specdec import kernels; kernels.available()"
    env = {**os.environ, "SPECDEC_CACHE_DIR": str(tmp_path), "CXX": "/bin/false"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.stderr.count("specdec: compiling its CPU kernels") == 1
    if kernels.available():  # this machine's own cache holds a finished build
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
        assert "compiling" not in done.stderr


def test_each_torch_installation_builds_in_its_own_directory() -> None:
    name = kernels.build_dir().name
    assert name.startswith(f"torch-{torch.__version__}-") and len(name.rsplit("-", 2)[-1]) == 8
