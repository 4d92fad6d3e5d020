"""`specdec verify`: check that a speculative configuration leaves the output unchanged.

Greedy: token-identical output to plain decoding on a prompt set, with the first divergence
reported in detail where there is one.

Sampling: a two-sample test. For each prompt, many seeded continuations are sampled with
speculation and as many without; at every position after the first (the first token comes
from the prefill, before any draft), the token counts of the two samples are compared with a
chi-square test of homogeneity, rare tokens pooled, and so are the pairs of consecutive tokens
(joint behaviour, which per-position marginals miss). The smallest p-value, Bonferroni-corrected
for the number of tests, is the verdict: it passes when above the significance level.

The conditional test watches the acceptance rule at work in the speculative arm. At every
sampled position it knows what the rule was given (the target's distribution p, the draft
token d and the draft's distribution q) and so the exact distribution the token must follow:
at a drafted position d with probability a = min(1, p(d)/q(d)), otherwise the residual
max(0, p - q) renormalised; after a fully accepted draft, p. Two statistics are summed over
every position of every continuation: whether the token is the draft (mean a) and the
token's probability under that distribution (the likelihood, mean sum r^2). Each term has a
known mean and variance given the past, so each sum is a martingale and its z-score is
normal under the right rule: no pooling, no dilution across different prefixes, and the
power grows with every position. A third statistic counts impossible tokens, ones that
distribution gives probability 0 (a rejected position's token where the target is not above
the draft); the right rule makes none but through float round-off, bounded by a rate of
1e-6 per position. It sees the rule only; the two-sample test sees the whole
pipeline (how drafts are made and reported), so both count, Bonferroni-corrected together.
Token trees are watched the same way: at each depth of the accepted path the node's children
were tried in order (each against what the earlier ones left), so the token's distribution is
known there too.

The self-check runs the same tests with the configured drafter on deliberately wrong rules and
must reject each, or the test proved nothing: "accept every draft" (gross), and
"residual from target" (the right acceptance test, but a rejected position's token drawn from
the target instead of the residual: subtle). Each is sampled with more and more draws (doubling,
up to 8 times `draws`) until the test rejects it; the draws it took are reported, a measure of
the test's power against that error.

Drafter-invariant sampling (SamplingParams.drafter_invariant) is checked token by token: with
the same seed, speculation must give exactly the plain tokens.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from typing import Any

import torch
from scipy.stats import chi2_contingency, norm, poisson

from specdec.api import LLM, Message
from specdec.bench.data import Record, load_records
from specdec.config import SamplingParams, SpeculativeConfig
from specdec.methods import DEFAULT_METHOD
from specdec.engine import Engine, Generation
from specdec.sampling import AcceptResult, SamplingRule, speculative_accept
from specdec.sampling.tree import TreeRule, accept_tree_sampling

# Prompts whose answers repeat themselves, so that drafters propose often at every position.
SAMPLING_PROMPTS: tuple[str, ...] = (
    "Count from 1 to 30, separated by commas.",
    "Write the word 'tick' ten times, then the word 'tock' ten times.",
    "List the days of the week, then list them again in reverse order.",
)


def builtin_prompts() -> list[Record]:
    """One real prompt per Spec-Bench category, shipped with specdec (Apache-2.0, hemingkx/Spec-Bench)."""
    path = resources.files("specdec.data").joinpath("verify_prompts.jsonl")
    with resources.as_file(path) as file:
        return load_records(file)


@dataclass(frozen=True)
class Divergence:
    position: int  # index into the generated tokens
    plain_token: int
    spec_token: int
    plain_piece: str
    spec_piece: str
    plain_logit: float  # the target's logit for each token at that position, given the plain prefix
    spec_logit: float


@dataclass(frozen=True)
class GreedyCheck:
    prompt_id: str
    tokens: int
    identical: bool
    divergence: Divergence | None


def first_divergence(llm: LLM, prompt_ids: list[int], plain: list[int], spec: list[int]) -> Divergence | None:
    position = next((i for i, (a, b) in enumerate(zip(plain, spec)) if a != b), None)
    if position is None:
        if len(plain) == len(spec):
            return None
        position = min(len(plain), len(spec))  # one stopped early: compare what came next
    eos = min(llm.target.eos_token_ids, default=-1)
    plain_token = plain[position] if position < len(plain) else eos
    spec_token = spec[position] if position < len(spec) else eos
    runner = llm.engine.runner
    context = prompt_ids + plain[:position]
    cache = runner.new_cache(len(context) + 1)
    logits = runner.forward(cache, context, last_only=True).logits[0]  # [vocab]
    decode = llm.tokenizer.decode
    return Divergence(
        position, plain_token, spec_token, decode([plain_token]), decode([spec_token]),
        float(logits[plain_token]), float(logits[spec_token]),
    )


def verify_greedy(llm: LLM, records: list[Record], params: SamplingParams,
                  on_prompt: Callable[[], None] | None = None) -> list[GreedyCheck]:
    """Greedy (params' temperature is ignored) with params' budget, bias and penalties."""
    params = dataclasses.replace(params, temperature=0.0)
    checks = []
    for record in records:
        messages: list[Message] = [{"role": "user", "content": record.turns[0]}]
        prompt_ids = llm.encode(messages)
        plain = llm.plain_engine.generate(prompt_ids, params).token_ids
        spec = llm.engine.generate(prompt_ids, params).token_ids
        divergence = first_divergence(llm, prompt_ids, plain, spec)
        checks.append(GreedyCheck(record.id, len(plain), divergence is None, divergence))
        if on_prompt is not None:
            on_prompt()
    return checks


def accept_every_draft(
    target_probs: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, generator: torch.Generator | None
) -> AcceptResult:
    """A deliberately WRONG rule for the self-check: keeps every drafted token, then samples a
    bonus token. Its output follows the drafter, not the target."""
    batch, k = draft_tokens.shape
    bonus = torch.multinomial(target_probs[:, k], 1, generator=generator)  # [batch, 1]
    return AcceptResult(tokens=torch.cat([draft_tokens, bonus], dim=1), num_accepted=torch.full((batch,), k))


def residual_from_target(
    target_probs: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, generator: torch.Generator | None
) -> AcceptResult:
    """A subtly WRONG rule for the self-check: the right acceptance test, but the token at a
    rejected position is drawn from the target instead of the residual max(0, target - draft)."""
    batch, k = draft_tokens.shape
    vocab = target_probs.shape[-1]
    if draft_probs is None:
        draft_probs = torch.nn.functional.one_hot(draft_tokens, vocab).to(target_probs.dtype)
    index = draft_tokens[..., None]
    ratio = target_probs[:, :k].gather(-1, index).squeeze(-1) / draft_probs.gather(-1, index).squeeze(-1).clamp_min(1e-30)
    accepted = torch.rand((batch, k), generator=generator) < ratio
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)
    final = torch.multinomial(target_probs[torch.arange(batch), num_accepted], 1, generator=generator)  # [batch, 1]
    tokens = torch.cat([draft_tokens, draft_tokens.new_full((batch, 1), -1)], dim=1)
    tokens = torch.where(torch.arange(k + 1)[None] < num_accepted[:, None], tokens, -1).scatter(1, num_accepted[:, None], final)
    return AcceptResult(tokens=tokens, num_accepted=num_accepted)


def tree_accept_first_branch(target_probs, tree, draft_probs, generator):
    """WRONG (accept every draft, for trees): follow each node's first child to a leaf, then
    draw a bonus token from the target."""
    path, node = [], -1
    while children := tree.children(node):
        node = children[0]
        path.append(node)
    return path, int(torch.multinomial(target_probs[node + 1], 1, generator=generator))


def tree_residual_from_target(target_probs, tree, draft_probs, generator):
    """WRONG (residual from target, for trees): the right test for each child, but against the
    target itself, never the residual; when all are rejected, the token comes from the target."""
    path, node = [], -1
    while True:
        accepted = None
        for child in tree.children(node):
            token = tree.tokens[child]
            q = 1.0 if draft_probs is None else float(draft_probs[child, token])
            if float(torch.rand((), generator=generator)) * q < float(target_probs[node + 1, token]):
                accepted = child
                break
        if accepted is None:
            return path, int(torch.multinomial(target_probs[node + 1], 1, generator=generator))
        path.append(accepted)
        node = accepted


# name -> (the chain rule, the same error for trees)
WRONG_RULES = {"accept_every_draft": (accept_every_draft, tree_accept_first_branch),
               "residual_from_target": (residual_from_target, tree_residual_from_target)}


class ConditionalTest:
    """Sums, over every position an acceptance rule decides, the terms of the conditional test:
    (value, mean, variance) of each statistic given what the rule was given."""

    STATISTICS = ("draft_kept", "likelihood")
    ROUND_OFF = 1e-6  # the most impossible tokens per position that float round-off could make

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.sums = {name: [0.0, 0.0, 0.0] for name in self.STATISTICS}  # sum value, sum mean, sum variance
        self.positions = 0
        self.impossible = 0

    def _add(self, name: str, value: float, mean: float, variance: float) -> None:
        s = self.sums[name]
        s[0] += value
        s[1] += mean
        s[2] += variance

    def observe(self, p: torch.Tensor, drafts: list[int], q: list[torch.Tensor | None], token: int) -> None:
        """One position: the target's distribution p [vocab], the drafted tokens tried there in
        order (a chain's one, a tree node's children, none after a full accept) with their draft
        distributions (None: one-hot), and the token the rule committed."""
        p = p.double()
        r = torch.zeros_like(p)
        remaining, stay = p, 1.0  # what is left to draw from; the chance that every draft so far was rejected
        for d, q_d in zip(drafts, q):
            q_d = torch.nn.functional.one_hot(torch.tensor(d), p.shape[-1]).double() if q_d is None else q_d.double()
            a = min(1.0, float(remaining[d]) / float(q_d[d])) if float(q_d[d]) > 0 else 1.0
            r[d] += stay * a
            stay *= 1 - a
            residual = (remaining - q_d).clamp_min(0)
            mass = float(residual.sum())
            remaining = residual / mass if mass > 0 else remaining
        r += stay * remaining
        if drafts:
            kept = sum(float(r[d]) for d in set(drafts))
            self._add("draft_kept", float(token in drafts), kept, kept * (1 - kept))
        r2 = float((r * r).sum())
        self._add("likelihood", float(r[token]), r2, max(0.0, float((r * r * r).sum()) - r2 * r2))
        self.impossible += float(r[token]) == 0.0
        self.positions += 1

    def pvalues(self) -> dict[str, float]:
        """Two-sided p-value of each statistic's z-score (1 where it has no variance)."""
        out = {}
        for name, (value, mean, variance) in self.sums.items():
            out[name] = float(2 * norm.sf(abs(value - mean) / variance**0.5)) if variance > 0 else 1.0
        # P(at least this many) when round-off alone makes them
        out["impossible"] = float(poisson.sf(self.impossible - 1, self.positions * self.ROUND_OFF)) if self.impossible else 1.0
        return out


class RecordingRule:
    """A chain acceptance rule, watched: every position it decides goes to `test`."""

    def __init__(self, rule: SamplingRule = speculative_accept, test: ConditionalTest | None = None) -> None:
        self.rule = rule
        self.test = test or ConditionalTest()

    def __call__(self, target_probs: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                 generator: torch.Generator | None) -> AcceptResult:
        result = self.rule(target_probs, draft_tokens, draft_probs, generator)
        for row in range(draft_tokens.shape[0]):
            drafts = draft_tokens[row].tolist()
            for i, token in enumerate(result.row(row)):
                if i < len(drafts):  # position i tried draft i
                    self.test.observe(target_probs[row, i], [drafts[i]],
                                      [None if draft_probs is None else draft_probs[row, i]], token)
                else:  # the bonus token after a fully accepted draft
                    self.test.observe(target_probs[row, i], [], [], token)
        return result


class RecordingTreeRule:
    """A token-tree acceptance rule, watched: each depth of the accepted path, and the final
    token, against the node's children (tried in order, as the multi-draft rule tries them)."""

    def __init__(self, rule: TreeRule = accept_tree_sampling, test: ConditionalTest | None = None) -> None:
        self.rule = rule
        self.test = test or ConditionalTest()

    def __call__(self, target_probs: torch.Tensor, tree, draft_probs: torch.Tensor | None,
                 generator: torch.Generator | None) -> tuple[list[int], int]:
        path, final = self.rule(target_probs, tree, draft_probs, generator)
        node = -1
        for child, token in [(c, tree.tokens[c]) for c in path] + [(None, final)]:
            children = tree.children(node)
            self.test.observe(target_probs[node + 1], [tree.tokens[c] for c in children],
                              [None if draft_probs is None else draft_probs[c] for c in children], token)
            node = child if child is not None else node
        return path, final


def sample_continuations(engine: Engine, prompt_ids: list[int], params: SamplingParams, draws: int, seed0: int) -> list[Generation]:
    return [engine.generate(prompt_ids, dataclasses.replace(params, seed=seed0 + i)) for i in range(draws)]


def homogeneity_pvalue(a: list[int], b: list[int], min_count: int = 5) -> float:
    """Chi-square test that two samples of tokens come from one distribution; tokens seen fewer
    than `min_count` times in both samples together are pooled into one cell."""
    ca, cb = Counter(a), Counter(b)
    common = [t for t in set(ca) | set(cb) if ca[t] + cb[t] >= min_count]
    rare_a = len(a) - sum(ca[t] for t in common)
    rare_b = len(b) - sum(cb[t] for t in common)
    table = [[ca[t] for t in common], [cb[t] for t in common]]
    if rare_a + rare_b > 0:
        table[0].append(rare_a)
        table[1].append(rare_b)
    if len(table[0]) < 2:
        return 1.0  # one cell: both samples are the same token every time
    return float(chi2_contingency(table).pvalue)


@dataclass(frozen=True)
class SamplingCheck:
    p_value: float  # Bonferroni-corrected smallest p-value
    tests: int
    passed: bool
    drafted: int
    accepted: int
    smallest: str  # the test with the smallest p-value: tokens, pairs, draft_kept, likelihood or impossible
    conditional: dict[str, float] | None = None  # the conditional test's uncorrected p-values, by statistic


END = 2**32 - 1  # after a continuation's EOS: not a token id


def _padded(tokens: list[int], length: int) -> list[int]:
    return tokens + [END] * (length - len(tokens))


def _pairs(samples: list[list[int]], position: int) -> list[int]:
    # A pair of consecutive tokens as one category (tokens are < 2**32).
    return [s[position - 1] << 32 | s[position] for s in samples]


def compare_samples(
    llm: LLM,
    spec_engine: Engine,
    params: SamplingParams,
    prompts: tuple[str, ...],
    draws: int,
    length: int,
    alpha: float,
    on_draws: Callable[[int], None] | None = None,
    plain_samples: dict[int, list[list[int]]] | None = None,
) -> SamplingCheck:
    """Sample `draws` continuations of `length` tokens per prompt with and without speculation
    and test each position's tokens and each pair of consecutive tokens; when the speculative
    engine's rule is a RecordingRule, the conditional test too. `plain_samples`
    (prompt index -> continuations) keeps the plain arm for later comparisons; it is extended
    when a comparison needs more draws than it holds."""
    # Fixed-length continuations; a grammar ends its own where it is complete (EOS), so those are
    # padded with END for the position-wise tests.
    params = dataclasses.replace(params, max_tokens=length, ignore_eos=params.structured is None, stop=())
    pvalues: list[tuple[str, float]] = []  # (test, uncorrected p-value)
    drafted = accepted = 0
    plain_samples = {} if plain_samples is None else plain_samples
    recorder = spec_engine.sampling_rule.test if isinstance(spec_engine.sampling_rule, RecordingRule) else None
    if recorder is not None:
        recorder.reset()
    for index, prompt in enumerate(prompts):
        prompt_ids = llm.encode([{"role": "user", "content": prompt}])
        # Different seeds for the two samples: the test compares distributions, not draws.
        held = plain_samples.setdefault(index, [])
        if len(held) < draws:
            held += [g.token_ids for g in sample_continuations(llm.plain_engine, prompt_ids, params, draws - len(held),
                                                                1_000_000 * index + len(held))]
        plain = [_padded(s, length) for s in held[:draws]]
        spec_runs = sample_continuations(spec_engine, prompt_ids, params, draws, 1_000_000 * index + 500_000)
        spec = [_padded(g.token_ids, length) for g in spec_runs]
        drafted += sum(g.stats.drafted_tokens for g in spec_runs)
        accepted += sum(g.stats.accepted_tokens for g in spec_runs)
        if on_draws is not None:
            on_draws(2 * draws)
        for position in range(1, length):
            pvalues.append(("tokens", homogeneity_pvalue([s[position] for s in plain], [s[position] for s in spec])))
            pvalues.append(("pairs", homogeneity_pvalue(_pairs(plain, position), _pairs(spec, position))))
    conditional = recorder.pvalues() if recorder is not None and recorder.positions else None
    if conditional is not None:
        pvalues += conditional.items()
    smallest, p_min = min(pvalues, key=lambda item: item[1])
    corrected = min(1.0, p_min * len(pvalues))
    return SamplingCheck(corrected, len(pvalues), corrected > alpha, drafted, accepted, smallest, conditional)


@dataclass(frozen=True)
class SelfCheck:
    rule: str
    rejected: bool
    draws: int  # per prompt and arm, when rejected (or the most tried)
    p_value: float
    test: str  # the test with the smallest p-value


@dataclass(frozen=True)
class InvariantCheck:
    """Drafter-invariant sampling: seeded continuations identical with and without speculation."""

    seeds: int
    identical: int
    passed: bool
    drafted: int
    accepted: int


def verify_invariant(llm: LLM, params: SamplingParams, draws: int, length: int,
                     prompts: tuple[str, ...] = (), on_draws: Callable[[int], None] | None = None) -> InvariantCheck:
    """The same seeds on both arms: every continuation must be token-identical."""
    params = dataclasses.replace(params, max_tokens=length, ignore_eos=params.structured is None, stop=())
    identical = drafted = accepted = total = 0
    for index, prompt in enumerate(prompts):
        prompt_ids = llm.encode([{"role": "user", "content": prompt}])
        plain = sample_continuations(llm.plain_engine, prompt_ids, params, draws, 1_000_000 * index)
        spec = sample_continuations(llm.engine, prompt_ids, params, draws, 1_000_000 * index)
        identical += sum(a.token_ids == b.token_ids for a, b in zip(plain, spec))
        drafted += sum(g.stats.drafted_tokens for g in spec)
        accepted += sum(g.stats.accepted_tokens for g in spec)
        total += draws
        if on_draws is not None:
            on_draws(2 * draws)
    return InvariantCheck(total, identical, identical == total, drafted, accepted)


def verify_sampling(
    llm: LLM,
    params: SamplingParams,
    draws: int = 200,
    length: int = 6,
    alpha: float = 0.01,
    prompts: tuple[str, ...] = SAMPLING_PROMPTS,
    on_draws: Callable[[int], None] | None = None,
    max_draws: int | None = None,
) -> tuple[SamplingCheck, list[SelfCheck]]:
    """The test on the configured speculation, then the self-check: each wrong rule with the
    configured drafter, draws doubling from `draws` up to `max_draws` (8 x draws) until rejected."""
    plain: dict[int, list[list[int]]] = {}  # one plain sample serves every comparison
    config = llm.speculative_config

    def engine(rule: SamplingRule, tree_rule: TreeRule) -> Engine:
        """The configured speculation (the default method without one), deciding with `rule`, watched."""
        test = ConditionalTest()
        return Engine.from_config(llm.target, config or SpeculativeConfig(DEFAULT_METHOD), sampling_rule=RecordingRule(rule, test),
                                  tree_rule=RecordingTreeRule(tree_rule, test))

    result = compare_samples(llm, engine(speculative_accept, accept_tree_sampling), params, prompts, draws, length,
                             alpha, on_draws, plain)
    checks = []
    for name, (rule, tree_rule) in WRONG_RULES.items():
        wrong = engine(rule, tree_rule)
        n = draws
        while True:
            check = compare_samples(llm, wrong, params, prompts, n, length, alpha, on_draws, plain)
            if not check.passed or n >= (max_draws or 8 * draws):
                break
            n *= 2
        checks.append(SelfCheck(name, not check.passed, n, check.p_value, check.smallest))
    return result, checks


def report(greedy: list[GreedyCheck] | None, sampling: tuple[SamplingCheck, list[SelfCheck]] | None,
           invariant: InvariantCheck | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if greedy is not None:
        out["greedy"] = {
            "prompts": len(greedy),
            "identical": sum(c.identical for c in greedy),
            "passed": all(c.identical for c in greedy),
            "checks": [dataclasses.asdict(c) for c in greedy],
        }
    if sampling is not None:
        result, self_check = sampling
        out["sampling"] = dataclasses.asdict(result)
        out["self_check"] = [dataclasses.asdict(c) for c in self_check]
    if invariant is not None:
        out["drafter_invariant"] = dataclasses.asdict(invariant)
    return out


def dumps(data: dict[str, Any]) -> str:
    return json.dumps(data, indent=2)
