"""Lookahead decoding: guesses from n-grams the target itself produced, in the same pass.

No draft model. Each target pass carries two branches after the last committed token (the root):

- the **lookahead branch**, a Jacobi window of W guessed tokens for the next W positions. The
  pass gives the target's top token after the root and after each window token: the next Jacobi
  iterate of those positions. Iterates are kept for the last N - 1 passes; along a diagonal
  (position a - N + 1 in the oldest, ..., position a in the newest) each token was predicted
  right after the one before it, so the diagonal is an n-gram the target itself proposed, and it
  goes into the pool keyed by its first token. The committed output's own n-grams go in too.
- the **verification branch**: up to G n-grams from the pool whose first token is the root,
  each proposing its other N - 1 tokens.

Both branches go to the engine as one token tree (shared prefixes merged), verified in one pass
with the tree's attention mask (each node sees the committed prefix and its own ancestors, at
position cache length + depth); the window is itself a candidate, as in Jacobi decoding. The
window and the guesses are deterministic functions of the context and of earlier passes' top
tokens, so verification uses the one-hot draft rule and output is exactly the target's. The
engine hands each pass's top tokens back through :meth:`LookaheadDrafter.observe_verified`.

This is the published method with one simplification: the window's levels are not all fed
again each pass (a W x (N - 1) block); only the newest iterate is, as a chain, and the older
levels are remembered. The diagonal n-grams are the same; the pass costs W tokens, not
W x (N - 1), which matters on a CPU, where each token beyond a few makes the pass dearer.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import TYPE_CHECKING

import torch

from specdec.drafters.base import Drafter, Proposal, Verified
from specdec.methods import LookaheadOptions
from specdec.models.loader import LoadedModel
from specdec.sampling.params import SamplingParams

if TYPE_CHECKING:
    from specdec.config import SpeculativeConfig


class NgramPool:
    """n-grams by first token: each key keeps its most recent `size` continuations, newest last."""

    def __init__(self, n: int, size: int) -> None:
        self.n = n
        self.size = size
        self._by_first: dict[int, OrderedDict[tuple[int, ...], None]] = {}

    def add(self, ngram: tuple[int, ...]) -> None:
        assert len(ngram) == self.n
        bucket = self._by_first.setdefault(ngram[0], OrderedDict())
        bucket.pop(ngram[1:], None)
        bucket[ngram[1:]] = None
        while len(bucket) > self.size:
            bucket.popitem(last=False)

    def guesses(self, first: int, count: int) -> list[tuple[int, ...]]:
        """The `count` most recent continuations of `first`, newest first."""
        bucket = self._by_first.get(first)
        return [] if not bucket else list(reversed(bucket))[:count]

    def __len__(self) -> int:
        return sum(len(b) for b in self._by_first.values())


def merge_chains(chains: list[list[int]]) -> tuple[list[int], list[int]]:
    """Token chains hanging from one root as a tree (a trie: shared prefixes once), in the order
    given, parents before children. Returns (tokens, parents), parent -1 for the root."""
    tokens: list[int] = []
    parents: list[int] = []
    children: dict[tuple[int, int], int] = {}  # (parent, token) -> node
    for chain in chains:
        parent = -1
        for token in chain:
            node = children.get((parent, token))
            if node is None:
                node = len(tokens)
                tokens.append(token)
                parents.append(parent)
                children[(parent, token)] = node
            parent = node
    return tokens, parents


class LookaheadDrafter(Drafter):
    added_memory_bytes = 0

    def __init__(self, window: int, n: int, guesses: int, pool_size: int) -> None:
        self.window = window
        self.n = n
        self.guesses = guesses
        self.pool_size = pool_size
        self.proposal_size = LookaheadOptions(window, n, guesses, pool_size).proposal_nodes  # most tokens a proposal holds
        self.pool = NgramPool(n, pool_size)
        self._guess: dict[int, int] = {}  # position -> the window's next token there
        # The last n - 1 passes: (tokens fed, top tokens out), each by position.
        self._levels: deque[tuple[dict[int, int], dict[int, int]]] = deque(maxlen=n - 1)
        self._window_sent: list[int] = []  # this pass's window tokens, as proposed
        self._root, self._root_token = -1, -1  # this pass's root: position and token
        self._seen = 0  # context tokens whose n-grams are in the pool
        self._prompt_len = 0

    def begin(self, prompt_ids: list[int], max_len: int) -> None:
        self.pool = NgramPool(self.n, self.pool_size)
        self._guess, self._levels = {}, deque(maxlen=self.n - 1)
        self._window_sent, self._root, self._root_token = [], -1, -1
        self._prompt_len = self._seen = len(prompt_ids)

    def _fill(self, context: list[int], position: int) -> int:
        # A window position no pass has reached yet starts from a context token (lookahead
        # decoding's usual start: tokens of the prompt), chosen by position so runs repeat.
        return context[(position * 2654435761) % len(context)]

    def propose(
        self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Proposal:
        root, first = len(context) - 1, context[-1]
        self._root, self._root_token = root, first
        width = min(self.window, k)
        self._window_sent = [self._guess.get(root + 1 + i, self._fill(context, root + 1 + i)) for i in range(width)]
        chains = [list(g[:k]) for g in self.pool.guesses(first, self.guesses)]
        if self._window_sent:
            chains.append(self._window_sent)
        tokens, parents = merge_chains(chains)
        if not tokens:
            return Proposal(tokens=[])
        if all(p == i - 1 for i, p in enumerate(parents)):
            return Proposal(tokens=tokens)  # one chain
        return Proposal(tokens=tokens, parents=tuple(parents))

    def observe_verified(self, verified: Verified) -> None:
        """After the pass: the nodes verified (as the engine kept them) and the target's top
        token after the root and after each node (`top`, 1 + len(tokens))."""
        tokens, parents, top = verified.tokens, verified.parents, verified.top()
        fed = {self._root: self._root_token}
        out = {self._root + 1: top[0]}
        node = -1
        for i, token in enumerate(self._window_sent):
            node = next((j for j, (t, p) in enumerate(zip(tokens, parents)) if p == node and t == token), None)
            if node is None:
                break
            fed[self._root + 1 + i] = token
            out[self._root + 2 + i] = top[1 + node]
        self._levels.append((fed, out))
        # The diagonals ending in this pass's output: the token fed at a - n + 1 in the oldest
        # pass kept, what that pass put after it, what the next pass put after that (it was fed
        # that token), ..., what this pass put at a. Each token was predicted right after the one
        # before it: an n-gram the target itself proposed.
        if len(self._levels) == self.n - 1:
            oldest_fed = self._levels[0][0]
            for a in out:
                start = a - self.n + 1
                gram = [oldest_fed.get(start)] + [level_out.get(start + 1 + j) for j, (_, level_out) in enumerate(self._levels)]
                if None not in gram:
                    self.pool.add(tuple(gram))  # type: ignore[arg-type]
        self._guess.update(out)

    def commit(self, context: list[int], num_accepted: int) -> None:
        # The output's own n-grams: each one ending at a newly committed token.
        for end in range(max(self._seen, self._prompt_len) + 1, len(context) + 1):
            if end >= self.n:
                self.pool.add(tuple(context[end - self.n : end]))
        self._seen = len(context)
        # Committed positions need no guess any more.
        root = len(context) - 1
        self._guess = {a: t for a, t in self._guess.items() if a > root}

    def fork(self) -> LookaheadDrafter:
        return LookaheadDrafter(self.window, self.n, self.guesses, self.pool_size)


def build(config: SpeculativeConfig, target: LoadedModel) -> LookaheadDrafter:
    o = config.options
    return LookaheadDrafter(o.lookahead_window, o.lookahead_ngram, o.lookahead_guesses, o.lookahead_pool)
