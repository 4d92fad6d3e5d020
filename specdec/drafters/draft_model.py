"""A draft model with its own KV cache: a separate smaller model, an int8 copy of the target
(`model: target, quantization: int8`), or the target's own layers (`layer_skip`).

The draft runs k single-token steps per round. Its cache is kept in step with the target by
keeping the longest prefix of what it has cached that is still in the committed context, and
rolling back the rest (a length move, no copy).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from specdec.config import SamplingParams, SpeculativeConfig
from specdec.drafters.base import Proposal, register
from specdec.models.cache import PreallocatedCache
from specdec.models.loader import LoadedModel, default_model_path, load_model
from specdec.models.quantize import quantize_int8, quantized_bytes
from specdec.models.runner import ModelRunner
from specdec.models.vocab import check_vocabulary_compatible
from specdec.sampling.probs import logits_to_probs, sample


def common_prefix_length(a: list[int], b: list[int]) -> int:
    if len(a) <= len(b) and a == b[: len(a)]:
        return len(a)
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class DraftModelDrafter:
    """Drafts with `draft`, or with only the given decoder layers of it (self-speculation)."""

    def __init__(self, draft: LoadedModel, layers: Sequence[int] | None = None, added_memory_bytes: int = 0) -> None:
        self.runner = ModelRunner(draft, layers)
        self.added_memory_bytes = added_memory_bytes
        self.cache: PreallocatedCache | None = None
        self.cached: list[int] = []  # the tokens whose KV the cache holds, in order

    def begin(self, prompt_ids: list[int], max_len: int) -> None:
        # A cache from the previous request is kept when big enough: propose() reuses whatever
        # prefix of it the new context shares (the same prompt sampled again, a longer chat).
        if self.cache is None or self.cache.max_len < max_len:
            self.cache = self.runner.new_cache(max_len)
            self.cached = []

    def propose(
        self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Proposal:
        assert self.cache is not None, "begin() must be called first"
        # 1. Keep what the cache holds of the context; at least one token must be fed.
        keep = min(common_prefix_length(self.cached, context), len(context) - 1)
        self.cache.rollback(keep)
        del self.cached[keep:]
        feed = context[keep:]
        # 2. Draft k tokens one at a time.
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        for _ in range(k):
            logits = self.runner.forward(self.cache, feed, last_only=True).logits  # [1, vocab]
            self.cached.extend(feed)
            if params.greedy:
                token = int(logits[0].argmax())
            else:
                draft_probs = logits_to_probs(logits, params)  # [1, vocab]
                token = int(sample(draft_probs, generator)[0])
                probs.append(draft_probs[0])
            tokens.append(token)
            feed = [token]
        return Proposal(tokens=tokens, probs=torch.stack(probs) if probs else None)

    def commit(self, context: list[int], num_accepted: int) -> None:
        # The next propose() rolls the cache back to what the context kept.
        pass


def _same_model(name: str, target: LoadedModel) -> bool:
    if name == "target":
        return True
    path = default_model_path() if name == "default" else Path(name).expanduser()
    return path.resolve() == Path(target.source).resolve()


@register("draft_model")
def _build(config: SpeculativeConfig, target: LoadedModel) -> DraftModelDrafter:
    assert config.model is not None  # the config checks this
    # A target drafting for itself shares its weights instead of loading them again.
    shared = _same_model(config.model, target)
    draft = target if shared else load_model(config.model, device=target.device)
    check_vocabulary_compatible(target, draft)
    added = 0 if shared else draft.weight_bytes()
    if config.quantization == "int8":
        # The int8 copy shares embeddings and norms with the model it was made from.
        draft = quantize_int8(draft)
        added += quantized_bytes(draft.model)
    return DraftModelDrafter(draft, added_memory_bytes=added)
