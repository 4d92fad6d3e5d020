"""Where specdec keeps what it builds once: converted models and compiled kernels."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """`$SPECDEC_CACHE_DIR`, default `~/.cache/specdec`."""
    return Path(os.environ.get("SPECDEC_CACHE_DIR", Path.home() / ".cache" / "specdec"))
