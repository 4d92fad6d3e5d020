"""specdec's own CPU kernels (a C++ extension), built on first use into the cache.

`quant.cpp` holds products of a few float rows with GGUF-style quantized weights (q4: Q4_0/Q4_1
blocks, q8: Q8_0 blocks), with AVX-512 VNNI and AVX2 paths chosen at run time; `packing.py` lays
weights out for them and `reference.py` is the plain PyTorch arithmetic they are tested against
bit for bit. The extension is compiled once per machine and torch version with the compiler on
the machine (about a minute on two cores); where it cannot be built (no compiler, no AVX2),
:func:`load` says why once and the native backend runs PyTorch's own int4/int8 kernels instead.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
from pathlib import Path
from types import ModuleType

import torch

from specdec.paths import cache_dir

log = logging.getLogger("specdec.kernels")

SOURCE = Path(__file__).with_name("quant.cpp")
# The instruction sets a product may be asked to run on: auto picks the best this CPU has.
ISAS = {"auto": 0, "avx2": 1, "avx512_vnni": 2}
# Set to `avx2` to run the AVX2 path on an AVX-512 machine (tests and comparisons), or `off`.
ENV_ISA = "SPECDEC_KERNELS"


class KernelsUnavailable(RuntimeError):
    """The extension cannot be built or run on this machine."""


def build_dir() -> Path:
    return cache_dir() / "kernels" / f"torch-{torch.__version__}-{platform.machine()}"


@functools.cache
def _build() -> ModuleType | str:
    """The compiled extension, or why there is none."""
    if os.environ.get(ENV_ISA, "auto") == "off":
        return f"{ENV_ISA}=off"
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"the kernels are written for x86-64, this is {platform.machine()}"
    try:
        from torch.utils import cpp_extension

        directory = build_dir()
        directory.mkdir(parents=True, exist_ok=True)
        module = cpp_extension.load(
            name="specdec_kernels", sources=[str(SOURCE)], build_directory=str(directory),
            # Baseline x86-64 code; the AVX2 and AVX-512 functions carry their own target
            # attributes and are chosen at run time. No FMA contraction: the reference's float
            # operations are separate multiplies and adds, and the kernels must round alike.
            # OpenMP: at::parallel_for is a pragma in torch's headers; the library it links
            # (libgomp.so.1) resolves to the one torch has loaded, so both share one thread pool.
            extra_cflags=["-O3", "-ffp-contract=off", "-fno-math-errno", "-fopenmp"],
            extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:  # noqa: BLE001 - any build failure means: run without the kernels
        return f"the extension did not build ({type(exc).__name__}: {str(exc).strip().splitlines()[-1][:200]})"
    if "avx2" not in module.instruction_sets():
        return "this CPU has no AVX2"
    return module


def load() -> ModuleType:
    """The extension (built on first call); raises :class:`KernelsUnavailable` with the reason."""
    built = _build()
    if isinstance(built, str):
        raise KernelsUnavailable(built)
    return built


@functools.cache
def available() -> bool:
    """Whether the kernels run here; says once, in the log, why not."""
    built = _build()
    if isinstance(built, str):
        log.warning("specdec kernels unavailable: %s; the native backend uses PyTorch's int4/int8 kernels", built)
        return False
    return True


def instruction_sets() -> list[str]:
    """The kernel paths this CPU runs (`avx2`, `avx512_vnni`); empty without the extension."""
    return list(load().instruction_sets()) if available() else []


@functools.cache
def default_isa() -> str:
    """The path products take: the best this CPU has, unless `$SPECDEC_KERNELS` names one
    (read once per process)."""
    wanted = os.environ.get(ENV_ISA, "auto")
    if wanted not in ISAS:
        raise KernelsUnavailable(f"{ENV_ISA}={wanted!r}: choose one of {', '.join(ISAS)} or off")
    if wanted == "auto":
        return "avx512_vnni" if "avx512_vnni" in instruction_sets() else "avx2"
    return wanted


def q4_matmul(x: torch.Tensor, packed: torch.Tensor, out_features: int, isa: str | None = None) -> torch.Tensor:
    """x [rows, in] float32 times q4-packed weights ([units, blocks, 320] uint8) -> [rows, out] float32."""
    return load().q4_matmul(x, packed, out_features, ISAS[isa or default_isa()])


def q8_matmul(x: torch.Tensor, packed: torch.Tensor, out_features: int, isa: str | None = None) -> torch.Tensor:
    """x [rows, in] float32 times q8-packed weights ([units, blocks, 544] uint8) -> [rows, out] float32."""
    return load().q8_matmul(x, packed, out_features, ISAS[isa or default_isa()])
