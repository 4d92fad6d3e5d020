"""specdec's quantized products against their PyTorch reference, bit for bit, on every
instruction-set path this CPU has; row invariance (a row's bits do not depend on how many rows
share the product, nor on the thread count); the packed layouts round-trip."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from specdec import kernels
from specdec.kernels import packing, reference

pytestmark = pytest.mark.skipif(not kernels.available(), reason="specdec's kernels are not built on this machine")

# The default model's shapes (query/key/value, output, gate/up, down, LM head) and odd ones:
# out_features not a multiple of 16, a single block.
SHAPES = [(960, 576), (576, 1536), (37, 96), (16, 32)]


def _q4(out_features: int, in_features: int, seed: int):
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed))
    q, d, m = packing.quantize_q4(weight)
    return q, d, m, packing.pack_q4(q, d, m)


def _q8(out_features: int, in_features: int, seed: int):
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed))
    q, d = packing.quantize_q8(weight)
    return q, d, packing.pack_q8(q, d)


def _activations(rows: int, in_features: int, seed: int) -> torch.Tensor:
    x = 3 * torch.randn(rows, in_features, generator=torch.Generator().manual_seed(seed))
    x[0, :32] = 0.0  # a block of zeros: d = 0, q = 0
    return x


@pytest.mark.parametrize("shape", SHAPES)
def test_q4_product_is_its_reference(isa: str, shape: tuple[int, int]) -> None:
    q, d, m, packed = _q4(*shape, seed=0)
    x = _activations(11, shape[1], seed=1)
    assert torch.equal(kernels.q4_matmul(x, packed, shape[0], isa), reference.q4_matmul(x, q, d, m))


@pytest.mark.parametrize("shape", SHAPES)
def test_q8_product_is_its_reference(isa: str, shape: tuple[int, int]) -> None:
    q, d, packed = _q8(*shape, seed=2)
    q[0, :5] = -128  # the extremes of a Q8_0 block
    q[1, :5] = 127
    packed = packing.pack_q8(q, d)
    x = _activations(11, shape[1], seed=3)
    assert torch.equal(kernels.q8_matmul(x, packed, shape[0], isa), reference.q8_matmul(x, q, d))


def test_reference_is_close_to_the_float_product() -> None:
    # What activation quantization costs: ~0.5% of the product's size on random data.
    q, d, m, _ = _q4(96, 576, seed=4)
    x = torch.randn(4, 576)
    weight = d.repeat_interleave(32, 1) * q.float() + m.repeat_interleave(32, 1)
    want = x @ weight.t()
    assert float((reference.q4_matmul(x, q, d, m) - want).norm() / want.norm()) < 0.01


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("fmt", ["q4", "q8"])
def test_products_are_row_invariant(isa: str, fmt: str, threads: int) -> None:
    # 1..32 rows: every tile size and remainder of every path (AMX: a 16-row tile, then the rest
    # in one AMX tile from 8 rows or in VNNI tiles below).
    out_features, in_features = 576, 1536
    if fmt == "q4":
        *_, packed = _q4(out_features, in_features, seed=5)
        product = kernels.q4_matmul
    else:
        *_, packed = _q8(out_features, in_features, seed=5)
        product = kernels.q8_matmul
    x = _activations(32, in_features, seed=6)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        alone = torch.cat([product(x[i : i + 1], packed, out_features, isa) for i in range(32)])
        for rows in range(2, 33):
            assert torch.equal(product(x[:rows], packed, out_features, isa), alone[:rows]), rows
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("fmt", ["q4", "q8"])
def test_every_path_gives_the_same_bits(isa: str, fmt: str) -> None:
    # Against the AVX2 path, which every supported CPU has: rows that fill AMX tiles (16, 32),
    # leave an AMX remainder (25 = 16 + 9) or a VNNI one (37 = 32 + 5); a last unit of 8 columns.
    if fmt == "q4":
        *_, packed = _q4(88, 192, seed=7)
        product = kernels.q4_matmul
    else:
        *_, packed = _q8(88, 192, seed=7)
        product = kernels.q8_matmul
    for rows in (1, 9, 16, 25, 32, 37):
        x = _activations(rows, 192, seed=8)
        assert torch.equal(product(x, packed, 88, isa), product(x, packed, 88, "avx2")), rows


def test_packing_round_trips() -> None:
    q, d, m, packed = _q4(37, 96, seed=9)
    assert packed.shape == (3, 3, packing.Q4_RECORD)
    for got, want in zip(packing.unpack_q4(packed, 37), (q, d, m)):
        assert torch.equal(got, want)
    q8, d8, packed8 = _q8(37, 96, seed=9)
    for got, want in zip(packing.unpack_q8(packed8, 37), (q8, d8)):
        assert torch.equal(got, want)


def test_bad_inputs_are_refused() -> None:
    *_, packed = _q4(32, 64, seed=10)
    with pytest.raises(RuntimeError, match="inputs"):
        kernels.q4_matmul(torch.randn(2, 96), packed, 32)
    with pytest.raises(RuntimeError, match="float32"):
        kernels.q4_matmul(torch.randn(2, 64).double(), packed, 32)
    with pytest.raises(ValueError, match="float16"):
        packing.pack_q4(torch.zeros(16, 32, dtype=torch.int32), torch.full((16, 1), 0.1), torch.zeros(16, 1))


def test_without_a_compiler_the_backend_falls_back_and_says_so(tmp_path) -> None:
    # A fresh cache and a compiler that fails: no extension, one line saying why, and GGUF blocks
    # run on PyTorch's int4/int8 kernels under `auto` instead.
    script = ("from specdec import kernels; from specdec.models.loader import default_model_path; "
              "from specdec.models.weights import GGUFWeights; w = GGUFWeights(default_model_path(), 9, 3); "
              "print(kernels.available(), w.auto_format('model.layers.0.mlp.up_proj.weight'), w.auto_format('lm_head.weight'))")
    env = {**os.environ, "SPECDEC_CACHE_DIR": str(tmp_path), "CXX": "/bin/false"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "int4", "int8"]
    assert done.stderr.count("specdec kernels unavailable: the extension did not build") == 1


def test_a_forced_path_this_machine_lacks_is_refused_with_its_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "instruction_sets", lambda: ["avx2"])
    monkeypatch.setenv(kernels.ENV_ISA, "amx")
    kernels.default_isa.cache_clear()
    try:
        with pytest.raises(kernels.KernelsUnavailable, match="SPECDEC_KERNELS=amx: "):
            kernels.default_isa()
        monkeypatch.setenv(kernels.ENV_ISA, "avx512_vnni")
        kernels.default_isa.cache_clear()
        with pytest.raises(kernels.KernelsUnavailable, match="no AVX512 VNNI"):
            kernels.default_isa()
    finally:
        monkeypatch.undo()
        kernels.default_isa.cache_clear()


def test_the_amx_path_is_offered_exactly_where_the_cpu_has_amx() -> None:
    # /proc/cpuinfo's flags against the extension's detection: a CPU with AMX-INT8 gets the path
    # unless Linux refused the tile state, which the reason then says; one without it never does.
    flags = open("/proc/cpuinfo", encoding="utf-8").read().split()
    if "amx_int8" in flags and "amx_tile" in flags and "avx512_vnni" in flags:
        assert "amx" in kernels.instruction_sets() or "Linux did not grant" in kernels.missing_reason("amx")
        if "amx" in kernels.instruction_sets():
            assert kernels.default_isa() == "amx" or os.environ.get(kernels.ENV_ISA, "auto") != "auto"
    else:
        assert "amx" not in kernels.instruction_sets() and kernels.missing_reason("amx")
