"""specdec's quantized products against their PyTorch reference, bit for bit, on every
instruction-set path this CPU has; row invariance (a row's bits do not depend on how many rows
share the product, nor on the thread count); the packed layouts round-trip."""

from __future__ import annotations

import os
import re
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


def _q4k(out_features: int, in_features: int, seed: int, levels: int = 16):
    """Q4_K's values as q4 groups: d = d_super * scale and m = -dmin * min per group of 32 (float16
    d_super and dmin per 8 groups, 6-bit scale and min), which float16 cannot hold: 384-byte records.
    levels=32: Q5_K's, 5-bit values in 640-byte records of bytes."""
    generator = torch.Generator().manual_seed(seed)
    groups = in_features // 32
    q = torch.randint(0, levels, (out_features, in_features), generator=generator, dtype=torch.int32)
    supers = (groups + 7) // 8
    d_super = (torch.rand(out_features, supers, generator=generator) / 500).half().float().repeat_interleave(8, 1)
    dmin = (torch.rand(out_features, supers, generator=generator) / 500).half().float().repeat_interleave(8, 1)
    scale = torch.randint(0, 64, (out_features, groups), generator=generator).float()
    minimum = torch.randint(0, 64, (out_features, groups), generator=generator).float()
    d, m = d_super[:, :groups] * scale, -(dmin[:, :groups] * minimum)
    return q, d, m, packing.pack_q4(q, d, m)


def _q8(out_features: int, in_features: int, seed: int):
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed))
    q, d = packing.quantize_q8(weight)
    return q, d, packing.pack_q8(q, d)


def _q6k(out_features: int, in_features: int, seed: int):
    """Q6_K's values as q8 groups of 16: q in -32..31, d = d_super * scale (float16 d_super per 16
    groups, int8 scale), which float16 cannot hold: 640-byte records."""
    generator = torch.Generator().manual_seed(seed)
    groups = in_features // 16
    q = torch.randint(-32, 32, (out_features, in_features), generator=generator, dtype=torch.int32)
    supers = (groups + 15) // 16
    d_super = (torch.rand(out_features, supers, generator=generator) / 1000).half().float().repeat_interleave(16, 1)
    scale = torch.randint(-128, 128, (out_features, groups), generator=generator).float()
    d = d_super[:, :groups] * scale
    return q, d, packing.pack_q8(q, d)


def _activations(rows: int, in_features: int, seed: int) -> torch.Tensor:
    x = 3 * torch.randn(rows, in_features, generator=torch.Generator().manual_seed(seed))
    x[0, :32] = 0.0  # a block of zeros: d = 0, q = 0
    return x


def _q5k(out_features: int, in_features: int, seed: int):
    return _q4k(out_features, in_features, seed, levels=32)


Q4_KINDS = {"q4": (_q4, packing.Q4_RECORD), "q4k": (_q4k, packing.Q4F_RECORD), "q5k": (_q5k, packing.Q5_RECORD)}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", list(Q4_KINDS))
def test_q4_product_is_its_reference(isa: str, shape: tuple[int, int], kind: str) -> None:
    make, record = Q4_KINDS[kind]
    q, d, m, packed = make(*shape, seed=0)
    assert packed.shape[-1] == record
    x = _activations(11, shape[1], seed=1)
    assert torch.equal(kernels.q4_matmul(x, packed, shape[0], isa), reference.q4_matmul(x, q, d, m))


@pytest.mark.parametrize("kind", list(Q4_KINDS))
def test_q4_products_of_the_largest_values_are_exact(isa: str, kind: str) -> None:
    # Every weight at its top value (15, or 31 for Q5_K) against activations at +-127 in whole
    # blocks: the largest integer sums a path adds (AVX2 adds maddubs' pairs in 16 bits first).
    make, _ = Q4_KINDS[kind]
    q, d, m, _ = make(64, 512, seed=8)
    q = torch.full_like(q, 31 if kind == "q5k" else 15)
    packed = packing.pack_q4(q, d, m)
    x = torch.ones(4, 512)
    x[1] = -1.0
    x[2, ::2] = -1.0
    x[3, 256:] = -1.0
    got = kernels.q4_matmul(x, packed, 64, isa)
    assert torch.equal(got, reference.q4_matmul(x, q, d, m))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("scales", ["per 32", "per 16"])
def test_q8_product_is_its_reference(isa: str, shape: tuple[int, int], scales: str) -> None:
    q, d, packed = (_q8 if scales == "per 32" else _q6k)(*shape, seed=2)
    q[0, :5] = -128  # the extremes of a Q8_0 block
    q[1, :5] = 127
    packed = packing.pack_q8(q, d)
    assert packed.shape[-1] == (packing.Q8_RECORD if scales == "per 32" else packing.Q6_RECORD)
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
@pytest.mark.parametrize("fmt", ["q4", "q4k", "q5k", "q8", "q6k"])
def test_products_are_row_invariant(isa: str, fmt: str, threads: int) -> None:
    # 1..32 rows: every tile size and remainder of every path (AMX: a 16-row tile, then the rest
    # in one AMX tile from 8 rows or in VNNI tiles below).
    out_features, in_features = 576, 1536
    if fmt in Q4_KINDS:
        *_, packed = Q4_KINDS[fmt][0](out_features, in_features, seed=5)
        product = kernels.q4_matmul
    else:
        *_, packed = (_q8 if fmt == "q8" else _q6k)(out_features, in_features, seed=5)
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


@pytest.mark.parametrize("fmt", ["q4", "q4k", "q5k", "q8", "q6k"])
def test_every_path_gives_the_same_bits(isa: str, fmt: str) -> None:
    # Against the AVX2 path, which every supported CPU has: rows that fill AMX tiles (16, 32),
    # leave an AMX remainder (25 = 16 + 9) or a VNNI one (37 = 32 + 5); a last unit of 8 columns.
    if fmt in Q4_KINDS:
        *_, packed = Q4_KINDS[fmt][0](88, 256, seed=7)
        product = kernels.q4_matmul
    else:
        *_, packed = (_q8 if fmt == "q8" else _q6k)(88, 256, seed=7)
        product = kernels.q8_matmul
    for rows in (1, 9, 16, 25, 32, 37):
        x = _activations(rows, packed.shape[1] * 32, seed=8)
        assert torch.equal(product(x, packed, 88, isa), product(x, packed, 88, "avx2")), rows


@pytest.mark.parametrize("fmt", ["q4", "q4k", "q5k", "q8"])
@pytest.mark.parametrize("in_features", [32, 64, 96, 160])
def test_odd_block_counts_and_many_panels(isa: str, fmt: str, in_features: int) -> None:
    # 1, 2, 3 and 5 blocks of 32 (the AMX tiles run blocks four at a time, two products ahead of
    # their stores), and 150 rows: nine full panels of 16 (more than a group of eight, whose
    # units are split into bytes once) and a last panel of 6. Each row as it is alone.
    if fmt in Q4_KINDS:
        *_, packed = Q4_KINDS[fmt][0](40, in_features, seed=11)
        product = kernels.q4_matmul
    else:
        *_, packed = _q8(40, in_features, seed=11)
        product = kernels.q8_matmul
    x = _activations(150, in_features, seed=12)
    alone = torch.cat([product(x[i : i + 1], packed, 40, isa) for i in range(150)])
    for rows in (17, 24, 150):
        assert torch.equal(product(x[:rows], packed, 40, isa), alone[:rows]), rows


def test_packing_round_trips() -> None:
    q, d, m, packed = _q4(37, 96, seed=9)
    assert packed.shape == (3, 3, packing.Q4_RECORD)
    for got, want in zip(packing.unpack_q4(packed, 37), (q, d, m)):
        assert torch.equal(got, want)
    qk, dk, mk, packed_k = _q4k(37, 256, seed=9)
    assert packed_k.shape == (3, 8, packing.Q4F_RECORD)  # float32 scales: float16 would round them
    for got, want in zip(packing.unpack_q4(packed_k, 37), (qk, dk, mk)):
        assert torch.equal(got, want)
    rows = torch.tensor([0, 17, 36])
    for got, want in zip(packing.q4_rows(packed_k, rows), (qk[rows], dk[rows], mk[rows])):
        assert torch.equal(got, want)
    q5, d5, m5, packed5 = _q5k(37, 256, seed=9)
    assert packed5.shape == (3, 8, packing.Q5_RECORD) and int(q5.max()) > 15
    for got, want in zip(packing.unpack_q4(packed5, 37), (q5, d5, m5)):
        assert torch.equal(got, want)
    for got, want in zip(packing.q4_rows(packed5, rows), (q5[rows], d5[rows], m5[rows])):
        assert torch.equal(got, want)
    q6, d6, packed6 = _q6k(37, 256, seed=9)
    assert packed6.shape == (3, 8, packing.Q6_RECORD)
    for got, want in zip(packing.unpack_q8(packed6, 37), (q6, d6)):
        assert torch.equal(got, want)
    for got, want in zip(packing.q8_rows(packed6, rows), (q6[rows], d6[rows])):
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
    with pytest.raises(RuntimeError, match="record size"):
        kernels.q4_matmul(torch.randn(2, 64), torch.cat([packed, packed[..., :32]], dim=-1), 32)


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
        reason = kernels.load().missing_reason(kernels.ISAS["avx512_vnni"])  # this CPU's (empty on AVX-512 ones)
        with pytest.raises(kernels.KernelsUnavailable, match=f"SPECDEC_KERNELS=avx512_vnni: {re.escape(reason)}"):
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
