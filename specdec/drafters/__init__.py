"""Drafters, one module each; the registry of methods by name, and the options each takes, is
`specdec.methods` (it imports a drafter's module only to build one)."""

from specdec.drafters.base import CacheStats, Drafter, Proposal, Verified

__all__ = ["CacheStats", "Drafter", "Proposal", "Verified"]
