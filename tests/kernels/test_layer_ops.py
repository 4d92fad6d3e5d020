"""specdec's fused layer operations against PyTorch: attention over the cache, RMSNorm, the
rotary split and SiLU * up. Each is checked against the PyTorch computation it replaces (the
rotary bitwise, the others within float32 rounding) and for row invariance: a row's or a query's
bits never depend on the other rows or queries in the pass, which keeps verification lossless."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specdec import kernels
from specdec.models.native import _rms_norm, _rotate

pytestmark = pytest.mark.skipif(not kernels.available(), reason="specdec's kernels are not built on this machine")

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
# Attention runs AVX2, or AVX-512 (head_dim 64 and 128) under the avx512_vnni and amx paths; the
# `isa` parameter comes from conftest.py, one per path.


def _cache(rows: int, span: int, seed: int, head_dim: int = HEAD_DIM) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    # Views into a longer preallocated buffer, as the KV caches hand them out.
    keys = torch.randn(rows, KV_HEADS, span + 17, head_dim, generator=gen)[:, :, :span]
    values = torch.randn(rows, KV_HEADS, span + 17, head_dim, generator=gen)[:, :, :span]
    return keys, values


def _sdpa(q, keys, values, r: int, i: int, seen) -> torch.Tensor:
    k = keys[r : r + 1, :, :seen] if isinstance(seen, int) else keys[r : r + 1, :, seen]
    v = values[r : r + 1, :, :seen] if isinstance(seen, int) else values[r : r + 1, :, seen]
    return F.scaled_dot_product_attention(q[r : r + 1, :, i : i + 1], k, v, enable_gqa=True).transpose(1, 2).reshape(-1)


@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_attention_over_prefixes_is_pytorchs(isa: str, head_dim: int) -> None:
    keys, values = _cache(2, 300, seed=0, head_dim=head_dim)
    q = torch.randn(2, HEADS, 5, head_dim)
    counts = torch.tensor([[290, 291, 292, 293, 294], [1, 2, 3, 9, 100]], dtype=torch.int32)
    out = kernels.attend_cached(q, keys, values, counts, isa=isa)  # [rows, new, heads * head_dim]
    for r in range(2):
        for i in range(5):
            torch.testing.assert_close(out[r, i], _sdpa(q, keys, values, r, i, int(counts[r, i])), rtol=1e-5, atol=1e-6)


def test_attention_over_a_float16_cache_is_attention_over_its_widened_values(isa: str) -> None:
    # A float16 cache's elements widen exactly; the arithmetic after is the float32 path's, bit for
    # bit, for a prefix and for listed slots, at each head_dim the paths specialise.
    for head_dim in (64, 128, 32):
        keys, values = _cache(2, 300, seed=4, head_dim=head_dim)
        keys16, values16 = keys.half(), values.half()
        q = torch.randn(2, HEADS, 3, head_dim)
        counts = torch.tensor([[290, 7, 1], [100, 299, 300]], dtype=torch.int32)
        assert torch.equal(kernels.attend_cached(q, keys16, values16, counts, isa=isa),
                           kernels.attend_cached(q, keys16.float(), values16.float(), counts, isa=isa))
        slots = torch.tensor([[[0, 5, 9], [1, 2, 3], [7, 0, 0]]] * 2, dtype=torch.int32)
        listed = torch.tensor([[3, 3, 1], [2, 3, 1]], dtype=torch.int32)
        assert torch.equal(kernels.attend_cached(q, keys16, values16, listed, slots, isa=isa),
                           kernels.attend_cached(q, keys16.float(), values16.float(), listed, slots, isa=isa))


@pytest.mark.parametrize("group", [2, 3, 4, 5])
def test_heads_sharing_a_key_value_head_get_their_own_bits(isa: str, group: int) -> None:
    # Heads that share a key/value head are computed together (each key loaded once for them):
    # each head's output is bitwise what it gets alone, for a float16 and a float32 cache.
    keys, values = _cache(1, 70, seed=9)
    heads = group * KV_HEADS
    q = torch.randn(1, heads, 4, HEAD_DIM, generator=torch.Generator().manual_seed(group))
    counts = torch.tensor([[1, 17, 33, 70]], dtype=torch.int32)
    for k, v in ((keys, values), (keys.half(), values.half())):
        together = kernels.attend_cached(q, k, v, counts, isa=isa)
        for h in range(heads):
            kvh = h // group
            alone = kernels.attend_cached(q[:, h : h + 1], k[:, kvh : kvh + 1], v[:, kvh : kvh + 1], counts, isa=isa)
            assert torch.equal(together[..., h * HEAD_DIM : (h + 1) * HEAD_DIM], alone), (group, h)


def test_attention_refuses_keys_and_values_of_two_formats() -> None:
    keys, values = _cache(1, 10, seed=5)
    with pytest.raises(RuntimeError, match="both float32 or both float16"):
        kernels.attend_cached(torch.randn(1, HEADS, 1, HEAD_DIM), keys.half(), values, torch.tensor([[4]], dtype=torch.int32))


def test_attention_over_listed_slots_is_pytorchs(isa: str) -> None:
    # A token tree: each node sees its own slots (listed in order, padded past its count).
    keys, values = _cache(1, 64, seed=1)
    q = torch.randn(1, HEADS, 3, HEAD_DIM)
    seen = [torch.tensor([0, 1, 2, 40]), torch.tensor([0, 1, 2, 41]), torch.tensor([0, 1, 2, 40, 42])]
    slots = torch.zeros(1, 3, 5, dtype=torch.int32)
    for i, s in enumerate(seen):
        slots[0, i, : len(s)] = s
    counts = torch.tensor([[len(s) for s in seen]], dtype=torch.int32)
    out = kernels.attend_cached(q, keys, values, counts, slots, isa=isa)
    for i, s in enumerate(seen):
        torch.testing.assert_close(out[0, i], _sdpa(q, keys, values, 0, i, s), rtol=1e-5, atol=1e-6)
    # Listing a prefix's slots is the prefix, bit for bit (20 slots: a block of 16 and a tail).
    prefix = torch.arange(20, dtype=torch.int32).expand(1, 1, 20).contiguous()
    twenty = torch.tensor([[20]], dtype=torch.int32)
    assert torch.equal(kernels.attend_cached(q[:, :, :1], keys, values, twenty, prefix, isa=isa),
                       kernels.attend_cached(q[:, :, :1], keys, values, twenty, isa=isa))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [1, 3])  # 1: tasks dealt out one by one; 3: a row's queries in turn
def test_attention_is_query_invariant(threads: int, rows: int, isa: str) -> None:
    keys, values = _cache(rows, 200, seed=2)
    q = torch.randn(rows, HEADS, 8, HEAD_DIM)
    counts = (torch.arange(8)[None] + 150 + 7 * torch.arange(rows)[:, None]).to(torch.int32).contiguous()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        together = kernels.attend_cached(q, keys, values, counts, isa=isa)
        for r in range(rows):
            for i in range(8):
                alone = kernels.attend_cached(q[r : r + 1, :, i : i + 1].contiguous(), keys[r : r + 1], values[r : r + 1],
                                              counts[r : r + 1, i : i + 1].contiguous(), isa=isa)
                assert torch.equal(alone[0, 0], together[r, i]), (r, i)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(("group", "threads"), [(1, 1), (2, 2), (3, 1), (3, 2), (4, 1)])
def test_a_prefills_queries_get_one_querys_bits(isa: str, group: int, threads: int) -> None:
    # Many queries over prefixes (a prefill: query i sees i + 1 slots; a long chain after a cache)
    # take another route on AVX-512 (the keys transposed once per call, by the pool's threads):
    # each query's output is still bitwise what it gets alone, for short prefixes, block tails and
    # longer caches.
    keys, values = _cache(2, 140, seed=6)
    heads = group * KV_HEADS
    q = torch.randn(2, heads, 37, HEAD_DIM, generator=torch.Generator().manual_seed(group))
    counts = torch.stack([torch.arange(1, 38), torch.arange(100, 137) + 3]).to(torch.int32)
    for k, v in ((keys, values), (keys.half(), values.half())):
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            together = kernels.attend_cached(q, k, v, counts, isa=isa)
        finally:
            torch.set_num_threads(before)
        for r in range(2):
            for i in range(37):
                alone = kernels.attend_cached(q[r : r + 1, :, i : i + 1].contiguous(), k[r : r + 1], v[r : r + 1],
                                              counts[r : r + 1, i : i + 1].contiguous(), isa=isa)
                assert torch.equal(alone[0, 0], together[r, i]), (r, i, k.dtype)


def test_attention_refuses_slots_past_the_cache() -> None:
    keys, values = _cache(1, 10, seed=3)
    q = torch.randn(1, HEADS, 1, HEAD_DIM)
    with pytest.raises(RuntimeError, match="past the cache"):
        kernels.attend_cached(q, keys, values, torch.tensor([[11]], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="past the cache"):
        kernels.attend_cached(q, keys, values, torch.tensor([[2]], dtype=torch.int32),
                              torch.tensor([[[0, 10]]], dtype=torch.int32))


def test_rms_norm_is_pytorchs_and_row_invariant() -> None:
    x = 4 * torch.randn(12, 576)
    weight = torch.rand(576) + 0.5
    out = kernels.rms_norm(x, weight, 1e-5)
    torch.testing.assert_close(out, _rms_norm(x, weight, 1e-5), rtol=2e-6, atol=1e-6)
    for i in range(12):
        assert torch.equal(kernels.rms_norm(x[i : i + 1], weight, 1e-5)[0], out[i])


def test_rotary_split_is_the_rotation_bit_for_bit() -> None:
    rows, new = 2, 3
    qkv = torch.randn(rows * new, (HEADS + 2 * KV_HEADS) * HEAD_DIM)
    angles = torch.rand(rows * new, HEAD_DIM // 2) * 6
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    q, k, v = kernels.rotary_split(qkv, cos, sin, rows, HEADS, KV_HEADS)
    split = qkv.view(rows, new, HEADS + 2 * KV_HEADS, HEAD_DIM).transpose(1, 2)
    want_q, want_k, want_v = split.split([HEADS, KV_HEADS, KV_HEADS], dim=1)
    cos4, sin4 = cos.view(rows, 1, new, -1), sin.view(rows, 1, new, -1)
    assert torch.equal(q, _rotate(want_q, cos4, sin4))
    assert torch.equal(k, _rotate(want_k, cos4, sin4))
    assert torch.equal(v, want_v)


def test_rotary_split_norms_each_query_and_key_head_first() -> None:
    # Qwen3: each query and key head RMS-normed (as the kernels' rms_norm norms a row), then rotated.
    rows, new = 2, 3
    qkv = torch.randn(rows * new, (HEADS + 2 * KV_HEADS) * HEAD_DIM)
    angles = torch.rand(rows * new, HEAD_DIM // 2) * 6
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    q_norm, k_norm = torch.rand(HEAD_DIM) + 0.5, torch.rand(HEAD_DIM) + 0.5
    q, k, v = kernels.rotary_split(qkv, cos, sin, rows, HEADS, KV_HEADS, q_norm, k_norm, 1e-6)
    split = qkv.view(rows, new, HEADS + 2 * KV_HEADS, HEAD_DIM).transpose(1, 2)
    want_q, want_k, want_v = split.split([HEADS, KV_HEADS, KV_HEADS], dim=1)
    cos4, sin4 = cos.view(rows, 1, new, -1), sin.view(rows, 1, new, -1)
    assert torch.equal(q, _rotate(kernels.rms_norm(want_q, q_norm, 1e-6), cos4, sin4))
    assert torch.equal(k, _rotate(kernels.rms_norm(want_k, k_norm, 1e-6), cos4, sin4))
    assert torch.equal(v, want_v)
    torch.testing.assert_close(q, _rotate(_rms_norm(want_q, q_norm, 1e-6), cos4, sin4), rtol=1e-5, atol=1e-5)


def test_silu_mul_is_pytorchs_and_row_invariant() -> None:
    h = 6 * torch.randn(7, 2 * 1536)
    out = kernels.silu_mul(h)
    gate, up = h.chunk(2, dim=-1)
    torch.testing.assert_close(out, F.silu(gate) * up, rtol=1e-5, atol=1e-5)
    for i in range(7):
        assert torch.equal(kernels.silu_mul(h[i : i + 1])[0], out[i])


def test_gelu_mul_is_pytorchs_tanh_gelu_and_row_invariant() -> None:
    # Gemma 3's GeGLU: the tanh approximation, down to large negative and positive gates.
    h = 6 * torch.randn(7, 2 * 2048)
    h[0, :4] = torch.tensor([-60.0, -9.0, 9.0, 60.0])
    out = kernels.gelu_mul(h)
    gate, up = h.chunk(2, dim=-1)
    torch.testing.assert_close(out, F.gelu(gate, approximate="tanh") * up, rtol=1e-5, atol=1e-5)
    for i in range(7):
        assert torch.equal(kernels.gelu_mul(h[i : i + 1])[0], out[i])


@pytest.mark.parametrize("fmt", ["q4", "q8"])
def test_products_add_the_residual(fmt: str, isa: str) -> None:
    # The add happens in the tiles' stores: bitwise the residual plus the product, for every
    # row count (each tile size) and for a last unit of 8 and of 3 columns (the partial stores).
    from specdec.kernels import packing

    for out_features in (48, 40, 35):
        weight = torch.randn(out_features, 64)
        packed = (packing.pack_q4(*packing.quantize_q4(weight)) if fmt == "q4"
                  else packing.pack_q8(*packing.quantize_q8(weight)))
        product = kernels.q4_matmul if fmt == "q4" else kernels.q8_matmul
        for rows in (1, 3, 8, 11, 16, 27):
            x, residual = torch.randn(rows, 64), torch.randn(rows, out_features)
            assert torch.equal(product(x, packed, out_features, isa, residual=residual),
                               residual + product(x, packed, out_features, isa))


def test_a_query_that_sees_nothing_gets_zeros(isa: str) -> None:
    # A padding position whose mask row is empty: zeros, where a softmax over nothing is NaN.
    keys, values = _cache(1, 10, seed=4)
    q = torch.randn(1, HEADS, 2, HEAD_DIM)
    out = kernels.attend_cached(q, keys, values, torch.tensor([[0, 3]], dtype=torch.int32), isa=isa)
    assert torch.equal(out[0, 0], torch.zeros(HEADS * HEAD_DIM)) and bool(out[0, 1].abs().sum() > 0)


@pytest.mark.parametrize("vocab", [5, 1003])
def test_draft_distribution_is_pytorchs(vocab: int) -> None:
    # What a head's target view keeps of each position: the first most likely token, and the k
    # most likely draft tokens (positions in the draft ids, best first, ties to the earlier one)
    # with their probabilities under the softmax over the whole vocabulary.
    gen = torch.Generator().manual_seed(21)
    logits = 4 * torch.randn(37, vocab, generator=gen)
    logits[3] = 0.5  # a row of ties: the first position wins everywhere
    logits[4, vocab // 2] = logits[4, 1] = 30.0  # two maxima: the first one's index
    draft = torch.randperm(vocab, generator=gen)[: max(3, vocab // 3)]
    k = min(8, len(draft))
    top, index, values = kernels.draft_distribution(logits, draft, k)
    assert torch.equal(top, logits.argmax(-1)) and int(top[4]) == 1
    want_values, want_index = torch.softmax(logits.double(), -1)[:, draft].sort(dim=-1, descending=True, stable=True)
    assert torch.equal(index, want_index[:, :k])
    torch.testing.assert_close(values.double(), want_values[:, :k], rtol=1e-5, atol=1e-9)
    assert torch.equal(index[3], torch.arange(k))
    with pytest.raises(RuntimeError, match="outside the vocabulary"):
        kernels.draft_distribution(logits, torch.tensor([vocab]), 1)
    with pytest.raises(RuntimeError, match="k <= the draft tokens"):
        kernels.draft_distribution(logits, draft, len(draft) + 1)


@pytest.mark.parametrize("n", [1, 7, 8, 49, 1003])
def test_argmax_is_pytorchs(n: int) -> None:
    # Each row's first maximum, as torch.argmax: ties, a NaN (which counts as the maximum, the
    # first one's index), a row of -inf, a 3-D input and a non-contiguous one.
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(2, 23, n, generator=gen)
    x[0, 1] = 2.0  # all tied
    x[0, 2, n // 2] = x[0, 2, -1] = 50.0
    x[0, 3] = -float("inf")
    x[0, 4, n // 3] = float("nan")
    x[0, 5, -1] = x[0, 5, 0] = float("nan")
    x[0, 6, -1] = float("inf")
    assert torch.equal(kernels.argmax(x), x.argmax(-1))
    wide = torch.randn(9, 2 * n, generator=gen)[:, ::2]
    assert not wide.is_contiguous() and torch.equal(kernels.argmax(wide), wide.argmax(-1))
