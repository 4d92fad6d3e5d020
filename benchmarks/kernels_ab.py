"""Two or more versions of specdec's kernels side by side in one process: the cost of a pass.

Each `--variant NAME=SOURCE` is built from a directory of kernel sources (`specdec/kernels`, or
a copy being changed) or from a git revision (`git:REV`, its `specdec/kernels`), into a cache
under /tmp. The default model loads once, a context of `--context` tokens is prefilled, and
then, round after round, every variant in turn runs passes of each size (tokens into the cache,
rolled back after). Reports each variant's median ms per size and the ratio to its own plain
step. The machine is shared and noisy: the rounds interleave the variants so that drift hits
them alike; read the ratios between variants, not the absolute times.

    python benchmarks/kernels_ab.py --variant before=git:HEAD~1 --variant after=specdec/kernels
    python benchmarks/kernels_ab.py --variant before=git:HEAD~1 --variant after=specdec/kernels \
        --dtype r8 --context 0 --sizes 64,1024 --last-only   # prefill
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from torch.utils import cpp_extension

from specdec import kernels
from specdec.models.loader import load_model
from specdec.models.runner import ModelRunner

ROOT = Path(__file__).resolve().parents[1]
FILES = [path.name for path in kernels.SOURCES + kernels.HEADERS]


def sources(spec: str) -> Path:
    """A directory holding the kernel sources of `spec` (a directory, or git:REV)."""
    if not spec.startswith("git:"):
        directory = Path(spec)
        if not all((directory / name).is_file() for name in FILES):
            raise SystemExit(f"{spec}: not a directory of kernel sources ({', '.join(FILES)})")
        return directory
    rev = spec[4:]
    directory = Path(tempfile.gettempdir()) / "specdec_kernels_ab" / f"git-{rev.replace('/', '_')}"
    directory.mkdir(parents=True, exist_ok=True)
    for name in FILES:
        shown = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:specdec/kernels/{name}"], capture_output=True)
        if shown.returncode != 0:
            raise SystemExit(f"git:{rev} has no specdec/kernels/{name}: {shown.stderr.decode().strip()}")
        (directory / name).write_bytes(shown.stdout)
    return directory


def build(name: str, directory: Path):
    """The extension built from `directory`, with the flags specdec builds its own with."""
    digest = hashlib.sha256(b"".join((directory / f).read_bytes() for f in FILES)).hexdigest()[:12]
    out = Path(tempfile.gettempdir()) / "specdec_kernels_ab" / f"build-{digest}"
    out.mkdir(parents=True, exist_ok=True)
    return cpp_extension.load(
        name=f"specdec_kernels_ab_{digest}", sources=[str(directory / path.name) for path in kernels.SOURCES],
        build_directory=str(out), extra_cflags=kernels.CFLAGS, verbose=False)


def built_variants(specs: list[str]) -> dict:
    """Each `NAME=SOURCE` of `--variant`, built: {name: module}."""
    variants = {}
    for spec in specs:
        name, _, source = spec.partition("=")
        if not source:
            raise SystemExit(f"--variant {spec!r}: give NAME=SOURCE")
        variants[name] = build(name, sources(source))
    return variants


class ListArguments:
    """A build from before `LayerWeights`, whose `forward_layers` took the layers' weights as lists."""

    def __init__(self, module) -> None:
        self.module = module

    def __getattr__(self, name: str):
        return getattr(self.module, name)

    @staticmethod
    def LayerWeights(*lists):  # noqa: N802 (the kernels' class name)
        return list(lists)

    def forward_layers(self, x, weights, *rest):
        return self.module.forward_layers(x, *weights, *rest)


def use(backend, module) -> None:
    """Every kernel the native backend calls, from this build: the fused layers and the products."""
    code = kernels.ISAS[kernels.default_isa()]
    backend._ops = module if hasattr(module, "LayerWeights") else ListArguments(module)
    backend._fused_weights = {}  # the layers' weights, gathered again for this build
    for linear in [linear for layer in backend.layers for linear in (layer.qkv, layer.o, layer.gate_up, layer.down)] + [backend.lm_head]:
        function = getattr(module, f"{linear.fmt}_matmul")
        linear._product = (lambda f: lambda x, packed, out, residual=None: f(x, packed, out, code, residual))(function)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", action="append", required=True, metavar="NAME=SOURCE",
                        help="a kernel version: NAME=DIRECTORY or NAME=git:REV (give two or more)")
    parser.add_argument("--sizes", default="1,4,8,16", help="tokens per pass, comma-separated (the first is the baseline)")
    parser.add_argument("--context", type=int, default=256, help="tokens in the cache before each pass")
    parser.add_argument("--rounds", type=int, default=6, help="rounds over every variant")
    parser.add_argument("--repeats", type=int, default=8, help="passes per size per round (their median counts)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="auto", help="the model's weight format (load_model's dtype: auto, r8, ...)")
    parser.add_argument("--last-only", action="store_true",
                        help="logits for each pass's last position only (a prefill's), not every position (a verification's)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sizes = [int(s) for s in args.sizes.split(",")]
    variants = built_variants(args.variant)

    model = load_model(dtype=args.dtype)
    backend = model.backend
    if not backend.fused:
        raise SystemExit("specdec's kernels are not available here: nothing to compare")
    runner = ModelRunner(model, None)
    cache = runner.new_cache(args.context + max(sizes) + 1)
    tokens = torch.randint(0, model.vocab_size, (args.context + max(sizes),), generator=torch.Generator().manual_seed(0)).tolist()
    if args.context:
        runner.forward(cache, tokens[: args.context], last_only=True)
    times = {(name, n): [] for name in variants for n in sizes}
    for _ in range(args.rounds):
        for name, module in variants.items():
            use(backend, module)
            for n in sizes:
                samples = []
                for _ in range(args.repeats):
                    start = time.perf_counter()
                    runner.forward(cache, tokens[args.context : args.context + n], last_only=args.last_only)
                    samples.append(time.perf_counter() - start)
                    cache.rollback(args.context)
                times[name, n].append(statistics.median(samples))
    print(f"{args.dtype}, {args.context} cached tokens, {args.threads} threads, ms per pass (ratio to the variant's "
          f"{sizes[0]}-token pass)")
    print("variant".ljust(12) + "".join(f"{n:>16d}" for n in sizes))
    for name in variants:
        base = statistics.median(times[name, sizes[0]])
        cells = [f"{statistics.median(times[name, n]) * 1e3:8.2f} ({statistics.median(times[name, n]) / base:4.2f})" for n in sizes]
        print(name.ljust(12) + "".join(f"{c:>16s}" for c in cells))


if __name__ == "__main__":
    main()
