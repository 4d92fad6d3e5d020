"""Attention over the KV cache (attention.cpp) against its reference (reference.attend_cached), bit
for bit on every path: the reference keeps the kernel's fixed order (each score an FMA chain per
lane, then the path's tree over 8 or 16 lanes; the softmax's exponentials and sum; the values'
FMAs in slot order), its FMAs emulated exactly, so no tolerance is needed. And query invariance:
a query's bits never depend on the other queries, rows or threads of the pass."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specdec import kernels
from specdec.kernels import reference

pytestmark = pytest.mark.skipif(not kernels.available(), reason="specdec's kernels are not built on this machine")

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
# avx2 sums a score's 8 lanes; avx512_vnni (and amx under it) 16 for head_dim 64 and 128, the
# avx2 code otherwise: reference.score_lanes. The `isa` parameter comes from conftest.py.


def _cache(rows: int, span: int, seed: int, head_dim: int = HEAD_DIM) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    # Views into a longer preallocated buffer, as the KV caches hand them out.
    keys = torch.randn(rows, KV_HEADS, span + 17, head_dim, generator=gen)[:, :, :span]
    values = torch.randn(rows, KV_HEADS, span + 17, head_dim, generator=gen)[:, :, :span]
    return keys, values


@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_attention_over_prefixes_is_its_reference(isa: str, head_dim: int) -> None:
    # Block tails (1, 2, 3, 9 slots), and long prefixes; a float16 cache as its widened values.
    keys, values = _cache(2, 300, seed=0, head_dim=head_dim)
    q = torch.randn(2, HEADS, 5, head_dim, generator=torch.Generator().manual_seed(head_dim))
    counts = torch.tensor([[290, 291, 17, 293, 300], [1, 2, 3, 9, 100]], dtype=torch.int32)
    for k, v in ((keys, values), (keys.half(), values.half())):
        got = kernels.attend_cached(q, k, v, counts, isa=isa)  # [rows, new, heads * head_dim]
        assert torch.equal(got, reference.attend_cached(q, k, v, counts, isa=isa)), k.dtype


def test_attention_over_listed_slots_is_its_reference(isa: str) -> None:
    # A token tree: each node sees its own slots (listed in order, padded past its count).
    keys, values = _cache(1, 64, seed=1)
    q = torch.randn(1, HEADS, 3, HEAD_DIM, generator=torch.Generator().manual_seed(1))
    seen = [torch.tensor([0, 1, 2, 40]), torch.tensor([0, 1, 2, 41]), torch.tensor([0, 1, 2, 40, 42])]
    slots = torch.zeros(1, 3, 5, dtype=torch.int32)
    for i, s in enumerate(seen):
        slots[0, i, : len(s)] = s
    counts = torch.tensor([[len(s) for s in seen]], dtype=torch.int32)
    got = kernels.attend_cached(q, keys, values, counts, slots, isa=isa)
    assert torch.equal(got, reference.attend_cached(q, keys, values, counts, slots, isa=isa))
    # Listing a prefix's slots is the prefix, bit for bit (20 slots: a block of 16 and a tail).
    prefix = torch.arange(20, dtype=torch.int32).expand(1, 1, 20).contiguous()
    twenty = torch.tensor([[20]], dtype=torch.int32)
    assert torch.equal(kernels.attend_cached(q[:, :, :1], keys, values, twenty, prefix, isa=isa),
                       kernels.attend_cached(q[:, :, :1], keys, values, twenty, isa=isa))


@pytest.mark.parametrize("lanes", [8, 16])
def test_the_reference_is_attention(lanes: int) -> None:
    # The reference's order of operations against PyTorch's attention, within float32 rounding,
    # for both trees of the scores' lanes (what the kernels' bits are held to is attention).
    keys, values = _cache(1, 120, seed=7)
    q = torch.randn(1, HEADS, 2, HEAD_DIM, generator=torch.Generator().manual_seed(7))
    counts = torch.tensor([[120, 33]], dtype=torch.int32)
    got = reference.attend_cached(q, keys, values, counts, isa="avx2" if lanes == 8 else "avx512_vnni")
    for i, n in enumerate((120, 33)):
        want = F.scaled_dot_product_attention(q[:, :, i : i + 1], keys[:, :, :n], values[:, :, :n], enable_gqa=True)
        torch.testing.assert_close(got[0, i], want.transpose(1, 2).reshape(-1), rtol=1e-5, atol=1e-6)


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
    # ... and the prefill's route is the reference's arithmetic too (a few queries of it)
    few = [0, 15, 36]
    assert torch.equal(together[:, few], reference.attend_cached(q[:, :, few], keys.half(), values.half(),
                                                                 counts[:, few].contiguous(), isa=isa))


def test_a_query_that_sees_nothing_gets_zeros(isa: str) -> None:
    # A padding position whose mask row is empty: zeros, where a softmax over nothing is NaN.
    keys, values = _cache(1, 10, seed=4)
    q = torch.randn(1, HEADS, 2, HEAD_DIM)
    out = kernels.attend_cached(q, keys, values, torch.tensor([[0, 3]], dtype=torch.int32), isa=isa)
    assert torch.equal(out[0, 0], torch.zeros(HEADS * HEAD_DIM)) and bool(out[0, 1].abs().sum() > 0)


def test_attention_refuses_keys_and_values_of_two_formats() -> None:
    keys, values = _cache(1, 10, seed=5)
    with pytest.raises(RuntimeError, match="both float32 or both float16"):
        kernels.attend_cached(torch.randn(1, HEADS, 1, HEAD_DIM), keys.half(), values, torch.tensor([[4]], dtype=torch.int32))


def test_attention_refuses_slots_past_the_cache() -> None:
    keys, values = _cache(1, 10, seed=3)
    q = torch.randn(1, HEADS, 1, HEAD_DIM)
    with pytest.raises(RuntimeError, match="past the cache"):
        kernels.attend_cached(q, keys, values, torch.tensor([[11]], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="past the cache"):
        kernels.attend_cached(q, keys, values, torch.tensor([[2]], dtype=torch.int32),
                              torch.tensor([[[0, 10]]], dtype=torch.int32))
