"""Drafters, one module each, registered by method name."""

from specdec.drafters.base import Drafter, Proposal, build_drafter, register, registered_methods

# Importing a drafter module registers it.
from specdec.drafters import draft_model, eagle, hybrid, layer_skip, medusa, mtp, ngram, suffix  # noqa: E402,F401  isort: skip

__all__ = ["Drafter", "Proposal", "build_drafter", "register", "registered_methods"]
