"""The float16-weight product (`half.cpp`) against its PyTorch reference, bit for bit, on every
instruction-set path this CPU has; row invariance over 1..32 rows and 1 or 2 threads; the residual;
bad inputs refused."""

from __future__ import annotations

import pytest
import torch

from specdec import kernels
from specdec.kernels import reference

pytestmark = pytest.mark.skipif(not kernels.available(), reason="specdec's kernels are not built on this machine")

# The default model's shapes, an out_features that leaves single columns (37), one step of 16 inputs.
SHAPES = [(960, 576), (576, 1536), (37, 96), (5, 16)]


def _weight(out_features: int, in_features: int, seed: int) -> torch.Tensor:
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed)) / 10
    weight[0, :3] = torch.tensor([65504.0, -65504.0, 6e-8])  # float16's extremes and a subnormal
    return weight.half()


def _activations(rows: int, in_features: int, seed: int) -> torch.Tensor:
    x = 3 * torch.randn(rows, in_features, generator=torch.Generator().manual_seed(seed))
    x[0, :3] = torch.tensor([1e-3, 2e-3, 1.0])
    return x


@pytest.mark.parametrize("shape", SHAPES)
def test_half_product_is_its_reference(isa: str, shape: tuple[int, int]) -> None:
    weight = _weight(*shape, seed=0)
    x = _activations(11, shape[1], seed=1)
    got = kernels.f16_matmul(x, weight, isa)
    assert torch.equal(got, reference.f16_matmul(x, weight))
    # ... which is the float product within float32 rounding.
    want = (x.double() @ weight.double().t()).float()
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-2)


def test_the_residual_is_added_last(isa: str) -> None:
    weight = _weight(96, 64, seed=2)
    x, residual = _activations(3, 64, seed=3), torch.randn(3, 96)
    assert torch.equal(kernels.f16_matmul(x, weight, isa, residual), reference.f16_matmul(x, weight) + residual)


@pytest.mark.parametrize("threads", [1, 2])
def test_half_product_is_row_invariant(isa: str, threads: int) -> None:
    weight = _weight(576, 1536, seed=4)
    x = _activations(32, 1536, seed=5)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        alone = torch.cat([kernels.f16_matmul(x[i : i + 1], weight, isa) for i in range(32)])
        for rows in range(2, 33):
            assert torch.equal(kernels.f16_matmul(x[:rows], weight, isa), alone[:rows]), rows
    finally:
        torch.set_num_threads(before)


def test_every_path_gives_the_same_bits(isa: str) -> None:
    weight = _weight(88, 256, seed=6)
    for rows in (1, 3, 8, 17):
        x = _activations(rows, 256, seed=7)
        assert torch.equal(kernels.f16_matmul(x, weight, isa), kernels.f16_matmul(x, weight, "avx2")), rows


def test_bad_inputs_are_refused() -> None:
    weight = _weight(32, 64, seed=8)
    with pytest.raises(RuntimeError, match="inputs"):
        kernels.f16_matmul(torch.randn(2, 96), weight)
    with pytest.raises(RuntimeError, match="float32"):
        kernels.f16_matmul(torch.randn(2, 64).double(), weight)
    with pytest.raises(RuntimeError, match="float16"):
        kernels.f16_matmul(torch.randn(2, 64), weight.float())
    with pytest.raises(RuntimeError, match="divisible by 16"):
        kernels.f16_matmul(torch.randn(2, 40), torch.randn(8, 40).half())
