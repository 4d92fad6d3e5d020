"""Models and caches: loading, the preallocated KV cache, and one forward interface."""

from specdec.models.backend import Backend, ForwardOutput
from specdec.models.cache import PreallocatedCache
from specdec.models.loader import LoadedModel, load_model
from specdec.models.runner import ModelRunner

__all__ = ["Backend", "ForwardOutput", "LoadedModel", "ModelRunner", "PreallocatedCache", "load_model"]
