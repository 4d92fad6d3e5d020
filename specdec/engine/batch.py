"""The draft-and-verify step for one or many sequences at once (continuous batching).

This is the one loop: the single-request :class:`~specdec.engine.engine.Engine` is a batch of
one, and the server's scheduler drives many rows. Each sequence has its own drafter, its own k
for the step (its policy's choice, capped by the caller's `k`), its own sampling parameters and
generator, and its own cache length. One step:

1. every sequence drafts up to its k tokens (k = 0: nothing);
2. the target verifies all rows in ONE forward pass over [rows, 1 + longest draft]; shorter
   rows are padded, and padding is never kept;
3. acceptance runs once for the step on the padded tensors with per-row lengths
   (:func:`~specdec.sampling.accept_batch`), each row with its own parameters and generator;
4. each row keeps the fed token plus its accepted drafts in the cache; its length forgets the
   rest (:class:`~specdec.models.batch_cache.BatchCache`), so a rejection in one row does not
   touch the others.

A drafter that reads the target's hidden states (an EAGLE head) names the layers in its
`target_layers`; the prefill and every verification pass then return those layers' outputs,
and each row's drafter gets its committed positions' states (:meth:`observe_target`).

With speculation off for every row the step is one batched forward pass over [rows, 1]: batched
plain decoding. Sequences join (:meth:`BatchEngine.admit`, which prefills the prompt alone, then
copies its KV into a free row) and leave (:meth:`BatchEngine.remove`) between steps. Stop
conditions (EOS, the token budget, stop strings) are applied per sequence, in token order.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from specdec import kernels
from specdec.config import SamplingParams
from specdec.drafters.base import Drafter, Verified
from specdec.drafters.prediction import PREDICTION_K, PredictionDrafter, draft_room  # noqa: F401 (draft_room: for the engine and server)
from specdec.engine.adaptive import SpeculationPolicy
from specdec.engine.generation import Generation, StreamChunk
from specdec.engine.text import TextAssembler
from specdec.errors import PromptError
from specdec.models.batch_cache import BatchCache
from specdec.models.cache import PreallocatedCache
from specdec.models.loader import LoadedModel
from specdec.models.prefix_cache import PrefixCache
from specdec.models.runner import ModelRunner
from specdec.sampling import RowDraft, SamplingRule, accept_step, speculative_accept
from specdec.sampling.grammar import Constraint, compiler_for
from specdec.sampling.logprobs import TokenLogprob, token_logprobs
from specdec.sampling.penalties import History, chain_paths, tree_paths
from specdec.sampling.tree import TokenTree, TreeRule, accept_tree_sampling

_ids = itertools.count()
# The most logits (rows x positions x vocabulary) whose acceptance runs torch on one thread: about
# 8 rows of one position over a 49k vocabulary, where sampling on one thread and on two cost the
# same step (benchmarks/torch_inline_ab.py --batch 8, round 17); 16 rows ran faster on two.
INLINE_LOGITS = 1 << 19


@dataclass(eq=False)
class Sequence:
    """One request's state inside the batch.

    k: the most tokens it may draft next step; the scheduler may change it between steps (0
    turns speculation off for that step). policy: chooses k within that cap step by step
    (adaptive k) and observes what each step did; None drafts the cap.
    """

    prompt_ids: list[int]
    params: SamplingParams
    drafter: Drafter | None = None
    k: int = 0
    policy: SpeculationPolicy | None = None
    grammar: Any = None  # params.structured compiled by the caller (None: compiled here)
    id: int = field(default_factory=lambda: next(_ids))
    result: Generation = field(init=False)
    context: list[int] = field(init=False, default_factory=list)
    budget: int = field(init=False, default=0)
    row: int = field(init=False, default=-1)
    finished: bool = field(init=False, default=False)
    paused_steps: int = field(init=False, default=0)  # steps in a row with speculation off (k 0)
    generator: torch.Generator | None = field(init=False, default=None)
    history: History | None = field(init=False, default=None)  # for a bias or penalties
    constraint: Constraint | None = field(init=False, default=None)  # for a structured output
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


@dataclass(frozen=True)
class _Prefill:
    prompt_ids: list[int]
    cache: PreallocatedCache
    logits: torch.Tensor  # [1, vocab], or [prompt, vocab] when every position's was asked for
    states: dict[int, torch.Tensor]  # {layer: [prompt, hidden]}, the layers asked for
    cached: int  # prompt tokens whose keys and values came from the prefix cache


def check_prompt(prompt_ids: list[int], limit: int, holder: str) -> None:
    """The one check of a tokenized prompt (the engines' and the server's): not empty, and room for
    one output token within `limit` positions (`holder`, what has that limit, names it)."""
    if not prompt_ids:
        raise PromptError("prompt is empty")
    if len(prompt_ids) >= limit:
        raise PromptError(f"{holder}'s maximum context length is {limit} tokens; the prompt has {len(prompt_ids)} tokens, "
                          f"leaving no room for output (a prompt takes at most {limit - 1})", too_long=True)


def target_layers(drafter: Drafter | None) -> tuple[int, ...]:
    """The target layers whose outputs a drafter reads (none for most drafters)."""
    return tuple(drafter.target_layers) if drafter is not None else ()


def _features(states: dict[int, torch.Tensor], layers: tuple[int, ...], row: int, offsets: list[int]) -> torch.Tensor:
    """[len(offsets), len(layers) * hidden]: a row's outputs of these layers at these new-token
    offsets (the fed token's and its accepted drafts')."""
    index = torch.tensor(offsets)
    return torch.cat([states[i][row, index] for i in layers], dim=-1)


class BatchEngine:
    """Advances up to `max_rows` sequences together against one :class:`BatchCache`.

    max_model_len: the longest sequence (prompt + output) a row may hold.
    max_draft: the most tokens any row drafts in a step.
    sampling_rule, tree_rule: how sampled chain and tree rows accept (the exact rules; `specdec
    verify` swaps in wrong ones).

    When a sequence has the same prompt as the one prefilled before it (many samples of one
    prompt), that prompt's KV and first-token logits are reused instead of computed again.
    prefix_cache: committed tokens' KV kept across sequences (:mod:`specdec.models.prefix_cache`):
    a prompt's prefill starts after the longest prefix it holds, and every prompt, and every
    sequence's committed tokens when it leaves, are stored in it. None: each prompt prefilled whole.
    """

    def __init__(self, target: LoadedModel, max_rows: int, max_model_len: int, max_draft: int = 16,
                 sampling_rule: SamplingRule = speculative_accept, tree_rule: TreeRule = accept_tree_sampling,
                 prefix_cache: PrefixCache | None = None) -> None:
        if max_model_len > target.max_positions:
            raise PromptError(f"max_model_len {max_model_len} exceeds {target.name}'s context of {target.max_positions}")
        self.target = target
        self.runner = ModelRunner(target)
        self.max_rows = max_rows
        self.max_model_len = max_model_len
        self.max_draft = max_draft
        self.sampling_rule = sampling_rule
        self.tree_rule = tree_rule
        # A row's last step may write a draft and padding past its last kept token.
        self.cache = BatchCache.for_backend(target.backend, max_rows, max_model_len + max_draft + 1)
        self.sequences: list[Sequence] = []  # index == row
        self.prefix_cache = prefix_cache
        self._last_prefill: _Prefill | None = None

    @property
    def running(self) -> int:
        return len(self.sequences)

    def check_prompt(self, prompt_ids: list[int]) -> None:
        """Raise PromptError when a prompt cannot run (empty, or no room for one output token)."""
        check_prompt(prompt_ids, self.max_model_len, "This model")

    # --- sequences join and leave ------------------------------------------------------------

    def admit(self, prompt_ids: list[int], params: SamplingParams, drafter: Drafter | None = None, k: int = 0,
              policy: SpeculationPolicy | None = None, *, grammar: Any = None,
              result: Generation | None = None) -> SequenceOutput:
        """The one way a request joins (the library's :class:`~specdec.engine.engine.Engine`, the
        server's scheduler and the corpus writer all come here): its sequence, checked, prefilled
        and given a row. It drafts with `drafter` (this sequence's own) up to k tokens a step under
        `policy`; with a predicted output (`params.prediction`) the prediction drafts it instead, at
        PREDICTION_K tokens a step, whatever the drafter and k (a caller that wants no drafting
        leaves the prediction out). `grammar`: its structured output compiled by the caller;
        `result`: a Generation to fill in. Returns its first token's output (`.sequence` is the
        sequence, whose `k` is the one decided here); on an error it holds no row."""
        if params.prediction:
            drafter, k, policy = PredictionDrafter(list(params.prediction)), PREDICTION_K, None
        seq = Sequence(list(prompt_ids), params, drafter, k=k, policy=policy, grammar=grammar)
        if result is not None:
            seq.result = result
        try:
            return self._add(seq)
        except BaseException:
            self.remove(seq)  # in case it got a row before failing
            raise

    def _add(self, seq: Sequence) -> SequenceOutput:
        """Prefill a sequence alone and give it a row (:meth:`admit`'s work). Returns its first
        token's output; the sequence may already be finished."""
        self.check_prompt(seq.prompt_ids)
        if self.running >= self.max_rows:
            raise RuntimeError(f"batch is full ({self.max_rows} sequences)")
        params = seq.params
        seq._start = time.perf_counter()
        cpu_start = time.process_time()
        stats = seq.result.stats
        stats.prompt_tokens = len(seq.prompt_ids)
        seq.budget = min(params.max_tokens, self.max_model_len - len(seq.prompt_ids))
        seq._eos = (frozenset() if params.ignore_eos else self.target.eos_token_ids) | frozenset(params.stop_token_ids)
        seq._text = TextAssembler(self.target.tokenizer, params.stop)
        if not params.greedy:
            seq.generator = torch.Generator(device=self.runner.device)
            if params.seed is None:
                seq.generator.seed()  # fresh entropy, leaving torch's global generator alone
            else:
                seq.generator.manual_seed(params.seed)
        max_len = len(seq.prompt_ids) + seq.budget
        if params.adjusts_logits:
            seq.history = History(params, self.target.vocab_size, seq.prompt_ids)
        if params.structured is not None:
            compiler = compiler_for(self.target.tokenizer, self.target.vocab_size, self.target.eos_token_ids)
            seq.constraint = compiler.constraint(params.structured, seq.grammar)
        if seq.drafter is not None:
            seq.drafter.begin(list(seq.prompt_ids), max_len)

        # 0. Prefill: one pass over the prompt alone gives the first token; its KV joins the batch.
        layers = target_layers(seq.drafter)
        prefill_cache, logits, states, stats.cached_tokens = self._prefill(list(seq.prompt_ids), layers,
                                                                          params.prompt_logprobs)
        if params.prompt_logprobs:  # each prompt token's from the position before it
            seq.result.prompt_logprobs = [None, *token_logprobs(logits[:-1], seq.prompt_ids[1:], params.logprobs or 0)]
        raw = logits[-1:]  # [1, vocab]
        if layers:
            seq.drafter.observe_target(_features({i: s[None] for i, s in states.items()}, layers, 0,
                                                 list(range(len(seq.prompt_ids)))))
        with kernels.torch_ops_inline():  # as a step's acceptance (see `step`)
            adjusted = self._adjusted([seq], raw[None], [[]], [None])[0]
            first = accept_step(adjusted[None], [RowDraft([])], [params], [seq.generator], [len(seq.prompt_ids)],
                                self.sampling_rule, self.tree_rule)[0].committed
        seq.context = list(seq.prompt_ids) + first
        seq.row = self.cache.insert_row(prefill_cache)
        stats.prefill_time_s = time.perf_counter() - seq._start
        stats.cpu_time_s += time.process_time() - cpu_start
        self.sequences.append(seq)
        with kernels.torch_ops_inline():
            return self._emit(seq, first, drafted=0, accepted=0, raw=raw, offsets=[0])

    @torch.inference_mode()
    def warm(self, prompt_ids: list[int], layers: tuple[int, ...] = ()) -> int:
        """Prefill `prompt_ids` into the prefix cache only (no row, no output): a long prompt's
        first part, ahead of its :meth:`admit`, which then prefills only what is left (exactly,
        as any prefix-cache hit). Returns the tokens it computed; 0 without a prefix cache."""
        if self.prefix_cache is None or len(prompt_ids) < 2:
            return 0
        _, _, _, cached = self._prefill(list(prompt_ids), layers)
        return len(prompt_ids) - cached

    def _prefill(self, prompt_ids: list[int], layers: tuple[int, ...], every_position: bool = False
                 ) -> tuple[PreallocatedCache, torch.Tensor, dict[int, torch.Tensor], int]:
        """The prompt's cache, its logits ([1, vocab]: the last position's; [prompt, vocab] with
        `every_position`), the asked layers' states and how many prompt tokens the prefix cache gave."""
        # The prompt's cache is only read (copied into a row), so a later sequence can reuse it.
        last = self._last_prefill
        if (last is not None and last.prompt_ids == prompt_ids and set(layers) <= set(last.states)
                and (not every_position or len(last.logits) == len(prompt_ids))):
            # The whole prompt's keys and values are reused: every prompt token counts as cached.
            return last.cache, last.logits if every_position else last.logits[-1:], last.states, len(prompt_ids)
        cache = self.runner.new_cache(len(prompt_ids))
        prefix = self.prefix_cache
        # Every position's logits need every position computed: such a prompt is only stored.
        hit = prefix.match(prompt_ids, layers) if prefix is not None and not every_position else None
        cached = hit.tokens if hit is not None else 0
        if cached:
            cache.fill(hit.kv())
        out = self.runner.forward(cache, prompt_ids[cached:], last_only=not every_position, hidden_layers=layers)
        states = out.layer_states or {}
        if cached and layers:
            states = {i: torch.cat([s, states[i]]) for i, s in hit.states(layers).items()}
        if prefix is not None:
            prefix.store(prompt_ids, cache, states=states)
        self._last_prefill = _Prefill(prompt_ids, cache, out.logits, states, cached)
        return cache, out.logits if every_position else out.logits[-1:], states, cached

    def remove(self, seq: Sequence) -> None:
        """Free a sequence's row (finished or cancelled)."""
        if seq.row < 0 or seq.row >= self.running or self.sequences[seq.row] is not seq:
            return
        row = seq.row
        if self.prefix_cache is not None:  # its committed tokens: the slots before its length
            self.prefix_cache.store(seq.context[: int(self.cache.lengths[row])], self.cache, row)
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
        cpu_start = time.process_time()
        seqs = list(self.sequences)

        # 1. Draft: each row proposes up to its k, never more than it can still use. A tree's
        #    depth is bounded by k, its size by the most tokens a row may verify.
        drafts: list[list[int]] = []
        draft_probs: list[torch.Tensor | None] = []
        trees: list[TokenTree | None] = []
        draft_times: list[float] = []
        proposed: list[bool] = []  # the drafter was asked this step
        for seq in seqs:
            start = time.perf_counter()
            wish = seq.policy.next_k() if seq.policy is not None else seq.k
            room = min(wish, seq.k, self.max_draft, seq.budget - len(seq.result.token_ids) - 1,
                       self.max_model_len - len(seq.context))
            tokens, probs, tree, asked = [], None, None, False
            if seq.drafter is not None and min(wish, seq.k) < 1:
                seq.paused_steps += 1
            elif seq.drafter is not None and room > 0:
                # Resumed after a pause (more than one step: a single timed plain step is none),
                # a drafter that keeps state may catch up on less than everything it missed.
                if seq.paused_steps > 1:
                    seq.drafter.resume()
                seq.paused_steps = 0
                # A drafter with no model of its own (lookup, a head) runs torch's operations on one
                # thread, as acceptance does; a draft model's passes keep torch's threads.
                with kernels.torch_ops_inline(seq.drafter.model_runner() is None):
                    proposal = seq.drafter.propose(seq.context, room, seq.params, seq.generator)
                asked = True
                if proposal.parents is not None:
                    tree = TokenTree(tuple(proposal.tokens), tuple(proposal.parents)).truncated(self.max_draft, room)
                    tokens = list(tree.tokens)
                    probs = proposal.probs[: len(tokens)] if proposal.probs is not None and tokens else None
                else:
                    tokens = proposal.tokens[:room]
                    if seq.constraint is not None and (proposal.probs is None or seq.params.greedy):
                        # A token the grammar forbids is never accepted: verify the draft up to it.
                        # (A sampled draft keeps it: the rule's rejection there resamples from the
                        # residual, which cutting would replace by the target's whole distribution.)
                        tokens = tokens[: seq.constraint.allowed_prefix(tokens)]
                    probs = proposal.probs[: len(tokens)] if proposal.probs is not None and tokens else None
            proposed.append(asked)
            drafts.append(tokens)
            draft_probs.append(probs)
            trees.append(tree if tokens else None)
            draft_times.append(time.perf_counter() - start)

        # 2. Verify: one target pass over [rows, new]; each row feeds its last committed token and
        #    its draft, padded at the end (padding sits after every real token, so causality hides it).
        #    A tree's nodes sit at positions by depth and see only their ancestors.
        start = time.perf_counter()
        new = 1 + max(len(d) for d in drafts)
        feed = [[seq.context[-1], *draft] + [seq.context[-1]] * (new - 1 - len(draft)) for seq, draft in zip(seqs, drafts)]
        input_ids = torch.tensor(feed, dtype=torch.long, device=self.runner.device)  # [rows, new]
        positions, mask = self.cache.step_inputs(new)  # [rows, new], [rows, 1, new, longest + new]
        for i, tree in enumerate(trees):
            if tree is not None:
                self.cache.tree_inputs(positions, mask, i, tree.depths(), tree.ancestors_mask())
        layers = sorted({i for seq in seqs for i in target_layers(seq.drafter)})
        out = self.target.backend.forward(self.cache, input_ids, positions, mask, hidden_layers=layers)
        raw = out.logits  # [rows, new, vocab]

        # 3. Accept, once for the step: each chain row a prefix of its draft, each tree row a
        #    branch of its tree, each with its own parameters. torch's operations here run on one
        #    thread where the step's logits are few (`kernels.torch_ops_inline`), on torch's where
        #    splitting them saves more than the spinning workers cost the next pass.
        with kernels.torch_ops_inline(raw.numel() <= INLINE_LOGITS):
            logits = self._adjusted(seqs, raw, drafts, trees)
            accepted = accept_step(logits, [RowDraft(d, p, t) for d, p, t in zip(drafts, draft_probs, trees)],
                                   [s.params for s in seqs], [s.generator for s in seqs],
                                   [len(s.context) for s in seqs], self.sampling_rule, self.tree_rule)
        for i, (row, tree) in enumerate(zip(accepted, trees)):
            if tree is not None:
                self.cache.keep_path(i, row.offsets)
        verify_time = time.perf_counter() - start

        # 4. Commit: a row keeps its fed token and accepted drafts; its length forgets the rest.
        #    Committed token j was chosen at new-token offset ([0] + kept)[j].
        self.cache.commit(new, [1 + len(row.offsets) for row in accepted])
        # The step's CPU time (drafting, the pass, acceptance) in equal shares: every row fed the
        # pass the same padded width.
        cpu_share = (time.process_time() - cpu_start) / len(seqs)
        outputs = []
        with kernels.torch_ops_inline():
            for i, (seq, tree, row) in enumerate(zip(seqs, trees, accepted)):
                committed, kept = row.committed, row.offsets
                num_accepted = len(committed) - 1
                # Positions drafted; for a tree, its depth.
                drafted = tree.depth if tree is not None else len(drafts[i])
                seq.context.extend(committed)
                if proposed[i]:
                    # Every node verified, kept or not, with the target's logits after the fed token
                    # and after each node (lookahead's Jacobi window learns from all of them).
                    nodes = list(tree.tokens) if tree is not None else drafts[i]
                    parents = list(tree.parents) if tree is not None else list(range(-1, len(nodes) - 1))
                    seq.drafter.observe_verified(Verified(nodes, parents, logits[i, : 1 + len(nodes)]))
                if seq.drafter is not None:
                    if own := target_layers(seq.drafter):  # the fed token's and accepted drafts' states
                        seq.drafter.observe_target(_features(out.layer_states, own, i, [0, *kept]))
                    seq.drafter.commit(seq.context, num_accepted)
                if seq.policy is not None:
                    seq.policy.observe(drafted, num_accepted, draft_times[i], verify_time)
                seq.result.stats.record_step(drafted, num_accepted, draft_times[i], verify_time,
                                             verified_tokens=1 + len(drafts[i]), cpu_time_s=cpu_share)
                outputs.append(self._emit(seq, committed, drafted=drafted, accepted=num_accepted, raw=raw[i],
                                          offsets=[0, *kept]))
        return outputs

    def _adjusted(self, seqs: list[Sequence], logits: torch.Tensor, drafts: list[list[int]],
                  trees: list[TokenTree | None]) -> torch.Tensor:
        """The logits acceptance reads: each row's with its bias and penalties applied, and its
        grammar's mask, at every position from the tokens before it (its draft's, or its tree
        node's ancestors')."""
        if all(seq.history is None and seq.constraint is None for seq in seqs):
            return logits
        logits = logits.float().clone()
        for i, (seq, draft, tree) in enumerate(zip(seqs, drafts, trees)):
            if seq.history is None and seq.constraint is None:
                continue
            paths = tree_paths(tree.tokens, tree.parents) if tree is not None else chain_paths(draft)
            rows = logits[i, : len(paths)]
            if seq.history is not None:
                rows = seq.history.adjust(rows, paths)
            if seq.constraint is not None:
                rows = seq.constraint.mask(rows.contiguous(), paths)
            logits[i, : len(paths)] = rows
        return logits

    def _emit(self, seq: Sequence, committed: list[int], drafted: int, accepted: int,
              raw: torch.Tensor, offsets: list[int]) -> SequenceOutput:
        """Apply the stop conditions to the committed tokens in token order: EOS, then the token
        budget, then stop strings. raw: [new, vocab], the row's logits from the target; offsets:
        the positions in it that chose the committed tokens (for logprobs)."""
        assert seq._text is not None
        result = seq.result
        finish, at_eos = None, False
        for i, token in enumerate(committed):
            if token in seq._eos:
                committed, finish, at_eos = committed[:i], "stop", True
                break
        room = seq.budget - len(result.token_ids)
        if len(committed) >= room:
            committed, finish = committed[:room], finish or "length"
        update = seq._text.add(committed)
        if update.stopped:
            committed, finish = committed[: update.kept_tokens], "stop"
        result.token_ids.extend(committed)
        if seq.history is not None:
            seq.history.add(committed)
        if seq.constraint is not None:
            seq.constraint.advance(committed)
            if at_eos and finish == "stop" and seq.constraint.dead_end():
                # The grammar allows nothing here: its language is empty past this point. The
                # client's spec, not the engine, failed: said as such (the server's 400).
                finish = "error"
                result.error = (f"the {seq.params.structured.what} has no instance that starts with this output "
                                f"({len(result.token_ids)} tokens): no text can complete it")
        logprobs: tuple[TokenLogprob, ...] = ()
        if seq.params.logprobs is not None:
            logprobs = tuple(token_logprobs(raw[offsets[: len(committed)]], committed, seq.params.logprobs))
            result.logprobs.extend(logprobs)
        result.stats.generated_tokens = len(result.token_ids)
        result.stats.wall_time_s = time.perf_counter() - seq._start
        delta = update.delta + (seq._text.finish() if finish else "")
        result.text = seq._text.text
        if finish:
            result.finish_reason = finish
            seq.finished = True
        return SequenceOutput(seq, StreamChunk(token_ids=committed, text=delta, logprobs=logprobs), seq.finished,
                              drafted, accepted)
