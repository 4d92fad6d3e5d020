"""Drafters, one module each, registered by method name (`specdec.drafters.registry`)."""

from specdec.drafters.base import CacheStats, Drafter, Proposal, Verified
from specdec.drafters.registry import (DEFAULT_HEAD, DEFAULT_METHOD, Method, Options, build_drafter, default_k, head_class,
                                       method, methods, register, register_head, registered_methods, trainable_heads)

# Importing a drafter module registers it.
from specdec.drafters import bigram, draft_model, eagle, hybrid, layer_skip, lookahead, medusa, mtp, ngram, suffix  # noqa: E402,F401  isort: skip

__all__ = ["DEFAULT_HEAD", "DEFAULT_METHOD", "CacheStats", "Drafter", "Method", "Options", "Proposal", "Verified",
           "build_drafter", "default_k", "head_class", "method", "methods", "register", "register_head", "registered_methods",
           "trainable_heads"]
