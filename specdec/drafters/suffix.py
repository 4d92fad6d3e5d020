"""Suffix drafting: propose what most often followed the current suffix, in this request's text
and in what the model wrote for earlier requests (SuffixDecoding, Oliaro et al. 2024).

Two sources are searched at every step: the request's own context (its prompt and output, as
prompt lookup searches it) and a cache of outputs shared by every request of one route (one
:class:`SuffixCache` per prototype drafter, shared by its forks; the server builds one per
route, so one tenant's text never steers another route's drafts). Outputs enter the cache as
they are committed, so parallel samples of one prompt (the `n` parameter, self-consistency)
draft from each other while they run.

In a source, the longest suffix of the context (at most `max_depth` tokens) that occurred
before is found, with all its occurrences. From there the proposal walks forward: at each
step the most frequent next token among the occurrences still agreeing, kept while the
product of those frequencies (the empirical probability that the whole walk is right) is at
least `min_prob`, and for at most `spec_factor` x the match length tokens (a long match
earns a long guess; at most k). Of the two sources' walks, the one with the larger expected
number of accepted tokens (the sum of the products along it) is proposed. With `tree`, a
source proposes instead the k continuations of largest probability (best first, each at least
`min_prob`), a token tree whose siblings are the different ways earlier text went on.
Proposals are deterministic: verification uses the one-hot draft rule, exact for sampling too.

Occurrences are found through an index of each source's token bigrams (and single tokens,
for matches of one), checked backwards against the context; the cache scans at most the
`CANDIDATES` most recent occurrences per query, so a step costs the same however much the
cache holds. The cache forgets whole requests, least recently written first, beyond
`max_requests` or `max_bytes` (an estimate of its Python objects' size).
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections import Counter, OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from specdec.drafters.base import CacheStats, Drafter, Proposal
from specdec.models.loader import LoadedModel
from specdec.sampling.params import SamplingParams

if TYPE_CHECKING:
    from specdec.config import SpeculativeConfig

CANDIDATES = 256  # most recent occurrences of a bigram examined per query
BYTES_PER_TOKEN = 160  # a cached token: its slot in the document and two index entries, as Python objects


class _Index:
    """Token documents with bigram and unigram indexes: (document, position) of every token
    that ends a bigram / is a token, appended in order (so the most recent are last)."""

    def __init__(self) -> None:
        self.docs: dict[int, list[int]] = {}
        self.bigrams: dict[tuple[int, int], list[tuple[int, int]]] = {}
        self.unigrams: dict[int, list[tuple[int, int]]] = {}
        self.dead = 0  # index entries of removed documents, skipped until a rebuild

    def extend(self, doc: int, tokens: Iterable[int]) -> int:
        """Append tokens to a document (created when new); returns how many were appended."""
        text = self.docs.setdefault(doc, [])
        added = 0
        for token in tokens:
            position = len(text)
            text.append(token)
            self.unigrams.setdefault(token, []).append((doc, position))
            if position:
                self.bigrams.setdefault((text[position - 1], token), []).append((doc, position))
            added += 1
        return added

    def remove(self, doc: int) -> int:
        text = self.docs.pop(doc, [])
        self.dead += 2 * len(text)
        if self.dead > 2 * sum(len(t) for t in self.docs.values()) + 4096:
            self._rebuild()
        return len(text)

    def _rebuild(self) -> None:
        docs, self.docs, self.bigrams, self.unigrams, self.dead = self.docs, {}, {}, {}, 0
        for doc, text in docs.items():
            self.extend(doc, text)

    def occurrences(self, context: list[int], max_depth: int) -> tuple[int, list[tuple[int, int]]]:
        """(m, occurrences): the longest m <= max_depth such that the context's last m tokens
        occur in a document followed by at least one more token, and the (document, position
        of the token after) of each such occurrence, most recent last."""
        if not context:
            return 0, []
        if len(context) >= 2 and (hits := self.bigrams.get((context[-2], context[-1]))):
            start_m = 2
        elif hits := self.unigrams.get(context[-1]):
            start_m = 1
        else:
            return 0, []
        best, found = 0, []
        limit = min(max_depth, len(context))
        for doc, position in hits[-CANDIDATES:]:
            text = self.docs.get(doc)
            if text is None or position + 1 >= len(text):
                continue  # a removed document, or no token after this occurrence
            m = start_m
            while m < limit and position - m >= 0 and text[position - m] == context[-1 - m]:
                m += 1
            if m > best:
                best, found = m, [(doc, position + 1)]
            elif m == best:
                found.append((doc, position + 1))
        return best, found

    def propose(self, context: list[int], k: int, max_depth: int, spec_factor: float,
                min_prob: float, tree: bool = False) -> _Draft:
        """The walk (or tree) from the longest matching suffix, at most min(k, spec_factor x its
        length) tokens deep; a tree holds at most k tokens."""
        m, occurrences = self.occurrences(context, max_depth)
        if not occurrences:
            return _Draft()
        depth = min(k, max(1, int(spec_factor * m)))
        if tree:
            return self.tree(occurrences, depth, k, min_prob)
        tokens, score = self.walk(occurrences, depth, min_prob)
        return _Draft(tokens, None, score)

    def walk(self, occurrences: list[tuple[int, int]], length: int, min_prob: float) -> tuple[list[int], float]:
        """The most frequent continuation of the occurrences, at most `length` tokens, while the
        product of the frequencies stays >= min_prob. Returns (tokens, expected accepted tokens)."""
        tokens: list[int] = []
        prob = score = 1.0
        alive = occurrences
        while alive and len(tokens) < length:
            counts = Counter(self.docs[doc][pos] for doc, pos in alive)
            token, count = counts.most_common(1)[0]
            prob *= count / len(alive)
            if prob < min_prob:
                break
            tokens.append(token)
            score += prob
            alive = [(doc, pos + 1) for doc, pos in alive
                     if self.docs[doc][pos] == token and pos + 1 < len(self.docs[doc])]
        return tokens, score - 1.0

    def tree(self, occurrences: list[tuple[int, int]], depth: int, nodes: int, min_prob: float) -> _Draft:
        """The `nodes` continuations of the occurrences with the largest empirical probability
        (best first, so parents come before children), each at least min_prob and at most
        `depth` deep. A continuation's probability is the fraction of the occurrences that
        follow its whole path; the score is their sum, the expected accepted tokens."""
        tokens: list[int] = []
        parents: list[int] = []
        score = 0.0
        frontier: list[tuple[float, int, int, int, list[tuple[int, int]], int]] = []
        order = itertools.count()  # ties: the earlier candidate first

        def offer(parent: int, alive: list[tuple[int, int]], prob: float, level: int) -> None:
            if level >= depth:
                return
            groups: dict[int, list[tuple[int, int]]] = {}
            for doc, pos in alive:
                groups.setdefault(self.docs[doc][pos], []).append((doc, pos))
            for token, group in groups.items():
                p = prob * len(group) / len(alive)
                if p >= min_prob:
                    heapq.heappush(frontier, (-p, next(order), parent, token, group, level + 1))

        offer(-1, occurrences, 1.0, 0)
        while frontier and len(tokens) < nodes:
            neg_prob, _, parent, token, group, level = heapq.heappop(frontier)
            tokens.append(token)
            parents.append(parent)
            score -= neg_prob
            following = [(doc, pos + 1) for doc, pos in group if pos + 1 < len(self.docs[doc])]
            if following:
                offer(len(tokens) - 1, following, -neg_prob, level)
        return _Draft(tokens, tuple(parents), score)


@dataclass(frozen=True)
class _Draft:
    """A source's proposal: a chain (parents None) or a tree, and its expected accepted tokens."""

    tokens: list[int] = field(default_factory=list)
    parents: tuple[int, ...] | None = None
    score: float = 0.0


class SuffixCache:
    """Outputs of one route's requests, shared by its drafters; safe under concurrent use."""

    def __init__(self, max_requests: int, max_bytes: int) -> None:
        self.max_requests = max_requests
        self.max_bytes = max_bytes
        self._index = _Index()
        self._order: OrderedDict[int, None] = OrderedDict()  # documents, least recently written first
        self._tokens = 0
        self._next = 0
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        """An estimate of the memory the cached outputs take."""
        return self._tokens * BYTES_PER_TOKEN

    @property
    def requests(self) -> int:
        return len(self._order)

    def new_document(self) -> int:
        with self._lock:
            self._next += 1
            return self._next

    def append(self, doc: int, tokens: list[int]) -> None:
        if self.max_requests < 1 or not tokens:
            return
        with self._lock:
            self._tokens += self._index.extend(doc, tokens)
            self._order[doc] = None
            self._order.move_to_end(doc)
            while self._order and (len(self._order) > self.max_requests or self.nbytes > self.max_bytes):
                oldest, _ = self._order.popitem(last=False)
                self._tokens -= self._index.remove(oldest)

    def propose(self, context: list[int], k: int, max_depth: int, spec_factor: float, min_prob: float,
                tree: bool = False) -> _Draft:
        with self._lock:
            return self._index.propose(context, k, max_depth, spec_factor, min_prob, tree)


class SuffixDrafter(Drafter):
    """One request's suffix drafting: its own context indexed as it grows, plus the route's cache."""

    added_memory_bytes = 0

    def __init__(self, cache: SuffixCache, max_depth: int = 24, spec_factor: float = 1.0, min_prob: float = 0.1,
                 tree: bool = False) -> None:
        self.cache = cache
        self.max_depth = max_depth
        self.spec_factor = spec_factor
        self.min_prob = min_prob
        self.tree = tree
        self._own = _Index()
        self._prompt_length = 0
        self._doc = 0

    def shared_cache(self) -> CacheStats:
        return CacheStats(self.cache.nbytes, self.cache.requests)

    def begin(self, prompt_ids: list[int], max_len: int) -> None:
        self._own = _Index()
        self._own.extend(0, prompt_ids)
        self._prompt_length = len(prompt_ids)
        self._doc = self.cache.new_document()

    def _sync(self, context: list[int]) -> None:
        seen = len(self._own.docs.get(0, ()))
        if len(context) > seen:
            new = context[seen:]
            self._own.extend(0, new)
            # The output (never the prompt) goes to the route's cache.
            self.cache.append(self._doc, context[max(seen, self._prompt_length):])

    def propose(self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator | None) -> Proposal:
        self._sync(context)
        own = self._own.propose(context, k, self.max_depth, self.spec_factor, self.min_prob, self.tree)
        shared = self.cache.propose(context, k, self.max_depth, self.spec_factor, self.min_prob, self.tree)
        best = shared if shared.score > own.score else own
        chain = best.parents is None or all(parent == i - 1 for i, parent in enumerate(best.parents))
        return Proposal(tokens=best.tokens, parents=None if chain else best.parents)

    def commit(self, context: list[int], num_accepted: int) -> None:
        self._sync(context)

    def fork(self) -> SuffixDrafter:
        return SuffixDrafter(self.cache, self.max_depth, self.spec_factor, self.min_prob, self.tree)


def build(config: SpeculativeConfig, target: LoadedModel) -> SuffixDrafter:
    cache = SuffixCache(config.suffix_decoding_max_cached_requests, int(config.suffix_decoding_max_cache_mib * 2**20))
    return SuffixDrafter(cache, config.suffix_decoding_max_tree_depth, config.suffix_decoding_max_spec_factor,
                         config.suffix_decoding_min_token_prob, config.suffix_decoding_use_tree)
