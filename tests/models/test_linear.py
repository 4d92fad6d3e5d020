"""thin_linear is F.linear computed another way: same results for every row count and shape;
use_thin_linear swaps classes in place and keeps the parameters."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from specdec.models.linear import THIN_ROWS_MAX, ThinLinear, thin_linear, use_thin_linear


# 1 .. 20 rows: both sides of THIN_ROWS_MAX, where thin_linear switches back to F.linear.
@pytest.mark.parametrize("rows", range(1, 21))
@pytest.mark.parametrize("with_bias", [False, True])
def test_thin_linear_equals_f_linear_2d(rows: int, with_bias: bool) -> None:
    assert THIN_ROWS_MAX < 20
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=gen)
    weight = torch.randn(80, 96, generator=gen)
    bias = torch.randn(80, generator=gen) if with_bias else None
    out = thin_linear(x, weight, bias)
    assert out.shape == (rows, 80)
    torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(1, 1), (1, 5), (2, 3), (3, 3), (1, 9), (4, 6)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_thin_linear_equals_f_linear_3d(shape: tuple[int, int], with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, 64, generator=gen)
    weight = torch.randn(48, 64, generator=gen)
    bias = torch.randn(48, generator=gen) if with_bias else None
    out = thin_linear(x, weight, bias)
    assert out.shape == (*shape, 48)
    torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


def test_thin_linear_handles_non_contiguous_input() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3, generator=gen).T  # [3, 64], a transposed view
    weight = torch.randn(32, 64, generator=gen)
    assert not x.is_contiguous()
    torch.testing.assert_close(thin_linear(x, weight), F.linear(x, weight), rtol=1e-5, atol=1e-5)


def test_use_thin_linear_converts_in_place_and_keeps_parameters() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Sequential(nn.Linear(16, 4, bias=False)), nn.LayerNorm(4))
    before = {name: p for name, p in model.named_parameters()}
    pointers = {name: p.data_ptr() for name, p in before.items()}
    x = torch.randn(3, 8)
    expected = model(x)
    assert use_thin_linear(model) == 2
    assert type(model[0]) is ThinLinear and type(model[2][0]) is ThinLinear
    assert type(model[3]) is nn.LayerNorm
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()
    assert all(after[name] is before[name] for name in before)
    assert all(after[name].data_ptr() == pointers[name] for name in before)
    torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)
    # Converting again finds nothing left to convert.
    assert use_thin_linear(model) == 0


def test_loaded_models_use_thin_linear_unless_asked_not_to(tiny_model_dir) -> None:
    from specdec.models import load_model

    fast = load_model(str(tiny_model_dir), backend="hf")
    plain = load_model(str(tiny_model_dir), backend="hf", fast_kernels=False)
    assert any(isinstance(m, ThinLinear) for m in fast.model.modules())
    assert not any(isinstance(m, ThinLinear) for m in plain.model.modules())
    tokens = torch.tensor([[5, 17, 300, 900]])
    with torch.inference_mode():
        torch.testing.assert_close(
            fast.model(input_ids=tokens).logits, plain.model(input_ids=tokens).logits, rtol=1e-5, atol=1e-5
        )
