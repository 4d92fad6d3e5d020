"""The one interface the engine and drafters use to run a model: a block of new tokens in,
their logits out, against a preallocated KV cache that rolls back by moving a length."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.errors import PromptError
from specdec.models.cache import PreallocatedCache
from specdec.models.loader import LoadedModel


@dataclass(frozen=True)
class ForwardOutput:
    """logits: [new, vocab] (or [1, vocab] with last_only); hidden: [new, hidden_size], the last
    layer's output after the final norm (the LM head's input), when asked for."""

    logits: torch.Tensor
    hidden: torch.Tensor | None = None


class ModelRunner:
    """Runs one sequence of a model against its own cache."""

    def __init__(self, loaded: LoadedModel) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.num_layers = int(self.model.config.num_hidden_layers)

    @property
    def device(self) -> torch.device:
        return self.loaded.device

    def new_cache(self, max_len: int) -> PreallocatedCache:
        if max_len > self.loaded.max_positions:
            raise PromptError(
                f"request needs {max_len} positions but {self.loaded.name} has a context of {self.loaded.max_positions}"
            )
        return PreallocatedCache(self.num_layers, max_len)

    @torch.inference_mode()
    def forward(
        self, cache: PreallocatedCache, tokens: list[int], *, last_only: bool = False, hidden: bool = False
    ) -> ForwardOutput:
        """Append `tokens` to the cache and return their logits (float32).

        last_only: compute logits for the last token only (prefill needs no more).
        """
        if not tokens:
            raise ValueError("forward needs at least one token")
        input_ids = torch.tensor([tokens], dtype=torch.long, device=self.device)  # [1, new]
        out = self.model(
            input_ids=input_ids,
            cache=cache,
            use_cache=True,
            logits_to_keep=1 if last_only else 0,
            output_hidden_states=hidden,
        )
        logits = out.logits[0].float()  # [new or 1, vocab]
        hidden_states = out.hidden_states[-1][0] if hidden else None
        return ForwardOutput(logits=logits, hidden=hidden_states)
