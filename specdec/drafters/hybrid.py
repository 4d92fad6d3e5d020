"""Hybrid drafting: prompt lookup where the text copies itself, the EAGLE head elsewhere.

Lookup costs nothing and, where the answer quotes the prompt or repeats itself, proposes long
runs the target accepts whole; the head guesses everywhere, at a few percent of a target step a
token. Each step tries lookup first, with matches of at least `prompt_lookup_min` tokens
(2 by default), and drafts with the head when lookup finds none, at most `hybrid_head_tokens`
tokens (1 by default: the shipped head's later guesses are rarely right, so they cost more than
they add; None: k). Both defaults are the best measured on training prompts (benchmarks/results/README.md, "Draft
heads"). The head sees every committed
position's target states either way, so it is ready whenever lookup has nothing.

With `hybrid_branches`, a step where lookup proposes also drafts with the head, and the target
verifies both drafts in one pass as two branches of a token tree (a shared prefix once): the
step keeps whichever branch the target follows further. The head's branch is then its most
likely tokens (deterministic, as lookup's are), so the tree's acceptance rule stays exact when
sampling.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from specdec.drafters.base import Drafter, Proposal
from specdec.drafters.eagle import EagleDrafter, load_head
from specdec.drafters.ngram import NgramDrafter
from specdec.models.loader import LoadedModel
from specdec.sampling.params import SamplingParams

if TYPE_CHECKING:
    from specdec.config import SpeculativeConfig

class HybridDrafter(Drafter):
    def __init__(self, eagle: EagleDrafter, lookup: NgramDrafter, head_tokens: int | None = None,
                 branches_up_to: int = 0) -> None:
        """branches_up_to: 0, or the most tokens a step drafts with both branches (k + the head's
        draft): then lookup's and the head's drafts are verified together."""
        self.eagle = eagle
        self.lookup = lookup
        self.head_tokens = head_tokens
        self.branches_up_to = branches_up_to
        self.target_layers = eagle.target_layers
        self.added_memory_bytes = eagle.added_memory_bytes
        self.proposal_size = max(eagle.proposal_size, branches_up_to)
        self.used_lookup = 0  # steps drafted by lookup (the rest by the head)

    def begin(self, prompt_ids: list[int], max_len: int) -> None:
        self.eagle.begin(prompt_ids, max_len)
        self.lookup.begin(prompt_ids, max_len)

    def observe_target(self, features: torch.Tensor) -> None:
        self.eagle.observe_target(features)

    def propose(
        self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Proposal:
        proposal = self.lookup.propose(context, k, params, generator)
        head_k = min(k, self.head_tokens or k)
        if not proposal.tokens:
            return self.eagle.propose(context, head_k, params, generator)
        self.used_lookup += 1
        if not self.branches_up_to:
            return proposal
        greedy = params if params.greedy else dataclasses.replace(params, temperature=0.0)
        return union(proposal, self.eagle.propose(context, head_k, greedy, None))

    def commit(self, context: list[int], num_accepted: int) -> None:
        self.eagle.commit(context, num_accepted)
        self.lookup.commit(context, num_accepted)

    def fork(self) -> HybridDrafter:
        return HybridDrafter(self.eagle.fork(), self.lookup.fork(), self.head_tokens, self.branches_up_to)


def union(first: Proposal, second: Proposal) -> Proposal:
    """Two deterministic proposals (chains or trees) as one: a token tree holding every path of
    both, a shared prefix once, `first`'s nodes first. A chain when one's paths hold the other's."""
    tokens: list[int] = []
    parents: list[int] = []
    node_of: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    for proposal in (first, second):
        own = proposal.parents if proposal.parents is not None else tuple(range(-1, len(proposal.tokens) - 1))
        placed: list[int] = []
        for token, parent in zip(proposal.tokens, own):
            key = (-1 if parent < 0 else placed[parent], token)
            if key not in node_of:
                node_of[key] = len(tokens)
                tokens.append(token)
                parents.append(key[0])
            placed.append(node_of[key])
    if parents == list(range(-1, len(tokens) - 1)):
        return Proposal(tokens=tokens)
    return Proposal(tokens=tokens, parents=tuple(parents))


def build(config: SpeculativeConfig, target: LoadedModel) -> HybridDrafter:
    branches = config.options.proposal_tokens(config.num_speculative_tokens) if config.hybrid_branches else 0
    return HybridDrafter(EagleDrafter(load_head(config, target), tree_width=config.tree_width,
                                      tree_nodes=config.tree_nodes, min_confidence=config.draft_confidence),
                         NgramDrafter(config.prompt_lookup_min,
                                      max(config.prompt_lookup_max, config.prompt_lookup_min)),
                         config.hybrid_head_tokens, branches)
