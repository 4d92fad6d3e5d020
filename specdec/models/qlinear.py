"""Weight formats for the native backend's matrix products: float32, bfloat16, int8 and int4.

Decoding multiplies every weight matrix by a handful of rows, so a step costs about the bytes
of its weights; packed integer weights are the cheapest way to read them. Each format is one
:class:`PackedLinear` holding `[out_features, in_features]` weights as PyTorch's CPU kernels
want them:

- `float32`: the matrix as is, multiplied as `weight @ x.T` (:func:`~specdec.models.linear.thin_linear`);
- `bfloat16`: the matrix in bfloat16, activations cast to it, 4 to 32 rows a product (padded
  up, split down) so that every row goes through oneDNN's one row-invariant path;
- `int8`: weight-only int8, one scale per output channel (`aten._weight_int8pack_mm`, bfloat16
  activations: its float32 path is many times slower);
- `int4`: weight-only int4 in groups of 32 along the input, a bfloat16 scale and zero per group,
  w = (q - 8) * scale + zero (`aten._weight_int4pack_mm_for_cpu`, bfloat16 activations).

GGUF's Q4_0 and Q4_1 blocks are groups of 32 as well (Q4_0: w = d * (q - 8); Q4_1: w = d * q + m),
so they repack into int4 without a float round trip: scale = d, zero = m + 8d (Q4_1) or 0 (Q4_0).
The only rounding is of d and m, stored as float16 in the file and as bfloat16 by the kernel.

Two more formats run specdec's own kernels (:mod:`specdec.kernels`) on the file's blocks exactly
as stored, float32 activations quantized to int8 per row and block of 32 on the fly:

- `q4`: the affine blocks, w = d q + m: Q4_0/Q4_1 (d and m in float16, as in the file), Q4_K
  (float32 group scales, the products of its super-block scales), Q5_1 and Q5_K (5-bit values);
- `q8`: the symmetric ones, w = d q: Q8_0 (the default model's tied LM head), Q5_0 (q - 16),
  IQ4_NL and IQ4_XS (q their 16 int8 levels), Q6_K and Q3_K (a float32 scale per 16 inputs).

A third runs float16 matrices (GGUF's F16, float16 checkpoints) as stored, 2 bytes a weight:

- `f16`: `[out, in]` float16, widened exactly as the kernel reads it (:mod:`specdec.kernels`' `half.cpp`).

They are what `--dtype auto` runs where the kernels are built; a row's result is bitwise the same
however many rows share the product, on every instruction-set path.

Matrices arrive as :data:`RawWeight`: a float tensor, :class:`Int4Groups` or :class:`Int8Groups`.
Fused projections (query/key/value, gate/up) are concatenated raw, then packed once; parts that
share no format stay apart in a :class:`StackedLinear`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from specdec import kernels
from specdec.kernels import packing
from specdec.models.linear import thin_linear

FORMATS = ("float32", "bfloat16", "int8", "int4")  # what `--dtype` names
KERNEL_FORMATS = ("q4", "q8", "f16", "r8")  # what runs on specdec's kernels (`--dtype auto`: the first three)
QUANTIZED_FORMATS = ("int8", "int4", "q8", "q4", "r8")
R8_INPUT_MULTIPLE = packing.ROTATION_BLOCK  # r8's rotation takes inputs 64 at a time (a narrower matrix runs q8)
INT4_GROUP = 32
F16_INPUT_MULTIPLE = 16  # the float16 kernel's inputs come 16 at a time (a narrower matrix stays float32)
INT4_OUT_MULTIPLE = 16  # the int4 kernel's packing needs out_features divisible by this
# oneDNN's bfloat16 product takes another path below this many rows, and that path rounds some
# rows differently (on AVX-512, K = 1536); from it on, a row's result no longer depends on how
# many rows share the product (tests/models/test_native.py checks 1 to 40 rows, 1 and 2 threads).
BFLOAT16_MIN_ROWS = 4
# ... and another above this many (on AMX CPUs, from 33 rows): longer products run in parts.
BFLOAT16_MAX_ROWS = 32


@dataclass(frozen=True)
class Int4Groups:
    """A matrix in groups of 32 along the input: w = d * q + m (GGUF's Q4_1; Q4_0 is m = -8d; Q4_K
    and Q5_K with float32 d and m, Q5_K's q up to 31).

    q: [out, in] integers 0..15 (0..31); d, m: [out, in / 32] float32."""

    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)  # type: ignore[return-value]

    def dequantize(self) -> torch.Tensor:
        """float32 [out, in], computed as d * q + m (the order GGUF's own dequantization uses)."""
        d = self.d.repeat_interleave(INT4_GROUP, dim=1)
        m = self.m.repeat_interleave(INT4_GROUP, dim=1)
        return d * self.q.float() + m

    @staticmethod
    def cat(parts: list[Int4Groups]) -> Int4Groups:
        return Int4Groups(torch.cat([p.q for p in parts]), torch.cat([p.d for p in parts]), torch.cat([p.m for p in parts]))


@dataclass(frozen=True)
class Int8Groups:
    """A matrix in groups of 32 along the input: w = d * q (GGUF's Q8_0, Q5_0 as q - 16, IQ4_NL and
    IQ4_XS as their levels), or of 16 (Q6_K's and Q3_K's, d = d_super * scale).

    q: [out, in] integers -128..127; d: [out, in / 32] float32 (float16 values) or [out, in / 16]."""

    q: torch.Tensor
    d: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)  # type: ignore[return-value]

    @property
    def group(self) -> int:
        return self.q.shape[1] // self.d.shape[1]

    def dequantize(self) -> torch.Tensor:
        """float32 [out, in]: d * q, one rounding (as GGUF's own dequantization)."""
        return self.d.repeat_interleave(self.group, dim=1) * self.q.float()

    @staticmethod
    def cat(parts: list[Int8Groups]) -> Int8Groups:
        """Stacked over their outputs; groups of 32 beside groups of 16 become groups of 16 (each
        scale twice: the same values)."""
        group = min(p.group for p in parts)
        return Int8Groups(torch.cat([p.q for p in parts]),
                          torch.cat([p.d.repeat_interleave(p.group // group, dim=1) for p in parts]))


RawWeight = torch.Tensor | Int4Groups | Int8Groups


class PackedLinear:
    """A bias-free linear map `x @ W.T` with W `[out_features, in_features]` in one of :data:`FORMATS`.

    Built with :meth:`pack`; call it on `[rows, in_features]` activations to get
    `[rows, out_features]` in the format's compute dtype.
    """

    def __init__(self, fmt: str, out_features: int, in_features: int, tensors: dict[str, torch.Tensor]) -> None:
        self.fmt = fmt
        self.out_features = out_features
        self.in_features = in_features
        self.tensors = tensors
        self._product: Callable[..., torch.Tensor] | None = None  # the kernel, bound on first use

    @classmethod
    def pack(cls, parts: RawWeight | list[RawWeight], fmt: str) -> PackedLinear:
        """Pack one matrix, or several stacked over their outputs, into `fmt`.

        int4 groups go to int4 or q4 as they are, int8 groups to q8; anything else is quantized
        from float: int8 per output channel (symmetric), int4 per group of 32 (asymmetric, min to
        max), q4 and q8 as GGUF's Q4_1 and Q8_0 blocks.
        """
        if fmt not in FORMATS + KERNEL_FORMATS:
            raise ValueError(f"unknown weight format {fmt!r}; choose one of: {', '.join(FORMATS + KERNEL_FORMATS)}")
        parts = parts if isinstance(parts, list) else [parts]
        if fmt in ("int4", "q4") and all(isinstance(p, Int4Groups) for p in parts):
            groups = Int4Groups.cat(parts)
            if fmt == "q4":
                return cls._pack_q4(groups)
            if int(groups.q.max()) <= 15:  # int4 holds 4-bit values only: 5-bit ones requantize below
                return cls._pack_int4(groups)
        if fmt == "q8" and all(isinstance(p, Int8Groups) for p in parts):
            return cls._pack_q8(Int8Groups.cat(parts))
        weight = torch.cat([p.detach().float() if isinstance(p, torch.Tensor) else p.dequantize() for p in parts])
        weight = weight.contiguous()  # [out, in]
        out_features, in_features = weight.shape
        if fmt == "q4":
            return cls._pack_q4(Int4Groups(*packing.quantize_q4(weight)))
        if fmt == "q8":
            return cls._pack_q8(Int8Groups(*packing.quantize_q8(weight)))
        if fmt == "r8":
            if in_features % R8_INPUT_MULTIPLE:
                return cls._pack_q8(Int8Groups(*packing.quantize_q8(weight)))
            return cls(fmt, out_features, in_features, {"weight": packing.pack_r8(*packing.quantize_r8(weight))})
        if fmt == "float32" or (fmt == "f16" and in_features % F16_INPUT_MULTIPLE):
            return cls("float32", out_features, in_features, {"weight": weight})
        if fmt == "f16":
            return cls(fmt, out_features, in_features, {"weight": weight.half()})
        if fmt == "bfloat16":
            return cls(fmt, out_features, in_features, {"weight": weight.to(torch.bfloat16)})
        if fmt == "int8":
            scales = weight.abs().amax(dim=1).clamp(min=1e-12) / 127  # [out]
            q = torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8)
            return cls(fmt, out_features, in_features, {"weight": q, "scales": scales.to(torch.bfloat16)})
        if in_features % INT4_GROUP:
            raise ValueError(f"int4 needs in_features divisible by {INT4_GROUP}, got {in_features}")
        groups = weight.reshape(out_features, in_features // INT4_GROUP, INT4_GROUP)
        low, high = groups.amin(dim=2), groups.amax(dim=2)  # [out, groups]
        d = ((high - low) / 15).clamp(min=1e-12)
        q = torch.round((groups - low[..., None]) / d[..., None]).clamp(0, 15).to(torch.int32)
        return cls._pack_int4(Int4Groups(q.reshape(out_features, in_features), d, low))

    @classmethod
    def _pack_q4(cls, groups: Int4Groups) -> PackedLinear:
        out_features, in_features = groups.shape
        return cls("q4", out_features, in_features, {"weight": packing.pack_q4(groups.q, groups.d, groups.m)})

    @classmethod
    def _pack_q8(cls, groups: Int8Groups) -> PackedLinear:
        out_features, in_features = groups.shape
        return cls("q8", out_features, in_features, {"weight": packing.pack_q8(groups.q, groups.d)})

    @classmethod
    def _pack_int4(cls, groups: Int4Groups) -> PackedLinear:
        # The kernel computes w = (q - 8) * scale + zero: scale = d, zero = m + 8d, in bfloat16.
        out_features, in_features = groups.shape
        q, d, zero = groups.q, groups.d, groups.m + 8 * groups.d
        pad = -out_features % INT4_OUT_MULTIPLE  # the kernel packs outputs in blocks; padding rows are sliced off
        if pad:
            q = torch.cat([q, torch.full((pad, in_features), 8, dtype=q.dtype)])
            d, zero = (torch.cat([t, torch.zeros(pad, t.shape[1])]) for t in (d, zero))
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
        scales_and_zeros = torch.stack([d.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous()  # [groups, out, 2]
        return cls("int4", out_features, in_features, {"weight": packed, "scales_and_zeros": scales_and_zeros})

    # --- use ---------------------------------------------------------------------------------

    @property
    def compute_dtype(self) -> torch.dtype:
        """The activation dtype the kernel runs in (and returns)."""
        return torch.float32 if self.fmt in ("float32", *KERNEL_FORMATS) else torch.bfloat16

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        # x: [rows, in_features] -> [rows, out_features]; with a float32 residual [rows, out_features],
        # residual + the product, in float32.
        x = x.to(self.compute_dtype)
        t = self.tensors
        if self.fmt in KERNEL_FORMATS:
            if self._product is None:
                self._product = kernels.product(self.fmt)
            return self._product(x, t["weight"], self.out_features, residual)
        if residual is not None:
            return residual + self(x).float()
        if self.fmt == "float32":
            return thin_linear(x, t["weight"])
        if self.fmt == "bfloat16":
            rows = x.shape[0]
            if rows > BFLOAT16_MAX_ROWS:
                return torch.cat([self(part) for part in x.split(BFLOAT16_MAX_ROWS)])
            if rows >= BFLOAT16_MIN_ROWS:
                return x @ t["weight"].t()
            padded = torch.cat([x, x.new_zeros(BFLOAT16_MIN_ROWS - rows, x.shape[1])])
            return (padded @ t["weight"].t())[:rows]
        if self.fmt == "int8":
            return torch.ops.aten._weight_int8pack_mm(x, t["weight"], t["scales"])
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(x, t["weight"], INT4_GROUP, t["scales_and_zeros"])
        return out if out.shape[-1] == self.out_features else out[:, : self.out_features]

    def dequantized(self) -> torch.Tensor:
        """The float32 matrix `[out, in]` this layer computes with (a reference for tests)."""
        t = self.tensors
        if self.fmt == "q4":
            return Int4Groups(*packing.unpack_q4(t["weight"], self.out_features)).dequantize()
        if self.fmt == "q8":
            return Int8Groups(*packing.unpack_q8(t["weight"], self.out_features)).dequantize()
        if self.fmt == "r8":  # the stored rotated weights, rotated back: x R (W R^-T)^T = x W^T
            q, s = packing.unpack_r8(t["weight"], self.out_features)
            return packing.unrotate_weights(q.double() * s.double()[:, None]).float()
        if self.fmt in ("float32", "bfloat16", "f16"):
            return t["weight"].float()
        if self.fmt == "int8":
            return t["weight"].float() * t["scales"].float()[:, None]
        eye = torch.eye(self.in_features, dtype=torch.bfloat16)
        return self(eye).float().t().contiguous()  # the kernel applied to the identity

    @property
    def nbytes(self) -> int:
        return sum(v.numel() * v.element_size() for v in self.tensors.values())

    @property
    def formats(self) -> set[str]:
        return {self.fmt}

    @property
    def one_call(self) -> bool:
        """Whether the one-call forward (`forward_layers`) takes it: specdec's kernel formats."""
        return self.fmt in KERNEL_FORMATS

    @property
    def parts(self) -> list[PackedLinear]:
        """The matrices stacked in it: itself."""
        return [self]


class StackedLinear:
    """Matrices stacked over their outputs, each a :class:`PackedLinear` in its own format: the
    product is their products side by side (each row's bits its parts' own). What a fused
    projection becomes when its parts' blocks share no exact format; the one-call forward takes it
    where it takes every part."""

    def __init__(self, parts: list[PackedLinear]) -> None:
        self.parts = parts
        self.fmt = "+".join(sorted(self.formats))
        self.out_features = sum(p.out_features for p in parts)
        self.in_features = parts[0].in_features

    @property
    def formats(self) -> set[str]:
        return {p.fmt for p in self.parts}

    @property
    def one_call(self) -> bool:
        return all(p.one_call for p in self.parts)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.cat([p(x).float() for p in self.parts], dim=-1)  # [rows, out_features]
        return out if residual is None else residual + out

    def dequantized(self) -> torch.Tensor:
        return torch.cat([p.dequantized() for p in self.parts])

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


class Embedding:
    """The token embedding as the file stores it: Q8_0 or Q4_0/Q4_1 blocks (packed as q8 or q4) or
    float16 (the tied LM head's own table when they are one matrix, so that it is held once), each
    lookup gathering its rows and widening them as GGUF does (bitwise the float32 table's rows); a
    float32 table where float16 cannot hold its values exactly."""

    def __init__(self, table: PackedLinear | torch.Tensor, shared: bool = False) -> None:
        self.table = table  # PackedLinear (q4, q8, f16) or [vocab, hidden] float32 or float16
        self.shared = shared  # the LM head's: its bytes are counted there
        # specdec's kernels gather and dequantize blocks in one call (a few us); PyTorch's indexing,
        # the same values, where they are not built.
        self._ops = kernels.load() if isinstance(table, PackedLinear) and kernels.available() else None

    @classmethod
    def of(cls, raw: RawWeight, lm_head: PackedLinear | StackedLinear) -> Embedding:
        if isinstance(raw, (Int4Groups, Int8Groups)):
            packed = PackedLinear.pack(raw, "q8" if isinstance(raw, Int8Groups) else "q4")
        else:
            table = raw.detach().float()
            half = table.half()
            if not torch.equal(half.float(), table):  # float16 would round it: keep float32
                return cls(table)
            packed = PackedLinear("f16", *half.shape, {"weight": half})
        tied = (isinstance(lm_head, PackedLinear) and lm_head.fmt == packed.fmt
                and lm_head.out_features == packed.out_features
                and torch.equal(lm_head.tensors["weight"], packed.tensors["weight"]))
        if tied:
            return cls(lm_head, shared=True)
        return cls(packed) if packed.fmt != "f16" else cls(packed.tensors["weight"])

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [...] -> [..., hidden] float32."""
        table = self.table
        if isinstance(table, torch.Tensor):
            return table[ids].float()
        flat = ids.reshape(-1)
        if table.fmt == "f16":
            rows = table.tensors["weight"][flat].float()
        elif self._ops is not None:
            rows = self._ops.embed_rows(table.tensors["weight"], flat, table.fmt == "q8")
        elif table.fmt == "q8":
            q, d = packing.q8_rows(table.tensors["weight"], flat)
            rows = d[:, :, None] * q.view(len(flat), d.shape[1], -1).float()  # GGUF's d * q
        else:
            q, d, m = packing.q4_rows(table.tensors["weight"], flat)
            rows = d[:, :, None] * q.view(len(flat), -1, INT4_GROUP).float() + m[:, :, None]  # GGUF's d * q + m
        return rows.reshape(*ids.shape, -1)

    def full(self) -> torch.Tensor:
        """[vocab, hidden] float32, the whole table (for heads that keep their own copy)."""
        return self.table.float() if isinstance(self.table, torch.Tensor) else self.table.dequantized()

    @property
    def nbytes(self) -> int:
        """Bytes it adds to the model's (none when it is the LM head's table)."""
        if self.shared:
            return 0
        table = self.table
        return table.numel() * table.element_size() if isinstance(table, torch.Tensor) else table.nbytes


def _half(blocks: np.ndarray, at: int) -> np.ndarray:
    """The float16 each block [..., bytes] holds at byte `at`, as float32 [...]."""
    return blocks[..., at : at + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def unpack_q4_blocks(raw: np.ndarray, out_features: int, in_features: int, with_min: bool) -> Int4Groups:
    """GGUF Q4_0 / Q4_1 blocks of one matrix as :class:`Int4Groups`.

    raw: the tensor's bytes, [out, blocks * block_bytes] uint8. A Q4_1 block is d (f16), m (f16)
    and 16 bytes whose low nibbles are elements 0..15 and high nibbles elements 16..31; a Q4_0
    block has no m and means w = d * (q - 8).
    """
    groups = in_features // INT4_GROUP
    header = 4 if with_min else 2
    blocks = np.ascontiguousarray(raw).reshape(out_features, groups, header + 16)
    d = _half(blocks, 0)  # [out, groups]
    nibbles = blocks[..., header:]  # [out, groups, 16]
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(out_features, in_features)
    m = _half(blocks, 2) if with_min else -8 * d
    return Int4Groups(torch.from_numpy(q.astype(np.int32)), torch.from_numpy(d), torch.from_numpy(m))


def _five_bit_blocks(raw: np.ndarray, out_features: int, in_features: int, with_min: bool):
    """GGUF Q5_0 / Q5_1 blocks of one matrix: q [out, in] in 0..31, d and m [out, blocks] float32
    (m None for Q5_0). A block is d (f16), for Q5_1 m (f16), 4 bytes holding each element's fifth
    bit (bit j for element j), and 16 bytes whose low nibbles are elements 0..15 and high nibbles
    elements 16..31."""
    groups = in_features // INT4_GROUP
    header = 4 if with_min else 2
    blocks = np.ascontiguousarray(raw).reshape(out_features, groups, header + 20)
    d = _half(blocks, 0)  # [out, groups]
    m = _half(blocks, 2) if with_min else None
    high = blocks[..., header : header + 4].copy().view(np.uint32)  # [out, groups, 1]
    fifth = ((high >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int32) << 4  # [out, groups, 32]
    nibbles = blocks[..., header + 4 :].astype(np.int32)
    low = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1)  # [out, groups, 32]
    return (low | fifth).reshape(out_features, in_features), d, m


def unpack_q5_0_blocks(raw: np.ndarray, out_features: int, in_features: int) -> Int8Groups:
    """GGUF Q5_0 blocks of one matrix as :class:`Int8Groups`, exactly: w = d * (q - 16) with q in
    0..31 is Q8_0's w = d * q' with q' = q - 16 in -16..15."""
    q, d, _ = _five_bit_blocks(raw, out_features, in_features, with_min=False)
    return Int8Groups(torch.from_numpy(q - 16), torch.from_numpy(d))


def unpack_q5_1_blocks(raw: np.ndarray, out_features: int, in_features: int) -> Int4Groups:
    """GGUF Q5_1 blocks of one matrix as :class:`Int4Groups` with 5-bit values, exactly: w = d q + m."""
    q, d, m = _five_bit_blocks(raw, out_features, in_features, with_min=True)
    return Int4Groups(torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(m))


def _k_groups(blocks: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's and Q5_K's superblocks [out, supers, bytes] -> each group of 32's d_g = d scale_g and
    m_g = -dmin min_g, float32 [out, supers * 8] (products exact in float32: an f16 times a 6-bit
    integer). A superblock opens with d and dmin (f16), then 12 bytes of eight 6-bit scales and
    eight 6-bit mins: scales 0..3 in the low 6 bits of bytes 0..3, mins 0..3 in bytes 4..7; for
    4..7 the low 4 bits are byte 8 + j's low (scale) or high (min) nibble, the top two bits those of
    byte j (scale) or j + 4 (min)."""
    out_features = blocks.shape[0]
    d, dmin = _half(blocks, 0)[..., None], _half(blocks, 2)[..., None]  # [out, supers, 1]
    packed = blocks[..., 4:16].astype(np.int32)
    low, top, mixed = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scale = np.concatenate([low & 0x3F, (mixed & 0x0F) | ((low >> 6) << 4)], axis=-1)  # [out, supers, 8]
    minimum = np.concatenate([top & 0x3F, (mixed >> 4) | ((top >> 6) << 4)], axis=-1)
    return (torch.from_numpy((d * scale.astype(np.float32)).reshape(out_features, -1)),
            torch.from_numpy(-(dmin * minimum.astype(np.float32)).reshape(out_features, -1)))


def unpack_q4_k_blocks(raw: np.ndarray, out_features: int, in_features: int) -> Int4Groups:
    """GGUF Q4_K blocks of one matrix as :class:`Int4Groups`, exactly: Q4_1's form per group of 32.

    raw: [out, superblocks * 144] uint8. A superblock of 256 inputs is 16 bytes of scales
    (:func:`_k_groups`), then 128 bytes: each 32 hold groups 2i (low nibbles) and 2i + 1 (high
    nibbles). Group g: w = (d scale_g) q - dmin min_g; float16 could not hold the group scales."""
    blocks = np.ascontiguousarray(raw).reshape(out_features, in_features // 256, 144)
    quants = blocks[..., 16:].reshape(out_features, -1, 4, 1, 32)
    q = np.concatenate([quants & 0x0F, quants >> 4], axis=3)  # [out, supers, 4, 2, 32]: groups 2i, 2i + 1
    return Int4Groups(torch.from_numpy(q.reshape(out_features, in_features).astype(np.int32)), *_k_groups(blocks))


def unpack_q5_k_blocks(raw: np.ndarray, out_features: int, in_features: int) -> Int4Groups:
    """GGUF Q5_K blocks of one matrix as :class:`Int4Groups` with 5-bit values, exactly.

    raw: [out, superblocks * 176] uint8. A superblock of 256 inputs is Q4_K's 16 bytes of scales
    (:func:`_k_groups`), 32 bytes of fifth bits, then 128 bytes of low nibbles: each 32 hold groups
    2i (low nibbles; fifth bit 2i of the 32 bit-bytes) and 2i + 1 (high nibbles; bit 2i + 1)."""
    blocks = np.ascontiguousarray(raw).reshape(out_features, in_features // 256, 176)
    fifth = blocks[..., 16:48].astype(np.int32)[:, :, None, :]  # [out, supers, 1, 32]
    bits = ((fifth >> np.arange(8, dtype=np.int32).reshape(8, 1)) & 1) << 4  # [out, supers, 8 groups, 32]
    quants = blocks[..., 48:].astype(np.int32).reshape(out_features, -1, 4, 1, 32)
    low = np.concatenate([quants & 0x0F, quants >> 4], axis=3).reshape(bits.shape)
    return Int4Groups(torch.from_numpy((low | bits).reshape(out_features, in_features)), *_k_groups(blocks))


def unpack_q6_k_blocks(raw: np.ndarray, out_features: int, in_features: int) -> Int8Groups:
    """GGUF Q6_K blocks of one matrix as :class:`Int8Groups` in groups of 16, exactly.

    raw: [out, superblocks * 210] uint8. A superblock of 256 inputs is 128 bytes of low nibbles,
    64 bytes of high bit pairs, 16 int8 scales and d (f16). In each half of 128 inputs (64 low
    bytes l, 32 high bytes h): input i < 32 takes l[i]'s low nibble and h[i]'s bits 0-1, 32 + i
    l[32 + i]'s low nibble and bits 2-3, 64 + i l[i]'s high nibble and bits 4-5, 96 + i l[32 + i]'s
    high nibble and bits 6-7; q = that 6-bit value - 32. Group g of 16: w = (d scale_g) q, the
    product exact in float32 (an f16 times an int8)."""
    supers = in_features // 256
    blocks = np.ascontiguousarray(raw).reshape(out_features, supers, 210)
    # In bytes throughout (a 6-bit value fits one): no int32 temporaries four times the matrix's
    # size, and q comes out int8, as the kernels' records hold it.
    low = blocks[..., :128].reshape(out_features, supers, 2, 2, 32)  # [.., half, l or l + 32, i]
    high = blocks[..., 128:192].reshape(out_features, supers, 2, 1, 32)  # [.., half, 1, i]
    pairs = (high >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)) & np.uint8(3)  # [.., half, 4, i]: bits 0-1 .. 6-7
    nibbles = np.concatenate([low & np.uint8(0x0F), low >> np.uint8(4)], axis=3)  # inputs i, 32 + i, 64 + i, 96 + i
    q = (nibbles | (pairs << np.uint8(4))).view(np.int8) - np.int8(32)
    scale = blocks[..., 192:208].copy().view(np.int8).astype(np.float32)  # [out, supers, 16]
    d = _half(blocks, 208)[..., None]  # [out, supers, 1]
    return Int8Groups(torch.from_numpy(q.reshape(out_features, in_features)),
                      torch.from_numpy((d * scale).reshape(out_features, supers * 16)))


# IQ4_NL's and IQ4_XS's 16 levels: a nibble indexes this table of int8 values.
IQ4_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int32)


def unpack_iq4_nl_blocks(raw: np.ndarray, out_features: int, in_features: int) -> Int8Groups:
    """GGUF IQ4_NL blocks of one matrix as :class:`Int8Groups`, exactly: a block is d (f16) and 16
    bytes whose low nibbles index elements 0..15's level and high nibbles 16..31's; w = d level."""
    blocks = np.ascontiguousarray(raw).reshape(out_features, in_features // INT4_GROUP, 18)
    nibbles = blocks[..., 2:]
    q = IQ4_LEVELS[np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1)]
    return Int8Groups(torch.from_numpy(q.reshape(out_features, in_features)), torch.from_numpy(_half(blocks, 0)))


def unpack_iq4_xs_blocks(raw: np.ndarray, out_features: int, in_features: int) -> Int8Groups:
    """GGUF IQ4_XS blocks of one matrix as :class:`Int8Groups`, exactly: IQ4_NL's levels per group
    of 32 under a 6-bit signed scale. A superblock of 256 inputs is d (f16), the 8 scales' top two
    bits (a uint16, group g at bits 2g), their low 4 bits (4 bytes, group g in byte g / 2's low or
    high nibble), then 8 groups of 16 bytes as IQ4_NL's; w = (d (scale - 32)) level, the product
    exact in float32 (an f16 times a 6-bit integer)."""
    supers = in_features // 256
    blocks = np.ascontiguousarray(raw).reshape(out_features, supers, 136)
    top = blocks[..., 2:4].copy().view(np.uint16).astype(np.int32)  # [out, supers, 1]
    low = blocks[..., 4:8].astype(np.int32)  # [out, supers, 4]
    low = np.stack([low & 0x0F, low >> 4], axis=-1).reshape(out_features, supers, 8)
    scale = (low | (((top >> (2 * np.arange(8, dtype=np.int32))) & 3) << 4)) - 32  # [out, supers, 8]
    d = _half(blocks, 0)[..., None] * scale.astype(np.float32)
    nibbles = blocks[..., 8:].reshape(out_features, supers, 8, 16)
    q = IQ4_LEVELS[np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1)]
    return Int8Groups(torch.from_numpy(q.reshape(out_features, in_features)),
                      torch.from_numpy(d.reshape(out_features, supers * 8)))


def unpack_q3_k_blocks(raw: np.ndarray, out_features: int, in_features: int) -> Int8Groups:
    """GGUF Q3_K blocks of one matrix as :class:`Int8Groups` in groups of 16, exactly.

    raw: [out, superblocks * 110] uint8. A superblock of 256 inputs is 32 bytes of high bits
    (input 32 j + i: bit j of byte i), 64 bytes of low bit pairs (input 128 h + 32 j + i: bits 2j,
    2j + 1 of byte 32 h + i), 12 bytes of sixteen 6-bit scales (scale g: low 4 bits in byte g % 8's
    low (g < 8) or high nibble, top 2 bits at bit 2 (g / 4) of byte 8 + g % 4), then d (f16).
    q = low pair - 4 where the high bit is 0, in -4..3; group g of 16: w = (d (scale_g - 32)) q."""
    supers = in_features // 256
    blocks = np.ascontiguousarray(raw).reshape(out_features, supers, 110)
    high = blocks[..., 0:32].astype(np.int32)[:, :, None, :]  # [out, supers, 1, 32]
    high = (high >> np.arange(8, dtype=np.int32).reshape(8, 1)) & 1  # [out, supers, 8 (j), 32 (i)]
    pairs = blocks[..., 32:96].astype(np.int32).reshape(out_features, supers, 2, 1, 32)
    pairs = (pairs >> (2 * np.arange(4, dtype=np.int32)).reshape(4, 1)) & 3  # [out, supers, 2 (h), 4 (j), 32]
    q = pairs.reshape(out_features, supers, 8, 32) - 4 * (1 - high)
    packed = blocks[..., 96:108].astype(np.int32)
    low = np.concatenate([packed[..., 0:8] & 0x0F, packed[..., 0:8] >> 4], axis=-1)  # [out, supers, 16]
    g = np.arange(16)
    scale = (low | (((packed[..., 8 + g % 4] >> (2 * (g // 4))) & 3) << 4)) - 32
    d = _half(blocks, 108)[..., None] * scale.astype(np.float32)
    return Int8Groups(torch.from_numpy(q.reshape(out_features, in_features)),
                      torch.from_numpy(d.reshape(out_features, supers * 16)))


def unpack_q8_blocks(raw: np.ndarray, out_features: int, in_features: int) -> Int8Groups:
    """GGUF Q8_0 blocks of one matrix as :class:`Int8Groups`.

    raw: the tensor's bytes, [out, blocks * 34] uint8; a block is d (f16) then 32 int8 values."""
    groups = in_features // INT4_GROUP
    blocks = np.ascontiguousarray(raw).reshape(out_features, groups, 34)
    d = _half(blocks, 0)  # [out, groups]
    q = blocks[..., 2:].copy().view(np.int8).reshape(out_features, in_features)
    return Int8Groups(torch.from_numpy(q.astype(np.int32)), torch.from_numpy(d))
