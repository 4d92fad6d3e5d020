"""The one-call layers (forward.cpp) against their references, bit for bit on every path:
`forward_layers` (decoder layers with Qwen2's bias, Qwen3's per-head norms, Gemma's post-norms and
GeGLU; stacked matrices of mixed formats; a float16 or float32 cache) and `head_layer` (EAGLE-3's
draft layer), each the composition of the per-op references that the kernel composes, the cache
buffers written alike."""

from __future__ import annotations

import pytest
import torch

from specdec import kernels
from specdec.kernels import packing, reference

pytestmark = pytest.mark.skipif(not kernels.available(), reason="specdec's kernels are not built on this machine")

HEADS, KV_HEADS, HEAD_DIM = 2, 1, 64  # head_dim 64: attention's AVX-512 code on those paths
HIDDEN, INTER = HEADS * HEAD_DIM, 128
KIND = {fmt: code for code, fmt in enumerate(reference.PART_KINDS)}


def _part(fmt: str, out_features: int, in_features: int, gen: torch.Generator) -> tuple[torch.Tensor, int, int]:
    """A random matrix part as the kernels take it: (packed tensor, kind, outputs)."""
    weight = torch.randn(out_features, in_features, generator=gen) / in_features**0.5
    packed = {"q4": lambda: packing.pack_q4(*packing.quantize_q4(weight)),
              "q8": lambda: packing.pack_q8(*packing.quantize_q8(weight)),
              "f16": lambda: weight.half(),
              "r8": lambda: packing.pack_r8(*packing.quantize_r8(weight))}[fmt]()
    return packed, KIND[fmt], out_features


def _matrix(parts: list[tuple[torch.Tensor, int, int]], spec: list[int]) -> list[torch.Tensor]:
    spec += [value for _, kind, out in parts for value in (kind, out)]
    return [packed for packed, _, _ in parts]


def _layers(gen: torch.Generator) -> list:
    """Two layers' LayerWeights arguments: the first with a query/key/value bias and per-head
    query and key norms, the second with post-norms; matrices in every format, gate_up stacked
    from two parts."""
    width = (HEADS + 2 * KV_HEADS) * HEAD_DIM

    def norm(n: int) -> torch.Tensor:
        return torch.rand(n, generator=gen) + 0.5

    none = torch.empty(0)
    spec: list[int] = []
    qkv, o, gate_up, down = [], [], [], []
    for fmts in (("q4", "q8", ("q4", "f16"), "r8"), ("q8", "f16", ("r8", "q8"), "q4")):
        qkv.append(_matrix([_part(fmts[0], width, HIDDEN, gen)], spec))
        o.append(_matrix([_part(fmts[1], HIDDEN, HIDDEN, gen)], spec))
        gate_up.append(_matrix([_part(fmt, INTER, HIDDEN, gen) for fmt in fmts[2]], spec))
        down.append(_matrix([_part(fmts[3], HIDDEN, INTER, gen)], spec))
    return [[norm(HIDDEN), norm(HIDDEN)], qkv, [torch.randn(width, generator=gen) / 10, none],
            [norm(HEAD_DIM), none], [norm(HEAD_DIM), none], o, [norm(HIDDEN), norm(HIDDEN)], gate_up, down,
            [none, norm(HIDDEN)], [none, norm(HIDDEN)], spec]


def _rotary(tokens: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.rand(tokens, HEAD_DIM // 2, generator=gen) * 6
    return torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("gelu", [False, True])
def test_forward_layers_is_its_reference(isa: str, cache_dtype: torch.dtype, gelu: bool) -> None:
    # Two rows of three new tokens each after their cached prefixes (6 and 2 slots), causal.
    gen = torch.Generator().manual_seed(int(gelu) + 2 * (cache_dtype == torch.float16))
    weights = _layers(gen)
    rows, new, span = 2, 3, 16
    x = torch.randn(rows * new, HIDDEN, generator=gen)
    keys = [torch.randn(rows, KV_HEADS, span, HEAD_DIM, generator=gen).to(cache_dtype) for _ in range(2)]
    values = [torch.randn(rows, KV_HEADS, span, HEAD_DIM, generator=gen).to(cache_dtype) for _ in range(2)]
    starts = [6, 2]
    write_rows = torch.arange(rows).repeat_interleave(new)
    write_slots = torch.cat([torch.arange(s, s + new) for s in starts])
    counts = torch.tensor([[s + i + 1 for i in range(new)] for s in starts], dtype=torch.int32)
    cos, sin = _rotary(rows * new, gen)
    no_slots = torch.empty(0, dtype=torch.int32)
    args = (write_rows, write_slots, cos, sin, counts, no_slots, rows, HEADS, KV_HEADS, 1e-6, HEAD_DIM**-0.5)
    ours_keys, ours_values = [k.clone() for k in keys], [v.clone() for v in values]
    got = kernels.load().forward_layers(x, kernels.load().LayerWeights(*weights), ours_keys, ours_values, *args,
                                        kernels.ISAS[isa], [0], gelu)
    want = reference.forward_layers(x, weights, keys, values, *args, isa, [0], gelu)
    assert len(got) == len(want) == 2
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    for a, b in zip(ours_keys + ours_values, keys + values):  # the new tokens' keys and values, written alike
        assert torch.equal(a, b)


def test_head_layer_is_its_reference(isa: str) -> None:
    # A draft head's layer over 4 positions after 5 cached ones: attention input [2 hidden].
    gen = torch.Generator().manual_seed(5)
    width = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    spec: list[int] = []
    qkv = _matrix([_part("q8", width, 2 * HIDDEN, gen)], spec)
    o = _matrix([_part("q8", HIDDEN, HIDDEN, gen)], spec)
    gate_up = _matrix([_part("q8", INTER, HIDDEN, gen), _part("q4", INTER, HIDDEN, gen)], spec)
    down = _matrix([_part("q8", HIDDEN, INTER, gen)], spec)
    n, span = 4, 12
    embedded, features = torch.randn(n, HIDDEN, generator=gen), torch.randn(n, HIDDEN, generator=gen)
    norms = [torch.rand(HIDDEN, generator=gen) + 0.5 for _ in range(3)]
    keys = torch.randn(1, KV_HEADS, span, HEAD_DIM, generator=gen)
    values = torch.randn(1, KV_HEADS, span, HEAD_DIM, generator=gen)
    write_slots = torch.arange(5, 5 + n)
    counts = torch.tensor([[6, 7, 8, 9]], dtype=torch.int32)
    cos, sin = _rotary(n, gen)
    tail = (write_slots, cos, sin, counts, torch.empty(0, dtype=torch.int32), HEADS, KV_HEADS, 1e-6, HEAD_DIM**-0.5)
    ours_keys, ours_values = keys.clone(), values.clone()
    got = kernels.load().head_layer(embedded, features, *norms, qkv, o, gate_up, down, spec, ours_keys, ours_values,
                                    *tail, kernels.ISAS[isa])
    want = reference.head_layer(embedded, features, *norms, qkv, o, gate_up, down, spec, keys, values, *tail, isa)
    assert torch.equal(got, want)
    assert torch.equal(ours_keys, keys) and torch.equal(ours_values, values)
