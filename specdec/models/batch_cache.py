"""A KV cache for many sequences that advance together, each at its own length.

Layout, per layer: keys and values `[max_rows, kv_heads, capacity, head_dim]`. The active
sequences occupy rows 0 .. rows - 1. Every step writes the same number of new slots into every
active row at a shared write pointer `write`, so the forward pass reads one contiguous view
`[rows, kv_heads, write + new, head_dim]` and copies nothing.

Rows differ in how much of what they wrote they keep: a rejected draft token, or the padding of
a row that drafted fewer tokens than another, leaves a *hole*: its slot stays in the buffer but
`valid[row, slot]` is False, and the attention mask hides it. A row's logical length (the
position of its next token, for RoPE) is the number of its valid slots, `lengths[row]`.

So a rejection moves nothing but a mask bit and a length. Three operations copy KV, each a named,
tested method: :meth:`BatchCache.insert_row` (a prefilled prompt joins), :meth:`BatchCache.remove_row`
(the last row moves into the slot of one that left, keeping rows contiguous) and
:meth:`BatchCache.compact` (packs each row's valid slots to the front when holes pile up or the
write pointer reaches the end of the buffer).
"""

from __future__ import annotations

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
        # key_states, value_states: [rows, kv_heads, new, head_dim]
        rows, new = key_states.shape[0], key_states.shape[-2]
        if rows != self.owner.rows:
            raise ValueError(f"forward over {rows} rows but the cache has {self.owner.rows} active")
        start = self.owner.write
        end = start + new
        if end > self.owner.capacity:
            raise ContextOverflowError(f"write to slot {end} exceeds the batch cache's {self.owner.capacity}")
        self.key_buf[:rows, :, start:end] = key_states
        self.value_buf[:rows, :, start:end] = value_states
        return self.key_buf[:rows, :, :end], self.value_buf[:rows, :, :end]

    def get_mask_sizes(self, query_length: int, *args) -> tuple[int, int]:
        return self.owner.write + query_length, 0

    def get_seq_length(self) -> int:
        return self.owner.write

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
        self.write = 0  # slots 0 .. write - 1 of every active row have been written
        self.valid = torch.zeros((max_rows, capacity), dtype=torch.bool, device=device)  # [max_rows, capacity]
        self.lengths = torch.zeros(max_rows, dtype=torch.long, device=device)  # [max_rows]

    @classmethod
    def for_backend(cls, backend: Backend, max_rows: int, capacity: int) -> BatchCache:
        return cls(backend.num_layers, max_rows, capacity, backend.kv_heads, backend.head_dim,
                   dtype=backend.kv_dtype, device=backend.device)

    @property
    def nbytes(self) -> int:
        """Bytes of the key and value buffers, all layers."""
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self._buffers)

    @property
    def holes(self) -> int:
        """Written slots of active rows that are not valid (rejected drafts, padding, alignment)."""
        return int(self.rows * self.write - self.lengths[: self.rows].sum())

    def clear(self) -> None:
        self.rows = 0
        self.write = 0
        self.valid.zero_()
        self.lengths.zero_()

    # --- rows join and leave -------------------------------------------------------------

    def insert_row(self, prefilled: PreallocatedCache) -> int:
        """Copy a single sequence's cache (a prefilled prompt) into a new row; returns its index.

        The prompt lands in slots 0 .. n - 1 of the new row. The shared write pointer moves to at
        least n; the other rows' slots between their own writes and there are holes.
        """
        n = prefilled.length
        if self.rows >= self.max_rows:
            raise ValueError(f"batch cache is full ({self.max_rows} rows)")
        if n > self.capacity:
            raise ContextOverflowError(f"a prompt of {n} tokens exceeds the batch cache's {self.capacity} slots")
        if n > self.write:
            self.valid[: self.rows, self.write : n] = False
            self.write = n
        row = self.rows
        for (key_buf, value_buf), layer in zip(self._buffers, prefilled.layers):
            key_buf[row, :, :n] = layer.keys[0, :, :n]
            value_buf[row, :, :n] = layer.values[0, :, :n]
        self.valid[row] = False
        self.valid[row, :n] = True
        self.lengths[row] = n
        self.rows += 1
        return row

    def remove_row(self, row: int) -> int | None:
        """Drop a row. The last row moves into its place so rows stay contiguous; returns the
        index that row had (its new index is `row`), or None when nothing moved."""
        if not 0 <= row < self.rows:
            raise ValueError(f"no active row {row} (rows: {self.rows})")
        last = self.rows - 1
        moved = None
        if row != last:
            for key_buf, value_buf in self._buffers:
                key_buf[row, :, : self.write] = key_buf[last, :, : self.write]
                value_buf[row, :, : self.write] = value_buf[last, :, : self.write]
            self.valid[row] = self.valid[last]
            self.lengths[row] = self.lengths[last]
            moved = last
        self.valid[last] = False
        self.lengths[last] = 0
        self.rows = last
        if self.rows == 0:
            self.write = 0
        return moved

    def compact(self) -> None:
        """Pack every active row's valid slots to the front, in order; the write pointer becomes
        the longest row's length. Attention results are unchanged (holes were masked out)."""
        rows, write = self.rows, self.write
        if rows == 0:
            self.write = 0
            return
        # Valid slots first, each group in slot order (a stable sort of the "is a hole" flag).
        order = torch.sort((~self.valid[:rows, :write]).to(torch.int8), dim=1, stable=True).indices  # [rows, write]
        new_write = int(self.lengths[:rows].max())
        for key_buf, value_buf in self._buffers:
            for buf in (key_buf, value_buf):
                index = order[:, None, :new_write, None].expand(rows, buf.shape[1], new_write, buf.shape[3])
                buf[:rows, :, :new_write] = buf[:rows, :, :write].gather(2, index)
        slots = torch.arange(self.capacity, device=self.valid.device)
        self.valid[:rows] = slots[None, :] < self.lengths[:rows, None]
        self.write = new_write

    # --- one step --------------------------------------------------------------------------

    def ensure_room(self, new: int, max_holes: int) -> None:
        """Compact when `new` slots per row would not fit, or when the write pointer runs more
        than `max_holes` slots past the longest row."""
        longest = int(self.lengths[: self.rows].max()) if self.rows else 0
        if self.write + new > self.capacity or self.write - longest > max_holes:
            self.compact()
        if self.write + new > self.capacity:
            raise ContextOverflowError(f"{new} new slots do not fit: longest row {longest}, capacity {self.capacity}")

    def step_inputs(self, new: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions and attention mask for `new` tokens per active row.

        Returns position_ids [rows, new] (each row continues from its own length) and a boolean
        mask [rows, 1, new, write + new]: a query sees its row's valid cached slots and, among
        the new tokens, itself and the ones before it. True means attend.
        """
        rows, write = self.rows, self.write
        positions = self.lengths[:rows, None] + torch.arange(new, device=self.device)  # [rows, new]
        cached = self.valid[:rows, None, :write].expand(rows, new, write)  # [rows, new, write]
        causal = torch.ones((new, new), dtype=torch.bool, device=self.device).tril()  # [new, new]
        mask = torch.cat([cached, causal.expand(rows, new, new)], dim=2)  # [rows, new, write + new]
        return positions, mask[:, None]

    def commit(self, new: int, keep: torch.Tensor) -> None:
        """After a forward pass over `new` tokens per row: row i keeps the first keep[i] of its
        new slots (the fed token and its accepted drafts); the rest become holes. keep: [rows]."""
        rows, write = self.rows, self.write
        if keep.shape != (rows,) or bool((keep < 0).any()) or bool((keep > new).any()):
            raise ValueError(f"keep must be [{rows}] with values in 0..{new}, got {keep.tolist()}")
        slots = torch.arange(new, device=self.device)
        self.valid[:rows, write : write + new] = slots[None, :] < keep[:, None]
        self.lengths[:rows] += keep
        self.write = write + new
