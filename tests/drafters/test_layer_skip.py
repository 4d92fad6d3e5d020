"""Self-speculation: running a subset of the target's layers, profiles, and the int8 self-draft."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specdec import SamplingParams, SpeculativeConfig
from specdec.methods import build_drafter
from specdec.engine import Engine
from specdec.drafters.layer_skip import LayerSkipProfile, default_layers, resolve_layers, shipped_profile
from specdec.errors import ConfigError
from specdec.models import LoadedModel
from specdec.models.quantize import quantize_int8, quantized_bytes
from specdec.models.runner import ModelRunner

TEXT = "The quick brown fox jumps over the lazy dog, and then it runs into the forest to hide."


def ids(model: LoadedModel) -> list[int]:
    return model.tokenizer(TEXT, add_special_tokens=True)["input_ids"]


def test_all_layers_reproduce_the_full_model(tiny_model: LoadedModel) -> None:
    tokens = ids(tiny_model)
    full, subset = ModelRunner(tiny_model), ModelRunner(tiny_model, layers=[1, 0])
    assert subset.layers == (0, 1)
    full_cache, subset_cache = full.new_cache(64), subset.new_cache(64)
    # A prompt, then a 3-token block after a rollback: the cached path and the mask both count.
    for block in (tokens, [5, 6, 7]):
        expected = full.forward(full_cache, block).logits
        got = subset.forward(subset_cache, block).logits
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
        full_cache.rollback(full_cache.length - 1)
        subset_cache.rollback(subset_cache.length - 1)
    assert subset_cache.length == full_cache.length


def test_a_subset_runs_only_its_layers(tiny_model: LoadedModel) -> None:
    tokens = ids(tiny_model)
    runner = ModelRunner(tiny_model, layers=[1])
    cache = runner.new_cache(64)
    logits = runner.forward(cache, tokens).logits
    assert cache.length == len(tokens)
    assert cache.layers[0].length == 0 and cache.layers[1].length == len(tokens)
    full = ModelRunner(tiny_model).forward(ModelRunner(tiny_model).new_cache(64), tokens).logits
    assert not torch.allclose(logits, full)  # skipping layer 0 does change the output
    # Step by step gives what one pass gives: the subset's cache and positions are consistent.
    cache.rollback(0)
    stepwise = [runner.forward(cache, [t]).logits[0] for t in tokens]
    torch.testing.assert_close(torch.stack(stepwise), logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("layers", [[], [-1], [2], [0, 5]])
def test_invalid_layers(tiny_model: LoadedModel, layers: list[int]) -> None:
    with pytest.raises(ConfigError, match="layers"):
        ModelRunner(tiny_model, layers=layers)


def test_other_architectures_are_refused_with_a_clear_message(tiny_model: LoadedModel) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=16, n_layer=2, n_head=2))
    other = LoadedModel.from_hf(gpt2, tiny_model.tokenizer, name="tiny-gpt2", source="memory")
    with pytest.raises(ConfigError, match="tiny-gpt2 is a 'gpt2' model"):
        ModelRunner(other, layers=[0, 1])


def test_default_layers() -> None:
    assert default_layers(30) == (0, 1, 2, 3, 4, 5, 6, 7, 9, 11, 13, 15, 17, 19, 21, 23, 24, 25, 26, 27, 28, 29)
    assert default_layers(2) == (0, 1)
    assert set(default_layers(12)) >= {0, 11}


def test_profile_round_trip_and_resolution(tmp_path: Path, tiny_model: LoadedModel) -> None:
    profile = LayerSkipProfile(model="tiny", num_layers=2, layers=(1,), acceptance=0.5, cost_ratio=0.6,
                               num_speculative_tokens=2, expected_speedup=0.9)
    path = tmp_path / "profile.json"
    profile.save(path)
    assert LayerSkipProfile.load(path) == profile
    config = SpeculativeConfig(method="layer_skip", profile=str(path))
    assert resolve_layers(config, tiny_model) == (1,)
    assert resolve_layers(SpeculativeConfig(method="layer_skip", layers=(0,)), tiny_model) == (0,)
    assert resolve_layers(SpeculativeConfig(method="layer_skip"), tiny_model) == default_layers(2)
    # A profile for another depth is refused.
    json_data = json.loads(path.read_text())
    path.write_text(json.dumps(json_data | {"num_layers": 30}))
    with pytest.raises(ConfigError, match="30-layer"):
        resolve_layers(config, tiny_model)
    path.write_text("{}")
    with pytest.raises(ConfigError, match="not a layer_skip profile"):
        resolve_layers(config, tiny_model)


def test_config_checks() -> None:
    with pytest.raises(ConfigError, match="'layers' is a key of layer_skip"):
        SpeculativeConfig(method="ngram", layers=(1, 2))
    with pytest.raises(ConfigError, match="not both"):
        SpeculativeConfig(method="layer_skip", layers=(1,), profile=__file__)
    with pytest.raises(ConfigError, match="profile not found"):
        SpeculativeConfig(method="layer_skip", profile="/nonexistent/profile.json")
    with pytest.raises(ConfigError, match="must not repeat"):
        SpeculativeConfig(method="layer_skip", layers=(1, 1))
    with pytest.raises(ConfigError, match="quantization"):
        SpeculativeConfig(method="draft_model", model="target", quantization="int4")
    with pytest.raises(ConfigError, match="'quantization' is a key of draft_model"):
        SpeculativeConfig(method="ngram", quantization="int8")
    assert SpeculativeConfig(method="layer_skip", layers=[3, 1]).to_dict()["layers"] == [1, 3]


@pytest.mark.real
def test_shipped_profile_is_used_for_the_default_model(default_model: LoadedModel) -> None:
    profile = shipped_profile(default_model.name)
    assert profile is not None and profile.num_layers == 30
    drafter = build_drafter(SpeculativeConfig(method="layer_skip"), default_model)
    assert drafter.runner.layers == profile.layers


def greedy_agreement(target: LoadedModel, draft: LoadedModel) -> float:
    """On the target's own greedy path, fed a token at a time as when drafting: how often the
    draft's greedy choice is the target's."""
    prompt = ids(target)
    answer = Engine(target).generate(prompt, SamplingParams(max_tokens=40, ignore_eos=True)).token_ids
    runner = ModelRunner(draft)
    cache = runner.new_cache(len(prompt) + len(answer))
    logits = [runner.forward(cache, prompt, last_only=True).logits[0]]
    logits += [runner.forward(cache, [token]).logits[0] for token in answer[:-1]]
    return (torch.stack(logits).argmax(-1) == torch.tensor(answer)).float().mean().item()


@pytest.mark.real
def test_int8_self_draft_shares_embeddings_and_leaves_the_target_alone(default_model_hf: LoadedModel) -> None:
    default_model = default_model_hf
    target_types = [type(m) for m in default_model.model.modules()]
    draft = quantize_int8(default_model)
    assert [type(m) for m in default_model.model.modules()] == target_types
    embed = default_model.model.get_input_embeddings().weight
    assert draft.model.get_input_embeddings().weight.data_ptr() == embed.data_ptr()
    # What it adds: about one byte per linear weight (the tied LM head included), no more.
    linear = sum(m.weight.numel() for m in default_model.model.modules() if isinstance(m, torch.nn.Linear))
    added = quantized_bytes(draft)
    assert linear <= added < 1.05 * linear
    # The draft's greedy choices mostly agree with the target's, not always.
    assert 0.7 < greedy_agreement(default_model, draft) < 1.0
    # A long block runs the shared float32 weights: the prompt's logits are the target's own.
    prompt = ids(default_model)
    target_logits = ModelRunner(default_model).score(prompt)
    draft_logits = ModelRunner(draft).score(prompt)
    torch.testing.assert_close(draft_logits, target_logits)


@pytest.mark.real
def test_native_int8_self_draft_shares_the_rest_and_mostly_agrees(default_model_native_f32: LoadedModel) -> None:
    target = default_model_native_f32
    draft = quantize_int8(target)
    assert draft.backend.weight_format == "int8" and target.backend.weight_format == "float32"
    assert draft.backend.embed is target.backend.embed
    # What it adds: one byte per matrix weight plus a bfloat16 scale per output channel.
    linear = target.backend.matrix_bytes() // 4
    assert linear <= quantized_bytes(draft) < 1.01 * linear
    assert 0.7 < greedy_agreement(target, draft) <= 1.0


def test_int8_self_draft_of_a_quantized_target_is_refused(default_model: LoadedModel) -> None:
    with pytest.raises(ConfigError, match=r"already runs q4 \(LM head q8\) weights"):
        quantize_int8(default_model)
