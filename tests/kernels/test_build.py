"""Where the kernels build, and what a killed build leaves behind."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from specdec import kernels


def test_a_killed_builds_lock_is_cleared_once_stale_and_a_live_one_kept(tmp_path: Path) -> None:
    lock = tmp_path / "lock"
    lock.touch()
    kernels._clear_stale_lock(tmp_path)
    assert lock.exists()  # a build may be running: wait for it
    old = time.time() - kernels.STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    kernels._clear_stale_lock(tmp_path)
    assert not lock.exists()
    kernels._clear_stale_lock(tmp_path)  # none: nothing to do


def test_each_torch_installation_builds_in_its_own_directory() -> None:
    name = kernels.build_dir().name
    assert name.startswith(f"torch-{torch.__version__}-") and len(name.rsplit("-", 2)[-1]) == 8
