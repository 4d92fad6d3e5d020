"""The backend protocol: what the engines and model drafters see of a model.

A backend runs a block of new tokens for one or more rows against a KV cache, with explicit
positions and an explicit attention mask, and returns their logits (and, when asked, hidden
states). Two implement it: `hf` (:mod:`specdec.models.hf_backend`, transformers' modeling code,
any architecture it loads; the reference) and `native` (:mod:`specdec.models.native`, a Llama-
family model written for decoding, with packed integer weights).

Caches are :class:`~specdec.models.cache.PreallocatedCache` (one row) and
:class:`~specdec.models.batch_cache.BatchCache` (many rows); both hand each layer's new keys
and values to `cache.layers[i].update(keys, values)` and get the filled view back, so either
backend writes either cache.
"""

from __future__ import annotations

import platform
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

BACKENDS = ("hf", "native")
DTYPES = ("auto", "float32", "bfloat16", "int8", "int4", "r8")


@dataclass(frozen=True)
class ForwardOutput:
    """logits: [rows, new, vocab] float32 (new = 1 with last_only);
    hidden: [rows, new, hidden_size], the last layer's output after the final norm (the LM
    head's input), when asked for; layer_states: for each requested layer index, that layer's
    output [rows, new, hidden_size] (before the final norm)."""

    logits: torch.Tensor
    hidden: torch.Tensor | None = None
    layer_states: dict[int, torch.Tensor] | None = None


class Backend(Protocol):
    name: str  # "hf" or "native"
    weight_format: str  # what the weights run in: "float32", "bfloat16", "int8", "int4", "r8", or "mixed: ..."
    kernel_path: str  # what runs the products: specdec's "amx", "avx512_vnni" or "avx2" path, or "pytorch"
    num_layers: int
    hidden_size: int
    kv_heads: int
    head_dim: int
    vocab_size: int
    kv_dtype: torch.dtype
    device: torch.device
    model_type: str
    # Whether a position's keys and values are bitwise the same whatever pass computes them
    # (whole prompt, part of one, a step among other rows): a prefix cache is exact only then.
    exact_blocks: bool

    def forward(
        self,
        cache,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor | None = None,
        *,
        layers: Sequence[int] | None = None,
        last_only: bool = False,
        hidden: bool = False,
        hidden_layers: Sequence[int] = (),
        last_logits: int | None = None,
    ) -> ForwardOutput:
        """Append `input_ids` [rows, new] at `positions` [rows, new] to `cache` and return the
        new tokens' outputs.

        mask: [rows, 1, new, cached + new] bool, True = attend; None means causal over
        everything cached (a single row whose cache holds no holes).
        layers: run only these decoder layers (ascending), then the final norm and LM head.
        last_logits: logits (and `hidden`) for the last this many new tokens only (last_only: 1);
        `hidden_layers` still give every token.
        """

    def weight_bytes(self) -> int:
        """Bytes of every weight the backend holds."""

    def input_embeddings(self) -> torch.Tensor:
        """[vocab, hidden] float32: the token embedding (for heads that read the target's)."""

    def output_embeddings(self) -> torch.Tensor:
        """[vocab, hidden] float32: the LM head's rows, as the backend computes with them."""

    def final_norm_weight(self) -> torch.Tensor:
        """[hidden] float32: the final RMSNorm's weight (the LM head reads rms(x) * weight)."""

    def kv_bytes_per_token(self, layers: Sequence[int] | None = None) -> int:
        """KV cache bytes one token costs across `layers` (all by default), keys and values."""


def kv_bytes_per_token(backend: Backend, layers: Sequence[int] | None = None) -> int:
    """KV cache bytes one token costs across `layers` (all by default): keys and values."""
    count = backend.num_layers if layers is None else len(layers)
    return 2 * count * backend.kv_heads * backend.head_dim * torch.finfo(backend.kv_dtype).bits // 8


def logits_kept(new: int, last_only: bool, last_logits: int | None) -> int:
    """How many of a pass's `new` tokens get logits (forward's `last_only` and `last_logits`)."""
    if last_logits is None:
        return 1 if last_only else new
    if last_only or not 1 <= last_logits <= new:
        raise ValueError(f"last_logits must be 1..{new} (the pass's new tokens), without last_only; got {last_logits}")
    return last_logits


def causal_mask(cached: int, new: int, device: torch.device) -> torch.Tensor:
    """[1, 1, new, cached + new] bool: each new token sees the cache and the new tokens up to itself."""
    query = torch.arange(new, device=device)[:, None] + cached  # [new, 1]
    key = torch.arange(cached + new, device=device)[None, :]  # [1, cached + new]
    return (key <= query)[None, None]


def cpu_model() -> str:
    """The CPU's model name as Linux reports it (results and costs name the machine they ran on)."""
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_multiplies_bfloat16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX-512 BF16 or AMX). Without it PyTorch
    emulates bfloat16 products, slower than float32 ones."""
    try:
        flags = Path("/proc/cpuinfo").read_text(encoding="utf-8")
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags
