"""Bigram statistics of the request itself: propose the chain of most frequent successors.

No model. The drafter counts, over the prompt and everything committed since, which token
followed which; from the last token it walks to the successor seen most often (ties: the most
recent), and on, for up to k tokens, stopping where a token has no successor or its best one
was seen fewer than `bigram_min_count` times. Where prompt lookup copies one earlier span
verbatim, this follows the request's habits (a word that is always followed by the same
punctuation, a list format), so it drafts after tokens whose longer context never repeated.
The proposal is deterministic: verification uses the one-hot draft rule.

It is also the example of adding a drafter to specdec: this module, its import in
`specdec/drafters/__init__.py`, and its tests are the whole change.
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING

import torch

from specdec.drafters.base import Drafter, Proposal
from specdec.models.loader import LoadedModel
from specdec.sampling.params import SamplingParams

if TYPE_CHECKING:
    from specdec.config import SpeculativeConfig


class BigramDrafter(Drafter):
    def __init__(self, min_count: int = 2) -> None:
        self.min_count = min_count
        # token -> successor -> (count, index of its latest occurrence)
        self._counts: dict[int, dict[int, list[int]]] = defaultdict(dict)
        self._seen = 0  # how much of the context is counted

    def begin(self, prompt_ids: list[int], max_len: int) -> None:
        self._counts.clear()
        self._seen = 0
        self._count(prompt_ids)

    def _count(self, context: list[int]) -> None:
        for i in range(max(1, self._seen), len(context)):
            entry = self._counts[context[i - 1]].setdefault(context[i], [0, 0])
            entry[0] += 1
            entry[1] = i
        self._seen = max(self._seen, len(context))

    def _best(self, token: int) -> int | None:
        successors = self._counts.get(token)
        if not successors:
            return None
        best, (count, _) = max(successors.items(), key=lambda item: (item[1][0], item[1][1]))
        return best if count >= self.min_count else None

    def propose(self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator | None) -> Proposal:
        self._count(context)
        tokens: list[int] = []
        token = context[-1]
        while len(tokens) < k and (token := self._best(token)) is not None:
            tokens.append(token)
        return Proposal(tokens=tokens)

    def commit(self, context: list[int], num_accepted: int) -> None:
        self._count(context)

    def fork(self) -> BigramDrafter:
        return BigramDrafter(self.min_count)


def build(config: SpeculativeConfig, target: LoadedModel) -> BigramDrafter:
    return BigramDrafter(config.bigram_min_count)
