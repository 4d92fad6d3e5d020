"""Drafters, one module each, registered by method name (`specdec.drafters.registry`)."""

from specdec.drafters.base import Drafter, Proposal
from specdec.drafters.registry import Options, build_drafter, default_k, method, register, registered_methods

# Importing a drafter module registers it.
from specdec.drafters import draft_model, eagle, hybrid, layer_skip, lookahead, medusa, mtp, ngram, suffix  # noqa: E402,F401  isort: skip

__all__ = ["Drafter", "Options", "Proposal", "build_drafter", "default_k", "method", "register", "registered_methods"]
