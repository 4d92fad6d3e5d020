"""The one interface the engine and drafters use to run a model: a block of new tokens in,
their logits out, against a preallocated KV cache that rolls back by moving a length."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers.masking_utils import create_causal_mask

from specdec.errors import ConfigError, PromptError
from specdec.models.cache import PreallocatedCache
from specdec.models.loader import LoadedModel


@dataclass(frozen=True)
class ForwardOutput:
    """logits: [new, vocab] (or [1, vocab] with last_only); hidden: [new, hidden_size], the last
    layer's output after the final norm (the LM head's input), when asked for."""

    logits: torch.Tensor
    hidden: torch.Tensor | None = None


# Decoder stacks whose layers can be run as a subset by `forward(layers=...)`: an embedding, a
# list of decoder layers sharing one rotary embedding and one causal mask, a final norm.
LAYER_SUBSET_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})


class ModelRunner:
    """Runs one sequence of a model against its own cache.

    layers: run only these decoder layers (0-based, ascending), then the model's own final
    norm and LM head: the target as its own draft (self-speculation). None runs them all.
    """

    def __init__(self, loaded: LoadedModel, layers: Sequence[int] | None = None) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.num_layers = int(self.model.config.num_hidden_layers)
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
        self, cache: PreallocatedCache, tokens: list[int], *, last_only: bool = False, hidden: bool = False
    ) -> ForwardOutput:
        """Append `tokens` to the cache and return their logits (float32).

        last_only: compute logits for the last token only (prefill needs no more).
        """
        if not tokens:
            raise ValueError("forward needs at least one token")
        input_ids = torch.tensor([tokens], dtype=torch.long, device=self.device)  # [1, new]
        if self.layers is not None:
            return self._forward_layers(cache, input_ids, last_only, hidden)
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

    def _forward_layers(
        self, cache: PreallocatedCache, input_ids: torch.Tensor, last_only: bool, hidden: bool
    ) -> ForwardOutput:
        """The decoder stack's forward pass over `self.layers` only; the same modules and
        arithmetic as the full model, so keeping every layer reproduces it."""
        base = self.model.model
        embeds = base.embed_tokens(input_ids)  # [1, new, hidden]
        past = cache.length
        position_ids = torch.arange(past, past + input_ids.shape[1], device=self.device)[None]  # [1, new]
        # The mask's size comes from the first layer run: skipped layers hold nothing.
        mask = create_causal_mask(
            config=base.config, inputs_embeds=embeds, attention_mask=None, cache=cache,
            position_ids=position_ids, layer_idx=self.layers[0],
        )
        position_embeddings = base.rotary_emb(embeds, position_ids=position_ids)
        states = embeds
        for index in self.layers:
            states = base.layers[index](
                states, attention_mask=mask, position_embeddings=position_embeddings,
                position_ids=position_ids, cache=cache, use_cache=True,
            )
        states = base.norm(states)[0]  # [new, hidden]
        if last_only:
            states = states[-1:]
        logits = self.model.lm_head(states).float()  # [new or 1, vocab]
        return ForwardOutput(logits=logits, hidden=states if hidden else None)


def check_layer_subset(loaded: LoadedModel, layers: Sequence[int]) -> tuple[int, ...]:
    """Validate a layer subset for `loaded`; returns it as an ascending tuple."""
    config = loaded.model.config
    model_type = getattr(config, "model_type", "?")
    if model_type not in LAYER_SUBSET_MODEL_TYPES:
        raise ConfigError(
            f"layer_skip runs a subset of layers of {', '.join(sorted(LAYER_SUBSET_MODEL_TYPES))} models; "
            f"{loaded.name} is a {model_type!r} model"
        )
    num_layers = int(config.num_hidden_layers)
    layers = tuple(sorted(set(layers)))
    if not layers or layers[0] < 0 or layers[-1] >= num_layers:
        raise ConfigError(f"layers must be indices in 0..{num_layers - 1} for {loaded.name}, got {list(layers)}")
    return layers
