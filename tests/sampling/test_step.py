"""One call accepts a whole step (`accept_step`): chains and trees, greedy, sampled and
drafter-invariant rows together, each row by its own rule. A chain given as a tree is accepted
alike, and an invariant tree node's token is the Gumbel-max sample at its depth's position."""

from __future__ import annotations

import torch

from specdec.config import SamplingParams
from specdec.sampling import RowDraft, accept_step
from specdec.sampling.invariant import invariant_tokens
from specdec.sampling.probs import logits_to_probs
from specdec.sampling.tree import TokenTree

VOCAB = 6


def _logits(rows: int, positions: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, positions, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_a_chain_as_a_tree_is_accepted_alike() -> None:
    greedy = SamplingParams(temperature=0.0)
    invariant = SamplingParams(temperature=1.0, seed=5, drafter_invariant=True)
    for seed in range(40):
        logits = _logits(1, 4, seed)
        draft = torch.randint(0, VOCAB, (3,), generator=torch.Generator().manual_seed(100 + seed)).tolist()
        if len(set(draft)) < 3:
            continue
        for params in (greedy, invariant):
            gens = [torch.Generator().manual_seed(5)]
            chain = accept_step(logits, [RowDraft(draft)], [params], gens, [10])
            tree = accept_step(logits, [RowDraft(draft, tree=TokenTree.chain(draft))], [params],
                               [torch.Generator().manual_seed(5)], [10])
            assert chain == tree, (seed, params)


def test_invariant_tree_nodes_sample_at_their_depth() -> None:
    # root -> a, root -> b, b -> c: b's child sits at depth 2, position base + 2.
    params = SamplingParams(temperature=1.0, seed=7, drafter_invariant=True)
    base = 20
    for seed in range(30):
        logits = _logits(1, 4, seed)[0]
        probs = logits_to_probs(logits, params)
        first = invariant_tokens(probs[:1], 7, base)[0]
        other = (first + 1) % VOCAB
        second = invariant_tokens(probs[2:3], 7, base + 1)[0]  # after node 1 (b), depth 1 -> position base + 1
        tree = TokenTree((other, first, second), (-1, -1, 1))
        (row,) = accept_step(logits[None], [RowDraft(list(tree.tokens), tree=tree)], [params],
                             [torch.Generator().manual_seed(7)], [base])
        third = invariant_tokens(probs[3:4], 7, base + 2)[0]
        assert row.committed == [first, second, third] and row.offsets == [2, 3]


def test_rows_keep_their_own_rules() -> None:
    logits = _logits(3, 4, 0)
    top = logits.argmax(-1)
    rows = [RowDraft([int(top[0, 0]), int(top[0, 1])]),  # greedy chain, both right
            RowDraft([]),  # no draft: the target's token alone
            RowDraft([int(top[2, 0])], tree=TokenTree((int(top[2, 0]),), (-1,)))]
    params = [SamplingParams(temperature=0.0)] * 3
    out = accept_step(logits, rows, params, [None] * 3, [5, 5, 5])
    assert out[0].committed == top[0, :3].tolist() and out[0].offsets == [1, 2]
    assert out[1].committed == [int(top[1, 0])] and out[1].offsets == []
    assert out[2].committed == [int(top[2, 0]), int(top[2, 1])] and out[2].offsets == [1]
