"""The r8 products (rotated.cpp): the rotation and the products bitwise their PyTorch reference on
every path, row-invariant, and close to the float product."""

from __future__ import annotations

import pytest
import torch

from specdec import kernels
from specdec.kernels import packing, reference

pytestmark = pytest.mark.skipif(not kernels.available(), reason="specdec's kernels are not built on this machine")


def _matrix(out_features: int, in_features: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=g) * 0.05
    q, s = packing.quantize_r8(weight)
    return weight, q, s, packing.pack_r8(q, s)


def _activations(rows: int, in_features: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=g)
    x[:, 3] *= 30  # an outlier input, which the rotation spreads
    return x


@pytest.mark.parametrize("in_features", [64, 192, 576, 1536, 2048])
def test_the_rotation_is_its_reference(isa: str, in_features: int) -> None:
    # (AVX2 rotates 8 lanes at a time, the other paths 16: the same bits)
    x = _activations(7, in_features, seed=1)
    assert torch.equal(kernels.load().rotate_rows(x, kernels.ISAS[isa]), reference.rotate_rows(x))


@pytest.mark.parametrize("in_features", [64, 576])
def test_the_stored_weights_undo_the_rotation(in_features: int) -> None:
    # (x R) (W R^-T)^T = x W^T, and unrotate_weights inverts rotate_weights.
    weight, *_ = _matrix(24, in_features, seed=2)
    x = _activations(3, in_features, seed=3).double()
    rotated = packing.rotate_weights(weight)
    torch.testing.assert_close(reference.rotate_rows(x.float()).double() @ rotated.t(), x @ weight.double().t(),
                               rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(packing.unrotate_weights(rotated), weight.double(), rtol=1e-5, atol=1e-6)
    assert torch.equal(packing.rotate_weights(weight), rotated)  # deterministic


@pytest.mark.parametrize("shape", [(16, 64), (40, 576), (33, 1536), (8, 192), (100, 128)])
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 9, 16, 25, 40])
def test_r8_product_is_its_reference(isa: str, shape: tuple[int, int], rows: int) -> None:
    out_features, in_features = shape
    _, q, s, packed = _matrix(out_features, in_features, seed=4)
    x = _activations(rows, in_features, seed=5)
    residual = torch.randn(rows, out_features)
    want = reference.r8_matmul(x, q, s)
    ops = kernels.load()
    assert torch.equal(ops.r8_matmul(x, packed, out_features, kernels.ISAS[isa], None), want)
    assert torch.equal(ops.r8_matmul(x, packed, out_features, kernels.ISAS[isa], residual), residual + want)


@pytest.mark.parametrize("threads", [1, 2])
def test_r8_products_are_row_invariant(isa: str, threads: int) -> None:
    out_features, in_features = 72, 576
    _, _, _, packed = _matrix(out_features, in_features, seed=6)
    x = _activations(40, in_features, seed=7)
    ops, code = kernels.load(), kernels.ISAS[isa]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        alone = torch.cat([ops.r8_matmul(x[i : i + 1], packed, out_features, code, None) for i in range(40)])
        for rows in range(2, 41):
            assert torch.equal(ops.r8_matmul(x[:rows], packed, out_features, code, None), alone[:rows]), rows
    finally:
        torch.set_num_threads(before)


def test_r8_is_close_to_the_float_product() -> None:
    # An int8 weight a column and an int8 activation a row, after the rotation: ~1% of the
    # product's size on random data, outlier included.
    weight, q, s, _ = _matrix(96, 576, seed=8)
    x = _activations(6, 576, seed=9)
    want = x @ weight.t()
    assert float((reference.r8_matmul(x, q, s) - want).norm() / want.norm()) < 0.03


def test_r8_packing_round_trips() -> None:
    _, q, s, packed = _matrix(40, 192, seed=10)
    assert packed.shape == (3, 192 * 16 + 64)
    got_q, got_s = packing.unpack_r8(packed, 40)
    assert torch.equal(got_q, q.to(torch.int32)) and torch.equal(got_s, s)
    assert int(q.abs().max()) <= 127


def test_r8_quantizes_a_matrix_the_same_in_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    # A big matrix (a 262k-token LM head) is rotated a few thousand columns at a time: each
    # column's values do not depend on how many are rotated with it.
    weight = torch.randn(40, 128)
    whole = packing.quantize_r8(weight)
    monkeypatch.setattr(packing, "R8_ROWS_AT_ONCE", 7)
    parts = packing.quantize_r8(weight)
    assert torch.equal(whole[0], parts[0]) and torch.equal(whole[1], parts[1])


def test_bad_r8_inputs_are_refused() -> None:
    _, _, _, packed = _matrix(16, 128, seed=11)
    ops = kernels.load()
    with pytest.raises(RuntimeError, match="divisible by 64"):
        ops.r8_matmul(torch.randn(2, 96), packed, 16, 0, None)
    with pytest.raises(RuntimeError, match="inputs a column"):
        ops.r8_matmul(torch.randn(2, 64), packed, 16, 0, None)
    with pytest.raises(ValueError, match="divisible by 64"):
        packing.rotate_weights(torch.randn(4, 96))
