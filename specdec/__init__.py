"""specdec: lossless speculative decoding for LLM text generation.

`LLM`, `RequestOutput` and `Infill` are imported on first use (PEP 562), so that importing a light module
(`specdec.config`, `specdec.methods`) loads no model code.
"""

from typing import TYPE_CHECKING, Any

from specdec import _openmp  # noqa: F401  before anything imports torch: see there

from specdec.config import SamplingParams, SpeculativeConfig, StructuredOutput
from specdec.errors import SpecDecError

if TYPE_CHECKING:
    from specdec.api import LLM, RequestOutput
    from specdec.models.prompts import Infill

__all__ = ["LLM", "Infill", "RequestOutput", "SamplingParams", "SpecDecError", "SpeculativeConfig", "StructuredOutput"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in ("LLM", "RequestOutput"):
        from specdec import api

        return getattr(api, name)
    if name == "Infill":
        from specdec.models.prompts import Infill

        return Infill
    raise AttributeError(f"module 'specdec' has no attribute {name!r}")
