"""Frozen, validated configuration: how to sample, and how to speculate.

The speculative config uses the vocabulary of serving stacks (vLLM's `speculative_config`):
`method`, `num_speculative_tokens`, `model`, `prompt_lookup_min`, `prompt_lookup_max`, plus
specdec's own keys for self-speculation (`quantization`, `layers`, `profile`) and `adaptive`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from specdec.errors import ConfigError

# Defaults per method, chosen by measurement (see README, "Choosing k").
DEFAULT_NUM_SPECULATIVE_TOKENS = {"ngram": 4, "draft_model": 4, "layer_skip": 1, "eagle": 4, "hybrid": 4, "medusa": 3, "mtp": 1, "suffix": 6}
QUANTIZATIONS = ("int8",)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. `temperature == 0` is greedy decoding.

    top_k = 0 and top_p = 1 and min_p = 0 turn those filters off.
    drafter_invariant: sample each token as argmax(log p + Gumbel noise keyed by the seed and the
        token's position), so a seeded request gives the same tokens whatever the drafter, k,
        batch or load, speculation on or off (see `specdec.sampling.invariant`).
    """

    max_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    drafter_invariant: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not self.temperature >= 0:
            raise ConfigError(f"temperature must be >= 0, got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ConfigError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not 0 <= self.min_p < 1:
            raise ConfigError(f"min_p must be in [0, 1), got {self.min_p!r}")
        if any(not s for s in self.stop):
            raise ConfigError("stop strings must be non-empty")
        if not isinstance(self.drafter_invariant, bool):
            raise ConfigError(f"drafter_invariant must be true or false, got {self.drafter_invariant!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class SpeculativeConfig:
    """What drafts the guesses and how many.

    method: a registered drafter name (`ngram`, `draft_model`, `layer_skip`, `eagle`, `hybrid`,
        `medusa`, `mtp`, `suffix`).
    num_speculative_tokens: k, the most tokens drafted per target step (>= 1).
    model: the draft model for `draft_model`: the same forms as the target (a GGUF path, a
        Hugging Face model directory, `default`), or `target` for the target's own weights.
        For `eagle` and `hybrid`: a head directory (`specdec train-draft`, or a published
        EAGLE-3 head); without it, the head shipped for the target. For `medusa` likewise.
        For `mtp`: a checkpoint directory holding a multi-token-prediction layer (DeepSeek-V3
        layout); without it, the target's own directory.
    quantization: `int8` quantizes the draft model's linear layers (weight-only int8 with
        dynamic activation scaling) in a copy that shares the target's embeddings; with
        `model: target` this is the quantized self-draft.
    prompt_lookup_min / prompt_lookup_max: n-gram sizes `ngram` tries, longest first (`hybrid`
        uses lookup only for matches of at least 3 tokens).
    layers: for `layer_skip`, the target's layers (0-based indices) the draft runs.
    profile: for `layer_skip`, a calibration profile file (`specdec calibrate`) naming them.
        Without either, the profile shipped for the model, else a default set.
    adaptive: let the number of drafted tokens follow acceptance (at most
        num_speculative_tokens), and switch speculation off for a while when it does not pay.
    drafter_invariant: sample with the drafter-invariant rule (SamplingParams.drafter_invariant):
        a seeded request gives the same tokens with speculation on or off.
    suffix_decoding_*: for `suffix` (names as in vLLM): the longest suffix matched, the most
        tokens proposed per matched token, the least empirical probability of a proposal, and the
        route's cache of earlier outputs: at most so many requests and MiB (0 requests: no cache).
    tree_width, tree_nodes: for `eagle`, `hybrid` and `mtp`, draft a token tree instead of a chain:
        the head's top `tree_width` tokens at each of the `tree_width` best nodes of each depth
        (num_speculative_tokens deep), the `tree_nodes` best kept (default 4 x width). 1: a chain.
    """

    method: str
    num_speculative_tokens: int | None = None
    model: str | None = None
    quantization: str | None = None
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 6
    layers: tuple[int, ...] | None = None
    profile: str | None = None
    adaptive: bool = False
    drafter_invariant: bool = False
    tree_width: int = 1
    tree_nodes: int | None = None
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_cache_mib: float = 64.0

    def __post_init__(self) -> None:
        # Imported here: the registry imports drafters, which import this module.
        from specdec.drafters import registered_methods

        methods = registered_methods()
        if self.method not in methods:
            raise ConfigError(f"unknown speculative method {self.method!r}; choose one of: {', '.join(methods)}")
        if self.num_speculative_tokens is None:
            object.__setattr__(self, "num_speculative_tokens", DEFAULT_NUM_SPECULATIVE_TOKENS.get(self.method, 4))
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ConfigError(f"num_speculative_tokens must be an integer >= 1, got {k!r}")
        if k > 64:
            raise ConfigError(f"num_speculative_tokens must be <= 64, got {k}")
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError(
                f"prompt_lookup_min ({self.prompt_lookup_min}) must be <= prompt_lookup_max ({self.prompt_lookup_max})"
            )
        if self.method == "draft_model" and not self.model:
            raise ConfigError("method 'draft_model' needs a draft model: set 'model' in the speculative config")
        if self.quantization is not None:
            if self.method != "draft_model":
                raise ConfigError("'quantization' applies to method 'draft_model' only")
            if self.quantization not in QUANTIZATIONS:
                raise ConfigError(f"unknown quantization {self.quantization!r}; choose one of: {', '.join(QUANTIZATIONS)}")
        if self.layers is not None:
            layers = self.layers
            if isinstance(layers, (str, bytes)) or not hasattr(layers, "__iter__"):
                raise ConfigError(f"layers must be a list of layer indices, got {layers!r}")
            layers = tuple(layers)
            if not layers or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in layers):
                raise ConfigError(f"layers must be a non-empty list of integers >= 0, got {list(layers)!r}")
            if len(set(layers)) != len(layers):
                raise ConfigError(f"layers must not repeat a layer, got {list(layers)!r}")
            object.__setattr__(self, "layers", tuple(sorted(layers)))
        if (self.layers is not None or self.profile is not None) and self.method != "layer_skip":
            raise ConfigError("'layers' and 'profile' apply to method 'layer_skip' only")
        if self.layers is not None and self.profile is not None:
            raise ConfigError("give 'layers' or 'profile' for layer_skip, not both")
        if self.profile is not None and not Path(self.profile).expanduser().is_file():
            raise ConfigError(f"layer_skip profile not found: {self.profile}")
        if not isinstance(self.adaptive, bool):
            raise ConfigError(f"adaptive must be true or false, got {self.adaptive!r}")
        if not isinstance(self.drafter_invariant, bool):
            raise ConfigError(f"drafter_invariant must be true or false, got {self.drafter_invariant!r}")
        for name in ("tree_width", "tree_nodes"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
        if self.tree_width is None:
            raise ConfigError("tree_width must be an integer >= 1, got None")
        if (self.tree_width > 1 or self.tree_nodes is not None) and self.method not in ("eagle", "hybrid", "mtp"):
            raise ConfigError("'tree_width' and 'tree_nodes' apply to methods 'eagle', 'hybrid' and 'mtp' only")
        for name, low in (("suffix_decoding_max_tree_depth", 1), ("suffix_decoding_max_cached_requests", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"{name} must be an integer >= {low}, got {value!r}")
        for name in ("suffix_decoding_max_spec_factor", "suffix_decoding_max_cache_mib"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ConfigError(f"{name} must be a number > 0, got {value!r}")
        value = self.suffix_decoding_min_token_prob
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
            raise ConfigError(f"suffix_decoding_min_token_prob must be a number in [0, 1], got {value!r}")
        if self.tree_width > 1 and self.tree_width * self.num_speculative_tokens > 64:
            raise ConfigError("a tree of tree_width x num_speculative_tokens > 64 expanded nodes is too large")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SpeculativeConfig:
        if not isinstance(data, dict):
            raise ConfigError(f"speculative config must be a JSON object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown speculative config key(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        if "method" not in data:
            raise ConfigError("speculative config needs a 'method'")
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"speculative config is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
        return cls.from_dict(data)

    @property
    def label(self) -> str:
        """A short name for tables: method, what drafts, k, adaptive."""
        parts = [self.method]
        if self.method in ("draft_model", "eagle", "hybrid", "medusa", "mtp") and self.model:
            parts.append("self" if self.model == "target" else Path(self.model).name)
        if self.quantization:
            parts.append(self.quantization)
        if self.profile:
            parts.append(Path(self.profile).stem)
        elif self.layers is not None:
            parts.append(f"{len(self.layers)} layers")
        if self.method == "suffix" and self.suffix_decoding_max_cached_requests == 0:
            parts.append("no cache")
        parts.append(f"k={self.num_speculative_tokens}")
        if self.tree_width > 1:
            parts.append(f"tree {self.tree_width}x{self.tree_nodes or 4 * self.tree_width}")
        if self.adaptive:
            parts.append("adaptive")
        if self.drafter_invariant:
            parts.append("invariant")
        return " ".join(parts)

    @classmethod
    def from_file(cls, path: str | Path, category: str | None = None) -> SpeculativeConfig | None:
        """Load a config from a JSON file: either the config object itself, or a
        recommendation written by `specdec tune` (`{"speculative_config": {...},
        "per_category": {category: {...}}}`), from which `category` picks an entry.
        A recommendation of `null` (plain decoding pays best) loads as None."""
        path = Path(path).expanduser()
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise ConfigError(f"cannot read speculative config {path}: {exc.strerror}") from None
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
        if isinstance(data, dict) and "speculative_config" in data:
            per_category = data.get("per_category") or {}
            if category is not None and category not in per_category:
                known = ", ".join(sorted(per_category)) or "none"
                raise ConfigError(f"{path} has no recommendation for category {category!r}; it has: {known}")
            data = per_category[category] if category is not None else data["speculative_config"]
            if data is None:
                return None
        elif category is not None:
            raise ConfigError(f"{path} is a single config, not a recommendation per category")
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        if self.layers is not None:
            data["layers"] = list(self.layers)
        return data
