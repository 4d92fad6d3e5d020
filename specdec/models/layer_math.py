"""The float32 arithmetic of a decoder layer that the native backend and the draft heads share:
Llama's RMS norm and the rotary embedding (Hugging Face's layout: the two halves of a head's
dimensions turn together). One definition of each, so that a head's layer rounds exactly as the
target's layers do on PyTorch's path (specdec's kernels fuse the same arithmetic)."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMS norm over the last dimension: x [..., dim] float32, weight [dim]."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope_inv_freq(theta: float, head_dim: int) -> torch.Tensor:
    """[head_dim / 2] the rotary inverse frequencies for a base `theta` (no scaling)."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))


def rope(inv_freq: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [..., n, head_dim] of the rotary embedding at positions [..., n] (each half of
    head_dim repeats the angles)."""
    angles = positions.float()[..., None] * inv_freq  # [..., n, head_dim / 2]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., n, head_dim] turned by the rotary embedding (cos, sin broadcast to x: e.g.
    [n, head_dim] for x [heads, n, head_dim], or [rows, 1, n, head_dim] for [rows, heads, n, head_dim])."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
