"""Shared fixtures: the real default model (loaded once), a tiny random model with the same
vocabulary saved as a Hugging Face directory, and tiny small-vocabulary models for
distribution tests, where the exact target distribution can be enumerated."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from specdec.drafters.mtp import LAYER_TENSORS
from specdec.models import LoadedModel, load_model

TINY_MAX_POSITIONS = 512


def pytest_configure(config: pytest.Config) -> None:
    # One intra-op thread per test process; `make test` runs one process per logical CPU
    # (pytest-xdist). Oversubscribed OpenMP threads spin and make small forward passes up to
    # 100x slower (measured: 5 ms vs 520 ms per tiny-model generation). Results do not depend on it.
    torch.set_num_threads(int(os.environ.get("SPECDEC_TEST_THREADS", "1")))


@pytest.fixture(scope="session")
def default_model() -> LoadedModel:
    """SmolLM2-135M-Instruct, the embedded default, on the default backend (native, the GGUF
    file's own int4/int8 weights)."""
    return load_model()


@pytest.fixture(scope="session")
def default_model_hf() -> LoadedModel:
    """The default model on the hf backend in float32 (converted once under ~/.cache/specdec)."""
    return load_model(backend="hf")


@pytest.fixture(scope="session")
def default_model_native_f32() -> LoadedModel:
    """The default model on the native backend with float32 weights (the same values as hf)."""
    return load_model(backend="native", dtype="float32")


# Every backend and weight format the lossless suite runs on.
BACKEND_VARIANTS = ("hf-float32", "native-float32", "native-bfloat16", "native-int8", "native-auto")


@pytest.fixture(scope="session")
def default_model_variants(default_model: LoadedModel, default_model_hf: LoadedModel,
                           default_model_native_f32: LoadedModel) -> Callable[[str], LoadedModel]:
    """The default model on each of BACKEND_VARIANTS, loaded once each."""
    loaded = {"native-auto": default_model, "hf-float32": default_model_hf, "native-float32": default_model_native_f32}

    def get(variant: str) -> LoadedModel:
        if variant not in loaded:
            backend, dtype = variant.split("-")
            loaded[variant] = load_model(backend=backend, dtype=dtype)
        return loaded[variant]

    return get


def _tiny_llama(vocab_size: int, seed: int, *, hidden: int = 64, layers: int = 2, eos: int = 2) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=2 * hidden,
        max_position_embeddings=TINY_MAX_POSITIONS,
        bos_token_id=1,
        eos_token_id=eos,
        pad_token_id=eos,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = eos
    return model


# The tiny model's own tokenizer: byte-level BPE trained here on specdec's docs (all bytes
# encode), with ChatML special tokens at the ids SmolLM2 uses (0 text end, 1 start, 2 end of turn).
TINY_VOCAB = 1024
TINY_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import decoders, pre_tokenizers, trainers
    from tokenizers.models import BPE

    # A fixed corpus (the project's README and docs as they stood when it was frozen): trained on
    # the live docs, every edit of them changed the tiny model's vocabulary and so its text.
    corpus = json.loads((Path(__file__).parent / "data" / "tiny_corpus.json").read_text(encoding="utf-8"))
    backend = Tokenizer(BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TINY_VOCAB, special_tokens=list(TINY_SPECIAL), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(corpus, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=TINY_SPECIAL[1], eos_token=TINY_SPECIAL[2],
                                        pad_token=TINY_SPECIAL[2], unk_token=TINY_SPECIAL[0])
    tokenizer.chat_template = CHATML
    return tokenizer


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer Llama with a tokenizer of its own (TINY_VOCAB tokens), saved as a
    Hugging Face model directory: the tiny tier's model (nothing of the real model's)."""
    path = tmp_path_factory.mktemp("tiny-llama")
    tokenizer = tiny_tokenizer()
    model = _tiny_llama(len(tokenizer), seed=1234, eos=tokenizer.eos_token_id)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_draft_dir(tmp_path_factory: pytest.TempPathFactory, default_model: LoadedModel) -> Path:
    """A random 2-layer Llama with SmolLM2's tokenizer: a draft model for the real target."""
    path = tmp_path_factory.mktemp("tiny-draft")
    tokenizer = default_model.tokenizer
    model = _tiny_llama(len(tokenizer), seed=1234, eos=tokenizer.eos_token_id)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_draft(tiny_draft_dir: Path) -> LoadedModel:
    """The tiny draft model with the real target's vocabulary, on the hf backend."""
    return load_model(str(tiny_draft_dir), backend="hf")


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir: Path) -> LoadedModel:
    """The tiny random model on the hf backend, loaded through specdec's loader (thin kernels on)."""
    return load_model(str(tiny_model_dir), backend="hf")


@pytest.fixture(scope="session")
def tiny_native(tiny_model_dir: Path) -> LoadedModel:
    """The tiny random model on the native backend (float32, from the same safetensors)."""
    return load_model(str(tiny_model_dir), backend="native")


@pytest.fixture(params=["hf", "native"])
def tiny_any(request: pytest.FixtureRequest, tiny_model: LoadedModel, tiny_native: LoadedModel) -> LoadedModel:
    """The tiny model on each backend."""
    return tiny_model if request.param == "hf" else tiny_native


def small_vocab_tokenizer(vocab_size: int, prefix: str = "t") -> PreTrainedTokenizerFast:
    """A word-level tokenizer over `vocab_size` words t0 .. t{n-1}; the last one is EOS."""
    vocab = {f"{prefix}{i}": i for i in range(vocab_size)}
    backend = Tokenizer(WordLevel(vocab, unk_token=f"{prefix}0"))
    backend.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=f"{prefix}{vocab_size - 1}")


SmallModelFactory = Callable[..., LoadedModel]


@pytest.fixture(scope="session")
def small_model_factory() -> SmallModelFactory:
    """Builds tiny random Llamas over a small vocabulary whose next-token distributions are
    far from uniform and depend on the context (random weights at a large scale).

    The returned models are in eval mode, without specdec's thin kernels: a plain
    transformers model, so they double as the reference implementation.
    """
    built: dict[tuple, LoadedModel] = {}

    def make(seed: int, vocab_size: int = 8, logit_scale: float = 2.0, prefix: str = "t", layers: int = 1) -> LoadedModel:
        key = (seed, vocab_size, logit_scale, prefix, layers)
        if key not in built:
            tokenizer = small_vocab_tokenizer(vocab_size, prefix)
            model = _tiny_llama(vocab_size, seed, hidden=32, layers=layers, eos=vocab_size - 1)
            with torch.no_grad():
                # Large embeddings and attention weights make the output depend on the whole
                # context; a large head makes the distributions peaked and far apart per seed.
                for name, param in model.named_parameters():
                    if "norm" not in name:
                        param.normal_(0.0, 0.5)
                head = model.get_output_embeddings().weight
                head.mul_(logit_scale / (head.std() * head.shape[1] ** 0.5))
            model.eval().requires_grad_(False)
            built[key] = LoadedModel.from_hf(model, tokenizer, name=f"small-{seed}", source=f"small-{seed}")
        return built[key]

    return make


CliRun = Callable[..., tuple[int, str, str]]


def _cli_runner(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> CliRun:
    from specdec.cli.main import main

    def run(*args: str) -> tuple[int, str, str]:
        monkeypatch.setattr(sys, "argv", ["specdec", *args])
        with pytest.raises(SystemExit) as exit_info:
            main()
        captured = capsys.readouterr()
        return exit_info.value.code or 0, captured.out, captured.err

    return run


@pytest.fixture
def run_cli(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], default_model: LoadedModel) -> CliRun:
    """Runs the `specdec` command in this process, as `main()` runs it: (exit status, stdout, stderr).
    The default model is loaded first, so its one-time conversion (with its progress bar) never
    lands in a command's output, whichever test of a worker runs first."""
    return _cli_runner(monkeypatch, capsys)


@pytest.fixture
def run_cli_tiny(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> CliRun:
    """run_cli for commands that name their own model (`--model` a tiny one): the tiny tier."""
    return _cli_runner(monkeypatch, capsys)


# --- test tiers ---------------------------------------------------------------------------------

# A test that uses one of these (directly or through another fixture) runs the real default
# model: it is in the `real` tier. Tests that run the real model in a subprocess say so with
# @pytest.mark.real.
REAL_MODEL_FIXTURES = frozenset({"default_model", "default_model_hf", "default_model_native_f32",
                                 "default_model_variants", "tiny_draft_dir", "run_cli"})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if REAL_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.real)


# --- MTP checkpoints (no real one can be had here) ------------------------------------------

def _random_mtp_tensors(target: LoadedModel, seed: int = 0, scale: float = 0.05) -> dict[str, torch.Tensor]:
    """A random MTP layer for `target`, named as in the checkpoint (without the layer prefix)."""
    config, gen = target.config, torch.Generator().manual_seed(seed)
    h, inter = int(config.hidden_size), int(config.intermediate_size)
    heads, kv = int(config.num_attention_heads), int(config.num_key_value_heads)
    head_dim = h // heads
    shapes = {"eh_proj.weight": (h, 2 * h), "self_attn.q_proj.weight": (heads * head_dim, h),
              "self_attn.k_proj.weight": (kv * head_dim, h), "self_attn.v_proj.weight": (kv * head_dim, h),
              "self_attn.o_proj.weight": (h, heads * head_dim), "mlp.gate_proj.weight": (inter, h),
              "mlp.up_proj.weight": (inter, h), "mlp.down_proj.weight": (h, inter)}
    tensors = {name: torch.randn(shape, generator=gen) * scale for name, shape in shapes.items()}
    for norm in ("enorm", "hnorm", "shared_head.norm", "input_layernorm", "post_attention_layernorm"):
        tensors[f"{norm}.weight"] = 1.0 + 0.1 * torch.randn(h, generator=gen)
    assert set(tensors) == set(LAYER_TENSORS)
    return tensors


def _write_checkpoint(target: LoadedModel, directory: Path, tensors: dict[str, torch.Tensor], shards: int = 1,
                     **config_changes) -> Path:
    """A checkpoint directory as a model with an MTP layer ships it: the model's config with
    num_nextn_predict_layers, the layer's tensors under model.layers.{L}. (over `shards` files
    with an index when more than one), beside a tensor of another layer that must be left alone."""
    directory.mkdir(parents=True, exist_ok=True)
    layer = target.num_layers
    config = target.config.to_dict() | {"num_nextn_predict_layers": 1} | config_changes
    (directory / "config.json").write_text(json.dumps(config))
    named = {f"model.layers.{layer}.{name}": t.contiguous() for name, t in tensors.items()}
    named["model.layers.0.input_layernorm.weight"] = torch.ones(int(target.config.hidden_size))
    names = sorted(named)
    if shards == 1:
        save_file(named, str(directory / "model.safetensors"))
        return directory
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {name: named[name] for name in names[i::shards]}
        save_file(part, str(directory / file))
        weight_map |= {name: file for name in part}
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return directory


@pytest.fixture(scope="session")
def mtp_checkpoint() -> Callable[..., tuple[Path, dict[str, torch.Tensor]]]:
    """write(target, directory, tensors=None, shards=1, seed=0, scale=0.05, **config_changes)
    -> (directory, tensors): a checkpoint directory holding an MTP layer for `target` (random
    unless `tensors` are given)."""

    def write(target: LoadedModel, directory: Path, tensors: dict[str, torch.Tensor] | None = None, shards: int = 1,
              seed: int = 0, scale: float = 0.05, **config_changes) -> tuple[Path, dict[str, torch.Tensor]]:
        tensors = tensors if tensors is not None else _random_mtp_tensors(target, seed, scale)
        return _write_checkpoint(target, directory, tensors, shards, **config_changes), tensors

    return write
