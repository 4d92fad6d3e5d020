"""One request at a time: a batch of one through the batched step (:mod:`specdec.engine.batch`).

Prefill, drafting, verification, acceptance and the stop conditions exist once, in
:class:`~specdec.engine.batch.BatchEngine`; this class adds what a single caller wants: k and
adaptive k per engine (what adaptive k learns is kept from request to request), a cache sized to
the request, and streaming. With no drafter the same step is plain decoding: every step verifies
an empty draft, one target pass over the last token, which is what makes outputs comparable.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from specdec.config import SamplingParams, SpeculativeConfig
from specdec.errors import ConfigError
from specdec.methods import build_drafter
from specdec.drafters.base import Drafter
from specdec.engine.adaptive import AdaptiveStates, SpeculationPolicy
from specdec.engine.batch import BatchEngine, check_prompt, draft_room
from specdec.engine.generation import Generation, StreamChunk
from specdec.models.loader import LoadedModel
from specdec.models.prefix_cache import PrefixCache
from specdec.models.runner import ModelRunner
from specdec.sampling import SamplingRule, speculative_accept
from specdec.sampling.tree import TreeRule, accept_tree_sampling

__all__ = ["Engine", "Generation", "StreamChunk"]


class Engine:
    """Generates for one request at a time with an optional drafter proposing up to k tokens.

    prefix_cache: committed tokens' KV kept from request to request (a prompt that starts with an
    earlier request's tokens prefills only the rest); engines of one target may share one.
    """

    def __init__(
        self,
        target: LoadedModel,
        drafter: Drafter | None = None,
        num_speculative_tokens: int = 0,
        sampling_rule: SamplingRule = speculative_accept,
        tree_rule: TreeRule = accept_tree_sampling,
        adaptive: bool = False,
        prefix_cache: PrefixCache | None = None,
    ) -> None:
        if drafter is not None and num_speculative_tokens < 1:
            raise ValueError("a drafter needs num_speculative_tokens >= 1")
        self.target = target
        self.runner = ModelRunner(target)
        self.drafter = drafter
        self.k = num_speculative_tokens if drafter is not None else 0
        self.adaptive = adaptive and drafter is not None
        self.adaptive_states = AdaptiveStates()  # what adaptive k learned, kept across requests
        self.sampling_rule = sampling_rule
        self.tree_rule = tree_rule
        self.prefix_cache = prefix_cache
        self._batch: BatchEngine | None = None
        self._busy = False

    @classmethod
    def from_config(cls, target: LoadedModel, config: SpeculativeConfig | None, *,
                    sampling_rule: SamplingRule = speculative_accept,
                    tree_rule: TreeRule = accept_tree_sampling, prefix_cache: PrefixCache | None = None) -> Engine:
        """The one way to build a drafter and its engine from a config (None: plain decoding):
        the library, `verify`, `bench` and `tune` all come here. The server builds its route
        drafters with the same :func:`~specdec.methods.build_drafter` over its batch engine."""
        if config is None:
            return cls(target, sampling_rule=sampling_rule, tree_rule=tree_rule, prefix_cache=prefix_cache)
        return cls(target, build_drafter(config, target), config.num_speculative_tokens,
                   sampling_rule=sampling_rule, tree_rule=tree_rule, adaptive=config.adaptive, prefix_cache=prefix_cache)

    def new_policy(self) -> SpeculationPolicy:
        """How many tokens each step of a new request drafts."""
        return self.adaptive_states.policy(self.k, self.adaptive)

    def _engine(self, max_len: int) -> BatchEngine:
        """A one-row batch engine whose cache holds `max_len` tokens (kept while big enough)."""
        if self._batch is None or self._batch.max_model_len < max_len:
            self._batch = self._batch_engine(1, max_len)
        return self._batch

    def _batch_engine(self, rows: int, max_len: int) -> BatchEngine:
        # A tree drafter may propose more tokens than its depth k; a predicted output drafts on any engine.
        size = draft_room(self.k, self.drafter.proposal_size if self.drafter else 0)
        return BatchEngine(self.target, max_rows=rows, max_model_len=max_len, max_draft=size,
                           sampling_rule=self.sampling_rule, tree_rule=self.tree_rule, prefix_cache=self.prefix_cache)

    def _budget(self, prompt_ids: list[int], params: SamplingParams) -> int:
        limit = self.target.max_positions
        check_prompt(prompt_ids, limit, self.target.name)
        return min(params.max_tokens, limit - len(prompt_ids))

    def stream(self, prompt_ids: list[int], params: SamplingParams, result: Generation | None = None) -> Iterator[StreamChunk]:
        """Generate, yielding text and tokens as they are committed. When `result` is given it
        is filled in (tokens, text, finish reason, stats) as generation goes."""
        budget = self._budget(prompt_ids, params)
        if self._busy:
            raise RuntimeError("this engine is already generating: finish or close the previous stream first")
        # A cache sized to the request: its budget exactly, so that the batch engine's budget
        # (the room left in a row) is the request's.
        engine = self._engine(len(prompt_ids) + budget)
        self._busy = True
        try:
            # A predicted output drafts the request on any engine, speculating or not (admit).
            out = engine.admit(prompt_ids, params, self.drafter, self.k, self.new_policy(), result=result)
            while True:
                if out.chunk.token_ids or out.chunk.text:
                    yield out.chunk
                if out.finished:
                    if out.sequence.result.error is not None:
                        raise ConfigError(out.sequence.result.error)
                    return
                (out,) = engine.step()
        finally:
            if engine.sequences:  # the one row, when admit gave it one
                engine.remove(engine.sequences[0])
            self._busy = False

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        result = Generation(prompt_ids=list(prompt_ids))
        for _ in self.stream(prompt_ids, params, result):
            pass
        return result

    def generate_batch(self, prompts: list[list[int]], params: SamplingParams | Sequence[SamplingParams],
                       max_rows: int = 8) -> list[Generation]:
        """Generate for several prompts together: up to `max_rows` sequences share each target pass
        (the server's batched step), each drafted by its own fork of this engine's drafter; a
        sequence that finishes leaves its row to the next prompt. The results are in the prompts'
        order, each as :meth:`generate` would give it on the native backend (its rows are bitwise
        their sequences' alone; on hf, float32 products may round a near tie otherwise). `params`:
        one for every prompt, or one each."""
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        each = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(each) != len(prompts):
            raise ValueError(f"{len(each)} sampling params for {len(prompts)} prompts")
        budgets = [self._budget(ids, p) for ids, p in zip(prompts, each)]  # every prompt checked before any runs
        if len(prompts) <= 1:
            return [self.generate(ids, p) for ids, p in zip(prompts, each)]
        if self._busy:
            raise RuntimeError("this engine is already generating: finish or close the previous stream first")
        engine = self._batch_engine(min(max_rows, len(prompts)), max(len(ids) + b for ids, b in zip(prompts, budgets)))
        results = [Generation(prompt_ids=list(ids)) for ids in prompts]
        waiting = list(range(len(prompts)))[::-1]
        self._busy = True
        try:
            while waiting or engine.sequences:
                while waiting and engine.running < engine.max_rows:
                    i = waiting.pop()
                    drafter = self.drafter.fork() if self.drafter is not None else None
                    out = engine.admit(prompts[i], each[i], drafter, self.k, self.new_policy(), result=results[i])
                    if out.finished:
                        engine.remove(out.sequence)
                for out in engine.step():
                    if out.finished:
                        engine.remove(out.sequence)
        finally:
            while engine.sequences:
                engine.remove(engine.sequences[-1])
            self._busy = False
        for result in results:
            if result.error is not None:
                raise ConfigError(result.error)
        return results
