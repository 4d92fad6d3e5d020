"""Acceptance over a token tree: several drafts verified in one target pass.

A tree is drafted tokens with parent indices (-1: the root, the last committed token); a chain
is the tree whose every node's parent is the node before it. Nodes come in topological order
(a parent before its children). The target's pass over the root and the nodes gives, for each
of them, its distribution of the next token: row 0 after the root, row 1 + i after node i.

Both rules walk from the root and return the accepted path (node indices, root excluded) and
the final token (recovered, or bonus after a leaf):

- greedy: follow the child whose token is the target's argmax; the output is token-identical
  to plain decoding, as with a chain.
- sampling (SpecInfer's multi-draft rule, as EAGLE uses): at a node, try its children in
  order; child x with draft distribution q is accepted with probability
  min(1, target(x) / q(x)); on rejection the target distribution becomes the residual
  max(0, target - q), renormalised, and the next child is tried against it. When every child is
  rejected, the final token is drawn from what remains. Exact when each child's token was
  drawn from its q independently of its siblings, or is deterministic (q one-hot: a top-k
  child, whose rejection removes its token from the target's distribution).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specdec.sampling.invariant import perturbed_at_depths
from specdec.sampling.probs import argmax, logits_to_probs, sample

if TYPE_CHECKING:
    from specdec.sampling.params import SamplingParams


@dataclass(frozen=True)
class TokenTree:
    """tokens[i], parents[i]: node i's token and its parent (-1: the root)."""

    tokens: tuple[int, ...]
    parents: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            raise ValueError("a tree needs one parent per token")
        for i, parent in enumerate(self.parents):
            if not -1 <= parent < i:
                raise ValueError(f"node {i}'s parent {parent} must be -1 or an earlier node")
        for parent in {-1, *self.parents}:
            siblings = [self.tokens[i] for i in self.children(parent)]
            if len(set(siblings)) != len(siblings):
                raise ValueError(f"node {parent} has two children with the same token")

    @classmethod
    def chain(cls, tokens: list[int]) -> TokenTree:
        return cls(tuple(tokens), tuple(range(-1, len(tokens) - 1)))

    def truncated(self, max_nodes: int, max_depth: int) -> TokenTree:
        """The nodes among the first `max_nodes` no deeper than `max_depth` (still a tree:
        ancestors come first and are shallower)."""
        depths = self.depths()
        keep = [i for i in range(min(max_nodes, len(self.tokens))) if depths[i] <= max_depth]
        where = {old: new for new, old in enumerate(keep)}
        return TokenTree(tuple(self.tokens[i] for i in keep),
                         tuple(-1 if self.parents[i] < 0 else where[self.parents[i]] for i in keep))

    @property
    def depth(self) -> int:
        return max(self.depths(), default=0)

    def children(self, node: int) -> list[int]:
        return [i for i, parent in enumerate(self.parents) if parent == node]

    def depths(self) -> list[int]:
        """Each node's depth (a root child is 1): its position offset after the root."""
        depth: list[int] = []
        for parent in self.parents:
            depth.append(1 if parent < 0 else depth[parent] + 1)
        return depth

    def ancestors_mask(self) -> torch.Tensor:
        """[1 + n, 1 + n] bool: row a sees column b when b is a or an ancestor of a (row and
        column 0: the root). The attention mask of the tree's verification pass."""
        n = len(self.tokens)
        mask = torch.eye(n + 1, dtype=torch.bool)
        mask[:, 0] = True
        for i, parent in enumerate(self.parents):
            if parent >= 0:
                mask[i + 1] |= mask[parent + 1]
        return mask


def accept_tree_greedy(target_logits: torch.Tensor, tree: TokenTree) -> tuple[list[int], int]:
    """target_logits: [1 + n, vocab]. Returns (accepted path, final token)."""
    top = argmax(target_logits).tolist()  # [1 + n]
    path, node = [], -1
    while True:
        wanted = top[node + 1]
        child = next((c for c in tree.children(node) if tree.tokens[c] == wanted), None)
        if child is None:
            return path, wanted
        path.append(child)
        node = child


def accept_tree_sampling(target_probs: torch.Tensor, tree: TokenTree, draft_probs: torch.Tensor | None,
                         generator: torch.Generator | None = None) -> tuple[list[int], int]:
    """target_probs: [1 + n, vocab]; draft_probs: [n, vocab], node i's draft distribution, or
    None (every node deterministic). Returns (accepted path, final token)."""
    n, vocab = len(tree.tokens), target_probs.shape[-1]
    if target_probs.shape[0] != n + 1 or (draft_probs is not None and draft_probs.shape != (n, vocab)):
        raise ValueError(f"need target_probs [{n + 1}, vocab] and draft_probs [{n}, vocab] or None")
    path, node = [], -1
    while True:
        remaining = target_probs[node + 1].double().clone()  # [vocab]
        accepted = None
        for child in tree.children(node):
            token = tree.tokens[child]
            if draft_probs is None:
                q = torch.zeros(vocab, dtype=torch.float64)
                q[token] = 1.0
            else:
                q = draft_probs[child].double()
            if float(torch.rand((), generator=generator, dtype=torch.float64)) * q[token] < remaining[token]:
                accepted = child
                break
            residual = (remaining - q).clamp_min(0)
            mass = residual.sum()
            # A zero residual: remaining <= q everywhere, so rejection had probability 0 (round-off).
            remaining = residual / mass if mass > 0 else remaining
        if accepted is None:
            final = int(sample(remaining[None], generator)[0])
            return path, final
        path.append(accepted)
        node = accepted


# (target_probs [1 + n, vocab], tree, draft_probs [n, vocab] | None, generator) -> (path, final
# token). Engines use accept_tree_sampling; `specdec verify` swaps in deliberately wrong rules.
TreeRule = Callable[[torch.Tensor, TokenTree, torch.Tensor | None, torch.Generator | None], tuple[list[int], int]]


def accept_tree(target_logits: torch.Tensor, tree: TokenTree, draft_probs: torch.Tensor | None, params: SamplingParams,
                generator: torch.Generator | None, position: int, rule: TreeRule = accept_tree_sampling) -> tuple[list[int], int]:
    """One row's tree with its sampling parameters. target_logits: [1 + n, vocab], after the fed
    token and each node; position: the sequence position of the row's first new token. Greedy
    follows the argmax; a drafter-invariant row follows its Gumbel-max tokens (each node's at
    its depth's position); a sampled row goes through `rule`."""
    if params.greedy:
        return accept_tree_greedy(target_logits, tree)
    target_probs = logits_to_probs(target_logits, params)  # [1 + n, vocab]
    if params.drafter_invariant:
        assert generator is not None, "a drafter-invariant row has a seeded generator"
        return accept_tree_greedy(perturbed_at_depths(target_probs, generator.initial_seed(), position, [0, *tree.depths()]), tree)
    return rule(target_probs, tree, draft_probs, generator)
