"""A preallocated KV cache whose rollback moves a length and copies nothing.

The transformers model calls :meth:`PreallocatedLayer.update` once per layer per forward pass;
we write the new keys and values into a buffer sized for the whole context and hand back a view
of the filled prefix. Rejecting speculated tokens is :meth:`PreallocatedCache.rollback`: it sets
the length, and the stale entries past it are overwritten by the next forward pass.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class PreallocatedLayer(CacheLayerMixin):
    """One layer's keys and values, `[batch, kv_heads, max_len, head_dim]`, filled up to `length`."""

    is_croppable = True

    def __init__(self, max_len: int) -> None:
        # Not CacheLayerMixin.__init__: it assigns `keys` and `values`, which here are views of
        # the buffers' filled prefix, made when asked for (a step does not pay for them).
        self.is_initialized = False
        self.max_len = max_len
        self.length = 0
        self._key_buf: torch.Tensor | None = None
        self._value_buf: torch.Tensor | None = None

    @property
    def keys(self) -> torch.Tensor | None:
        return None if self._key_buf is None else self._key_buf[:, :, : self.length]

    @property
    def values(self) -> torch.Tensor | None:
        return None if self._value_buf is None else self._value_buf[:, :, : self.length]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        # The first update tells us batch, heads, head_dim, dtype and device.
        batch, heads, _, head_dim = key_states.shape
        shape = (batch, heads, self.max_len, head_dim)
        self._key_buf = torch.empty(shape, dtype=key_states.dtype, device=key_states.device)
        self._value_buf = torch.empty(
            (batch, heads, self.max_len, value_states.shape[-1]),
            dtype=value_states.dtype,
            device=value_states.device,
        )
        self.device = key_states.device
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # key_states, value_states: [batch, kv_heads, new, head_dim]
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, new = self.length, key_states.shape[-2]
        end = start + new
        if end > self.max_len:
            raise ContextOverflowError(f"context of {end} tokens exceeds the cache's {self.max_len}")
        self._key_buf[:, :, start:end] = key_states
        self._value_buf[:, :, start:end] = value_states
        self.length = end
        return self._key_buf[:, :, :end], self._value_buf[:, :, :end]

    def claim(self, rows: int, new: int, kv_heads: int, head_dim: int,
              dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """For a pass that writes the buffers itself (the native backend's fused layers): the key
        and value buffers (of `dtype`) and the first slot it will write (then :meth:`advance`);
        None where the buffers hold another shape or format."""
        if not self.is_initialized:
            empty = torch.empty(rows, kv_heads, 0, head_dim, dtype=dtype)
            self.lazy_initialization(empty, empty)
        if tuple(self._key_buf.shape) != (rows, kv_heads, self.max_len, head_dim) or self._key_buf.dtype != dtype:
            return None
        if self.length + new > self.max_len:
            raise ContextOverflowError(f"context of {self.length + new} tokens exceeds the cache's {self.max_len}")
        return self._key_buf, self._value_buf, self.length

    def advance(self, new: int) -> None:
        """The `new` positions after the cached ones were written (see :meth:`claim`)."""
        self.length += new

    def get_mask_sizes(self, query_length: int, *args) -> tuple[int, int]:
        # Called before update: the mask spans what is cached plus the new queries.
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.max_len

    def crop(self, tokens_to_remove: int) -> None:
        # transformers' convention: a negative count removes that many tokens from the end.
        self.length = self.length + tokens_to_remove if tokens_to_remove < 0 else tokens_to_remove

    def reset(self) -> None:
        self.length = 0


class ContextOverflowError(ValueError):
    """A forward pass would write past the end of the preallocated cache."""


class PreallocatedCache(Cache):
    """KV cache for the layers of one model, preallocated to `max_len` positions.

    held: the layers that are run (a draft running a subset of the target's layers); the
    others keep no keys or values. None: every layer.
    """

    def __init__(self, num_layers: int, max_len: int, held: Sequence[int] | None = None) -> None:
        super().__init__(layers=[PreallocatedLayer(max_len) for _ in range(num_layers)])
        self.max_len = max_len
        self._first = 0 if held is None else min(held)  # a layer whose length is the cache's

    @property
    def length(self) -> int:
        return self.layers[self._first].length

    def keys_values(self, start: int, end: int, row: int = 0) -> torch.Tensor:
        """[layers, 2, kv_heads, end - start, head_dim]: a copy of slots start .. end - 1 of row
        `row`, keys then values (what a prefix cache keeps). Every layer must be held."""
        if not 0 <= start <= end <= self.length:
            raise ValueError(f"slots {start}..{end} are not within the {self.length} cached")
        return torch.stack([torch.stack((layer._key_buf[row, :, start:end], layer._value_buf[row, :, start:end]))
                            for layer in self.layers])

    def fill(self, kv: torch.Tensor) -> None:
        """Start an empty cache of one row from positions 0 .. n - 1 computed before (a prefix
        cache's). kv: [layers, 2, kv_heads, n, head_dim], keys then values."""
        if self.length:
            raise ValueError(f"fill starts an empty cache; this one holds {self.length} positions")
        layers, _, _, n, _ = kv.shape
        if layers != len(self.layers) or n > self.max_len:
            raise ValueError(f"{n} positions of {layers} layers cannot fill a cache of {len(self.layers)} layers "
                             f"and {self.max_len} positions")
        for i, layer in enumerate(self.layers):
            keys, values = kv[i, 0][None], kv[i, 1][None]  # [1, kv_heads, n, head_dim]
            if not layer.is_initialized:
                layer.lazy_initialization(keys, values)
            layer._key_buf[:, :, :n] = keys
            layer._value_buf[:, :, :n] = values
            layer.length = n

    def rollback(self, length: int) -> None:
        """Forget every position at or past `length`. Moves a length on each layer; copies nothing."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back to {length}: cache holds {self.length} positions")
        for layer in self.layers:
            layer.length = length
