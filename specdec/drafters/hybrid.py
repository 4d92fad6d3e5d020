"""Hybrid drafting: prompt lookup where the text copies itself, the EAGLE head elsewhere.

Lookup costs nothing and, where the answer quotes the prompt or repeats itself, proposes long
runs the target accepts whole; the head guesses everywhere, at a few percent of a target step a
token. Each step tries lookup first, with matches of at least `prompt_lookup_min` tokens
(2 by default), and drafts with the head when lookup finds none, at most `hybrid_head_tokens`
tokens (1 by default: the shipped head's later guesses are rarely right, so they cost more than
they add; None: k). Both defaults are the best measured on training prompts (benchmarks/results/README.md, "Draft
heads"). The head sees every committed
position's target states either way, so it is ready whenever lookup has nothing.
"""

from __future__ import annotations

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
    def __init__(self, eagle: EagleDrafter, lookup: NgramDrafter, head_tokens: int | None = None) -> None:
        self.eagle = eagle
        self.lookup = lookup
        self.head_tokens = head_tokens
        self.target_layers = eagle.target_layers
        self.added_memory_bytes = eagle.added_memory_bytes
        self.proposal_size = eagle.proposal_size
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
        if proposal.tokens:
            self.used_lookup += 1
            return proposal
        return self.eagle.propose(context, min(k, self.head_tokens or k), params, generator)

    def commit(self, context: list[int], num_accepted: int) -> None:
        self.eagle.commit(context, num_accepted)
        self.lookup.commit(context, num_accepted)

    def fork(self) -> HybridDrafter:
        return HybridDrafter(self.eagle.fork(), self.lookup.fork(), self.head_tokens)


def build(config: SpeculativeConfig, target: LoadedModel) -> HybridDrafter:
    return HybridDrafter(EagleDrafter(load_head(config, target), tree_width=config.tree_width,
                                      tree_nodes=config.tree_nodes),
                         NgramDrafter(config.prompt_lookup_min,
                                      max(config.prompt_lookup_max, config.prompt_lookup_min)),
                         config.hybrid_head_tokens)
