"""What holds the kernels to their references: every op the extension exports has one
(reference.REFERENCES), the paths have one vocabulary from the C++ to the user, and the
reference's own building blocks (an exact FMA, a correctly rounded square root, simd.h's
exponential) are what they claim."""

from __future__ import annotations

import math
import re
from fractions import Fraction

import pytest
import torch

from specdec import kernels
from specdec.kernels import reference

pytestmark = pytest.mark.skipif(not kernels.available(), reason="specdec's kernels are not built on this machine")


def test_every_op_the_extension_exports_has_a_reference() -> None:
    # A new binding fails here until reference.py has its arithmetic (or says why it computes nothing).
    exports = {name for name in dir(kernels.load()) if not name.startswith("_")}
    assert exports - set(reference.REFERENCES) - set(reference.NOT_OPS) == set()
    assert set(reference.REFERENCES) | set(reference.NOT_OPS) <= exports  # nothing stale either
    assert not set(reference.REFERENCES) & set(reference.NOT_OPS)
    assert all(function.__name__ == name for name, function in reference.REFERENCES.items())


def test_the_paths_have_one_vocabulary() -> None:
    # The C++'s codes and names (cpu.h's Isa and ISA_NAMES) are Python's, and the paths this CPU
    # runs, the reasons for the others and the default are said in those names.
    ops = kernels.load()
    assert ops.isa_names() == list(kernels.ISAS) and list(kernels.ISAS.values()) == list(range(len(kernels.ISAS)))
    assert list(kernels.PATHS) == list(kernels.ISAS)[1:]
    have = kernels.instruction_sets()
    assert "avx2" in have and set(have) <= set(kernels.PATHS) and kernels.default_isa() in have
    for path in kernels.PATHS:
        assert (path in have) == (ops.missing_reason(kernels.ISAS[path]) == "") == (kernels.missing_reason(path) == "")
    missing = [path for path in kernels.PATHS if path not in have]
    for path in missing:  # a forced path this CPU lacks is refused in its name, with the reason
        with pytest.raises(RuntimeError, match=re.escape(f"no {path} path: {kernels.missing_reason(path)}")):
            kernels.attend_cached(torch.randn(1, 1, 1, 64), torch.randn(1, 1, 2, 64), torch.randn(1, 1, 2, 64),
                                  torch.tensor([[2]], dtype=torch.int32), isa=path)


def _correctly_rounded(exact: Fraction) -> float:
    """exact rounded to the nearest float32, ties to even."""
    near = torch.tensor(float(exact), dtype=torch.float32)
    candidates = [torch.nextafter(near, torch.tensor(-math.inf)), near, torch.nextafter(near, torch.tensor(math.inf))]
    return float(min(candidates, key=lambda c: (abs(Fraction(float(c)) - exact), int(c.view(torch.int32)) & 1)))


def test_the_emulated_fma_rounds_once() -> None:
    gen = torch.Generator().manual_seed(0)
    a, b, c = (torch.randn(300, generator=gen) * 10 for _ in range(3))
    c[:100] = -(a[:100].double() * b[:100].double()).float()  # cancellation: the exact residue of a b
    got = reference.fma(a, b, c)
    for i in range(300):
        exact = Fraction(float(a[i])) * Fraction(float(b[i])) + Fraction(float(c[i]))
        assert float(got[i]) == _correctly_rounded(exact), i


def test_the_square_root_is_correctly_rounded() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.cat([torch.rand(2000, generator=gen) * 1000, torch.rand(2000, generator=gen) * 1e-30, torch.tensor([4.0, 2.0])])
    got = reference.sqrt(x)
    for i in range(0, len(x), 7):
        value = Fraction(float(x[i]))
        root = Fraction(float(got[i]))
        below = Fraction(float(torch.nextafter(got[i], torch.tensor(0.0))))
        above = Fraction(float(torch.nextafter(got[i], torch.tensor(math.inf))))
        assert ((root + below) / 2) ** 2 <= value <= ((root + above) / 2) ** 2, i
    assert float(got[-2]) == 2.0


def test_the_exponential_is_close_to_exp() -> None:
    # simd.h's polynomial: about 2e-7 relative over the softmax's range; clamped outside [-87, 88].
    x = torch.linspace(-87, 88, 20001)
    torch.testing.assert_close(reference.exp8(x).double(), x.double().exp(), rtol=4e-7, atol=0)
    assert torch.equal(reference.exp8(torch.tensor([-1000.0, 1000.0])), reference.exp8(torch.tensor([-87.0, 88.0])))
