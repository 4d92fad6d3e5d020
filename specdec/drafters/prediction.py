"""Predicted outputs (OpenAI's `prediction`): a request's expected output as its drafter.

An edit request ("rename this variable in this function") mostly repeats text the client already
has. The prediction's tokens are that text; this drafter proposes the prediction's next tokens
for as long as the output follows it, so an unchanged stretch is verified up to k tokens a pass.
Where the output leaves the prediction (the edit), the drafter is lost and proposes nothing (a
plain step) until the output's last few tokens occur in the prediction again; it then resumes
after that occurrence, the first one at or after where it lost its place (edits move forward
through a text), else the last one before. Like any drafter it only proposes: the target
verifies, so the output is the target's whatever the prediction says.
"""

from __future__ import annotations

import numpy as np
import torch

from specdec.drafters.base import Proposal
from specdec.sampling.params import SamplingParams

# Tokens a prediction drafts a step: a long chain pays when the output copies the prediction,
# and a pass stops paying for rejected tokens at the first one.
PREDICTION_K = 8


class PredictionDrafter:
    """Drafts from `prediction` (token ids), aligned with the output as it goes.

    match: how many of the output's last tokens must occur in the prediction to find its place
    again after an edit (fewer are tried when the output is shorter).
    """

    added_memory_bytes = 0

    def __init__(self, prediction: list[int], match: int = 3) -> None:
        if match < 1:
            raise ValueError("match must be >= 1")
        self.prediction = np.asarray(prediction, dtype=np.int64)
        self.match = match
        self._prompt_len = 0
        self._seen = 0  # output tokens already aligned
        self._place: int | None = 0  # the prediction index the next output token should match
        self._lost_at = 0  # where the output last left the prediction

    def begin(self, prompt_ids: list[int], max_len: int) -> None:
        self._prompt_len = len(prompt_ids)
        self._seen, self._place, self._lost_at = 0, 0, 0

    def propose(self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator | None) -> Proposal:
        self._align(context[self._prompt_len :])
        if self._place is None:
            return Proposal([])
        return Proposal(self.prediction[self._place : self._place + k].tolist())

    def commit(self, context: list[int], num_accepted: int) -> None:
        self._align(context[self._prompt_len :])

    def fork(self) -> PredictionDrafter:
        return PredictionDrafter(self.prediction.tolist(), self.match)

    def _align(self, output: list[int]) -> None:
        """Follow the output's new tokens through the prediction; find the place again if lost."""
        for token in output[self._seen :]:
            if self._place is not None and self._place < len(self.prediction) and self.prediction[self._place] == token:
                self._place += 1
            elif self._place is not None:
                self._lost_at, self._place = self._place, None
        self._seen = len(output)
        if self._place is None:
            self._place = self._find(output)

    def _find(self, output: list[int]) -> int | None:
        """The index after an occurrence of the output's last tokens in the prediction."""
        n = min(self.match, len(output))
        if n == 0 or len(self.prediction) < n:
            return None
        suffix = np.asarray(output[-n:], dtype=np.int64)
        windows = np.lib.stride_tricks.sliding_window_view(self.prediction, n)  # [len - n + 1, n]
        hits = np.flatnonzero((windows == suffix).all(axis=1)) + n  # indices just after each match
        if not hits.size:
            return None
        ahead = hits[hits >= self._lost_at]
        return int(ahead[0]) if ahead.size else int(hits[-1])
