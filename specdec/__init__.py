"""specdec: lossless speculative decoding for LLM text generation.

`LLM` and `RequestOutput` are imported on first use (PEP 562), so that importing a light module
(`specdec.config`, `specdec.methods`) loads no model code.
"""

import os
from typing import TYPE_CHECKING, Any

# torch's OpenMP workers (libgomp) spin about 300,000 times after each parallel torch op before
# they sleep, and on a small machine that spinning takes the core the kernels' own pool
# (specdec/kernels/pool.cpp) needs in plain decoding, which runs a few vocabulary-wide torch ops a
# step beside the kernels. A shorter spin costs torch's own parallel work nothing measurable
# (docs/backends.md has both figures). libgomp reads this when torch loads it, so it takes effect
# where specdec is imported before torch; a value the user set is kept.
if "GOMP_SPINCOUNT" not in os.environ and "OMP_WAIT_POLICY" not in os.environ:
    os.environ["GOMP_SPINCOUNT"] = "10000"

from specdec.config import SamplingParams, SpeculativeConfig, StructuredOutput
from specdec.errors import SpecDecError

if TYPE_CHECKING:
    from specdec.api import LLM, RequestOutput

__all__ = ["LLM", "RequestOutput", "SamplingParams", "SpecDecError", "SpeculativeConfig", "StructuredOutput"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in ("LLM", "RequestOutput"):
        from specdec import api

        return getattr(api, name)
    raise AttributeError(f"module 'specdec' has no attribute {name!r}")
