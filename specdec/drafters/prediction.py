"""Predicted outputs (OpenAI's `prediction`): a request's expected output as its drafter.

An edit request ("rename this variable in this function") mostly repeats text the client already
has. The prediction's tokens are that text; this drafter proposes the prediction's next tokens
for as long as the output follows it. The draft grows with the run of output tokens that
followed the prediction (at least 2, at most k): a pass over many tokens costs more than a plain
step, so a long draft is kept for where the prediction has been right.

Where the output leaves the prediction (the edit), the drafter is lost and drafts as prompt
lookup does (`specdec.drafters.ngram`) over the prediction followed by the context: the latest
occurrence of the longest suffix of the output. When that occurrence is in the prediction, the
drafter has found its place again and follows the prediction from there; when it is in the
context (the prompt quoting the same text, or the output repeating itself), it proposes what
followed it there. Like any drafter it only proposes: the target verifies, so the output is the
target's whatever the prediction says.
"""

from __future__ import annotations

import numpy as np
import torch

from specdec.drafters.base import Drafter, Proposal
from specdec.drafters.ngram import find_match
from specdec.sampling.params import SamplingParams

# Tokens a prediction drafts a step: a long chain pays when the output copies the prediction,
# and a pass stops paying for rejected tokens at the first one.
PREDICTION_K = 8


def draft_room(*sizes: int) -> int:
    """The most tokens a row drafts in a step (a batch engine's `max_draft`) for drafters of these
    sizes (k, or a tree's nodes): the largest, or a predicted output's draft where that is longer
    (a prediction drafts a request on any engine: `BatchEngine.admit`)."""
    return max(PREDICTION_K, *sizes)


class PredictionDrafter(Drafter):
    """Drafts from `prediction` (token ids), aligned with the output as it goes.

    lookup_max: the longest suffix of the output looked up while lost (prompt lookup's default).
    """

    added_memory_bytes = 0

    def __init__(self, prediction: list[int], lookup_max: int = 6) -> None:
        if lookup_max < 1:
            raise ValueError("lookup_max must be >= 1")
        self.prediction = np.asarray(prediction, dtype=np.int64)
        self.lookup_max = lookup_max
        self._prompt_len = 0
        self._seen = 0  # output tokens already followed
        self._place: int | None = 0  # the prediction index the next output token should match
        self._run = 0  # output tokens that followed the prediction since the drafter last found its place

    def begin(self, prompt_ids: list[int], max_len: int) -> None:
        self._prompt_len = len(prompt_ids)
        self._seen, self._place, self._run = 0, 0, 0

    def propose(self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator | None) -> Proposal:
        self._follow(context[self._prompt_len :])
        if self._place is None:
            corpus = np.concatenate([self.prediction, np.asarray(context, dtype=np.int64)])
            match = find_match(corpus, 1, self.lookup_max)
            if match is None:
                return Proposal([])
            start, n = match
            if start >= len(self.prediction):  # in the context: prompt lookup's proposal
                return Proposal(corpus[start : start + min(k, max(1, n - 1))].tolist())
            self._place, self._run = start, n  # found again in the prediction
        return Proposal(self.prediction[self._place : self._place + min(k, max(2, self._run))].tolist())

    def commit(self, context: list[int], num_accepted: int) -> None:
        self._follow(context[self._prompt_len :])

    def fork(self) -> PredictionDrafter:
        return PredictionDrafter(self.prediction.tolist(), self.lookup_max)

    def _follow(self, output: list[int]) -> None:
        """Follow the output's new tokens through the prediction; lost at the first that differs."""
        for token in output[self._seen :]:
            if self._place is None:
                break
            if self._place < len(self.prediction) and self.prediction[self._place] == token:
                self._place += 1
                self._run += 1
            else:
                self._place, self._run = None, 0
        self._seen = len(output)
