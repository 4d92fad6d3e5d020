"""Pure sampling and acceptance: tensors in, tokens out. No model, no cache, no I/O."""

from specdec.sampling.acceptance import (Accepted, AcceptResult, RowDraft, SamplingRule, accept_batch, accept_step, greedy_accept,
                                         speculative_accept)
from specdec.sampling.probs import logits_to_probs, sample

__all__ = ["AcceptResult", "Accepted", "RowDraft", "SamplingRule", "accept_batch", "accept_step", "greedy_accept", "logits_to_probs",
           "sample", "speculative_accept"]
