"""A draft model with its own KV cache: a separate smaller model, an int8 copy of the target
(`model: target, quantization: int8`), or the target's own layers (`layer_skip`).

The draft runs k single-token steps per round. Its cache is kept in step with the target by
keeping the longest prefix of what it has cached that is still in the committed context, and
rolling back the rest (a length move, no copy).

A draft the engine stopped asking for a while (adaptive k or the load schedule switched
speculation off for more than one step; the engine says so by calling `resume()` before the
next proposal) would first have to catch up on everything committed meanwhile: on a long
prompt that pass costs most of a prefill, and it is paid on every probe. Instead a resumed
draft keeps the context's first `sink` tokens and catches up on only its last
`resume_window` (StreamingLLM's window with attention sinks). It runs at cache positions, not
the context's, so under rotary embeddings each recent token keeps its distances to the others.
The draft is weaker for seeing less, never wrong: what it proposes is still verified. It sees
the whole context again from the next request on.

A draft model with a shorter context than the target's drafts while the sequence fits in its
context and proposes nothing after: speculation is limited to what the draft can see, and the
target serves the rest of the request alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from specdec.drafters.base import Drafter, Proposal
from specdec.drafters.ngram import NgramDrafter
from specdec.errors import ConfigError
from specdec.models import catalog
from specdec.models.cache import PreallocatedCache
from specdec.models.loader import LoadedModel, load_model, model_file
from specdec.models.quantize import quantize_int8, quantized_bytes
from specdec.models.runner import ModelRunner
from specdec.models.vocab import check_draft_vocabulary, check_vocabulary_compatible
from specdec.sampling.invariant import invariant_tokens
from specdec.sampling.params import SamplingParams
from specdec.sampling.penalties import History
from specdec.sampling.probs import logits_to_probs, sample

if TYPE_CHECKING:
    from specdec.config import SpeculativeConfig


# A resumed draft keeps this many of the context's first tokens and catches up on this many
# of its last (that pass costs about 2.7 plain steps of the default model on a CPU:
# `python benchmarks/catch_up_cost.py`).
SINK = 4
RESUME_WINDOW = 16
# The longest n-gram prompt lookup tries in front of a draft model (as `ngram`'s default).
LOOKUP_MAX = 6


def common_prefix_length(a: list[int], b: list[int]) -> int:
    if len(a) <= len(b) and a == b[: len(a)]:
        return len(a)
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class DraftModelDrafter(Drafter):
    """Drafts with `draft`, or with only the given decoder layers of it (self-speculation)."""

    def __init__(
        self, draft: LoadedModel, layers: Sequence[int] | None = None, added_memory_bytes: int = 0,
        sink: int = SINK, resume_window: int = RESUME_WINDOW, p_min: float | None = None,
    ) -> None:
        if sink < 0 or resume_window < 1:
            raise ValueError("need sink >= 0 and resume_window >= 1")
        if p_min is not None and not 0 < p_min <= 1:
            raise ValueError(f"p_min must be in (0, 1], got {p_min!r}")
        self.p_min = p_min
        self.runner = ModelRunner(draft, layers)
        self.added_memory_bytes = added_memory_bytes
        self.sink = sink
        self.resume_window = resume_window
        self.cache: PreallocatedCache | None = None
        self.cached: list[int] = []  # the tokens whose KV the cache holds, in order
        self.offset = 0  # the draft sees context[:sink] + context[offset:]; 0: all of the context
        self._resumed = False  # resume() was called: the next proposal may shorten the view
        self.prompt_len = 0  # the request's prompt: context[:prompt_len] (penalties count the rest)

    def view(self, context: list[int]) -> list[int]:
        """The part of the context the draft runs on."""
        return context if self.offset == 0 else context[: self.sink] + context[self.offset :]

    def begin(self, prompt_ids: list[int], max_len: int) -> None:
        # A cache from the previous request is kept when big enough: propose() reuses whatever
        # prefix of it the new context shares (the same prompt sampled again, a longer chat).
        max_len = min(max_len, self.runner.loaded.max_positions)  # past its context the draft proposes nothing
        if self.cache is None or self.cache.max_len < max_len:
            self.cache = self.runner.new_cache(max_len)
            self.cached = []
        self.offset = 0  # a new request is seen whole (unless the draft is resumed mid-way)
        self._resumed = False
        self.prompt_len = len(prompt_ids)

    def resume(self) -> None:
        """The engine paused speculation and asks again: catch up on the sink and the recent
        window only, if the draft missed more than that."""
        self._resumed = True

    def model_runner(self) -> ModelRunner:
        return self.runner

    def propose(
        self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Proposal:
        assert self.cache is not None, "begin() must be called first"
        # 1. Keep what the cache holds of the context; at least one token must be fed. A draft
        #    resumed after being skipped catches up on the sink and the recent window only.
        view = self.view(context)
        keep = min(common_prefix_length(self.cached, view), len(view) - 1)
        if self._resumed and len(view) - keep > self.sink + self.resume_window:
            self.offset = len(context) - self.resume_window
            view = self.view(context)
            keep = min(common_prefix_length(self.cached, view), len(view) - 1)
        self._resumed = False
        # The cache holds the view and all drafted tokens but the last: what its size leaves of k.
        k = min(k, self.cache.max_len - len(view) + 1)
        if k < 1:
            return Proposal(tokens=[])
        self.cache.rollback(keep)
        del self.cached[keep:]
        feed = view[keep:]
        # 2. Draft k tokens one at a time, from logits with the request's bias and penalties (as
        #    the target's are verified), so that the draft follows what the target will sample.
        history = None
        if params.adjusts_logits:
            history = History(params, self.runner.loaded.vocab_size, context[: self.prompt_len])
            history.add(context[self.prompt_len :])
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        for _ in range(k):
            logits = self.runner.forward(self.cache, feed, last_only=True).logits  # [1, vocab]
            self.cached.extend(feed)
            if history is not None:
                logits = history.adjust(logits, [tokens])
            # With a floor, the draft stops where its most likely token is less likely than that
            # (under greedy, as the logits' softmax says; sampled, as the distribution it samples
            # from): it decides from its own distribution alone, so what it drafts stays exact.
            if params.greedy:
                if self.p_min is not None and float(torch.softmax(logits[0].float(), -1).max()) < self.p_min:
                    break
                token = int(logits[0].argmax())
            else:
                draft_probs = logits_to_probs(logits, params)  # [1, vocab]
                if self.p_min is not None and float(draft_probs.max()) < self.p_min:
                    break
                if params.drafter_invariant:  # the target's noise at this position: a deterministic draft
                    token = invariant_tokens(draft_probs, generator.initial_seed(), len(context) + len(tokens))[0]
                else:
                    token = int(sample(draft_probs, generator)[0])
                    probs.append(draft_probs[0])
            tokens.append(token)
            feed = [token]
        return Proposal(tokens=tokens, probs=torch.stack(probs) if probs else None)

    def fork(self) -> DraftModelDrafter:
        return DraftModelDrafter(self.runner.loaded, self.runner.layers, self.added_memory_bytes, self.sink,
                                 self.resume_window, self.p_min)

    def commit(self, context: list[int], num_accepted: int) -> None:
        pass  # the next propose() rolls the cache back to what the context kept


def _same_model(name: str, target: LoadedModel) -> bool:
    if name == "target":
        return True
    return model_file(name).resolve() == Path(target.source).resolve()


class LookupFirst(Drafter):
    """Prompt lookup where the context repeats itself, the draft model elsewhere: each step tries
    lookup first and runs the draft only when lookup finds nothing. Lookup costs nothing and,
    where the answer quotes the prompt or itself, proposes runs the target accepts whole; the
    draft guesses everywhere, at a fraction of a target step a token. The draft's cache catches
    up on what lookup's steps committed at its next proposal (one pass over those tokens)."""

    def __init__(self, draft: DraftModelDrafter, lookup: NgramDrafter) -> None:
        self.draft = draft
        self.lookup = lookup
        self.added_memory_bytes = draft.added_memory_bytes
        self.used_lookup = 0  # steps drafted by lookup (the rest by the draft model)

    def begin(self, prompt_ids: list[int], max_len: int) -> None:
        self.draft.begin(prompt_ids, max_len)
        self.lookup.begin(prompt_ids, max_len)

    def propose(
        self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Proposal:
        proposal = self.lookup.propose(context, k, params, generator)
        if proposal.tokens:
            self.used_lookup += 1
            return proposal
        return self.draft.propose(context, k, params, generator)

    def commit(self, context: list[int], num_accepted: int) -> None:
        self.draft.commit(context, num_accepted)
        self.lookup.commit(context, num_accepted)

    def resume(self) -> None:
        self.draft.resume()

    def model_runner(self) -> ModelRunner:
        return self.draft.model_runner()

    def fork(self) -> LookupFirst:
        return LookupFirst(self.draft.fork(), self.lookup.fork())


def draft_name(config: SpeculativeConfig, target: LoadedModel) -> str:
    """The draft the config names, else the target's known draft (a catalog pair); ConfigError
    for a target that has none."""
    if config.model:
        return config.model
    known = catalog.known_draft(target.source)
    if known is None:
        pairs = ", ".join(f"{m.name} -> {m.draft}" for m in catalog.MODELS.values() if m.draft)
        raise ConfigError(f"method 'draft_model' needs a draft model: set 'model' in the speculative config "
                          f"(--draft-model); {target.name} has no known draft (known pairs: {pairs})")
    return known


def offered(target: LoadedModel) -> list[dict]:
    """draft_model with the target's known draft, for a target that has one
    (:func:`specdec.methods.target_methods`)."""
    return [{"method": "draft_model"}] if catalog.known_draft(target.source) is not None else []


def pinned(config: SpeculativeConfig, target: LoadedModel) -> SpeculativeConfig:
    """The config with the target's known draft named (:func:`specdec.methods.pinned`)."""
    return config if config.model else dataclasses.replace(config, model=draft_name(config, target))


def build(config: SpeculativeConfig, target: LoadedModel) -> DraftModelDrafter | LookupFirst:
    config = pinned(config, target)
    assert config.model is not None
    # A target drafting for itself shares its weights instead of loading them again.
    shared = _same_model(config.model, target)
    if not shared:  # a draft that cannot pair is refused before its weights load
        check_draft_vocabulary(target, config.model)
    draft = target if shared else load_model(config.model, device=target.device)
    check_vocabulary_compatible(target, draft)
    added = 0 if shared else draft.weight_bytes()
    if config.quantization == "int8":
        # The int8 copy shares embeddings and norms with the model it was made from.
        draft = quantize_int8(draft)
        added += quantized_bytes(draft)
    drafter = DraftModelDrafter(draft, added_memory_bytes=added, p_min=config.draft_p_min)
    if config.draft_lookup_min is None:
        return drafter
    return LookupFirst(drafter, NgramDrafter(config.draft_lookup_min, max(LOOKUP_MAX, config.draft_lookup_min)))
