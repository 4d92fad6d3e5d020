"""The draft-and-verify loop, its statistics, and text assembly."""

from specdec.engine.engine import Engine
from specdec.engine.generation import Generation, StreamChunk
from specdec.engine.stats import RequestStats

__all__ = ["Engine", "Generation", "RequestStats", "StreamChunk"]
