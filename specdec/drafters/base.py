"""The drafter protocol (the registry of methods by name is `specdec.methods`).

A drafter proposes up to k tokens to follow the context; the engine verifies them with one
target pass and then tells the drafter what was committed, so a stateful drafter (one with a
KV cache) can roll back. The engine never looks at a drafter's type.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specdec.sampling.probs import argmax

if TYPE_CHECKING:
    from specdec.models.runner import ModelRunner
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


@dataclass(frozen=True)
class CacheStats:
    """A cache a drafter keeps across requests (the suffix drafter's earlier outputs of its
    route), as the server reports it."""

    nbytes: int
    requests: int


class Verified:
    """One verification pass's nodes for :meth:`Drafter.observe_verified`: the drafted tokens,
    their parents (-1: the fed token; a chain's are -1, 0, 1, ...) and the target's logits after
    the fed token and after each node. `top()`, the target's top tokens, is computed on first use."""

    def __init__(self, tokens: list[int], parents: list[int], logits: torch.Tensor | None = None,
                 top: list[int] | None = None) -> None:
        if (logits is None) == (top is None):
            raise ValueError("give the logits or the top tokens")
        self.tokens, self.parents, self._logits, self._top = tokens, parents, logits, top

    def top(self) -> list[int]:
        if self._top is None:
            assert self._logits is not None
            self._top = argmax(self._logits).tolist()
        return self._top


class Drafter:
    """The contract between a drafter and the rest of specdec: the engine, the server, the memory
    plan and the tools read a drafter only through these members. `begin`, `propose`, `commit`
    and `fork` are each drafter's own; every other hook has a default here that means "not used"."""

    # Bytes of weights the drafter holds beyond the target's (0 when it shares them).
    added_memory_bytes: int = 0
    # The target layers whose outputs the drafter reads (EAGLE: three; Medusa: the last); the
    # engine then passes their states at each committed position to observe_target().
    target_layers: tuple[int, ...] = ()
    # The most tokens a proposal may hold (a tree's nodes); 0: at most k, a chain.
    proposal_size: int = 0

    def begin(self, prompt_ids: list[int], max_len: int) -> None:
        """A new request starts with these prompt tokens; the context will not exceed max_len."""
        raise NotImplementedError

    def propose(
        self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Proposal:
        """Propose up to k tokens to follow `context` (the prompt and every committed token)."""
        raise NotImplementedError

    def commit(self, context: list[int], num_accepted: int) -> None:
        """After verification: `context` now holds the committed tokens; `num_accepted` of the
        proposal were accepted."""
        raise NotImplementedError

    def fork(self) -> Drafter:
        """A drafter for another sequence: the same weights (shared, not copied) and options,
        none of this one's per-sequence state."""
        raise NotImplementedError

    def observe_target(self, features: torch.Tensor) -> None:
        """The target's states of `target_layers` at the positions just committed
        ([positions, len(target_layers) * hidden]), after the prompt and after each pass."""

    def observe_verified(self, verified: Verified) -> None:
        """After each verification pass the drafter proposed for, before commit(): every node
        verified, kept or not (lookahead's window learns from all of them)."""

    def resume(self) -> None:
        """Called before propose() when the engine had switched speculation off for this
        sequence for more than one step (adaptive k, the load schedule): a drafter that keeps
        state over the context may catch up on less than everything it missed."""

    def model_runner(self) -> ModelRunner | None:
        """The runner of the model this drafter drafts with (its weights and KV count in the
        memory plan), or None: no model of its own (lookup, heads on the target's states)."""
        return None

    def shared_cache(self) -> CacheStats | None:
        """The cache the drafter shares with its route's other requests, or None."""
        return None
