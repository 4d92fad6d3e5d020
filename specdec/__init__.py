"""specdec: lossless speculative decoding for LLM text generation."""

from specdec.api import LLM, RequestOutput
from specdec.config import SamplingParams, SpeculativeConfig, StructuredOutput
from specdec.errors import SpecDecError

__all__ = ["LLM", "RequestOutput", "SamplingParams", "SpecDecError", "SpeculativeConfig", "StructuredOutput"]
__version__ = "0.1.0"
