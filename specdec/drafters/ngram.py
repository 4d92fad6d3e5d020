"""Prompt lookup: propose what followed the last n tokens the previous time they occurred.

No model. The last n tokens of the context (n from prompt_lookup_max down to
prompt_lookup_min) are searched for earlier in the context; the tokens that followed the most
recent earlier occurrence are the proposal. Most recent, because in generated text the latest
repetition is the best guess of what repeats next; in a prompt being quoted any occurrence
will do. The proposal is deterministic, so verification uses the one-hot draft rule.

A match of n tokens proposes at most n - 1 tokens (at least one, at most k). Short matches are
often coincidence, and every rejected token still lengthens the verification pass: on the CPU
a pass over 2 tokens costs about 1.07 times a plain step, over 5 tokens about 1.6 times
(`specdec.bench.cost`). Replaying recorded greedy outputs of held-out Spec-Bench prompts with
those costs, this rule beat a fixed proposal length of 3 by a few percent and of 4 or more by
more.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from specdec.drafters.base import Drafter, Proposal
from specdec.models.loader import LoadedModel
from specdec.sampling.params import SamplingParams

if TYPE_CHECKING:
    from specdec.config import SpeculativeConfig


def find_match(context: np.ndarray, n_min: int, n_max: int) -> tuple[int, int] | None:
    """(where the continuation starts, n) for the latest earlier occurrence of the longest
    matching suffix of n = n_max .. n_min tokens; None when nothing matches. context: [length].

    Every occurrence of a suffix ends on the context's last token, so the candidates are the
    earlier places of that token (one pass over the context), narrowed one token back at a time:
    a step costs about one comparison per token of context, not one per token per n.
    """
    length = len(context)
    if length < 2:
        return None
    # Ends of earlier occurrences: e <= length - 2, so that a continuation follows.
    ends = np.flatnonzero(context[: length - 1] == context[length - 1])
    longest = min(n_max, length - 1)
    # matched[i]: candidates whose i + 1 tokens ending at e match the suffix's last i + 1.
    matched = [ends]
    for i in range(1, longest):
        last = matched[-1]
        last = last[last >= i]  # the occurrence must start at 0 or later
        matched.append(last[context[last - i] == context[length - 1 - i]])
        if not matched[-1].size:
            break
    for n in range(longest, n_min - 1, -1):
        if n <= len(matched) and matched[n - 1].size:
            return int(matched[n - 1][-1]) + 1, n
    return None


def find_continuation(context: np.ndarray, n_min: int, n_max: int, k: int) -> list[int]:
    """The tokens that followed the latest earlier match of the longest matching suffix.

    context: [length] token ids. Tries n = n_max .. n_min; returns [] when nothing matches,
    else at most min(k, max(1, n - 1)) tokens.
    """
    match = find_match(context, n_min, n_max)
    if match is None:
        return []
    start, n = match
    return context[start : start + min(k, max(1, n - 1))].tolist()


class NgramDrafter(Drafter):
    added_memory_bytes = 0

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.n_min = prompt_lookup_min
        self.n_max = prompt_lookup_max

    def begin(self, prompt_ids: list[int], max_len: int) -> None:
        pass

    def propose(
        self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Proposal:
        tokens = find_continuation(np.asarray(context, dtype=np.int64), self.n_min, self.n_max, k)
        return Proposal(tokens=tokens, probs=None)

    def commit(self, context: list[int], num_accepted: int) -> None:
        pass

    def fork(self) -> NgramDrafter:
        return NgramDrafter(self.n_min, self.n_max)


def build(config: SpeculativeConfig, target: LoadedModel) -> NgramDrafter:
    return NgramDrafter(config.prompt_lookup_min, config.prompt_lookup_max)
