"""The kernels' arithmetic in plain PyTorch: for every op the extension exports (`REFERENCES`,
by the op's name), the same IEEE float32 operations in the same order, so that each kernel is
tested against its reference bit for bit on every path. Integer sums are exact in both; a fused
multiply-add is emulated exactly (:func:`fma`), the exponential is simd.h's polynomial
(:func:`exp8`), and a sum over vector lanes folds them in the kernel's fixed tree. The one
path-dependent order is attention's: its scores sum 8 lanes on avx2 and 16 on the AVX-512
paths (:func:`score_lanes`). Slow (Python loops where the kernels keep lanes): for tests and for
checking a new kernel path.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from specdec.kernels import packing
from specdec.kernels.packing import BLOCK, ROTATION_BLOCK, butterflies, mix_blocks, rotation_dct, rotation_signs


def _f32(value: float) -> torch.Tensor:
    # A C++ float constant: each one below is the same float32 whether rounded from its decimal
    # or from Python's double (no double rounding lands elsewhere for these).
    return torch.tensor(value, dtype=torch.float32)


def fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """a * b + c in float32 rounded once, as the FMA instructions compute it (broadcast shapes).

    The product of two float32 is exact in float64, and the sum s = p + c is rounded; its exact
    error (TwoSum) says which side the exact value lies on. Rounding s to odd (to the neighbour
    toward the error where s's last bit is even), then to float32, rounds the exact value once:
    round-to-odd at 53 bits >= 2 x 24 + 2 is innocuous (Boldo and Melquiond).
    """
    p = a.double() * b.double()
    c = c.double()
    s = p + c
    v = s - p
    error = (p - (s - v)) + (c - v)
    even = (s.view(torch.int64) & 1) == 0
    toward = torch.where(error > 0, math.inf, -math.inf).double()
    return torch.where((error != 0) & even, torch.nextafter(s, toward), s).float()


_LOG2E, _LN2_HIGH, _LN2_LOW = _f32(1.44269504089), _f32(0.693359375), _f32(-2.12194440e-4)
# exp's polynomial, highest degree first: 1/720 .. 1/6 are float32 divisions, as the C++ writes them
_EXP_TERMS = [_f32(1.0) / _f32(n) for n in (720.0, 120.0, 24.0, 6.0)] + [_f32(0.5), _f32(1.0), _f32(1.0)]


def exp8(x: torch.Tensor) -> torch.Tensor:
    """simd.h's exp8 (and exp16, the same per lane) of float32 x: x clamped to [-87, 88] (as
    max_ps and min_ps: a NaN becomes -87), x = n ln2 + r with n = round(x log2(e)) half to even
    and r = (x - n ln2_high) - n ln2_low (ln2_high's product with n is exact, so the first
    multiply-add rounds once as a subtraction), a degree-6 polynomial of r by FMAs, times 2^(n >> 1)
    and then 2^(n - (n >> 1))."""
    x = torch.where(x > -87.0, x, _f32(-87.0))
    x = torch.where(x < 88.0, x, _f32(88.0))
    n = torch.round(x * _LOG2E)
    r = fma(-n, _LN2_LOW, x - n * _LN2_HIGH)
    p = _EXP_TERMS[0]
    for term in _EXP_TERMS[1:]:
        p = fma(p, r, term)
    k = n.to(torch.int32)
    half = k >> 1
    return (p * ((half + 127) << 23).view(torch.float32)) * ((k - half + 127) << 23).view(torch.float32)


def sqrt(x: torch.Tensor) -> torch.Tensor:
    """The square root of float32 x > 0 rounded once, as sqrtss (torch.sqrt's vectorized one need
    not be): float64's root rounded to float32 is within an ulp, then moved to whichever side of
    its neighbours' midpoints x lies (a midpoint has 25 bits, its square is exact in float64)."""
    root = torch.sqrt(x.double()).float()
    below, above = torch.nextafter(root, _f32(-math.inf)), torch.nextafter(root, _f32(math.inf))
    low, high = (root.double() + below.double()) / 2, (root.double() + above.double()) / 2
    wide = x.double()
    return torch.where(wide < low * low, below, torch.where(wide > high * high, above, root))


def horizontal_sum(lanes: torch.Tensor) -> torch.Tensor:
    """lanes [..., 8] -> [...]: simd.h's fixed order, ((0 + 4) + (2 + 6)) + ((1 + 5) + (3 + 7))."""
    folded = lanes[..., :4] + lanes[..., 4:]
    pairs = folded[..., :2] + folded[..., 2:]
    return pairs[..., 0] + pairs[..., 1]


# ---------------------------------------------------------------------------------------------
# Products (quant.cpp, amx.cpp, half.cpp, rotated.cpp): the same bits on every path.

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


def f16_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [rows, in] float32 times float16 weights [out, in] -> [rows, out], as `half.cpp` sums.

    Each output: 16 lanes, lane j summing x[i] w[i] over inputs i = j, 16 + j, ... first to last
    (each product and sum rounded to float32), then lane j + lane j + 8, folded as simd.h's
    horizontal_sum. The residual, where the kernel takes one, is added last.
    """
    rows, in_features = x.shape
    steps = in_features // 16
    xs = x.float().reshape(rows, 1, steps, 16)
    ws = weight.float().reshape(1, weight.shape[0], steps, 16)
    acc = torch.zeros(rows, weight.shape[0], 16)
    for j in range(steps):
        acc = acc + xs[:, :, j] * ws[:, :, j]
    return horizontal_sum(acc[..., :8] + acc[..., 8:])

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


# ---------------------------------------------------------------------------------------------
# The small per-layer ops (layer_ops.cpp): one path (avx2), a row at a time.

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., dim] float32 -> x / sqrt(mean(x^2) + eps) * weight [dim], per row, as layer_ops.cpp.

    The sum of squares in 8 lanes (lane j: inputs j, 8 + j, ... first to last, each square
    rounded, then added), folded by :func:`horizontal_sum`, the inputs past the last 8 added one by
    one; then inverse = 1 / sqrt(sum / dim + eps) and out = (x * inverse) * weight.
    """
    dim = x.shape[-1]
    rows = x.reshape(-1, dim).float()
    full = dim // 8 * 8
    lanes = rows[:, :full].reshape(len(rows), dim // 8, 8)
    acc = torch.zeros(len(rows), 8)
    for c in range(dim // 8):
        acc = acc + lanes[:, c] * lanes[:, c]
    squares = horizontal_sum(acc)
    for i in range(full, dim):
        squares = squares + rows[:, i] * rows[:, i]
    denominator = sqrt(squares / _f32(dim) + _f32(eps))
    inverse = torch.ones_like(denominator) / denominator
    return ((rows * inverse[:, None]) * weight.float()).reshape(x.shape)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [rows, heads, new, head_dim], cos and sin [rows, 1, new, head_dim] (halves repeated):
    # x cos - x_other sin on the first half, x cos + x_other sin on the second
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def rotary_split(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rows: int, heads: int, kv_heads: int,
                 q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                 eps: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [rows * new, (heads + 2 kv_heads) * head_dim], cos and sin [rows * new, head_dim] ->
    q [rows, heads, new, head_dim], k and v [rows, kv_heads, new, head_dim]: q and k rotated (each
    head normed by :func:`rms_norm` first with q_norm and k_norm [head_dim], where given and not
    empty), v as it is."""
    tokens, width = qkv.shape
    new, head_dim = tokens // rows, width // (heads + 2 * kv_heads)
    split = qkv.float().reshape(rows, new, heads + 2 * kv_heads, head_dim).transpose(1, 2)
    q, k, v = split.split([heads, kv_heads, kv_heads], dim=1)
    if q_norm is not None and q_norm.numel():
        q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
    cos4, sin4 = cos.float().reshape(rows, 1, new, head_dim), sin.float().reshape(rows, 1, new, head_dim)
    return _rotate(q, cos4, sin4), _rotate(k, cos4, sin4), v.contiguous()


def silu_mul(h: torch.Tensor) -> torch.Tensor:
    """h [rows, 2 * inter] (gate, then up) -> silu(gate) * up [rows, inter]: gate / (1 + exp8(0 -
    gate)), times up."""
    gate, up = h.float().chunk(2, dim=-1)
    return (gate / (exp8(torch.zeros_like(gate) - gate) + 1.0)) * up


def gelu_mul(h: torch.Tensor) -> torch.Tensor:
    """h [rows, 2 * inter] (gate, then up) -> GELU(gate) * up [rows, inter], GELU's tanh
    approximation written as g / (1 + exp8(-2 sqrt(2 / pi) (g + 0.044715 g^3))), g^3 as (g g) g."""
    gate, up = h.float().chunk(2, dim=-1)
    inner = gate + _f32(0.044715) * ((gate * gate) * gate)
    return (gate / (exp8(_f32(-1.5957691216057308) * inner) + 1.0)) * up


def embed_rows(packed: torch.Tensor, ids: torch.Tensor, q8: bool) -> torch.Tensor:
    """Rows ids [n] of a packed q8 or q4 matrix, dequantized -> [n, in] float32: d q (q8: a scale per
    32 inputs, or per 16 in Q6_K's records) or d q + m (q4), each operation rounded, as GGUF's own
    dequantization."""
    if q8:
        q, d = packing.q8_rows(packed, ids)
        return d.repeat_interleave(q.shape[1] // d.shape[1], dim=1) * q.float()
    q, d, m = packing.q4_rows(packed, ids)
    return d.repeat_interleave(BLOCK, dim=1) * q.float() + m.repeat_interleave(BLOCK, dim=1)


# ---------------------------------------------------------------------------------------------
# Reductions over the vocabulary (distribution.cpp).

def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x [rows, n] float32 -> [rows] int64: each row's first maximum, a NaN's where the row has one
    (torch.argmax's definition, which the kernel keeps)."""
    return x.argmax(-1)


def draft_distribution(logits: torch.Tensor, draft_ids: torch.Tensor,
                       k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [positions, vocab] float32, draft_ids [draft] -> (top [positions], index [positions,
    k], values [positions, k]) as distribution.cpp: top the first maximum; index the k best draft
    positions by logit, ties to the earlier position; values exp(logit - normalizer) in float64,
    rounded to float32, with normalizer = max + log(sum), the sum of exp8(x - max) over the
    vocabulary's blocks of 8 in 8 float32 lanes, folded, widened, then the last few added as the C
    library's exp in float64 (Python's math module calls the same library)."""
    x = logits.float()
    positions, vocab = x.shape
    top, highest = x.argmax(-1), x.max(-1).values
    blocks = vocab // 8
    total = torch.zeros(positions, 8)
    for b in range(blocks):
        total = total + exp8(x[:, 8 * b : 8 * b + 8] - highest[:, None])
    sums = horizontal_sum(total)
    picked = x[:, draft_ids]
    index = picked.sort(dim=-1, descending=True, stable=True).indices[:, :k]
    values = torch.empty(positions, k)
    for r in range(positions):
        m, total_r = float(highest[r]), float(sums[r])
        for i in range(8 * blocks, vocab):
            total_r += math.exp(float(x[r, i]) - m)
        normalizer = m + math.log(total_r)
        for j in range(k):
            values[r, j] = math.exp(float(picked[r, index[r, j]]) - normalizer)
    return top, index, values


# ---------------------------------------------------------------------------------------------
# Attention over the KV cache (attention.cpp).

def score_lanes(isa: str, head_dim: int) -> int:
    """The lanes of attention's dot products on path `isa`: 16 where AVX-512 vectors run them
    (avx512_vnni, and amx under it, for head_dim 64 and 128), else 8."""
    return 16 if isa in ("avx512_vnni", "amx") and head_dim in (64, 128) else 8


def _lane_tree(lanes: torch.Tensor) -> torch.Tensor:
    # a dot product's lanes [..., 8 or 16] -> [...], in the path's fixed tree: 8 lanes (AVX2's
    # hadds) ((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7)); 16 lanes, per block b of 4,
    # s_b = (4b + (4b + 2)) + ((4b + 1) + (4b + 3)), then (s0 + s1) + (s2 + s3)
    if lanes.shape[-1] == 8:
        pairs = lanes[..., 0::2] + lanes[..., 1::2]
        return (pairs[..., 0] + pairs[..., 1]) + (pairs[..., 2] + pairs[..., 3])
    blocks = lanes.reshape(*lanes.shape[:-1], 4, 4)
    s = (blocks[..., 0] + blocks[..., 2]) + (blocks[..., 1] + blocks[..., 3])
    return (s[..., 0] + s[..., 1]) + (s[..., 2] + s[..., 3])


def _attend_query(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: torch.Tensor, lanes: int) -> torch.Tensor:
    # q [heads, head_dim], k and v [heads, n, head_dim] float32 -> [heads, head_dim]
    heads, n, head_dim = k.shape
    chunks = head_dim // lanes
    # 1. scores: lane l of a key's dot product FMAs q[c lanes + l] k[c lanes + l] over the chunks
    #    c in order, from 0; the lanes in the path's tree; times the scale
    qc, kc = q.reshape(heads, 1, chunks, lanes), k.reshape(heads, n, chunks, lanes)
    acc = torch.zeros(heads, n, lanes)
    for c in range(chunks):
        acc = fma(qc[:, :, c], kc[:, :, c], acc)
    scores = _lane_tree(acc) * scale
    # 2. weights exp8(score - highest), unnormalized; their sum in 8 lanes (lane j: weights j,
    #    8 + j, ... in order), folded
    weights = exp8(scores - scores.max(-1, keepdim=True).values)
    padded = torch.cat([weights, torch.zeros(heads, -n % 8)], dim=-1).reshape(heads, -1, 8)
    total = torch.zeros(heads, 8)
    for b in range(padded.shape[1]):
        total = total + padded[:, b]
    sums = horizontal_sum(total)
    inverse = torch.ones_like(sums) / sums
    # 3. each output element FMAs weight times value over the slots in order, from 0; times 1 / sum
    out = torch.zeros(heads, head_dim)
    for j in range(n):
        out = fma(weights[:, j : j + 1], v[:, j], out)
    return out * inverse[:, None]


def attend_cached(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, counts: torch.Tensor,
                  slots: torch.Tensor | None = None, scale: float | None = None, isa: str = "avx2") -> torch.Tensor:
    """Attention of each query over the cache slots it sees -> [rows, new, heads * head_dim] float32,
    as attention.cpp computes it on path `isa` (arguments as `specdec.kernels.attend_cached`'s):
    per (row, query, head), float32 scores q.k * scale (:func:`score_lanes`' lanes, each an FMA
    chain, then the lanes' tree), a softmax by :func:`exp8` against the highest score, and the
    weighted sum of the values by FMAs in slot order, normalized last. A query that sees nothing
    gets zeros. Keys and values in float16 widen exactly first.
    """
    rows, heads, new, head_dim = q.shape
    group = heads // keys.shape[1]
    lanes = score_lanes(isa, head_dim)
    factor = _f32(head_dim ** -0.5 if scale is None else scale)
    listed = slots is not None and slots.numel() > 0
    out = torch.zeros(rows, new, heads, head_dim)
    for r in range(rows):
        for i in range(new):
            n = int(counts[r, i])
            if n == 0:
                continue
            seen = slots[r, i, :n].long() if listed else torch.arange(n)
            k = keys[r][:, seen].float().repeat_interleave(group, dim=0)  # [heads, n, head_dim]
            v = values[r][:, seen].float().repeat_interleave(group, dim=0)
            out[r, i] = _attend_query(q[r, :, i].float(), k, v, factor, lanes)
    return out.reshape(rows, new, heads * head_dim)


# ---------------------------------------------------------------------------------------------
# Decoder layers in one call (forward.cpp): the ops above, composed as the kernel composes them.

PART_KINDS = ("q4", "q8", "f16", "r8")  # forward.cpp's PartKind, by code


def _part_product(x: torch.Tensor, part: torch.Tensor, kind: int, out_features: int) -> torch.Tensor:
    fmt = PART_KINDS[kind]
    if fmt == "q4":
        return q4_matmul(x, *packing.unpack_q4(part, out_features))
    if fmt == "q8":
        return q8_matmul(x, *packing.unpack_q8(part, out_features))
    if fmt == "r8":
        return r8_matmul(x, *packing.unpack_r8(part, out_features))
    return f16_matmul(x, part)


def _product(x: torch.Tensor, matrix: list[tuple[torch.Tensor, int, int]],
             residual: torch.Tensor | None = None) -> torch.Tensor:
    # x times a matrix's parts (each (packed, kind, outputs)) side by side, plus the residual last
    h = torch.cat([_part_product(x, *part) for part in matrix], dim=1)
    return h if residual is None else residual + h


def _matrices(parts: Sequence[int]) -> Callable[[Sequence[torch.Tensor]], list[tuple[torch.Tensor, int, int]]]:
    # the matrices of a call in order, each taking its parts' (kind, outputs) off the flat list
    spec = iter(parts)
    return lambda tensors: [(t, next(spec), next(spec)) for t in tensors]


def _write_cache(states: torch.Tensor, buffer: torch.Tensor, write_rows: torch.Tensor, write_slots: torch.Tensor) -> None:
    # states [rows, kv_heads, new, head_dim] -> buffer [R, kv_heads, S, head_dim] at (row, slot)
    # per token, in the buffer's format (float16: rounded to nearest even)
    rows, kv_heads, new, head_dim = states.shape
    tokens = states.transpose(1, 2).reshape(rows * new, kv_heads, head_dim)
    buffer[write_rows.long(), :, write_slots.long()] = tokens.to(buffer.dtype)


def forward_layers(x: torch.Tensor, weights: Sequence, keys: list[torch.Tensor], values: list[torch.Tensor],
                   write_rows: torch.Tensor, write_slots: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   counts: torch.Tensor, slots: torch.Tensor, rows: int, heads: int, kv_heads: int, eps: float,
                   scale: float, isa: str, keep: Sequence[int], gelu: bool) -> list[torch.Tensor]:
    """x [rows * new, hidden] through the layers, as forward.cpp's forward_layers (its arguments;
    `weights` the lists its LayerWeights is made of, in that order; `isa` a path's name): per
    layer, x + o(attention(rotary(qkv(norm(x)) + bias))), then x + down(act(gate_up(norm(x)))),
    each sublayer's output normed first where a post-norm is given, the keys and values written
    into the cache buffers first. Returns [x after the last layer, x after each kept layer]."""
    (attn_norm, qkv, qkv_bias, q_norm, k_norm, o, mlp_norm, gate_up, down,
     post_attn_norm, post_mlp_norm, parts) = weights
    matrix = _matrices(parts)
    tokens, kept = x.shape[0], []
    for i in range(len(attn_norm)):
        qkv_m, o_m, gate_up_m, down_m = matrix(qkv[i]), matrix(o[i]), matrix(gate_up[i]), matrix(down[i])
        h = _product(rms_norm(x, attn_norm[i], eps), qkv_m)
        if qkv_bias[i].numel():
            h = h + qkv_bias[i]
        q, k, v = rotary_split(h, cos, sin, rows, heads, kv_heads, q_norm[i], k_norm[i], eps)
        _write_cache(k, keys[i], write_rows, write_slots)
        _write_cache(v, values[i], write_rows, write_slots)
        attended = attend_cached(q, keys[i][:rows], values[i][:rows], counts, slots, scale, isa).view(tokens, -1)
        if post_attn_norm[i].numel():
            x = x + rms_norm(_product(attended, o_m), post_attn_norm[i], eps)
        else:
            x = _product(attended, o_m, x)
        g = _product(rms_norm(x, mlp_norm[i], eps), gate_up_m)
        act = gelu_mul(g) if gelu else silu_mul(g)
        if post_mlp_norm[i].numel():
            x = x + rms_norm(_product(act, down_m), post_mlp_norm[i], eps)
        else:
            x = _product(act, down_m, x)
        if i in keep:
            kept.append(x)
    return [x, *kept]


def head_layer(embedded: torch.Tensor, features: torch.Tensor, input_norm: torch.Tensor, hidden_norm: torch.Tensor,
               mlp_norm: torch.Tensor, qkv: Sequence[torch.Tensor], o: Sequence[torch.Tensor],
               gate_up: Sequence[torch.Tensor], down: Sequence[torch.Tensor], parts: Sequence[int],
               keys: torch.Tensor, values: torch.Tensor, write_slots: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, counts: torch.Tensor, slots: torch.Tensor, heads: int, kv_heads: int, eps: float,
               scale: float, isa: str) -> torch.Tensor:
    """A draft head's decoder layer (EAGLE-3's) over n positions of one sequence, as forward.cpp's
    head_layer (its arguments; `isa` a path's name): attention over [norm(embedded), norm(features)]
    ([n, 2 hidden]) into the residual stream `features` ([n, hidden]), then the SiLU MLP."""
    matrix = _matrices(parts)
    qkv_m, o_m, gate_up_m, down_m = matrix(qkv), matrix(o), matrix(gate_up), matrix(down)
    n, x = features.shape[0], features.float()
    attention_input = torch.cat([rms_norm(embedded, input_norm, eps), rms_norm(x, hidden_norm, eps)], dim=1)
    q, k, v = rotary_split(_product(attention_input, qkv_m), cos, sin, 1, heads, kv_heads)
    row = torch.zeros(n, dtype=torch.long)
    _write_cache(k, keys, row, write_slots)
    _write_cache(v, values, row, write_slots)
    x = _product(attend_cached(q, keys, values, counts, slots, scale, isa).view(n, -1), o_m, x)
    return _product(silu_mul(_product(rms_norm(x, mlp_norm, eps), gate_up_m)), down_m, x)


# Every op the extension exports (bindings.cpp), by name, and its reference: tests/kernels holds
# each kernel to it, and holds this table to the extension's exports.
REFERENCES: dict[str, Callable[..., object]] = {
    "q4_matmul": q4_matmul, "q8_matmul": q8_matmul, "r8_matmul": r8_matmul, "rotate_rows": rotate_rows,
    "f16_matmul": f16_matmul, "attend_cached": attend_cached, "rms_norm": rms_norm, "rotary_split": rotary_split,
    "silu_mul": silu_mul, "gelu_mul": gelu_mul, "embed_rows": embed_rows, "argmax_rows": argmax_rows,
    "draft_distribution": draft_distribution, "forward_layers": forward_layers, "head_layer": head_layer,
}
# The extension's other exports, which compute nothing to compare, and what they are.
NOT_OPS: dict[str, str] = {
    "LayerWeights": "forward_layers' weights gathered once (its reference takes the same lists)",
    "isa_names": "the kernel paths' names by code (specdec.kernels.ISAS)",
    "instruction_sets": "the paths this CPU runs",
    "missing_reason": "why this CPU lacks a path",
    "hold_threads": "the pool's thread count for a calling thread",
    "kernel_threads": "the pool's thread count now",
}
