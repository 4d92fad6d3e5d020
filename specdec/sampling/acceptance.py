"""Verification: which drafted tokens to keep, and the token the target adds.

Vocabulary, used everywhere in specdec:

- **accepted** tokens: the leading drafted tokens that pass verification;
- **recovered** token: at the first rejected position, a token drawn from the residual
  distribution (greedy: the target's own argmax); everything drafted after it is dropped;
- **bonus** token: when all drafted tokens are accepted, one more token drawn from the target's
  distribution after the last of them.

Each step therefore commits `num_accepted + 1` tokens.

The speculative sampling rule (Leviathan et al. 2023; Chen et al. 2023), with `target_probs`
the target's distribution and `draft_probs` the distribution the draft token was sampled from:
accept draft token x with probability min(1, target_probs[x] / draft_probs[x]); at the first
rejection draw from max(0, target_probs - draft_probs), renormalised. The committed tokens are
then distributed exactly as if drawn from the target alone, whatever the draft.

A deterministic drafter (n-gram lookup) proposes each token with probability one, so its
draft distribution is the one-hot of the token: x is accepted with probability
target_probs[x], and the residual is target_probs with x removed. That is the same rule with
one-hot `draft_probs`; pass `draft_probs=None` for it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from specdec.sampling.invariant import perturbed_log_probs
from specdec.sampling.params import SamplingParams
from specdec.sampling.probs import argmax, logits_to_probs, sample
from specdec.sampling.tree import TokenTree, TreeRule, accept_tree, accept_tree_sampling

PAD_TOKEN = -1


@dataclass(frozen=True)
class AcceptResult:
    """tokens: [batch, k + 1], the accepted drafted tokens then the recovered or bonus token,
    padded with PAD_TOKEN. num_accepted: [batch], accepted drafted tokens per row (0..k)."""

    tokens: torch.Tensor
    num_accepted: torch.Tensor

    def row(self, index: int = 0) -> list[int]:
        """The `num_accepted + 1` committed tokens of one row."""
        return self.tokens[index, : int(self.num_accepted[index]) + 1].tolist()


def _check_shapes(target: torch.Tensor, draft_tokens: torch.Tensor) -> tuple[int, int]:
    if draft_tokens.dim() != 2:
        raise ValueError(f"draft_tokens must be [batch, k], got shape {tuple(draft_tokens.shape)}")
    batch, k = draft_tokens.shape
    if target.dim() != 3 or target.shape[0] != batch or target.shape[1] != k + 1:
        raise ValueError(f"target must be [batch={batch}, k + 1={k + 1}, vocab], got shape {tuple(target.shape)}")
    return batch, k


def _commit(draft_tokens: torch.Tensor, num_accepted: torch.Tensor, final_token: torch.Tensor) -> AcceptResult:
    # draft_tokens: [batch, k]; num_accepted, final_token: [batch]
    batch, k = draft_tokens.shape
    positions = torch.arange(k + 1, device=draft_tokens.device).expand(batch, k + 1)  # [batch, k + 1]
    padded = torch.cat([draft_tokens, draft_tokens.new_full((batch, 1), PAD_TOKEN)], dim=1)
    tokens = torch.where(positions < num_accepted[:, None], padded, PAD_TOKEN)
    tokens = tokens.scatter(1, num_accepted[:, None], final_token[:, None])
    return AcceptResult(tokens=tokens, num_accepted=num_accepted)


def _renormalised(residual: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """residual [batch, vocab] scaled to sum to one; `fallback` [batch, vocab] where a row has no
    mass. A zero residual means target == draft there, so rejection had probability 0; only
    float round-off reaches it. Falling back to the target keeps the draw well defined."""
    mass = residual.sum(dim=-1, keepdim=True)
    return torch.where(mass > 0, residual / mass.clamp_min(1e-30), fallback)


def _leading_true(mask: torch.Tensor) -> torch.Tensor:
    """[batch, k] bool -> [batch]: how many leading entries are True."""
    return mask.long().cumprod(dim=1).sum(dim=1)


def greedy_accept(target_logits: torch.Tensor, draft_tokens: torch.Tensor) -> AcceptResult:
    """Keep drafted tokens while each is the target's argmax; then add the target's argmax.

    target_logits: [batch, k + 1, vocab]; draft_tokens: [batch, k].
    """
    _, k = _check_shapes(target_logits, draft_tokens)
    target_tokens = argmax(target_logits)  # [batch, k + 1]
    num_accepted = _leading_true(draft_tokens == target_tokens[:, :k])  # [batch]
    final_token = target_tokens.gather(1, num_accepted[:, None]).squeeze(1)  # recovered or bonus
    return _commit(draft_tokens, num_accepted, final_token)


def speculative_accept(
    target_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    generator: torch.Generator | None = None,
) -> AcceptResult:
    """The exact speculative sampling rule.

    target_probs: [batch, k + 1, vocab], the target's distributions at the k drafted positions
        and the one after them.
    draft_tokens: [batch, k].
    draft_probs: [batch, k, vocab], the distributions the draft tokens were sampled from, or
        None for a deterministic draft (one-hot at each draft token).
    """
    batch, k = _check_shapes(target_probs, draft_tokens)
    vocab = target_probs.shape[-1]
    if draft_probs is not None and draft_probs.shape != (batch, k, vocab):
        raise ValueError(f"draft_probs must be [{batch}, {k}, {vocab}], got shape {tuple(draft_probs.shape)}")

    if k == 0:  # nothing drafted: the bonus token from the target, as step 2 draws it
        final_token = sample(_renormalised(target_probs[:, 0], target_probs[:, 0]), generator)  # [batch]
        return AcceptResult(tokens=final_token[:, None], num_accepted=final_token.new_zeros(batch))

    # 1. Accept position i with probability min(1, target/draft) at the drafted token.
    index = draft_tokens[..., None]  # [batch, k, 1]
    target_at_draft = target_probs[:, :k].gather(-1, index).squeeze(-1)  # [batch, k]
    uniform = torch.rand((batch, k), generator=generator, device=target_probs.device)
    if draft_probs is None:  # a deterministic draft: one-hot at each token, so draft = 1 there
        accepted = uniform < target_at_draft
    else:
        draft_at_draft = draft_probs.gather(-1, index).squeeze(-1)  # [batch, k]
        accepted = uniform * draft_at_draft < target_at_draft  # u < target/draft without dividing by 0
    num_accepted = _leading_true(accepted)  # [batch]

    # 2. The final token: from the residual at the first rejection, from the target after a full accept.
    rows = torch.arange(batch, device=target_probs.device)
    final_target = target_probs[rows, num_accepted]  # [batch, vocab]
    rejected = num_accepted < k
    if draft_probs is None:
        # max(0, target - one-hot): the target with the rejected token's probability zeroed
        # (p - 1 <= 0 there, p - 0 = p elsewhere), the same floats without a [k, vocab] one-hot.
        residual = final_target.clone()
        if bool(rejected.any()):
            at = rows[rejected]
            residual[at, draft_tokens[at, num_accepted[at]]] = 0
    else:
        padded_draft = torch.cat([draft_probs, draft_probs.new_zeros((batch, 1, vocab))], dim=1)  # [batch, k + 1, vocab]
        residual = (final_target - padded_draft[rows, num_accepted]).clamp_min(0)  # bonus rows: draft row is 0
    final_token = sample(_renormalised(residual, final_target), generator)  # [batch]
    return _commit(draft_tokens, num_accepted, final_token)


# (target_probs [batch, n + 1, vocab], draft_tokens [batch, n], draft_probs [batch, n, vocab] | None,
#  generator) -> AcceptResult. Engines use speculative_accept; `specdec verify` swaps in a
# deliberately wrong rule to show that its test can tell.
SamplingRule = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Generator | None], AcceptResult]


def accept_batch(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    lengths: list[int],
    draft_probs: list[torch.Tensor | None],
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    rule: SamplingRule = speculative_accept,
    keys: list[tuple[int, int] | None] | None = None,
) -> AcceptResult:
    """One step's acceptance for every row of a batch, each with its own draft length, sampling
    parameters and generator.

    target_logits: [rows, n + 1, vocab], the target's logits after each row's fed token and
        draft; positions past a row's draft are padding and never read.
    draft_tokens: [rows, n], PAD_TOKEN past each row's length.
    lengths: each row's draft length (<= n).
    draft_probs: per row, [length, vocab] for a sampled draft, or None (deterministic draft).
    keys: per row, (seed, position of the row's first new token) for a drafter-invariant row
        (params.drafter_invariant): its tokens are the Gumbel-max samples of
        :mod:`specdec.sampling.invariant`, drafts kept while they equal them.
    Greedy rows are decided together (a padded position never matches an argmax); a sampled row
    goes through `rule` with its own filtered distributions and generator.
    """
    rows, n = draft_tokens.shape
    if target_logits.shape[:2] != (rows, n + 1) or not len(lengths) == len(draft_probs) == len(params) == len(generators) == rows:
        raise ValueError(f"need target_logits [{rows}, {n + 1}, vocab] and one length, draft_probs, params and generator per row")
    tokens = draft_tokens.new_full((rows, n + 1), PAD_TOKEN)
    num_accepted = draft_tokens.new_zeros(rows)
    greedy = [i for i in range(rows) if params[i].greedy]
    if len(greedy) == rows:  # all greedy: no copy of the logits
        result = greedy_accept(target_logits, draft_tokens)
        tokens, num_accepted = result.tokens, result.num_accepted
    elif greedy:
        index = torch.tensor(greedy, device=draft_tokens.device)
        result = greedy_accept(target_logits[index], draft_tokens[index])
        tokens[index], num_accepted[index] = result.tokens, result.num_accepted
    for i in range(rows):
        if params[i].greedy:
            continue
        k = lengths[i]
        target_probs = logits_to_probs(target_logits[i, : k + 1], params[i])[None]  # [1, k + 1, vocab]
        if params[i].drafter_invariant:
            if keys is None or keys[i] is None:
                raise ValueError("a drafter-invariant row needs its (seed, position) key")
            perturbed = perturbed_log_probs(target_probs[0], *keys[i])[None]  # [1, k + 1, vocab]
            result = greedy_accept(perturbed, draft_tokens[i : i + 1, :k])
            tokens[i, : k + 1], num_accepted[i] = result.tokens[0], result.num_accepted[0]
            continue
        probs = draft_probs[i]
        result = rule(target_probs, draft_tokens[i : i + 1, :k], None if probs is None else probs[None], generators[i])
        tokens[i, : k + 1], num_accepted[i] = result.tokens[0], result.num_accepted[0]
    return AcceptResult(tokens=tokens, num_accepted=num_accepted)


@dataclass(frozen=True)
class RowDraft:
    """What one row verified: its drafted tokens (a tree's nodes), the distributions they were
    sampled from ([len(tokens), vocab], or None: deterministic), and its tree (None: a chain)."""

    tokens: list[int]
    probs: torch.Tensor | None = None
    tree: TokenTree | None = None


@dataclass(frozen=True)
class Accepted:
    """One row's outcome: the committed tokens (accepted drafts, then the recovered or bonus
    token) and the new-token offsets of the accepted drafts in the pass (1 + node index)."""

    committed: list[int]
    offsets: list[int]


def accept_step(
    target_logits: torch.Tensor,
    rows: list[RowDraft],
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    positions: list[int],
    rule: SamplingRule = speculative_accept,
    tree_rule: TreeRule = accept_tree_sampling,
) -> list[Accepted]:
    """A step's acceptance for every row of a batch: chains together (:func:`accept_batch`),
    trees one by one (:func:`specdec.sampling.tree.accept_tree`), each with its own parameters.

    target_logits: [rows, 1 + longest draft, vocab], after each row's fed token and its nodes;
    positions: the sequence position of each row's first new token (the drafter-invariant keys).
    """
    chains = [[] if row.tree is not None else row.tokens for row in rows]
    longest = max(len(c) for c in chains)
    if all(p.greedy for p in params) and all(row.tree is None for row in rows):
        # Greedy chains (every plain step too): greedy_accept's rule on the argmaxes as lists,
        # without its dozen tensor operations a step.
        out = []
        for chain, best in zip(chains, argmax(target_logits[:, : longest + 1]).tolist()):
            n = 0
            while n < len(chain) and chain[n] == best[n]:
                n += 1
            out.append(Accepted(chain[:n] + [best[n]], list(range(1, n + 1))))
        return out
    padded = torch.tensor([c + [PAD_TOKEN] * (longest - len(c)) for c in chains], dtype=torch.long,
                          device=target_logits.device).reshape(len(rows), longest)  # [rows, longest]
    keys = [(g.initial_seed(), pos) if p.drafter_invariant and g is not None else None
            for p, g, pos in zip(params, generators, positions)]
    result = accept_batch(target_logits[:, : longest + 1], padded, [len(c) for c in chains],
                          [row.probs for row in rows], params, generators, rule, keys)
    out = []
    for i, row in enumerate(rows):
        if row.tree is None:
            out.append(Accepted(result.row(i), list(range(1, int(result.num_accepted[i]) + 1))))
            continue
        path, final = accept_tree(target_logits[i, : 1 + len(row.tree.tokens)], row.tree, row.probs, params[i],
                                  generators[i], positions[i], tree_rule)
        out.append(Accepted([row.tree.tokens[j] for j in path] + [final], [1 + j for j in path]))
    return out
