"""The kernels' arithmetic in plain PyTorch: what `quant.cpp` and `half.cpp` compute, bit for bit.

Integer sums are exact in both; every float operation is a single IEEE float32 multiply or add
in the same order (over blocks, first to last), so the results are identical, not merely close.
Slow (it materializes per-block sums): for tests and for checking a new kernel path.
"""

from __future__ import annotations

import torch

from specdec.kernels.packing import BLOCK, ROTATION_BLOCK, butterflies, mix_blocks, rotation_dct, rotation_signs


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [rows, in] float32 -> q [rows, blocks, 32] int32 in -127..127, d [rows, blocks], sums [rows, blocks] int32.

    Per row and block of 32: d = amax / 127 and q = round(x * (1 / d)), half to even (0 where amax is 0).
    """
    rows, in_features = x.shape
    blocks = x.float().reshape(rows, in_features // BLOCK, BLOCK)
    d = blocks.abs().amax(dim=-1) / 127
    inverse = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(blocks * inverse[..., None]).to(torch.int32)
    return q, d, q.sum(dim=-1, dtype=torch.int32)


def _block_sums(xq: torch.Tensor, wq: torch.Tensor) -> torch.Tensor:
    # xq [rows, blocks, 32], wq [out, blocks, 32] integers -> [rows, out, blocks] exact sums
    # (float64 holds every partial sum of these small integers exactly).
    return torch.einsum("rgk,ngk->rng", xq.double(), wq.double()).to(torch.int32)


def q4_matmul(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """x [rows, in] float32 times w = d q + m (q [out, in] 0..15; d, m [out, blocks]) -> [rows, out].

    Per block: t = sum(q_w q_x) d_w; t = t + sum(q_x) m_w; t = t d_x; out = out + t.
    """
    xq, dx, sx = quantize_rows(x)
    sums = _block_sums(xq, q.reshape(q.shape[0], -1, BLOCK))
    out = torch.zeros(x.shape[0], q.shape[0])
    for g in range(sums.shape[-1]):
        t = sums[..., g].float() * d[None, :, g].float()
        t = t + sx[:, None, g].float() * m[None, :, g].float()
        out = out + t * dx[:, None, g]
    return out


def q8_matmul(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """x [rows, in] float32 times w = d q (q [out, in] -128..127, d [out, blocks]) -> [rows, out].

    Per block: t = sum(q_w q_x) d_w; t = t d_x; out = out + t. With a scale per 16 inputs (d
    [out, 2 blocks]): t = sum_lo d_lo + sum_hi d_hi over the block's two halves, then the same.
    """
    if d.shape[1] == 2 * (q.shape[1] // BLOCK):
        return _q8_per16_matmul(x, q, d)
    xq, dx, _ = quantize_rows(x)
    sums = _block_sums(xq, q.reshape(q.shape[0], -1, BLOCK))
    out = torch.zeros(x.shape[0], q.shape[0])
    for g in range(sums.shape[-1]):
        out = out + (sums[..., g].float() * d[None, :, g].float()) * dx[:, None, g]
    return out


def _q8_per16_matmul(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    xq, dx, _ = quantize_rows(x)
    half = BLOCK // 2
    sums = _block_sums(xq.reshape(x.shape[0], -1, half), q.reshape(q.shape[0], -1, half))  # [rows, out, 2 blocks]
    out = torch.zeros(x.shape[0], q.shape[0])
    for g in range(sums.shape[-1] // 2):
        t = sums[..., 2 * g].float() * d[None, :, 2 * g].float()
        t = t + sums[..., 2 * g + 1].float() * d[None, :, 2 * g + 1].float()
        out = out + t * dx[:, None, g]
    return out


def half_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [rows, in] float32 times float16 weights [out, in] -> [rows, out], as `half.cpp` sums.

    Each output: 16 lanes, lane j summing x[i] w[i] over inputs i = j, 16 + j, ... first to last
    (each product and sum rounded to float32), then lane j + lane j + 8, j + 4, j + 2, j + 1.
    """
    rows, in_features = x.shape
    steps = in_features // 16
    xs = x.float().reshape(rows, 1, steps, 16)
    ws = weight.float().reshape(1, weight.shape[0], steps, 16)
    acc = torch.zeros(rows, weight.shape[0], 16)
    for j in range(steps):
        acc = acc + xs[:, :, j] * ws[:, :, j]
    for width in (8, 4, 2, 1):
        acc = acc[..., :width] + acc[..., width : 2 * width]
    return acc[..., 0]


def rotate_rows(x: torch.Tensor) -> torch.Tensor:
    """x [rows, in] float32 -> x R as `rotated.cpp` computes it: each block of 64 times S, its
    Walsh-Hadamard butterflies on index bits 5, 4, 3, 2, 1, 0 in that order ((a, b) -> (a + b,
    a - b)), then y_i = C[i, 0] z_0 + C[i, 1] z_1 + ... over the blocks, first to last."""
    rows, in_features = x.shape
    m = in_features // ROTATION_BLOCK
    z = butterflies(x.float().reshape(rows, m, ROTATION_BLOCK) * rotation_signs().float())
    return mix_blocks(rotation_dct(m).float(), z).reshape(rows, in_features)


def r8_matmul(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """x [rows, in] float32 times the r8 weights (q [out, in] -127..127 rotated, s [out]) -> [rows, out].

    The rotated row quantized as one block (d = amax / 127, q = round(y * (1 / d)), half to even),
    its exact integer sums over all inputs, then out = float(sum) * s * d."""
    y = rotate_rows(x)
    d = y.abs().amax(dim=1) / 127
    inverse = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    xq = torch.round(y * inverse[:, None])
    sums = (xq.double() @ q.double().t()).to(torch.int32)
    return (sums.float() * s[None, :].float()) * d[:, None]
