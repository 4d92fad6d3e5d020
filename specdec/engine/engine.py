"""The draft-and-verify loop for one request.

With no drafter the same loop is plain decoding: every step verifies an empty draft, which is
one target pass over the last token. Plain decoding and speculation therefore share every
line of code but the proposal, which is what makes their outputs comparable.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from specdec.config import SamplingParams
from specdec.drafters.base import Drafter, Proposal
from specdec.engine.adaptive import AdaptiveK, AdaptiveState, FixedK, SpeculationPolicy
from specdec.engine.stats import RequestStats
from specdec.engine.text import TextAssembler
from specdec.errors import PromptError
from specdec.models.cache import PreallocatedCache
from specdec.models.loader import LoadedModel
from specdec.models.runner import ModelRunner
from specdec.sampling import AcceptResult, greedy_accept, logits_to_probs, speculative_accept

NO_PROPOSAL = Proposal(tokens=[])

# (target_probs [batch, n + 1, vocab], draft_tokens [batch, n], draft_probs [batch, n, vocab] | None,
#  generator) -> AcceptResult. The engine uses speculative_accept; `specdec verify` swaps in a
# deliberately wrong rule to show that its test can tell.
SamplingRule = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Generator | None], AcceptResult]


@dataclass(frozen=True)
class _Prefill:
    prompt_ids: list[int]
    cache: PreallocatedCache
    logits: torch.Tensor  # [1, vocab]


@dataclass(frozen=True)
class StreamChunk:
    """Tokens committed by one target step (after stop conditions), and their new text."""

    token_ids: list[int]
    text: str


@dataclass
class Generation:
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop" (EOS or stop string) or "length"
    stats: RequestStats = field(default_factory=RequestStats)


class Engine:
    """Generates for one request at a time with an optional drafter proposing up to k tokens.

    When a request has the same prompt as the one before it (many samples of one prompt), the
    prompt's KV cache and first-token logits are reused instead of computed again.
    """

    def __init__(
        self,
        target: LoadedModel,
        drafter: Drafter | None = None,
        num_speculative_tokens: int = 0,
        sampling_rule: SamplingRule = speculative_accept,
        adaptive: bool = False,
    ) -> None:
        if drafter is not None and num_speculative_tokens < 1:
            raise ValueError("a drafter needs num_speculative_tokens >= 1")
        self.target = target
        self.runner = ModelRunner(target)
        self.drafter = drafter
        self.k = num_speculative_tokens if drafter is not None else 0
        self.adaptive = adaptive and drafter is not None
        self.adaptive_state: AdaptiveState | None = None  # what adaptive k learned, kept across requests
        self.sampling_rule = sampling_rule
        self._last_prefill: _Prefill | None = None
        self._busy = False

    def _new_generator(self, params: SamplingParams) -> torch.Generator:
        generator = torch.Generator(device=self.runner.device)
        if params.seed is None:
            generator.seed()  # fresh entropy, leaving torch's global generator alone
        else:
            generator.manual_seed(params.seed)
        return generator

    def new_policy(self) -> SpeculationPolicy:
        """How many tokens each step of a new request drafts."""
        if not self.adaptive:
            return FixedK(self.k)
        policy = AdaptiveK(self.k, self.adaptive_state)
        self.adaptive_state = policy.state
        return policy

    def _steps(self, prompt_ids: list[int], params: SamplingParams, budget: int, stats: RequestStats) -> Iterator[list[int]]:
        """Yield the tokens each target pass commits; the caller stops iterating when done."""
        generator = None if params.greedy else self._new_generator(params)
        policy = self.new_policy()
        max_len = len(prompt_ids) + budget  # the cache never holds the last committed token
        if self.drafter is not None:
            self.drafter.begin(prompt_ids, max_len)

        # 0. Prefill: one pass over the prompt gives the first token.
        start = time.perf_counter()
        cache, logits = self._prefill(prompt_ids, max_len)  # logits: [1, vocab]
        empty = torch.empty((1, 0), dtype=torch.long)
        first = self._accept(logits, empty, None, params, generator).row(0)
        stats.prefill_time_s = time.perf_counter() - start
        context = prompt_ids + first
        generated = 1
        yield first

        while True:
            # 1. Draft up to k tokens (the policy's k); never more than the request can still use.
            start = time.perf_counter()
            room = min(policy.next_k(), budget - generated - 1)
            proposal = self.drafter.propose(context, room, params, generator) if room > 0 else NO_PROPOSAL
            draft = proposal.tokens[:room]
            draft_probs = proposal.probs[: len(draft)] if proposal.probs is not None else None
            drafted = time.perf_counter()

            # 2. Verify: one target pass over the last committed token and the draft.
            verified_from = cache.length  # == len(context) - 1: the last token is not cached yet
            logits = self.runner.forward(cache, context[-1:] + draft).logits  # [len(draft) + 1, vocab]

            # 3. Accept a prefix of the draft and add the recovered or bonus token.
            draft_tensor = torch.tensor([draft], dtype=torch.long)  # [1, len(draft)]
            result = self._accept(logits, draft_tensor, draft_probs, params, generator)
            committed = result.row(0)
            num_accepted = len(committed) - 1

            # 4. Commit: the cache keeps the last token and the accepted drafts, and drops the rest.
            cache.rollback(verified_from + 1 + num_accepted)
            context.extend(committed)
            generated += len(committed)
            if self.drafter is not None:
                self.drafter.commit(context, num_accepted)
            draft_time, verify_time = drafted - start, time.perf_counter() - drafted
            policy.observe(len(draft), num_accepted, draft_time, verify_time)
            stats.record_step(len(draft), num_accepted, draft_time, verify_time)
            yield committed

    def _prefill(self, prompt_ids: list[int], max_len: int) -> tuple[PreallocatedCache, torch.Tensor]:
        last = self._last_prefill
        if last is not None and last.prompt_ids == prompt_ids and last.cache.max_len >= max_len:
            last.cache.rollback(len(prompt_ids))
            return last.cache, last.logits
        cache = self.runner.new_cache(max_len)
        logits = self.runner.forward(cache, prompt_ids, last_only=True).logits
        self._last_prefill = _Prefill(list(prompt_ids), cache, logits)
        return cache, logits

    def _accept(
        self,
        logits: torch.Tensor,
        draft: torch.Tensor,
        draft_probs: torch.Tensor | None,
        params: SamplingParams,
        generator: torch.Generator | None,
    ) -> AcceptResult:
        # logits: [n + 1, vocab]; draft: [1, n]; draft_probs: [n, vocab] or None
        if params.greedy:
            return greedy_accept(logits[None], draft)
        target_probs = logits_to_probs(logits, params)[None]  # [1, n + 1, vocab]
        return self.sampling_rule(target_probs, draft, None if draft_probs is None else draft_probs[None], generator)

    def stream(self, prompt_ids: list[int], params: SamplingParams, result: Generation | None = None) -> Iterator[StreamChunk]:
        """Generate, yielding text and tokens as they are committed. When `result` is given it
        is filled in (tokens, text, finish reason, stats) as generation goes."""
        if not prompt_ids:
            raise PromptError("prompt is empty")
        limit = self.target.max_positions
        if len(prompt_ids) >= limit:
            raise PromptError(f"prompt has {len(prompt_ids)} tokens; {self.target.name} takes at most {limit - 1}")
        if self._busy:
            raise RuntimeError("this engine is already generating: finish or close the previous stream first")
        result = result if result is not None else Generation(prompt_ids=list(prompt_ids))
        stats = result.stats
        stats.prompt_tokens = len(prompt_ids)
        budget = min(params.max_tokens, limit - len(prompt_ids))
        eos = frozenset() if params.ignore_eos else self.target.eos_token_ids
        text = TextAssembler(self.target.tokenizer, params.stop)
        start = time.perf_counter()
        steps = self._steps(list(prompt_ids), params, budget, stats)
        self._busy = True
        try:
            for committed in steps:
                # Stop conditions, in token order: EOS, then the token budget, then stop strings.
                finish = None
                for i, token in enumerate(committed):
                    if token in eos:
                        committed, finish = committed[:i], "stop"
                        break
                room = budget - len(result.token_ids)
                if len(committed) >= room:
                    committed, finish = committed[:room], finish or "length"
                update = text.add(committed)
                if update.stopped:
                    committed, finish = committed[: update.kept_tokens], "stop"
                result.token_ids.extend(committed)
                stats.generated_tokens = len(result.token_ids)
                stats.wall_time_s = time.perf_counter() - start
                delta = update.delta + (text.finish() if finish else "")
                result.text = text.text
                if committed or delta:
                    yield StreamChunk(token_ids=committed, text=delta)
                if finish:
                    result.finish_reason = finish
                    return
        finally:
            steps.close()
            self._busy = False

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        result = Generation(prompt_ids=list(prompt_ids))
        for _ in self.stream(prompt_ids, params, result):
            pass
        return result
