"""Token trees: structure, the greedy walk, and the multi-draft sampling rule's exactness
(enumerated target distributions over a 5-token vocabulary, chi-square; a wrong rule fails)."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from specdec.bench.verify import tree_residual_from_target  # WRONG: siblings tested against the target, not the residual
from specdec.sampling.tree import TokenTree, accept_tree_greedy, accept_tree_sampling

VOCAB = 5


def test_structure() -> None:
    tree = TokenTree((3, 4, 1, 2), (-1, -1, 0, 2))  # root -> 3 -> 1 -> 2, root -> 4
    assert tree.children(-1) == [0, 1] and tree.children(0) == [2]
    assert tree.depths() == [1, 1, 2, 3]
    mask = tree.ancestors_mask()
    assert mask[4].tolist() == [True, True, False, True, True]  # node 3 sees root, 0, 2 and itself
    assert mask[2].tolist() == [True, False, True, False, False]
    assert TokenTree.chain([7, 8, 9]).parents == (-1, 0, 1)
    with pytest.raises(ValueError, match="earlier node"):
        TokenTree((1, 2), (1, -1))
    with pytest.raises(ValueError, match="same token"):
        TokenTree((1, 1), (-1, -1))


def test_greedy_follows_the_argmax_branch() -> None:
    tree = TokenTree((3, 4, 1), (-1, -1, 1))
    logits = torch.full((4, VOCAB), -5.0)
    logits[0, 4] = 1.0  # after the root the target wants 4: node 1
    logits[2, 1] = 1.0  # after node 1 it wants 1: node 2
    logits[3, 0] = 1.0  # after node 2: the bonus token 0
    assert accept_tree_greedy(logits, tree) == ([1, 2], 0)
    logits[0] = -5.0
    logits[0, 2] = 1.0  # a token no child has: nothing accepted, 2 recovered
    assert accept_tree_greedy(logits, tree) == ([], 2)


def _target_rows(seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(6, VOCAB, generator=generator) * 1.5, dim=-1)


def _first_two(tree: TokenTree, path: list[int], final: int) -> tuple[int, int | None]:
    tokens = [tree.tokens[i] for i in path] + [final]
    return tokens[0], tokens[1] if len(tokens) > 1 else None


def _pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    keep = probs > 0
    expected = probs[keep].double() / probs[keep].double().sum() * counts.sum()
    return float(chisquare(counts[keep].numpy(), expected.numpy()).pvalue)


def _check(samples: list[tuple[int, int | None]], tree: TokenTree, target: torch.Tensor) -> float:
    """The smallest p-value of: the first token against the target's root row, and the second
    token, given a first token that is a root child, against that child's row."""
    pvalues = []
    first = torch.bincount(torch.tensor([a for a, _ in samples]), minlength=VOCAB).double()
    pvalues.append(_pvalue(first, target[0]))
    for child in tree.children(-1):
        seconds = [b for a, b in samples if a == tree.tokens[child] and b is not None]
        if len(seconds) < 200:
            continue
        pvalues.append(_pvalue(torch.bincount(torch.tensor(seconds), minlength=VOCAB).double(), target[1 + child]))
    return min(pvalues)


@pytest.mark.parametrize("rule", [accept_tree_sampling, tree_residual_from_target])
def test_deterministic_children_sample_the_target(rule) -> None:
    # Root children 3 and 1 (top-2 style, deterministic), node 0 has children 0 and 2, node 2
    # one child: the first two committed tokens must follow the target exactly.
    tree = TokenTree((3, 1, 0, 2, 4), (-1, -1, 0, 0, 2))
    target = _target_rows(1)
    generator = torch.Generator().manual_seed(0)
    samples = [_first_two(tree, *rule(target, tree, None, generator)) for _ in range(20000)]
    p = _check(samples, tree, target)
    if rule is accept_tree_sampling:
        assert p > 1e-3
    else:
        assert p < 1e-6


def test_independently_sampled_children_sample_the_target() -> None:
    # Two root children drawn independently from drafts with disjoint supports (so always
    # distinct), each with its own distribution; a grandchild drawn from a third.
    target = _target_rows(2)
    q1 = torch.tensor([0.6, 0.4, 0.0, 0.0, 0.0])
    q2 = torch.tensor([0.0, 0.0, 0.2, 0.5, 0.3])
    q3 = torch.softmax(torch.randn(VOCAB, generator=torch.Generator().manual_seed(5)), dim=-1)
    generator = torch.Generator().manual_seed(1)
    samples = []
    trees = []
    for _ in range(20000):
        a, b = int(torch.multinomial(q1, 1, generator=generator)), int(torch.multinomial(q2, 1, generator=generator))
        c = int(torch.multinomial(q3, 1, generator=generator))
        tree = TokenTree((a, b, c), (-1, -1, 0))
        draft = torch.stack([q1, q2, q3])
        # The target's rows depend on the node's token, as a model's would: row 1 + i is the
        # target after node i's token (rows 1.. of _target_rows indexed by token).
        rows = torch.stack([target[0], target[1 + a], target[1 + b], target[1 + c % 5]])
        path, final = accept_tree_sampling(rows, tree, draft, generator)
        tokens = [tree.tokens[i] for i in path] + [final]
        samples.append((tokens[0], tokens[1] if len(tokens) > 1 else None))
        trees.append(tree)
    first = torch.bincount(torch.tensor([s[0] for s in samples]), minlength=VOCAB).double()
    assert _pvalue(first, target[0]) > 1e-3
    for token in range(VOCAB):  # after a first token from q1's support, the next follows row 1 + token
        seconds = [s[1] for s in samples if s[0] == token and s[1] is not None]
        if len(seconds) < 300:
            continue
        assert _pvalue(torch.bincount(torch.tensor(seconds), minlength=VOCAB).double(), target[1 + token]) > 1e-3, token
