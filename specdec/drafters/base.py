"""The drafter protocol and the registry of drafters by name.

A drafter proposes up to k tokens to follow the context; the engine verifies them with one
target pass and then tells the drafter what was committed, so a stateful drafter (one with a
KV cache) can roll back. The engine never looks at a drafter's type.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from specdec.config import SamplingParams

if TYPE_CHECKING:
    from specdec.config import SpeculativeConfig
    from specdec.models.loader import LoadedModel


@dataclass(frozen=True)
class Proposal:
    """tokens: the drafted tokens, at most k (may be empty: nothing worth proposing).
    probs: [len(tokens), vocab], the distribution each token was sampled from, or None when
    the drafter is deterministic (each token proposed with probability one).
    parents: for a token tree, each token's parent (-1: the last committed token; parents
    before children, siblings distinct); None for a chain. k bounds the tree's depth."""

    tokens: list[int]
    probs: torch.Tensor | None = None
    parents: tuple[int, ...] | None = None


class Drafter(Protocol):
    # Bytes of weights the drafter holds beyond the target's (0 when it shares them).
    added_memory_bytes: int

    def begin(self, prompt_ids: list[int], max_len: int) -> None:
        """A new request starts with these prompt tokens; the context will not exceed max_len."""

    def propose(
        self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Proposal:
        """Propose up to k tokens to follow `context` (the prompt and every committed token)."""

    def commit(self, context: list[int], num_accepted: int) -> None:
        """After verification: `context` now holds the committed tokens; `num_accepted` of the
        proposal were accepted."""

    # Optional: `resume()`, called before propose() when the engine had switched speculation off
    # for this sequence for more than one step (adaptive k, the load schedule); a drafter that
    # keeps state over the context may then catch up on less than everything it missed.

    def fork(self) -> Drafter:
        """A drafter for another sequence: the same weights (shared, not copied) and options,
        none of this one's per-sequence state."""


DrafterFactory = Callable[["SpeculativeConfig", "LoadedModel"], Drafter]
_REGISTRY: dict[str, DrafterFactory] = {}


def register(name: str) -> Callable[[DrafterFactory], DrafterFactory]:
    """Register a drafter factory under a method name."""

    def wrap(factory: DrafterFactory) -> DrafterFactory:
        if name in _REGISTRY:
            raise ValueError(f"drafter {name!r} is already registered")
        _REGISTRY[name] = factory
        return factory

    return wrap


def registered_methods() -> list[str]:
    return sorted(_REGISTRY)


def build_drafter(config: SpeculativeConfig, target: LoadedModel) -> Drafter:
    return _REGISTRY[config.method](config, target)
