"""Prefix caching: committed tokens' keys and values kept across requests and reused by any later
prompt that starts with the same tokens.

Blocks of `block` tokens are keyed by their tokens and the block before them, so a block names
its whole prefix exactly (tuples compared, no hash that could collide): a later prompt reuses the
longest run of whole blocks it starts with, and the prefill computes only the rest. Only
committed tokens enter: a prompt's, stored after its prefill, and a finished sequence's tokens up
to its cache length, stored when its row is freed; a draft's or a rejected token's slots are past
that length and never read. Blocks are evicted least recently used first within a byte budget; a
block is always used more recently than its descendants, so eviction takes leaves first and
never strands a reachable block.

Reuse is exact only where a position's keys and values do not depend on the pass that computed
them: the backend's `exact_blocks` (per-query attention and row-invariant products), so that a
prompt's keys are bitwise what its prefill, or decoding the same tokens one by one, would give.
Elsewhere :meth:`PrefixCache.for_backend` returns None and prompts are prefilled whole.

A drafter that reads the target's hidden states (an EAGLE head) needs them for every prompt
position: a block keeps the states it was stored with, and such a prompt reuses only blocks that
hold the layers it reads.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specdec.models.backend import Backend
from specdec.models.batch_cache import BatchCache
from specdec.models.cache import PreallocatedCache

DEFAULT_BLOCK = 16


@dataclass(eq=False)
class _Block:
    id: int
    kv: torch.Tensor  # [layers, 2, kv_heads, block, head_dim]: keys, then values
    states: dict[int, torch.Tensor] = field(default_factory=dict)  # {layer: [block, hidden]}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.kv, *self.states.values()))


@dataclass(frozen=True)
class PrefixHit:
    """The blocks a prompt starts with: `tokens` of them, their keys and values and, where asked,
    their states."""

    tokens: int
    blocks: tuple[_Block, ...]

    def kv(self) -> torch.Tensor:
        """[layers, 2, kv_heads, tokens, head_dim]: the blocks' keys and values (for
        :meth:`PreallocatedCache.fill`)."""
        return torch.cat([b.kv for b in self.blocks], dim=3)

    def states(self, layers: Sequence[int]) -> dict[int, torch.Tensor]:
        """{layer: [tokens, hidden]} for the asked layers (every block holds them)."""
        return {i: torch.cat([b.states[i] for b in self.blocks]) for i in layers} if self.blocks else {}


@dataclass
class PrefixStats:
    """Counts since start: prompt tokens looked up and found, blocks stored and evicted."""

    lookup_tokens: int = 0
    hit_tokens: int = 0
    stored_blocks: int = 0
    evicted_blocks: int = 0


class PrefixCache:
    """Blocks of committed keys and values within `budget_bytes`; see the module docstring."""

    def __init__(self, budget_bytes: int, *, block: int = DEFAULT_BLOCK) -> None:
        if block < 1:
            raise ValueError(f"block must be >= 1, got {block}")
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self.block = block
        self.nbytes = 0
        self.stats = PrefixStats()
        # (parent block id, its tokens) -> block, least recently used first; the root's id is 0.
        self._blocks: OrderedDict[tuple[int, tuple[int, ...]], _Block] = OrderedDict()
        self._next_id = 1

    @classmethod
    def for_backend(cls, backend: Backend, budget_bytes: int, *, block: int = DEFAULT_BLOCK) -> PrefixCache | None:
        """A cache for this backend's prompts, or None where reuse would not be exact (see the
        module docstring) or the budget holds no block."""
        if not getattr(backend, "exact_blocks", False):
            return None
        if budget_bytes < block * backend.kv_bytes_per_token():
            return None
        return cls(budget_bytes, block=block)

    def __len__(self) -> int:
        return len(self._blocks)

    def _chain(self, tokens: Sequence[int], limit: int) -> list[tuple[tuple[int, tuple[int, ...]], _Block | None]]:
        """(key, block or None) for the whole blocks of tokens[:limit], in order, up to the first
        block not held (its key, with None) or the end."""
        out, parent, size = [], 0, self.block
        for start in range(0, limit - size + 1, size):
            key = (parent, tuple(tokens[start : start + size]))
            found = self._blocks.get(key)
            out.append((key, found))
            if found is None:
                break
            parent = found.id
        return out

    def _touch(self, keys: list[tuple[int, tuple[int, ...]]]) -> None:
        # Deepest first: a block ends up used more recently than everything below it.
        for key in reversed(keys):
            self._blocks.move_to_end(key)

    def match(self, tokens: Sequence[int], layers: Sequence[int] = ()) -> PrefixHit:
        """The longest run of held blocks `tokens` starts with, leaving at least one token to
        prefill (its logits give the first output token); with `layers`, only blocks that hold
        those layers' states. Counts the lookup in :attr:`stats`."""
        held = []
        for key, found in self._chain(tokens, len(tokens) - 1):
            if found is None or any(i not in found.states for i in layers):
                break
            held.append((key, found))
        self._touch([key for key, _ in held])
        hit = PrefixHit(len(held) * self.block, tuple(b for _, b in held))
        self.stats.lookup_tokens += len(tokens)
        self.stats.hit_tokens += hit.tokens
        return hit

    def store(self, tokens: Sequence[int], cache: PreallocatedCache | BatchCache, row: int = 0,
              states: dict[int, torch.Tensor] | None = None) -> int:
        """Keep the whole blocks of `tokens`, whose keys and values sit in slots 0 .. len - 1 of
        `cache` (a single sequence's, or row `row` of a batch's); `states` ({layer: [len(tokens),
        hidden]}) are kept with blocks that do not hold them yet. Blocks already held are only
        marked used. Returns how many blocks were added."""
        chain = self._chain(tokens, len(tokens))
        if states:  # the blocks held give their states where they lack them
            for n, (_, found) in enumerate(chain):
                if found is not None:
                    for i, s in states.items():
                        if i not in found.states:
                            found.states[i] = s[n * self.block : (n + 1) * self.block].clone()
                            self.nbytes += found.states[i].numel() * found.states[i].element_size()
        first = len(chain) - 1 if chain and chain[-1][1] is None else len(chain)
        end = len(tokens) // self.block * self.block
        start = first * self.block
        keys = [key for key, _ in chain[:first]]
        added = 0
        if start < end:
            kv = cache.keys_values(start, end, row)  # [layers, 2, kv_heads, end - start, head_dim]
            parent = chain[first - 1][1].id if first else 0
            for n in range(start, end, self.block):
                key = (parent, tuple(tokens[n : n + self.block]))
                block = _Block(self._next_id, kv[:, :, :, n - start : n - start + self.block].clone(),
                               {i: s[n : n + self.block].clone() for i, s in (states or {}).items()})
                self._next_id += 1
                self._blocks[key] = block
                self.nbytes += block.nbytes
                keys.append(key)
                parent = block.id
                added += 1
        self._touch(keys)
        self.stats.stored_blocks += added
        self._evict()
        return added

    def _evict(self) -> None:
        while self.nbytes > self.budget_bytes and self._blocks:
            _, block = self._blocks.popitem(last=False)
            self.nbytes -= block.nbytes
            self.stats.evicted_blocks += 1

