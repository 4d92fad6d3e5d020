"""Weight layouts of the kernels in `quant.cpp`: GGUF blocks regrouped by 16 output columns.

A record holds one unit (16 output columns) times one block (32 inputs), so the kernel reads a
unit's weights front to back and applies each vector to every activation row:

- q4 (Q4_0/Q4_1 values q in 0..15, w = d q + m): 4 x 64 bytes of nibbles, byte `64 p + 4 c + i`
  holding input `4 p + i` in its low nibble and input `16 + 4 p + i` in its high one, for column
  c; then the 16 columns' d and m as float16 (320 bytes), or as float32 (384 bytes) where float16
  cannot hold them exactly (Q4_K: d = d_super * scale and m = -dmin * min, 17-bit products),
  or, for values up to 31 (Q5_K), a byte a value laid out as q8's, then float32 d and m (640 bytes);
- q8 (Q8_0 values q in -128..127, w = d q): 8 x 64 bytes, byte `64 j + 4 c + i` holding input
  `4 j + i` of column c; then 16 float16 d (544 bytes), or, with a scale per 16 inputs (Q6_K:
  d = d_super * scale, exact in float32 only), 16 float32 d of inputs 0..15 and 16 of inputs
  16..31 (640 bytes).

Columns past the matrix (out_features not a multiple of 16) are zeros and never stored.
"""

from __future__ import annotations

import math

import torch

BLOCK = 32  # inputs per block: GGUF's Q4_0, Q4_1 and Q8_0 blocks
UNIT = 16  # output columns per record
Q4_RECORD = 320
Q4F_RECORD = 384  # q4 with float32 scales
Q5_RECORD = 640  # q4's form with a byte a value (Q5_K's 0..31), float32 scales
Q8_RECORD = 544
Q6_RECORD = 640  # q8 with a float32 scale per 16 inputs


def _pad_columns(t: torch.Tensor) -> torch.Tensor:
    pad = -t.shape[0] % UNIT
    return torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) if pad else t


def _halves(t: torch.Tensor) -> torch.Tensor:
    # float16 or float32 [out, blocks] -> the records' bytes [units, blocks, 32 or 64]
    units, blocks = t.shape[0] // UNIT, t.shape[1]
    return t.reshape(units, UNIT, -1).transpose(1, 2).contiguous().view(torch.uint8).reshape(units, blocks, -1)


def _unhalves(b: torch.Tensor, out_features: int) -> torch.Tensor:
    # the records' bytes [units, blocks, 32 (float16) or 64 (float32)] -> float32 [out, blocks]
    units, blocks, width = b.shape
    dtype = torch.float16 if width == 2 * UNIT else torch.float32
    return b.contiguous().view(dtype).reshape(units, blocks, UNIT).transpose(1, 2).reshape(-1, blocks)[
        :out_features].float()


def _is_half(t: torch.Tensor) -> bool:
    return bool(torch.equal(t.half().float(), t.float()))


def pack_q4(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """q [out, in] integers 0..15, d and m [out, in / 32] float32 -> [units, blocks, 320] uint8 with
    float16 scales where float16 holds every d and m exactly, else [units, blocks, 384] with float32 ones."""
    out_features, in_features = q.shape
    if in_features % BLOCK:
        raise ValueError(f"q4 needs in_features divisible by {BLOCK}, got {in_features}")
    if int(q.max()) > 15:  # 5-bit values: bytes, as q8's layout
        q, d, m = _pad_columns(q.to(torch.uint8)), _pad_columns(d.float()), _pad_columns(m.float())
        units, blocks = q.shape[0] // UNIT, in_features // BLOCK
        bytes_ = q.reshape(units, UNIT, blocks, 8, 4).permute(0, 2, 3, 1, 4).reshape(units, blocks, 512)
        return torch.cat([bytes_, _halves(d), _halves(m)], dim=-1).contiguous()
    scale_type = torch.float16 if _is_half(d) and _is_half(m) else torch.float32
    q, d, m = _pad_columns(q.to(torch.uint8)), _pad_columns(d.to(scale_type)), _pad_columns(m.to(scale_type))
    units, blocks = q.shape[0] // UNIT, in_features // BLOCK
    # [units, column, block, half (low/high nibble), p, i] -> [units, block, p, column, i, half]
    nib = q.reshape(units, UNIT, blocks, 2, 4, 4).permute(0, 2, 4, 1, 5, 3)
    bytes_ = (nib[..., 0] | (nib[..., 1] << 4)).reshape(units, blocks, 256)
    return torch.cat([bytes_, _halves(d), _halves(m)], dim=-1).contiguous()


def unpack_q4(packed: torch.Tensor, out_features: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of :func:`pack_q4`: q [out, in] int32, d and m [out, blocks] float32."""
    units, blocks, record = packed.shape
    if record == Q5_RECORD:
        q = packed[..., :512].reshape(units, blocks, 8, UNIT, 4).permute(0, 3, 1, 2, 4)
        q = q.reshape(units * UNIT, blocks * BLOCK)[:out_features].to(torch.int32)
        return q, _unhalves(packed[..., 512:576], out_features), _unhalves(packed[..., 576:], out_features)
    bytes_ = packed[..., :256].reshape(units, blocks, 4, UNIT, 4)
    nib = torch.stack([bytes_ & 0x0F, bytes_ >> 4], dim=-1)  # [units, block, p, column, i, half]
    q = nib.permute(0, 3, 1, 5, 2, 4).reshape(units * UNIT, blocks * BLOCK)[:out_features].to(torch.int32)
    width = (packed.shape[-1] - 256) // 2  # each of d and m: 32 bytes (float16) or 64 (float32)
    return (q, _unhalves(packed[..., 256 : 256 + width], out_features),
            _unhalves(packed[..., 256 + width :], out_features))


def pack_q8(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """q [out, in] integers -128..127, d [out, in / 32] (float16 values) -> [units, blocks, 544] uint8,
    or d [out, in / 16] (a scale per 16 inputs, float32) -> [units, blocks, 640]; scales per 32 that
    float16 cannot hold (IQ4_XS's) go in the latter, each twice."""
    out_features, in_features = q.shape
    if in_features % BLOCK:
        raise ValueError(f"q8 needs in_features divisible by {BLOCK}, got {in_features}")
    per16 = d.shape[1] == 2 * (in_features // BLOCK)
    if not per16 and not _is_half(d):
        d, per16 = d.float().repeat_interleave(2, dim=1), True
    q = _pad_columns(q.to(torch.int8))
    units, blocks = q.shape[0] // UNIT, in_features // BLOCK
    # [units, column, block, j, i] -> [units, block, j, column, i]
    bytes_ = q.reshape(units, UNIT, blocks, 8, 4).permute(0, 2, 3, 1, 4).reshape(units, blocks, 512)
    if per16:  # each block's scales of inputs 0..15, then of 16..31
        d = _pad_columns(d.float())
        scales = [_halves(d[:, 0::2].contiguous()), _halves(d[:, 1::2].contiguous())]
    else:
        scales = [_halves(_pad_columns(d.half()))]
    return torch.cat([bytes_.view(torch.uint8), *scales], dim=-1).contiguous()


def unpack_q8(packed: torch.Tensor, out_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`pack_q8`: q [out, in] int32, d [out, blocks] (or [out, 2 blocks], a
    scale per 16 inputs) float32."""
    units, blocks, record = packed.shape
    bytes_ = packed[..., :512].contiguous().view(torch.int8).reshape(units, blocks, 8, UNIT, 4)
    q = bytes_.permute(0, 3, 1, 2, 4).reshape(units * UNIT, blocks * BLOCK)[:out_features].to(torch.int32)
    if record == Q6_RECORD:
        low, high = _unhalves(packed[..., 512:576], out_features), _unhalves(packed[..., 576:640], out_features)
        return q, torch.stack([low, high], dim=-1).reshape(out_features, 2 * blocks)
    return q, _unhalves(packed[..., 512:544], out_features)


def q4_rows(packed: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows [n] of a :func:`pack_q4` matrix, unpacked: q [n, in] int32, d and m [n, blocks]
    float32 (an embedding's lookup: a few rows of the table it may share with the LM head)."""
    units, blocks, record = packed.shape
    unit, column = rows // UNIT, rows % UNIT
    if record == Q5_RECORD:
        q = packed[..., :512].reshape(units, blocks, 8, UNIT, 4)[unit, :, :, column]  # [n, block, j, i]
        scales = packed[..., 512:].view(torch.float32).reshape(units, blocks, 2, UNIT)  # d, then m
        return (q.reshape(len(rows), blocks * BLOCK).to(torch.int32), scales[unit, :, 0, column],
                scales[unit, :, 1, column])
    bytes_ = packed[..., :256].reshape(units, blocks, 4, UNIT, 4)[unit, :, :, column]  # [n, block, p, i]
    q = torch.stack([bytes_ & 0x0F, bytes_ >> 4], dim=2).reshape(len(rows), blocks * BLOCK).to(torch.int32)
    dtype = torch.float16 if packed.shape[-1] == Q4_RECORD else torch.float32
    halves = packed[..., 256:].view(dtype).reshape(units, blocks, 2, UNIT)  # d, then m
    return q, halves[unit, :, 0, column].float(), halves[unit, :, 1, column].float()


def q8_rows(packed: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [n] of a :func:`pack_q8` matrix, unpacked: q [n, in] int32, d [n, blocks] (or
    [n, 2 blocks], a scale per 16 inputs) float32."""
    units, blocks, record = packed.shape
    unit, column = rows // UNIT, rows % UNIT
    bytes_ = packed[..., :512].view(torch.int8).reshape(units, blocks, 8, UNIT, 4)[unit, :, :, column]  # [n, block, j, i]
    q = bytes_.reshape(len(rows), blocks * BLOCK).to(torch.int32)
    if record == Q6_RECORD:
        halves = packed[..., 512:].view(torch.float32).reshape(units, blocks, 2, UNIT)  # low, then high
        return q, halves[unit, :, :, column].reshape(len(rows), 2 * blocks)
    d = packed[..., 512:].view(torch.float16).reshape(units, blocks, UNIT)[unit, :, column]
    return q, d.float()


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


# --- r8: rotated int8 (rotated.cpp) ----------------------------------------------------------

ROTATION_BLOCK = 64  # inputs a Walsh-Hadamard block spans (and an AMX tile product): r8's inputs come 64 at a time
R8_SCALES = 64  # bytes of a unit's 16 float32 column scales


def rotation_signs() -> torch.Tensor:
    """S's diagonal [64] float64: rotated.cpp's fixed pattern (bit 7 of i times Knuth's hash)."""
    return torch.tensor([1.0 if (i * 2654435761 >> 7) & 1 else -1.0 for i in range(ROTATION_BLOCK)],
                        dtype=torch.float64)


def rotation_dct(m: int) -> torch.Tensor:
    """C [m, m]: the orthonormal DCT-II, computed in double as rotated.cpp computes it and rounded
    once to float32 (returned as float64 holding those float32 values)."""
    c = torch.empty(m, m, dtype=torch.float64)
    for i in range(m):
        for j in range(m):
            v = math.cos(math.pi / m * (j + 0.5) * i) * math.sqrt(2.0 / m)
            c[i, j] = v / math.sqrt(2.0) if i == 0 else v
    return c.float().double()


def _hadamard(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return h


def butterflies(w: torch.Tensor) -> torch.Tensor:
    """w [..., 64] times H (unnormalized Walsh-Hadamard) in w's dtype: the butterflies on index bits
    5, 4, 3, 2, 1, 0 in that order, (a, b) -> (a + b, a - b), as rotated.cpp takes them.
    Elementwise, so the same bits on every machine and in every process (a BLAS product's can
    differ with its threads and alignment, and a weight rounded otherwise would change the model)."""
    w = w.clone()
    for bit in (5, 4, 3, 2, 1, 0):
        t = 1 << bit
        view = w.reshape(*w.shape[:-1], ROTATION_BLOCK // (2 * t), 2, t)
        low, high = view[..., 0, :].clone(), view[..., 1, :].clone()
        view[..., 0, :] = low + high
        view[..., 1, :] = low - high
    return w


def mix_blocks(c: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """w [rows, m, 64] -> out[:, i] = c[i, 0] w[:, 0] + c[i, 1] w[:, 1] + ..., elementwise in that
    order (rotated.cpp's block mix, in w's dtype)."""
    out = torch.empty_like(w)
    for i in range(c.shape[0]):
        acc = c[i, 0] * w[:, 0]
        for j in range(1, c.shape[1]):
            acc = acc + c[i, j] * w[:, j]
        out[:, i] = acc
    return out


def rotate_weights(weight: torch.Tensor) -> torch.Tensor:
    """W [out, in] -> W R^-T in float64, so that (x R) (W R^-T)^T = x W^T for the kernel's x R.

    R = kron(C^T, S H) acts on x as [m, 64]: X -> C X S H. Its inverse transpose acts on W's rows
    as W -> C^-T W (S H)^-T, with (S H)^-T = S H / 64 (H H = 64 I, H symmetric, S S = I) and C^-T
    = C for the orthonormal DCT (its float32 rounding leaves C^T C within 1e-7 of I, far below
    the int8 rounding that follows). Elementwise, in a fixed order: deterministic."""
    out_features, in_features = weight.shape
    if in_features % ROTATION_BLOCK:
        raise ValueError(f"r8 needs in_features divisible by {ROTATION_BLOCK}, got {in_features}")
    m = in_features // ROTATION_BLOCK
    w = weight.double().reshape(out_features, m, ROTATION_BLOCK) * rotation_signs()
    w = butterflies(w) / ROTATION_BLOCK
    return mix_blocks(rotation_dct(m), w).reshape(out_features, in_features)


R8_ROWS_AT_ONCE = 4096  # output columns rotated together: a 262k-row LM head in float64 would take GBs


def quantize_r8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float matrix [out, in] -> q [out, in] int8 in -127..127 and s [out] float32: the rotated
    weights, one scale per output column (s = amax / 127, q = round(w / s)), a few thousand
    columns at a time (each column's values do not depend on the others)."""
    q = torch.empty(weight.shape, dtype=torch.int8)
    s = torch.empty(weight.shape[0], dtype=torch.float32)
    for start in range(0, weight.shape[0], R8_ROWS_AT_ONCE):
        rotated = rotate_weights(weight[start : start + R8_ROWS_AT_ONCE])
        scale = (rotated.abs().amax(dim=1) / 127).float()
        safe = torch.where(scale > 0, scale.double(), torch.ones_like(scale, dtype=torch.float64))
        q[start : start + len(rotated)] = torch.round(rotated / safe[:, None]).clamp(-127, 127).to(torch.int8)
        s[start : start + len(rotated)] = scale
    return q, s


def pack_r8(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """q [out, in] integers -127..127, s [out] float32 -> [units, in * 16 + 64] uint8: per unit of 16
    columns, in / 4 lines of 64 bytes (line j: inputs 4 j .. 4 j + 3 of column c at bytes 4 c ..),
    then the 16 columns' scales."""
    out_features, in_features = q.shape
    q = _pad_columns(q.to(torch.int8))
    units = q.shape[0] // UNIT
    # [units, column, line, i] -> [units, line, column, i]
    lines = q.reshape(units, UNIT, in_features // 4, 4).permute(0, 2, 1, 3).reshape(units, -1).view(torch.uint8)
    scales = _pad_columns(s.float()[:, None]).reshape(units, UNIT).contiguous().view(torch.uint8)
    return torch.cat([lines, scales], dim=1).contiguous()


def unpack_r8(packed: torch.Tensor, out_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`pack_r8`: q [out, in] int32, s [out] float32."""
    units, width = packed.shape
    in_features = (width - R8_SCALES) // UNIT
    q = packed[:, : in_features * UNIT].contiguous().view(torch.int8).reshape(units, in_features // 4, UNIT, 4)
    q = q.permute(0, 2, 1, 3).reshape(units * UNIT, in_features)[:out_features].to(torch.int32)
    s = packed[:, in_features * UNIT :].contiguous().view(torch.float32).reshape(-1)[:out_features]
    return q, s


def unrotate_weights(rotated: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`rotate_weights`: W R^-T [out, in] -> W (C^T W' (S H)^T), in float64."""
    out_features, in_features = rotated.shape
    m = in_features // ROTATION_BLOCK
    w = mix_blocks(rotation_dct(m).t(), rotated.double().reshape(out_features, m, ROTATION_BLOCK))
    return (butterflies(w) * rotation_signs()).reshape(out_features, in_features)
