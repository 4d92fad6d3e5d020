"""The drafter protocol (the registry of drafters by name is `specdec.drafters.registry`).

A drafter proposes up to k tokens to follow the context; the engine verifies them with one
target pass and then tells the drafter what was committed, so a stateful drafter (one with a
KV cache) can roll back. The engine never looks at a drafter's type.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from specdec.sampling.params import SamplingParams


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


def best_subtree(tokens: list[int], parents: list[int], scores: list[float], count: int) -> Proposal:
    """The `count` highest-scoring nodes of a candidate tree (parents before children; ties
    kept in order), as a proposal. Each score is its path's total log-probability, so a child
    never outscores its parent and the kept set holds every kept node's parent."""
    keep = sorted(sorted(range(len(tokens)), key=lambda n: (-scores[n], n))[:count])
    where = {old: new for new, old in enumerate(keep)}
    return Proposal(tokens=[tokens[n] for n in keep],
                    parents=tuple(-1 if parents[n] < 0 else where[parents[n]] for n in keep))


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

    # Optional: `observe_verified(tokens, parents, top)`, called after each verification pass the
    # drafter proposed for, before commit(): the nodes verified (a chain's parents are -1, 0, 1,
    # ...) and the target's top token after the fed token and after each node.
    # Optional: `resume()`, called before propose() when the engine had switched speculation off
    # for this sequence for more than one step (adaptive k, the load schedule); a drafter that
    # keeps state over the context may then catch up on less than everything it missed.

    def fork(self) -> Drafter:
        """A drafter for another sequence: the same weights (shared, not copied) and options,
        none of this one's per-sequence state."""
