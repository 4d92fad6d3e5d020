"""specdec's own CPU kernels (a C++ extension), built on first use into the cache.

`quant.cpp` holds products of a few float rows with GGUF-style quantized weights (q4: Q4_0/Q4_1
blocks, q8: Q8_0 blocks), `amx.cpp` their AMX tiles, `rotated.cpp` the r8 products and `half.cpp`
float16 weights' (GGUF's F16); `packing.py` lays weights out for them. `attention.cpp` attends a
few queries per row over the KV cache in one call a layer; `layer_ops.cpp` fuses RMSNorm, the
rotary embedding with the query/key/value split, and SiLU(gate) * up (GELU for Gemma);
`distribution.cpp` reduces logits over the vocabulary; `forward.cpp` runs the decoder layers of a
pass in one call of those same kernels; `pool.cpp` is the thread pool they share (work claimed in
chunks, so a descheduled thread stalls nobody); `bindings.cpp` holds the module's Python
functions (`ops.h` declares what the sources share; only the bindings include pybind11).
`cpu.cpp` detects the CPU at run time and picks each op's path, named alike everywhere (`ISAS`:
avx2, avx512_vnni, amx). `reference.py` has every exported op's arithmetic in plain PyTorch, which
tests/kernels holds each kernel to bit for bit on every path; a row's result never depends on the
other rows. The extension is compiled once per machine, torch installation and version of its
sources with the compiler on the machine (an edited source is a new version: the next load
rebuilds); where it cannot be built (no compiler, no avx2 path), :func:`load` says why once and
the native backend runs PyTorch's own int4/int8 kernels instead.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import sys
from pathlib import Path
from collections.abc import Callable, Iterator
from types import ModuleType

import torch

import specdec._openmp as _openmp
from specdec.paths import cache_dir

log = logging.getLogger("specdec.kernels")

SOURCES = [Path(__file__).with_name(name)
           for name in ("cpu.cpp", "quant.cpp", "amx.cpp", "rotated.cpp", "half.cpp", "attention.cpp", "layer_ops.cpp", "forward.cpp", "pool.cpp",
                        "distribution.cpp", "bindings.cpp")]
# The kernel paths an op may be asked to run on, by name and by the code the extension takes (its
# cpu.h's Isa and ISA_NAMES, which a test holds to these): auto picks the best this CPU has. These
# names are the only ones the kernels, `instruction_sets()`, errors and the CLI use.
ISAS = {"auto": 0, "avx2": 1, "avx512_vnni": 2, "amx": 3}
# The paths, slowest first: avx2 (every supported CPU), avx512_vnni, and amx: AMX tiles for products
# of 16 rows or more (fewer rows, attention and the rest run avx512_vnni under it).
PATHS = ("avx2", "avx512_vnni", "amx")
# Set to a path this CPU has (`avx2`, `avx512_vnni`, `amx`) to force it, e.g. the avx2 path on an
# AVX-512 machine for tests and comparisons, or to `off`.
ENV_ISA = "SPECDEC_KERNELS"


class KernelsUnavailable(RuntimeError):
    """The extension cannot be built or run on this machine."""


HEADERS = [Path(__file__).with_name(name) for name in ("cpu.h", "simd.h", "ops.h", "quant.h", "pool.h")]


def _sources_digest() -> str:
    digest = hashlib.sha256()
    for path in [*SOURCES, *HEADERS]:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def build_dir() -> Path:
    """One directory per torch installation, machine and version of the sources: checkouts with
    the same sources and environment share a build, and different ones do not rebuild each
    other's (the build's commands name the installation's headers, so two environments in one
    directory would each rebuild what the other built)."""
    installation = hashlib.sha256(str(Path(torch.__file__).resolve().parent).encode()).hexdigest()[:8]
    return cache_dir() / "kernels" / f"torch-{torch.__version__}-{platform.machine()}-{_sources_digest()}-{installation}"


@contextlib.contextmanager
def _build_lock(directory: Path) -> Iterator[None]:
    """The build directory's own lock, held while a process builds or loads the extension: an OS
    lock (flock) that dies with its process. Under it, torch's build lock (a plain file, which a
    killed build leaves behind and every later build would wait on) can only be a dead build's,
    and is removed."""
    with open(directory / "specdec.lock", "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            (directory / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _staged_sources(directory: Path) -> list[str]:
    """The sources copied into the build directory, so that the build never depends on where the
    checkout is (torch's build rules name the source paths)."""
    staged = directory / "src"
    staged.mkdir(parents=True, exist_ok=True)
    for path in [*SOURCES, *HEADERS]:
        target = staged / path.name
        if not target.exists() or target.read_bytes() != path.read_bytes():
            shutil.copyfile(path, target)
    return [str(staged / path.name) for path in SOURCES]


@functools.cache
def _build() -> ModuleType | str:
    """The compiled extension, or why there is none."""
    if os.environ.get(ENV_ISA, "auto") == "off":
        return f"{ENV_ISA}=off"
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"the kernels are written for x86-64, this is {platform.machine()}"
    try:
        directory = build_dir()
        directory.mkdir(parents=True, exist_ok=True)
        with _build_lock(directory):
            if not (directory / "specdec_kernels.so").exists():
                # A silent minute would look like a hang, and a killed build costs the next start
                # the whole build again: say what is happening, once.
                print("specdec: compiling its CPU kernels for this machine and torch (once; about 30 s to "
                      "2 minutes on two cores)...", file=sys.stderr, flush=True)
            module = _compile(directory)
    except Exception as exc:  # noqa: BLE001 - any build failure means: run without the kernels
        return f"the extension did not build ({type(exc).__name__}: {str(exc).strip().splitlines()[-1][:200]})"
    if "avx2" not in module.instruction_sets():
        return f"no avx2 path: {module.missing_reason(ISAS['avx2'])}"
    return module


CFLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno"]  # the kernels' compiler flags (see _compile)


def _compile(directory: Path) -> ModuleType:
    """torch's build of the extension into `directory` (or its load, where the build is current)."""
    from torch.utils import cpp_extension

    return cpp_extension.load(
        name="specdec_kernels", sources=_staged_sources(directory), build_directory=str(directory),
        # Baseline x86-64 code; the AVX2, AVX-512 and AMX functions carry their own target
        # attributes and are chosen at run time. No FMA contraction: the reference's float
        # operations are separate multiplies and adds, and the kernels must round alike.
        # No OpenMP: the kernels run on their own pool (pool.cpp).
        extra_cflags=CFLAGS, verbose=False)


def load() -> ModuleType:
    """The extension (built on first call); raises :class:`KernelsUnavailable` with the reason."""
    built = _build()
    if isinstance(built, str):
        raise KernelsUnavailable(built)
    return built


@contextlib.contextmanager
def torch_ops_inline(when: bool = True) -> Iterator[None]:
    """torch's own operations on the calling thread alone while specdec's kernels keep their
    threads: for the work between two passes (acceptance, penalties, logprobs), where torch was
    imported before specdec and nobody bounded OpenMP's spinning (`specdec._openmp`). An
    operation over a vocabulary's logits is big enough for torch to split it among its OpenMP
    threads, which then spin, waiting for more work, on the cores the kernels' pool needs for the
    next pass: that pass loses a core for part of its time (a sampled step's pass ran far slower
    than a greedy one's: benchmarks/results/history/2026-12-07-xeon-torch-threads-huge-pages-eagle-step.md).
    On one thread those small operations cost little. Elsewhere (the CLI, the server, a script
    importing specdec first), or without `when`, this does nothing."""
    threads = torch.get_num_threads()
    if not when or threads == 1 or _openmp.spin_bounded:
        yield
        return
    held = available()
    if held:
        load().hold_threads(threads)
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        if held:
            load().hold_threads(0)


@functools.cache
def available() -> bool:
    """Whether the kernels run here; says once, in the log, why not."""
    built = _build()
    if isinstance(built, str):
        log.warning("specdec kernels unavailable: %s; the native backend uses PyTorch's int4/int8 kernels", built)
        return False
    return True


def instruction_sets() -> list[str]:
    """The kernel paths this CPU runs (`avx2`, `avx512_vnni`, `amx`); empty without the extension."""
    return list(load().instruction_sets()) if available() else []


@functools.cache
def default_isa() -> str:
    """The path products take: the best this CPU has, unless `$SPECDEC_KERNELS` names one
    (read once per process)."""
    wanted = os.environ.get(ENV_ISA, "auto")
    if wanted not in ISAS:
        raise KernelsUnavailable(f"{ENV_ISA}={wanted!r}: choose one of {', '.join(ISAS)} or off")
    have = instruction_sets()
    if wanted == "auto":
        return next((isa for isa in ("amx", "avx512_vnni") if isa in have), "avx2")
    if wanted not in have:
        raise KernelsUnavailable(f"{ENV_ISA}={wanted}: {missing_reason(wanted)}")
    return wanted


def missing_reason(isa: str = "auto") -> str:
    """Why this machine has no `isa` path (`auto`: no path at all); empty where it has one."""
    if not available():
        return f"specdec kernels unavailable: {_build()}"
    if isa == "auto" or isa in instruction_sets():
        return ""
    return load().missing_reason(ISAS[isa])


def product(fmt: str, isa: str | None = None) -> Callable[..., torch.Tensor]:
    """The extension's `q4_matmul`, `q8_matmul` or `f16_matmul` with the instruction set bound: called as
    `f(x, packed, out_features, residual)` (the hot path: no look-ups per call)."""
    function, code = getattr(load(), f"{fmt}_matmul"), ISAS[isa or default_isa()]
    return lambda x, packed, out_features, residual=None: function(x, packed, out_features, code, residual)


def q4_matmul(x: torch.Tensor, packed: torch.Tensor, out_features: int, isa: str | None = None,
              residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, in] float32 times q4-packed weights ([units, blocks, 320 or 384] uint8) -> [rows, out] float32,
    plus `residual` ([rows, out] float32) where given."""
    return load().q4_matmul(x, packed, out_features, ISAS[isa or default_isa()], residual)


def q8_matmul(x: torch.Tensor, packed: torch.Tensor, out_features: int, isa: str | None = None,
              residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, in] float32 times q8-packed weights ([units, blocks, 544] uint8) -> [rows, out] float32,
    plus `residual` where given."""
    return load().q8_matmul(x, packed, out_features, ISAS[isa or default_isa()], residual)


def f16_matmul(x: torch.Tensor, weight: torch.Tensor, isa: str | None = None,
               residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, in] float32 times float16 weights [out, in] (in divisible by 16) -> [rows, out] float32,
    plus `residual` where given."""
    return load().f16_matmul(x, weight, weight.shape[0], ISAS[isa or default_isa()], residual)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., dim] float32 -> x / sqrt(mean(x^2) + eps) * weight, per row."""
    return load().rms_norm(x, weight, eps)


def rotary_split(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rows: int, heads: int,
                 kv_heads: int, q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                 eps: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [rows * new, (heads + 2 kv_heads) * head_dim], cos and sin [rows * new, head_dim] ->
    q [rows, heads, new, head_dim], k and v [rows, kv_heads, new, head_dim], q and k rotated
    (each head RMS-normed first with q_norm, k_norm [head_dim] where given: Qwen3)."""
    none = torch.empty(0)
    q, k, v = load().rotary_split(qkv, cos, sin, rows, heads, kv_heads, none if q_norm is None else q_norm,
                                  none if k_norm is None else k_norm, eps)
    return q, k, v


def silu_mul(h: torch.Tensor) -> torch.Tensor:
    """h [rows, 2 * inter] (gate, then up) -> silu(gate) * up [rows, inter]."""
    return load().silu_mul(h)


def gelu_mul(h: torch.Tensor) -> torch.Tensor:
    """h [rows, 2 * inter] (gate, then up) -> GELU(gate) (tanh approximation) * up [rows, inter]."""
    return load().gelu_mul(h)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x [..., n] float32 on the CPU -> [...] int64: the index of each row's first maximum (a NaN's,
    where the row holds one), as `x.argmax(-1)` gives it, several times faster."""
    return load().argmax_rows(x.reshape(-1, x.shape[-1])).view(x.shape[:-1])


def draft_distribution(logits: torch.Tensor, draft_ids: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [positions, vocab] float32, draft_ids [draft] int64 -> (top [positions]: the first most
    likely token of the vocabulary; index [positions, k]: the k most likely draft tokens as positions
    in draft_ids, best first, ties to the earlier position; values [positions, k]: their
    probabilities under the softmax over the whole vocabulary)."""
    top, index, values = load().draft_distribution(logits, draft_ids, k)
    return top, index, values


def attend_cached(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, counts: torch.Tensor,
                  slots: torch.Tensor | None = None, scale: float | None = None, isa: str | None = None) -> torch.Tensor:
    """Attention of each query over the cache slots it sees -> [rows, new, heads * head_dim] float32.

    q: [rows, heads, new, head_dim]; keys, values: [rows, kv_heads, S, head_dim] (heads share kv
    heads in groups, as GQA); counts: [rows, new] int32, how many slots each query sees: slots
    0 .. n - 1, or with `slots` ([rows, new, L] int32) the first n listed there (a tree node's).
    scale: default 1 / sqrt(head_dim). isa: the path, as for the products (the AVX-512 one
    runs head_dim 64 and 128; its scores' bits differ from the AVX2 path's).
    """
    empty = torch.empty(0, dtype=torch.int32)
    return load().attend_cached(q, keys, values, counts, empty if slots is None else slots,
                                q.shape[-1] ** -0.5 if scale is None else scale, ISAS[isa or default_isa()])
