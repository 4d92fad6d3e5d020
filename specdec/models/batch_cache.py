"""A KV cache for many sequences that advance together, each at its own length.

Layout, per layer: keys and values `[max_rows, kv_heads, capacity, head_dim]`. The active
sequences occupy rows 0 .. rows - 1, and row r holds its sequence's keys and values in slots
0 .. lengths[r] - 1, in order, exactly as the single-sequence
:class:`~specdec.models.cache.PreallocatedCache` would: a step writes each row's new tokens at
that row's own length, and rejecting drafts moves the row's length back, as a single cache's
rollback does. There are no holes, so a backend can attend over a row's prefix as a view and get
bitwise what the row's own sequence would get alone (the native backend does).

A forward pass reads `[rows, kv_heads, longest + new, head_dim]` with a mask that hides, for each
row, the slots past its own tokens. Four operations copy KV, each a named, tested method:
:meth:`BatchCache.insert_row` (a prefilled prompt joins), :meth:`BatchCache.remove_row` (the
last row moves into the slot of one that left, keeping rows contiguous) and
:meth:`BatchCache.keep_path` (a token tree's accepted branch moves up behind the fed token) and
:meth:`BatchCache.keys_values` (a row's committed slots copied out for a prefix cache).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from specdec.models.backend import Backend
from specdec.models.cache import ContextOverflowError, PreallocatedCache


class BatchCacheLayer(CacheLayerMixin):
    """One layer's keys and values for every row; written by the model's attention."""

    is_croppable = False

    def __init__(self, owner: BatchCache, key_buf: torch.Tensor, value_buf: torch.Tensor) -> None:
        super().__init__()
        self.owner = owner
        self.key_buf = key_buf  # [max_rows, kv_heads, capacity, head_dim]
        self.value_buf = value_buf
        self.device = key_buf.device
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass  # allocated up front by BatchCache

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # key_states, value_states: [rows, kv_heads, new, head_dim], row r written at slots
        # lengths[r] .. lengths[r] + new - 1.
        owner = self.owner
        rows, new = key_states.shape[0], key_states.shape[-2]
        if rows != owner.rows:
            raise ValueError(f"forward over {rows} rows but the cache has {owner.rows} active")
        row_index, slot_index = owner.write_index(new)  # [rows, new] each
        self.key_buf[row_index, :, slot_index] = key_states.transpose(1, 2)  # [rows, new, kv_heads, head_dim]
        self.value_buf[row_index, :, slot_index] = value_states.transpose(1, 2)
        span = owner.span(new)
        return self.key_buf[:rows, :, :span], self.value_buf[:rows, :, :span]

    def get_mask_sizes(self, query_length: int, *args) -> tuple[int, int]:
        return self.owner.span(query_length), 0

    def get_seq_length(self) -> int:
        return self.owner.longest

    def get_max_length(self) -> int:
        return self.owner.capacity

    def reset(self) -> None:
        self.owner.clear()


class BatchCache(Cache):
    """KV cache for up to `max_rows` sequences of one model; see the module docstring.

    The engine drives it in three calls per step: :meth:`step_inputs` (positions and mask for
    `new` tokens per row), the model's forward pass (which writes the slots), and
    :meth:`commit` (which keeps a prefix of each row's new slots).
    """

    def __init__(
        self,
        num_layers: int,
        max_rows: int,
        capacity: int,
        kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if max_rows < 1 or capacity < 1:
            raise ValueError(f"max_rows and capacity must be >= 1, got {max_rows} and {capacity}")
        shape = (max_rows, kv_heads, capacity, head_dim)
        self._buffers = [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                         for _ in range(num_layers)]
        super().__init__(layers=[BatchCacheLayer(self, k, v) for k, v in self._buffers])
        self.max_rows = max_rows
        self.capacity = capacity
        self.device = torch.device(device)
        self.rows = 0
        self.lengths = torch.zeros(max_rows, dtype=torch.long, device=device)  # [max_rows]
        self._index: tuple[int, tuple[torch.Tensor, torch.Tensor]] | None = None  # write_index, per step
        # The mask step_inputs last returned and each query's visible count under it, while no
        # tree has changed it (prefix_counts).
        self._prefix: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def for_backend(cls, backend: Backend, max_rows: int, capacity: int) -> BatchCache:
        return cls(backend.num_layers, max_rows, capacity, backend.kv_heads, backend.head_dim,
                   dtype=backend.kv_dtype, device=backend.device)

    @property
    def nbytes(self) -> int:
        """Bytes of the key and value buffers, all layers."""
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self._buffers)

    @property
    def longest(self) -> int:
        return int(self.lengths[: self.rows].max()) if self.rows else 0

    def span(self, new: int) -> int:
        """Slots a forward pass over `new` tokens per row reads: the longest row's, plus new."""
        return self.longest + new

    def write_index(self, new: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(row, slot) index tensors [rows, new] of the slots a forward pass over `new` tokens
        writes: row r's at lengths[r] .. lengths[r] + new - 1. Built once per step."""
        if self._index is None or self._index[0] != new:
            rows = self.rows
            slots = self.lengths[:rows, None] + torch.arange(new, device=self.device)  # [rows, new]
            if rows and int(slots.max()) >= self.capacity:
                raise ContextOverflowError(f"write to slot {int(slots.max()) + 1} exceeds the batch cache's {self.capacity}")
            row_index = torch.arange(rows, device=self.device)[:, None].expand(rows, new)
            self._index = (new, (row_index, slots))
        return self._index[1]

    def clear(self) -> None:
        self.rows = 0
        self.lengths.zero_()
        self._index = self._prefix = None

    # --- rows join and leave -------------------------------------------------------------

    def insert_row(self, prefilled: PreallocatedCache) -> int:
        """Copy a single sequence's cache (a prefilled prompt) into a new row; returns its index."""
        n = prefilled.length
        if self.rows >= self.max_rows:
            raise ValueError(f"batch cache is full ({self.max_rows} rows)")
        if n > self.capacity:
            raise ContextOverflowError(f"a prompt of {n} tokens exceeds the batch cache's {self.capacity} slots")
        row = self.rows
        for (key_buf, value_buf), layer in zip(self._buffers, prefilled.layers):
            key_buf[row, :, :n] = layer.keys[0, :, :n]
            value_buf[row, :, :n] = layer.values[0, :, :n]
        self.lengths[row] = n
        self.rows += 1
        self._index = self._prefix = None
        return row

    def remove_row(self, row: int) -> int | None:
        """Drop a row. The last row moves into its place so rows stay contiguous; returns the
        index that row had (its new index is `row`), or None when nothing moved."""
        if not 0 <= row < self.rows:
            raise ValueError(f"no active row {row} (rows: {self.rows})")
        last = self.rows - 1
        moved = None
        if row != last:
            n = int(self.lengths[last])
            for key_buf, value_buf in self._buffers:
                key_buf[row, :, :n] = key_buf[last, :, :n]
                value_buf[row, :, :n] = value_buf[last, :, :n]
            self.lengths[row] = n
            moved = last
        self.lengths[last] = 0
        self.rows = last
        self._index = self._prefix = None
        return moved

    def keys_values(self, start: int, end: int, row: int) -> torch.Tensor:
        """[layers, 2, kv_heads, end - start, head_dim]: a copy of row `row`'s slots start ..
        end - 1, keys then values (what a prefix cache keeps of a finished sequence)."""
        if not 0 <= row < self.rows or not 0 <= start <= end <= int(self.lengths[row]):
            raise ValueError(f"slots {start}..{end} of row {row} are not within what it holds")
        return torch.stack([torch.stack((k[row, :, start:end], v[row, :, start:end])) for k, v in self._buffers])

    # --- one step --------------------------------------------------------------------------

    def step_inputs(self, new: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions and attention mask for `new` tokens per active row.

        Returns position_ids [rows, new] (each row continues from its own length) and a boolean
        mask [rows, 1, new, longest + new]: query i of row r sees slots 0 .. lengths[r] + i, its
        row's cached tokens, the new tokens before it, and itself. True means attend.
        """
        rows = self.rows
        positions = self.lengths[:rows, None] + torch.arange(new, device=self.device)  # [rows, new]
        slots = torch.arange(self.span(new), device=self.device)  # [span]
        mask = (slots[None, None, :] <= positions[:, :, None])[:, None]  # [rows, 1, new, span]
        self.write_index(new)
        self._prefix = (mask, (positions + 1).to(torch.int32))
        return positions, mask

    def prefix_counts(self, mask: torch.Tensor | None) -> torch.Tensor | None:
        """[rows, new] int32: how many slots each query sees, where `mask` is the one
        :meth:`step_inputs` returned and no tree changed it (every query then sees a prefix of its
        row, through itself); else None. What a backend would count from the mask, without the
        counting."""
        return self._prefix[1] if self._prefix is not None and self._prefix[0] is mask else None

    def tree_inputs(self, positions: torch.Tensor, mask: torch.Tensor, row: int, depths: list[int],
                    ancestors: torch.Tensor) -> None:
        """Make row `row` of a step's inputs (from :meth:`step_inputs`) verify a token tree: its
        fed token and n nodes sit at slots lengths[row] .. + n; node i's position is the row's
        length + depths[i], and the tree's nodes see only their ancestors among the new slots.
        positions: [rows, new]; mask: [rows, 1, new, span], changed in place; ancestors:
        [1 + n, 1 + n] (TokenTree.ancestors_mask)."""
        self._prefix = None  # the mask is no longer every query's prefix
        n = len(depths)
        length = int(self.lengths[row])
        positions[row, 1 : 1 + n] = length + torch.tensor(depths, device=positions.device)
        mask[row, 0, : 1 + n, length : length + 1 + n] = ancestors.to(mask.device)

    def keep_path(self, row: int, offsets: list[int]) -> None:
        """Copy KV within row `row`'s last step: the entries at new-token offsets `offsets`
        (an accepted tree branch, increasing) move to offsets 1, 2, ... right after the fed
        token, so that :meth:`commit` keeps them. Each source is at or after its destination,
        so copying in order never overwrites a source still to be read."""
        length = int(self.lengths[row])
        for j, offset in enumerate(offsets, start=1):
            if offset < j:
                raise ValueError(f"offsets must be increasing and >= their rank, got {offsets}")
            if offset == j:
                continue
            for key_buf, value_buf in self._buffers:
                key_buf[row, :, length + j] = key_buf[row, :, length + offset]
                value_buf[row, :, length + j] = value_buf[row, :, length + offset]

    def commit(self, new: int, keep: Sequence[int] | torch.Tensor) -> None:
        """After a forward pass over `new` tokens per row: row i keeps the first keep[i] of them
        (the fed token and its accepted drafts); the rest are forgotten by its length. keep: one
        count per row."""
        rows = self.rows
        counts = keep.tolist() if isinstance(keep, torch.Tensor) else list(keep)
        if len(counts) != rows or not all(isinstance(c, int) and 0 <= c <= new for c in counts):
            raise ValueError(f"keep must be {rows} counts in 0..{new}, got {counts}")
        self.lengths[:rows] += torch.tensor(counts, dtype=self.lengths.dtype, device=self.lengths.device)
        self._index = self._prefix = None
