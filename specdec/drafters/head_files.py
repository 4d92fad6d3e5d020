"""Directories of trained draft heads (EAGLE, Medusa): where they ship, how they are saved and read.

A head directory holds `config.json` and `model.safetensors`. Floating-point tensors are saved in
bfloat16 (half the bytes, and a head's accuracy does not need more) and read back as float32.
Heads trained for a model ship inside specdec under `specdec/data/heads/<kind>/<model name>/`.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file, save_file

from specdec.errors import ConfigError
from specdec.models.loader import LoadedModel

if TYPE_CHECKING:
    from specdec.config import SpeculativeConfig

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
TRAIN_HINT = {"eagle": "train one with `specdec train-draft --arch eagle`",
              "medusa": "train them with `specdec train-draft --arch medusa`"}


def shipped_dir(kind: str, model_name: str) -> Path | None:
    """The `kind` head ("eagle" or "medusa") trained for a model and shipped with specdec, if any."""
    resource = resources.files("specdec.data").joinpath("heads", kind, model_name)
    return Path(str(resource)) if resource.joinpath(CONFIG_FILE).is_file() else None


def config_dir(kind: str, config: SpeculativeConfig, target: LoadedModel) -> Path:
    """The directory a config names (`model`), else the head shipped for the target."""
    directory = Path(config.model).expanduser() if config.model else shipped_dir(kind, target.name)
    if directory is None:
        raise ConfigError(f"no {kind} head ships for {target.name}: {TRAIN_HINT[kind]} and set 'model' to its directory")
    return directory


def save(directory: str | Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    tensors = {name: t.detach().to(torch.bfloat16).contiguous() if t.is_floating_point() else t.contiguous()
               for name, t in tensors.items()}
    save_file(tensors, str(directory / WEIGHTS_FILE))


def read(kind: str, directory: str | Path) -> tuple[Path, dict[str, Any], dict[str, torch.Tensor]]:
    """(directory, config.json's contents, tensors: floating point as float32)."""
    directory = Path(directory).expanduser()
    config_path, weights_path = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    if not config_path.is_file() or not weights_path.is_file():
        raise ConfigError(f"no {kind} head in {directory}: it needs {CONFIG_FILE} and {WEIGHTS_FILE}")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{config_path} is not valid JSON: {exc.msg} at line {exc.lineno}") from None
    tensors = {name: t.float() if t.is_floating_point() else t for name, t in load_file(str(weights_path)).items()}
    return directory, config, tensors


def check_target(kind: str, directory: Path, hidden_size: int, vocab_size: int, target: LoadedModel) -> None:
    """A head reads the target's states and names its tokens: both sizes must be the target's."""
    backend = target.backend
    if hidden_size != backend.hidden_size or vocab_size != backend.vocab_size:
        raise ConfigError(
            f"the {kind} head at {directory} is for a target with hidden size {hidden_size} and vocabulary "
            f"{vocab_size}; {target.name} has {backend.hidden_size} and {backend.vocab_size}"
        )


def check_state(kind: str, directory: Path, missing: list[str], unexpected: list[str]) -> None:
    if missing or unexpected:
        raise ConfigError(f"the {kind} head at {directory} does not match its config: missing {missing}, "
                          f"unexpected {unexpected}")
