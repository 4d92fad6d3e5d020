"""The small per-layer ops and the reductions over the vocabulary against their references
(reference.py), bit for bit: RMSNorm, the rotary split, SiLU and GELU times up, embedding rows,
argmax and the draft distribution; and row invariance: a row's bits never depend on the other rows
in the pass, which keeps verification lossless. These ops have one path, avx2's code, which
every path's CPU runs (they take no `isa`), so each runs once; the products' residual add runs on
every path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specdec import kernels
from specdec.kernels import packing, reference

pytestmark = pytest.mark.skipif(not kernels.available(), reason="specdec's kernels are not built on this machine")

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


@pytest.mark.parametrize("dim", [576, 100, 7])  # whole vectors of 8; a tail of 4; only a tail
def test_rms_norm_is_its_reference_and_row_invariant(dim: int) -> None:
    x = 4 * torch.randn(12, dim, generator=torch.Generator().manual_seed(dim))
    weight = torch.rand(dim) + 0.5
    out = kernels.rms_norm(x, weight, 1e-5)
    assert torch.equal(out, reference.rms_norm(x, weight, 1e-5))
    for i in range(12):
        assert torch.equal(kernels.rms_norm(x[i : i + 1], weight, 1e-5)[0], out[i])
    # ... which is RMSNorm within float32 rounding
    want = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5) * weight.double()
    torch.testing.assert_close(out.double(), want, rtol=2e-6, atol=1e-6)


def _rotary_inputs(rows: int, new: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(rows * new)
    qkv = torch.randn(rows * new, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=gen)
    angles = torch.rand(rows * new, HEAD_DIM // 2, generator=gen) * 6
    return qkv, torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()


def test_rotary_split_is_its_reference() -> None:
    qkv, cos, sin = _rotary_inputs(2, 3)
    got = kernels.rotary_split(qkv, cos, sin, 2, HEADS, KV_HEADS)
    for a, b in zip(got, reference.rotary_split(qkv, cos, sin, 2, HEADS, KV_HEADS)):
        assert torch.equal(a, b)
    assert torch.equal(got[2], qkv.view(2, 3, -1, HEAD_DIM).transpose(1, 2)[:, HEADS + KV_HEADS :])  # v as it is


def test_rotary_split_norms_each_query_and_key_head_first() -> None:
    # Qwen3: each query and key head RMS-normed (as rms_norm norms a row), then rotated.
    qkv, cos, sin = _rotary_inputs(2, 3)
    q_norm, k_norm = torch.rand(HEAD_DIM) + 0.5, torch.rand(HEAD_DIM) + 0.5
    got = kernels.rotary_split(qkv, cos, sin, 2, HEADS, KV_HEADS, q_norm, k_norm, 1e-6)
    for a, b in zip(got, reference.rotary_split(qkv, cos, sin, 2, HEADS, KV_HEADS, q_norm, k_norm, 1e-6)):
        assert torch.equal(a, b)


def test_silu_mul_is_its_reference_and_row_invariant() -> None:
    h = 6 * torch.randn(7, 2 * 1536, generator=torch.Generator().manual_seed(1))
    h[0, :6] = torch.tensor([-100.0, -9.0, 9.0, 100.0, 0.0, -0.0])  # both clamps of the exponential, signed zeros
    out = kernels.silu_mul(h)
    assert torch.equal(out, reference.silu_mul(h))
    for i in range(7):
        assert torch.equal(kernels.silu_mul(h[i : i + 1])[0], out[i])
    gate, up = h.chunk(2, dim=-1)
    torch.testing.assert_close(out, F.silu(gate) * up, rtol=1e-5, atol=1e-5)


def test_gelu_mul_is_its_reference_and_row_invariant() -> None:
    # Gemma 3's GeGLU: the tanh approximation, down to large negative and positive gates.
    h = 6 * torch.randn(7, 2 * 2048, generator=torch.Generator().manual_seed(2))
    h[0, :4] = torch.tensor([-60.0, -9.0, 9.0, 60.0])
    out = kernels.gelu_mul(h)
    assert torch.equal(out, reference.gelu_mul(h))
    for i in range(7):
        assert torch.equal(kernels.gelu_mul(h[i : i + 1])[0], out[i])
    gate, up = h.chunk(2, dim=-1)
    torch.testing.assert_close(out, F.gelu(gate, approximate="tanh") * up, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", ["q4", "q4k", "q5k", "q8", "q6k"])
def test_embedding_rows_are_their_reference(fmt: str) -> None:
    # Every record kind: float16 and float32 scales, nibbles and bytes, a scale per 16 inputs.
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(37, 256, generator=gen)
    if fmt in ("q4", "q8"):
        packed = packing.pack_q4(*packing.quantize_q4(weight)) if fmt == "q4" else packing.pack_q8(*packing.quantize_q8(weight))
    elif fmt == "q6k":  # Q6_K's: q in -32..31, a float32 scale per 16 inputs
        q = torch.randint(-32, 32, (37, 256), generator=gen)
        packed = packing.pack_q8(q, torch.rand(37, 16, generator=gen) / 300)
    else:  # Q4_K's or Q5_K's: float32 d and m that float16 cannot hold
        q = torch.randint(0, 16 if fmt == "q4k" else 32, (37, 256), generator=gen)
        packed = packing.pack_q4(q, torch.rand(37, 8, generator=gen) / 300, -torch.rand(37, 8, generator=gen) / 7)
    q8 = fmt in ("q8", "q6k")
    ids = torch.tensor([0, 17, 36, 5, 5])
    assert torch.equal(kernels.load().embed_rows(packed, ids, q8), reference.embed_rows(packed, ids, q8))
    with pytest.raises(RuntimeError, match="outside the matrix"):
        kernels.load().embed_rows(packed, torch.tensor([48]), q8)


@pytest.mark.parametrize("fmt", ["q4", "q8"])
def test_products_add_the_residual(fmt: str, isa: str) -> None:
    # The add happens in the tiles' stores: bitwise the residual plus the product, for every
    # row count (each tile size) and for a last unit of 8 and of 3 columns (the partial stores).
    for out_features in (48, 40, 35):
        weight = torch.randn(out_features, 64)
        packed = (packing.pack_q4(*packing.quantize_q4(weight)) if fmt == "q4"
                  else packing.pack_q8(*packing.quantize_q8(weight)))
        product = kernels.q4_matmul if fmt == "q4" else kernels.q8_matmul
        for rows in (1, 3, 8, 11, 16, 27):
            x, residual = torch.randn(rows, 64), torch.randn(rows, out_features)
            assert torch.equal(product(x, packed, out_features, isa, residual=residual),
                               residual + product(x, packed, out_features, isa))


@pytest.mark.parametrize("vocab", [5, 1003])
def test_draft_distribution_is_its_reference(vocab: int) -> None:
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
    for got, want in zip((top, index, values), reference.draft_distribution(logits, draft, k)):
        assert torch.equal(got, want)
    assert int(top[4]) == 1 and torch.equal(index[3], torch.arange(k))
    # ... which is the softmax's, within float32 rounding
    want_values, want_index = torch.softmax(logits.double(), -1)[:, draft].sort(dim=-1, descending=True, stable=True)
    assert torch.equal(index, want_index[:, :k])
    torch.testing.assert_close(values.double(), want_values[:, :k], rtol=1e-5, atol=1e-9)
    with pytest.raises(RuntimeError, match="outside the vocabulary"):
        kernels.draft_distribution(logits, torch.tensor([vocab]), 1)
    with pytest.raises(RuntimeError, match="k <= the draft tokens"):
        kernels.draft_distribution(logits, draft, len(draft) + 1)


@pytest.mark.parametrize("n", [1, 7, 8, 49, 1003])
def test_argmax_is_its_reference(n: int) -> None:
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
    assert torch.equal(kernels.argmax(x), reference.argmax_rows(x.reshape(-1, n)).view(2, 23))
    wide = torch.randn(9, 2 * n, generator=gen)[:, ::2]
    assert not wide.is_contiguous() and torch.equal(kernels.argmax(wide), reference.argmax_rows(wide))
