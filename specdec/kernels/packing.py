"""Weight layouts of the kernels in `quant.cpp`: GGUF blocks regrouped by 16 output columns.

A record holds one unit (16 output columns) times one block (32 inputs), so the kernel reads a
unit's weights front to back and applies each vector to every activation row:

- q4 (Q4_0/Q4_1 values q in 0..15, w = d q + m): 4 x 64 bytes of nibbles, byte `64 p + 4 c + i`
  holding input `4 p + i` in its low nibble and input `16 + 4 p + i` in its high one, for column
  c; then the 16 columns' d and m as float16 (320 bytes);
- q8 (Q8_0 values q in -128..127, w = d q): 8 x 64 bytes, byte `64 j + 4 c + i` holding input
  `4 j + i` of column c; then 16 float16 d (544 bytes).

Columns past the matrix (out_features not a multiple of 16) are zeros and never stored.
"""

from __future__ import annotations

import torch

BLOCK = 32  # inputs per block: GGUF's Q4_0, Q4_1 and Q8_0 blocks
UNIT = 16  # output columns per record
Q4_RECORD = 320
Q8_RECORD = 544


def _pad_columns(t: torch.Tensor) -> torch.Tensor:
    pad = -t.shape[0] % UNIT
    return torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) if pad else t


def _halves(t: torch.Tensor) -> torch.Tensor:
    # float16 [out, blocks] -> the records' bytes [units, blocks, 32]
    units = t.shape[0] // UNIT
    return t.reshape(units, UNIT, -1).transpose(1, 2).contiguous().view(torch.uint8).reshape(units, -1, 2 * UNIT)


def _unhalves(b: torch.Tensor, out_features: int) -> torch.Tensor:
    # the records' bytes [units, blocks, 32] -> float32 [out, blocks]
    units, blocks, _ = b.shape
    return b.contiguous().view(torch.float16).reshape(units, blocks, UNIT).transpose(1, 2).reshape(-1, blocks)[
        :out_features].float()


def pack_q4(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """q [out, in] integers 0..15, d and m [out, in / 32] (float16 values) -> [units, blocks, 320] uint8."""
    out_features, in_features = q.shape
    if in_features % BLOCK:
        raise ValueError(f"q4 needs in_features divisible by {BLOCK}, got {in_features}")
    if not (torch.equal(d.half().float(), d.float()) and torch.equal(m.half().float(), m.float())):
        raise ValueError("q4 scales and mins must be float16 values (round them before quantizing)")
    q, d, m = _pad_columns(q.to(torch.uint8)), _pad_columns(d.half()), _pad_columns(m.half())
    units, blocks = q.shape[0] // UNIT, in_features // BLOCK
    # [units, column, block, half (low/high nibble), p, i] -> [units, block, p, column, i, half]
    nib = q.reshape(units, UNIT, blocks, 2, 4, 4).permute(0, 2, 4, 1, 5, 3)
    bytes_ = (nib[..., 0] | (nib[..., 1] << 4)).reshape(units, blocks, 256)
    return torch.cat([bytes_, _halves(d), _halves(m)], dim=-1).contiguous()


def unpack_q4(packed: torch.Tensor, out_features: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of :func:`pack_q4`: q [out, in] int32, d and m [out, blocks] float32."""
    units, blocks, _ = packed.shape
    bytes_ = packed[..., :256].reshape(units, blocks, 4, UNIT, 4)
    nib = torch.stack([bytes_ & 0x0F, bytes_ >> 4], dim=-1)  # [units, block, p, column, i, half]
    q = nib.permute(0, 3, 1, 5, 2, 4).reshape(units * UNIT, blocks * BLOCK)[:out_features].to(torch.int32)
    return q, _unhalves(packed[..., 256:288], out_features), _unhalves(packed[..., 288:320], out_features)


def pack_q8(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """q [out, in] integers -128..127, d [out, in / 32] (float16 values) -> [units, blocks, 544] uint8."""
    out_features, in_features = q.shape
    if in_features % BLOCK:
        raise ValueError(f"q8 needs in_features divisible by {BLOCK}, got {in_features}")
    if not torch.equal(d.half().float(), d.float()):
        raise ValueError("q8 scales must be float16 values (round them before quantizing)")
    q, d = _pad_columns(q.to(torch.int8)), _pad_columns(d.half())
    units, blocks = q.shape[0] // UNIT, in_features // BLOCK
    # [units, column, block, j, i] -> [units, block, j, column, i]
    bytes_ = q.reshape(units, UNIT, blocks, 8, 4).permute(0, 2, 3, 1, 4).reshape(units, blocks, 512)
    return torch.cat([bytes_.view(torch.uint8), _halves(d)], dim=-1).contiguous()


def unpack_q8(packed: torch.Tensor, out_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`pack_q8`: q [out, in] int32, d [out, blocks] float32."""
    units, blocks, _ = packed.shape
    bytes_ = packed[..., :512].contiguous().view(torch.int8).reshape(units, blocks, 8, UNIT, 4)
    q = bytes_.permute(0, 3, 1, 2, 4).reshape(units * UNIT, blocks * BLOCK)[:out_features].to(torch.int32)
    return q, _unhalves(packed[..., 512:544], out_features)


def q4_rows(packed: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows [n] of a :func:`pack_q4` matrix, unpacked: q [n, in] int32, d and m [n, blocks]
    float32 (an embedding's lookup: a few rows of the table it may share with the LM head)."""
    units, blocks, _ = packed.shape
    unit, column = rows // UNIT, rows % UNIT
    bytes_ = packed[..., :256].reshape(units, blocks, 4, UNIT, 4)[unit, :, :, column]  # [n, block, p, i]
    q = torch.stack([bytes_ & 0x0F, bytes_ >> 4], dim=2).reshape(len(rows), blocks * BLOCK).to(torch.int32)
    halves = packed[..., 256:].view(torch.float16).reshape(units, blocks, 2, UNIT)  # d, then m
    return q, halves[unit, :, 0, column].float(), halves[unit, :, 1, column].float()


def q8_rows(packed: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [n] of a :func:`pack_q8` matrix, unpacked: q [n, in] int32, d [n, blocks] float32."""
    units, blocks, _ = packed.shape
    unit, column = rows // UNIT, rows % UNIT
    bytes_ = packed[..., :512].view(torch.int8).reshape(units, blocks, 8, UNIT, 4)[unit, :, :, column]  # [n, block, j, i]
    d = packed[..., 512:].view(torch.float16).reshape(units, blocks, UNIT)[unit, :, column]
    return bytes_.reshape(len(rows), blocks * BLOCK).to(torch.int32), d.float()


def quantize_q4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A float matrix [out, in] as Q4_1 blocks (min to max, d and m rounded to float16 first)."""
    out_features, in_features = weight.shape
    groups = weight.float().reshape(out_features, in_features // BLOCK, BLOCK)
    low, high = groups.amin(dim=2), groups.amax(dim=2)
    m = low.half().float()
    d = ((high - m) / 15).half().float()
    safe = torch.where(d > 0, d, torch.ones_like(d))
    q = torch.round((groups - m[..., None]) / safe[..., None]).clamp(0, 15).to(torch.int32)
    return q.reshape(out_features, in_features), d, m


def quantize_q8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float matrix [out, in] as Q8_0 blocks (d = amax / 127, rounded to float16 first)."""
    out_features, in_features = weight.shape
    groups = weight.float().reshape(out_features, in_features // BLOCK, BLOCK)
    d = (groups.abs().amax(dim=2) / 127).half().float()
    safe = torch.where(d > 0, d, torch.ones_like(d))
    q = torch.round(groups / safe[..., None]).clamp(-128, 127).to(torch.int32)
    return q.reshape(out_features, in_features), d
