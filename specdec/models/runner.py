"""One sequence's view of a backend: a block of new tokens in, their logits out, against a
preallocated KV cache that rolls back by moving a length."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec.errors import ConfigError, PromptError
from specdec.models.backend import ForwardOutput
from specdec.models.cache import PreallocatedCache
from specdec.models.loader import LoadedModel

# Decoder stacks whose layers can be run as a subset (`layers=`): an embedding, a list of
# decoder layers sharing one rotary embedding and one causal mask, a final norm.
LAYER_SUBSET_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})


class ModelRunner:
    """Runs one sequence of a model against its own cache.

    layers: run only these decoder layers (0-based, ascending), then the model's own final
    norm and LM head: the target as its own draft (self-speculation). None runs them all.
    """

    def __init__(self, loaded: LoadedModel, layers: Sequence[int] | None = None) -> None:
        self.loaded = loaded
        self.backend = loaded.backend
        self.num_layers = loaded.num_layers
        self.layers = None if layers is None else check_layer_subset(loaded, layers)

    @property
    def device(self) -> torch.device:
        return self.loaded.device

    def new_cache(self, max_len: int) -> PreallocatedCache:
        if max_len > self.loaded.max_positions:
            raise PromptError(
                f"request needs {max_len} positions but {self.loaded.name} has a context of {self.loaded.max_positions}"
            )
        return PreallocatedCache(self.num_layers, max_len, held=self.layers)

    @torch.inference_mode()
    def forward(
        self, cache: PreallocatedCache, tokens: list[int], *, last_only: bool = False, hidden: bool = False,
        hidden_layers: Sequence[int] = (), last_logits: int | None = None,
    ) -> ForwardOutput:
        """Append `tokens` to the cache and return their logits [new or 1, vocab] (float32) and,
        when asked, the final normed hidden states [new or 1, hidden] and the outputs of
        `hidden_layers` ({layer: [new, hidden]}, every token even with last_only).

        last_only: compute logits for the last token only (prefill needs no more); last_logits: for
        the last this many.
        """
        if not tokens:
            raise ValueError("forward needs at least one token")
        input_ids = torch.tensor([tokens], dtype=torch.long, device=self.device)  # [1, new]
        positions = torch.arange(cache.length, cache.length + len(tokens), device=self.device)[None]  # [1, new]
        out = self.backend.forward(cache, input_ids, positions, None, layers=self.layers, last_only=last_only,
                                   hidden=hidden, hidden_layers=hidden_layers, last_logits=last_logits)
        states = {i: state[0] for i, state in out.layer_states.items()} if out.layer_states else None
        return ForwardOutput(logits=out.logits[0], hidden=out.hidden[0] if out.hidden is not None else None,
                             layer_states=states)


    def score(self, tokens: list[int]) -> torch.Tensor:
        """[len(tokens), vocab]: the logits of a whole sequence from one pass into a fresh cache
        (a reference: nothing cached before, nothing kept after)."""
        return self.forward(self.new_cache(len(tokens)), tokens).logits


def check_layer_subset(loaded: LoadedModel, layers: Sequence[int]) -> tuple[int, ...]:
    """Validate a layer subset for `loaded`; returns it as an ascending tuple."""
    model_type = loaded.backend.model_type
    if model_type not in LAYER_SUBSET_MODEL_TYPES:
        raise ConfigError(
            f"layer_skip runs a subset of layers of {', '.join(sorted(LAYER_SUBSET_MODEL_TYPES))} models; "
            f"{loaded.name} is a {model_type!r} model"
        )
    num_layers = loaded.num_layers
    layers = tuple(sorted(set(layers)))
    if not layers or layers[0] < 0 or layers[-1] >= num_layers:
        raise ConfigError(f"layers must be indices in 0..{num_layers - 1} for {loaded.name}, got {list(layers)}")
    return layers
