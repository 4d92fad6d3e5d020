"""Pure sampling and acceptance: tensors in, tokens out. No model, no cache, no I/O.

The acceptance and probability functions are imported on first use (PEP 562): the sampling
parameters (`specdec.sampling.params`, which the config re-exports) need no torch.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from specdec.sampling.acceptance import (Accepted, AcceptResult, RowDraft, SamplingRule, accept_batch, accept_step,
                                             greedy_accept, speculative_accept)
    from specdec.sampling.probs import logits_to_probs, sample

_FROM = {"acceptance": ("AcceptResult", "Accepted", "RowDraft", "SamplingRule", "accept_batch", "accept_step",
                        "greedy_accept", "speculative_accept"),
         "probs": ("logits_to_probs", "sample")}
__all__ = sorted(name for names in _FROM.values() for name in names)


def __getattr__(name: str) -> Any:
    for module, names in _FROM.items():
        if name in names:
            from importlib import import_module

            return getattr(import_module(f"specdec.sampling.{module}"), name)
    raise AttributeError(f"module 'specdec.sampling' has no attribute {name!r}")
