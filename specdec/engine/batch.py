"""The draft-and-verify loop for many sequences at once (continuous batching).

Each sequence has its own drafter, its own k for the step, its own sampling parameters and
generator, and its own cache length. One step:

1. every sequence drafts up to its k tokens (k = 0: nothing);
2. the target verifies all rows in ONE forward pass over [rows, 1 + longest draft]; shorter
   rows are padded, and padding is never kept;
3. each row accepts a prefix of its draft with the same pure functions as the single-request
   :class:`~specdec.engine.engine.Engine`, with its own generator;
4. each row keeps the fed token plus its accepted drafts in the cache; its length forgets the
   rest (:class:`~specdec.models.batch_cache.BatchCache`), so a rejection in one row does not
   touch the others.

With speculation off for every row the step is one batched forward pass over [rows, 1]: batched
plain decoding. Sequences join (:meth:`BatchEngine.add`, which prefills the prompt alone, exactly
as the single-request engine does, then copies its KV into a free row) and leave
(:meth:`BatchEngine.remove`) between steps.

Stop conditions (EOS, the token budget, stop strings) are applied per sequence in the same order
as :meth:`Engine.stream`, and statistics are the same :class:`RequestStats`.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import torch

from specdec.config import SamplingParams
from specdec.drafters.base import Drafter
from specdec.engine.engine import Generation, StreamChunk
from specdec.engine.text import TextAssembler
from specdec.errors import PromptError
from specdec.models.batch_cache import BatchCache
from specdec.models.loader import LoadedModel
from specdec.models.runner import ModelRunner
from specdec.sampling import AcceptResult, greedy_accept, logits_to_probs, speculative_accept

_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    """One request's state inside the batch. `k` is the most tokens it may draft next step;
    the scheduler may change it between steps (0 turns speculation off for that step)."""

    prompt_ids: list[int]
    params: SamplingParams
    drafter: Drafter | None = None
    k: int = 0
    id: int = field(default_factory=lambda: next(_ids))
    result: Generation = field(init=False)
    context: list[int] = field(init=False, default_factory=list)
    budget: int = field(init=False, default=0)
    row: int = field(init=False, default=-1)
    finished: bool = field(init=False, default=False)
    generator: torch.Generator | None = field(init=False, default=None)
    _text: TextAssembler | None = field(init=False, default=None)
    _eos: frozenset[int] = field(init=False, default=frozenset())
    _start: float = field(init=False, default=0.0)

    def __post_init__(self) -> None:
        self.result = Generation(prompt_ids=list(self.prompt_ids))


@dataclass(frozen=True)
class SequenceOutput:
    """What one step did for one sequence: the chunk it emits (possibly empty), whether it
    finished, and what it drafted and accepted (for metrics)."""

    sequence: Sequence
    chunk: StreamChunk
    finished: bool
    drafted: int
    accepted: int


class BatchEngine:
    """Advances up to `max_rows` sequences together against one :class:`BatchCache`.

    max_model_len: the longest sequence (prompt + output) a row may hold.
    """

    def __init__(self, target: LoadedModel, max_rows: int, max_model_len: int, max_draft: int = 16) -> None:
        if max_model_len > target.max_positions:
            raise PromptError(f"max_model_len {max_model_len} exceeds {target.name}'s context of {target.max_positions}")
        self.target = target
        self.runner = ModelRunner(target)
        self.max_rows = max_rows
        self.max_model_len = max_model_len
        self.max_draft = max_draft
        # A row's last step may write a draft and padding past its last kept token.
        self.cache = BatchCache.for_backend(target.backend, max_rows, max_model_len + max_draft + 1)
        self.sequences: list[Sequence] = []  # index == row

    @property
    def running(self) -> int:
        return len(self.sequences)

    def check_prompt(self, prompt_ids: list[int]) -> None:
        """Raise PromptError when a prompt cannot run (empty, or no room for one output token)."""
        if not prompt_ids:
            raise PromptError("prompt is empty")
        if len(prompt_ids) >= self.max_model_len:
            raise PromptError(
                f"prompt has {len(prompt_ids)} tokens; this server takes at most {self.max_model_len - 1}"
            )

    # --- sequences join and leave ------------------------------------------------------------

    def add(self, seq: Sequence) -> SequenceOutput:
        """Prefill a sequence alone (as the single-request engine does) and give it a row.
        Returns its first token's output; the sequence may already be finished."""
        self.check_prompt(seq.prompt_ids)
        if self.running >= self.max_rows:
            raise RuntimeError(f"batch is full ({self.max_rows} sequences)")
        params = seq.params
        seq._start = time.perf_counter()
        stats = seq.result.stats
        stats.prompt_tokens = len(seq.prompt_ids)
        seq.budget = min(params.max_tokens, self.max_model_len - len(seq.prompt_ids))
        seq._eos = frozenset() if params.ignore_eos else self.target.eos_token_ids
        seq._text = TextAssembler(self.target.tokenizer, params.stop)
        if not params.greedy:
            seq.generator = torch.Generator(device=self.runner.device)
            if params.seed is None:
                seq.generator.seed()
            else:
                seq.generator.manual_seed(params.seed)
        max_len = len(seq.prompt_ids) + seq.budget
        if seq.drafter is not None:
            seq.drafter.begin(list(seq.prompt_ids), max_len)

        # 0. Prefill: one pass over the prompt alone gives the first token; its KV joins the batch.
        prefill_cache = self.runner.new_cache(max_len)
        logits = self.runner.forward(prefill_cache, list(seq.prompt_ids), last_only=True).logits  # [1, vocab]
        first = self._accept(seq, logits, [], None).row(0)
        stats.prefill_time_s = time.perf_counter() - seq._start
        seq.context = list(seq.prompt_ids) + first
        seq.row = self.cache.insert_row(prefill_cache)
        self.sequences.append(seq)
        out = self._emit(seq, first, drafted=0, accepted=0)
        return out

    def remove(self, seq: Sequence) -> None:
        """Free a sequence's row (finished or cancelled)."""
        if seq.row < 0 or seq.row >= self.running or self.sequences[seq.row] is not seq:
            return
        row = seq.row
        moved = self.cache.remove_row(row)
        last = self.sequences.pop()
        if moved is not None:
            self.sequences[row] = last
            last.row = row
        seq.row = -1

    # --- one step ----------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[SequenceOutput]:
        """Advance every running sequence by one target pass. Finished sequences stay in the
        batch until :meth:`remove`; the caller removes them."""
        if not self.sequences:
            return []
        seqs = list(self.sequences)

        # 1. Draft: each row proposes up to its own k, never more than it can still use.
        drafts: list[list[int]] = []
        draft_probs: list[torch.Tensor | None] = []
        for seq in seqs:
            room = min(seq.k, self.max_draft, seq.budget - len(seq.result.token_ids) - 1,
                       self.max_model_len - len(seq.context))
            if seq.drafter is None or room <= 0:
                drafts.append([])
                draft_probs.append(None)
                continue
            proposal = seq.drafter.propose(seq.context, room, seq.params, seq.generator)
            tokens = proposal.tokens[:room]
            drafts.append(tokens)
            draft_probs.append(proposal.probs[: len(tokens)] if proposal.probs is not None else None)

        # 2. Verify: one target pass over [rows, new]; each row feeds its last committed token and
        #    its draft, padded at the end (padding sits after every real token, so causality hides it).
        new = 1 + max(len(d) for d in drafts)
        feed = [[seq.context[-1], *draft] + [seq.context[-1]] * (new - 1 - len(draft)) for seq, draft in zip(seqs, drafts)]
        input_ids = torch.tensor(feed, dtype=torch.long, device=self.runner.device)  # [rows, new]
        positions, mask = self.cache.step_inputs(new)  # [rows, new], [rows, 1, new, longest + new]
        logits = self.target.backend.forward(self.cache, input_ids, positions, mask).logits  # [rows, new, vocab]

        # 3. Accept per row, with the row's own parameters and generator.
        results = [self._accept(seq, logits[i, : len(draft) + 1], draft, probs)
                   for i, (seq, draft, probs) in enumerate(zip(seqs, drafts, draft_probs))]
        num_accepted = [int(r.num_accepted[0]) for r in results]

        # 4. Commit: a row keeps its fed token and accepted drafts; its length forgets the rest.
        keep = torch.tensor([1 + a for a in num_accepted], dtype=torch.long, device=self.cache.device)  # [rows]
        self.cache.commit(new, keep)
        outputs = []
        for seq, draft, result, accepted in zip(seqs, drafts, results, num_accepted):
            committed = result.row(0)
            seq.context.extend(committed)
            if seq.drafter is not None:
                seq.drafter.commit(seq.context, accepted)
            seq.result.stats.record_step(len(draft), accepted)
            outputs.append(self._emit(seq, committed, drafted=len(draft), accepted=accepted))
        return outputs

    def _accept(self, seq: Sequence, logits: torch.Tensor, draft: list[int], draft_probs: torch.Tensor | None) -> AcceptResult:
        # logits: [n + 1, vocab]; draft: n tokens; draft_probs: [n, vocab] or None
        draft_tensor = torch.tensor([draft], dtype=torch.long, device=logits.device)  # [1, n]
        if seq.params.greedy:
            return greedy_accept(logits[None], draft_tensor)
        target_probs = logits_to_probs(logits, seq.params)[None]  # [1, n + 1, vocab]
        return speculative_accept(target_probs, draft_tensor, None if draft_probs is None else draft_probs[None], seq.generator)

    def _emit(self, seq: Sequence, committed: list[int], drafted: int, accepted: int) -> SequenceOutput:
        """Apply the stop conditions to the committed tokens, as Engine.stream does, in token
        order: EOS, then the token budget, then stop strings."""
        assert seq._text is not None
        result = seq.result
        finish = None
        for i, token in enumerate(committed):
            if token in seq._eos:
                committed, finish = committed[:i], "stop"
                break
        room = seq.budget - len(result.token_ids)
        if len(committed) >= room:
            committed, finish = committed[:room], finish or "length"
        update = seq._text.add(committed)
        if update.stopped:
            committed, finish = committed[: update.kept_tokens], "stop"
        result.token_ids.extend(committed)
        result.stats.generated_tokens = len(result.token_ids)
        result.stats.wall_time_s = time.perf_counter() - seq._start
        delta = update.delta + (seq._text.finish() if finish else "")
        result.text = seq._text.text
        if finish:
            result.finish_reason = finish
            seq.finished = True
        return SequenceOutput(seq, StreamChunk(token_ids=committed, text=delta), seq.finished, drafted, accepted)
