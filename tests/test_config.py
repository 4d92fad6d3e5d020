"""SpeculativeConfig and SamplingParams: defaults, and a ConfigError naming the problem for
every invalid value."""

from __future__ import annotations

import dataclasses

import pytest

from specdec import SamplingParams, SpeculativeConfig
from specdec.methods import default_k, registered_methods
from specdec.errors import ConfigError, SpecDecError


def test_registered_methods() -> None:
    assert registered_methods() == ["bigram", "draft_model", "eagle", "hybrid", "layer_skip", "lookahead", "medusa", "mtp", "ngram", "suffix"]


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_default_k_per_method(method: str) -> None:
    config = SpeculativeConfig(method=method, model="default" if method == "draft_model" else None)
    assert config.num_speculative_tokens == default_k(method) == {"ngram": 4, "draft_model": 4}[method]
    if method == "ngram":
        assert (config.prompt_lookup_min, config.prompt_lookup_max) == (1, 6)


def test_config_is_frozen_and_round_trips() -> None:
    config = SpeculativeConfig(method="draft_model", model="/m", num_speculative_tokens=6)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.num_speculative_tokens = 2  # type: ignore[misc]
    assert SpeculativeConfig.from_dict(config.to_dict()) == config
    assert SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 3}') == SpeculativeConfig(
        method="ngram", num_speculative_tokens=3
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1, got 0"),
        ({"method": "ngram", "num_speculative_tokens": -3}, "num_speculative_tokens must be an integer >= 1, got -3"),
        ({"method": "ngram", "num_speculative_tokens": 2.5}, "num_speculative_tokens must be an integer >= 1, got 2.5"),
        (
            {"method": "ngram", "num_speculative_tokens": True},
            "num_speculative_tokens must be an integer >= 1, got True",
        ),
        ({"method": "ngram", "num_speculative_tokens": "4"}, "num_speculative_tokens must be an integer >= 1, got '4'"),
        ({"method": "ngram", "num_speculative_tokens": 65}, "num_speculative_tokens must be <= 64, got 65"),
        ({"method": "hydra"}, "unknown speculative method 'hydra'; choose one of: bigram, draft_model, eagle, hybrid, layer_skip, "
                              "lookahead, medusa, mtp, ngram, suffix"),
        ({"method": "ngram", "tree_width": 2}, "unknown speculative config key(s) for method 'ngram': tree_width; "
                                               "'tree_width' is a key of eagle, hybrid, medusa, mtp"),
        ({"method": "eagle", "tree_width": 16, "num_speculative_tokens": 5}, "a tree of tree_width x num_speculative_tokens > 64"),
        ({"method": "ngram", "layers": [1]}, "'layers' is a key of layer_skip"),
        ({"method": "layer_skip", "layers": [1, 1]}, "layers must not repeat a layer, got [1, 1]"),
        ({"method": "layer_skip", "layers": [1], "profile": "p.json"}, "give 'layers' or 'profile' for layer_skip, not both"),
        ({"method": "draft_model", "model": "/m", "quantization": "int4"}, "unknown quantization 'int4'; choose one of: int8"),
        ({"method": "suffix", "suffix_decoding_min_token_prob": 1.5}, "suffix_decoding_min_token_prob must be a number in [0, 1], got 1.5"),
        ({"method": "suffix", "suffix_decoding_max_cache_mib": 0}, "suffix_decoding_max_cache_mib must be a number > 0, got 0"),
        ({"method": "ngram", "options": None, "adaptive": 1}, "adaptive must be true or false, got 1"),
        ({"method": "eagle", "tree_width": 0}, "tree_width must be an integer >= 1, got 0"),
        ({"method": "eagle", "drafter_invariant": "yes"}, "drafter_invariant must be true or false, got 'yes'"),
        ({"method": "draft_model", "model": ""}, "method 'draft_model' needs a draft model"),
        (
            {"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 3},
            "prompt_lookup_min (5) must be <= prompt_lookup_max (3)",
        ),
        ({"method": "ngram", "prompt_lookup_min": 0}, "prompt_lookup_min must be an integer >= 1, got 0"),
        ({"method": "ngram", "prompt_lookup_max": 2.0}, "prompt_lookup_max must be an integer >= 1, got 2.0"),
    ],
)
def test_invalid_speculative_config(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        SpeculativeConfig(**kwargs)
    assert message in str(info.value)
    # The same through the dict and JSON forms.
    with pytest.raises(ConfigError, match="speculative|num_speculative_tokens|prompt_lookup|draft|tree|layers|quantization|suffix|adaptive|options"):
        SpeculativeConfig.from_dict(kwargs)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"method": "ngram",', "speculative config is not valid JSON"),
        ("method=ngram", "speculative config is not valid JSON: Expecting value at line 1 column 1"),
        ('["ngram"]', "speculative config must be a JSON object, got list"),
        ('{"method": "ngram", "k": 3}', "unknown speculative config key(s) for method 'ngram': k; known:"),
        ('{"method": "ngram", "options": {}}', "give the method's keys flat"),
        ('{"num_speculative_tokens": 3}', "speculative config needs a 'method'"),
    ],
)
def test_invalid_json_config(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        SpeculativeConfig.from_json(text)
    assert message in str(info.value)


def test_unknown_keys_are_all_named() -> None:
    with pytest.raises(ConfigError, match=r"unknown speculative config key\(s\) for method 'ngram': draft, k; known: adaptive, "
                                          r"drafter_invariant, method, model, num_speculative_tokens, prompt_lookup_max, prompt_lookup_min$"):
        SpeculativeConfig.from_dict({"method": "ngram", "k": 3, "draft": "x"})


def test_head_defaults_are_the_measured_ones() -> None:
    # Measured on the training prompts with the shipped head (benchmarks/results/README.md): k = 1 for eagle; the hybrid
    # looks up from 2 tokens and lets the head draft one.
    assert SpeculativeConfig("eagle").num_speculative_tokens == 1
    hybrid = SpeculativeConfig("hybrid")
    assert (hybrid.num_speculative_tokens, hybrid.prompt_lookup_min, hybrid.hybrid_head_tokens) == (4, 2, 1)
    assert hybrid.label == "hybrid k=4"
    older = SpeculativeConfig("hybrid", hybrid_head_tokens=None, prompt_lookup_min=3)
    assert older.label == "hybrid k=4 head k=k lookup>=3"


def test_method_keys_live_in_the_registry_options() -> None:
    # The common keys are the config's fields; a method's own keys are its registry options,
    # readable as attributes, flattened by to_dict and kept by dataclasses.replace.
    config = SpeculativeConfig(method="hybrid", prompt_lookup_max=4, tree_width=2)
    assert [f.name for f in dataclasses.fields(SpeculativeConfig)] == [
        "method", "num_speculative_tokens", "model", "adaptive", "drafter_invariant", "options"]
    assert (config.prompt_lookup_max, config.tree_width, config.options.proposal_nodes) == (4, 2, 8)
    assert config.to_dict()["tree_width"] == 2 and "options" not in config.to_dict()
    assert dataclasses.replace(config, num_speculative_tokens=2, tree_width=3).options.tree_width == 3
    assert dataclasses.replace(config, num_speculative_tokens=2).options == config.options
    assert config.label == "hybrid k=4 tree 2x8"
    with pytest.raises(AttributeError, match="no key 'layers'"):
        config.layers  # noqa: B018
    assert SpeculativeConfig(method="layer_skip", layers=[5, 2]).layers == (2, 5)


def test_config_errors_are_value_errors_and_specdec_errors() -> None:
    with pytest.raises(ValueError):
        SpeculativeConfig(method="ngram", num_speculative_tokens=0)
    assert issubclass(ConfigError, SpecDecError)


# --- SamplingParams ---------------------------------------------------------------------------


def test_sampling_defaults_are_greedy() -> None:
    params = SamplingParams()
    assert params.greedy
    assert (params.max_tokens, params.top_k, params.top_p, params.min_p, params.stop) == (128, 0, 1.0, 0.0, ())
    assert not SamplingParams(temperature=0.5).greedy


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens must be an integer >= 1, got 0"),
        ({"max_tokens": 2.0}, "max_tokens must be an integer >= 1, got 2.0"),
        ({"temperature": -0.1}, "temperature must be >= 0, got -0.1"),
        ({"temperature": float("nan")}, "temperature must be >= 0, got nan"),
        ({"top_k": -1}, "top_k must be an integer >= 0 (0 = off), got -1"),
        ({"top_p": -0.1}, "top_p must be in [0, 1], got -0.1"),
        ({"top_p": 1.5}, "top_p must be in [0, 1], got 1.5"),
        ({"min_p": 1.5}, "min_p must be in [0, 1], got 1.5"),
        ({"min_p": -0.1}, "min_p must be in [0, 1], got -0.1"),
        ({"stop": ("ok", "")}, "stop strings must be non-empty"),
        ({"stop": ""}, "stop strings must be non-empty"),
    ],
)
def test_invalid_sampling_params(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        SamplingParams(**kwargs)
    assert message in str(info.value)


@pytest.mark.parametrize("field", ["max_tokens", "top_k"])
def test_sampling_integers_reject_booleans(field: str) -> None:
    # SpeculativeConfig refuses True as an integer; SamplingParams must too (True == 1 would
    # silently mean max_tokens=1 or top_k=1).
    with pytest.raises(ConfigError, match=field):
        SamplingParams(**{field: True})
