"""What the heads that read the target's hidden states share (EAGLE, MTP, Medusa, hybrid):
RMS norm and rotary embeddings as a head layer computes them, a head's matrices packed for
specdec's kernels, and the token-tree options."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specdec.drafters.registry import Options, require_int
from specdec.errors import ConfigError
from specdec.models.qlinear import PackedLinear

if TYPE_CHECKING:
    from specdec.config import SpeculativeConfig

TREE_SLOTS = 64  # cache slots for a tree's expanded nodes (tree_width x depth at most)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMS norm over the last dimension."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope_inv_freq(theta: float, head_dim: int) -> torch.Tensor:
    """[head_dim / 2] the rotary frequencies of a head layer."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))


def rope(inv_freq: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [..., n, head_dim] of the rotary embedding at these positions [..., n]."""
    angles = positions.float()[..., None] * inv_freq  # [..., n, head_dim / 2]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [heads, n, head_dim] turned by the rotary embedding (cos, sin: [n, head_dim])."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


@dataclass(frozen=True)
class PackedHead:
    """The matrices of a head as the drafter multiplies them (:class:`PackedLinear`). `fc` is
    the layer's input projection: EAGLE's fusion of the target's states, an MTP layer's eh_proj."""

    fc: PackedLinear
    qkv: PackedLinear
    o: PackedLinear
    gate_up: PackedLinear
    down: PackedLinear
    lm: PackedLinear

    def nbytes(self) -> int:
        return sum(m.nbytes for m in (self.fc, self.qkv, self.o, self.gate_up, self.down, self.lm))


# The trees `tune` measures for a head's drafter, (k, tree_width, tree_nodes): small ones, where a
# CPU's verification pass grows with every token it checks, to a few wider ones.
TUNE_TREES = ((2, 2, 3), (3, 2, 4), (3, 2, 6), (4, 3, 8))


@dataclass(frozen=True)
class TreeOptions(Options):
    """tree_width, tree_nodes: draft a token tree instead of a chain: the head's top `tree_width`
    tokens at each of the `tree_width` best nodes of each depth (k deep), the `tree_nodes` best
    kept (default 4 x width). 1: a chain."""

    tree_width: int = 1
    tree_nodes: int | None = None

    def __post_init__(self) -> None:
        require_int("tree_width", self.tree_width, 1)
        require_int("tree_nodes", self.tree_nodes, 1, optional=True)

    def check(self, config: SpeculativeConfig) -> None:
        if self.tree_width > 1 and self.tree_width * config.num_speculative_tokens > 64:
            raise ConfigError("a tree of tree_width x num_speculative_tokens > 64 expanded nodes is too large")

    def label_after_k(self) -> list[str]:
        return [f"tree {self.tree_width}x{self.proposal_nodes}"] if self.tree_width > 1 else []

    @property
    def proposal_nodes(self) -> int:
        """The most tokens one proposal holds beyond k (0 for a chain)."""
        return (self.tree_nodes or 4 * self.tree_width) if self.tree_width > 1 else 0
