"""Frozen, validated configuration: how to speculate (and, re-exported, how to sample).

The speculative config uses the vocabulary of serving stacks (vLLM's `speculative_config`):
`method`, `num_speculative_tokens`, `model`, plus each method's own keys (its options in the
registry of methods, `specdec.methods`) and specdec's `adaptive` and `drafter_invariant`.
Importing it loads no model code: neither torch nor transformers.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdec import methods as registry
from specdec.methods import Options
from specdec.errors import ConfigError
from specdec.sampling.params import SamplingParams, StructuredOutput

__all__ = ["COMMON_KEYS", "SamplingParams", "SpeculativeConfig", "StructuredOutput"]

COMMON_KEYS = ("method", "num_speculative_tokens", "model", "adaptive", "drafter_invariant")


@dataclass(frozen=True, init=False)
class SpeculativeConfig:
    """What drafts the guesses and how many.

    The keys every method shares:

    method: a registered drafter name (`specdec.methods`): `ngram`, `draft_model`,
        `layer_skip`, `eagle`, `hybrid`, `medusa`, `mtp`, `suffix`.
    num_speculative_tokens: k, the most tokens drafted per target step (>= 1); without it the
        method's default k from the registry.
    model: what drafts, for the methods that read one: for `draft_model` the draft model (the
        same forms as the target: a GGUF path, a Hugging Face model directory, `default`), or
        `target` for the target's own weights; for `eagle`, `hybrid` and `medusa` a head
        directory (`specdec train-draft`, or a published EAGLE-3 / Medusa head; without it, the
        head shipped for the target); for `mtp` a checkpoint directory holding a
        multi-token-prediction layer (without it, the target's own directory).
    adaptive: let the number of drafted tokens follow acceptance (at most
        num_speculative_tokens), and switch speculation off for a while when it does not pay.
    drafter_invariant: sample with the drafter-invariant rule (SamplingParams.drafter_invariant):
        a seeded request gives the same tokens with speculation on or off.

    Every other key belongs to the method: its options dataclass in the registry validates it
    (`prompt_lookup_min`/`_max` for ngram and hybrid, `quantization` for draft_model, `layers`
    and `profile` for layer_skip, `tree_width`/`tree_nodes` for eagle, hybrid, mtp and medusa,
    `draft_confidence` for eagle and hybrid,
    `suffix_decoding_*` for suffix). They are given flat, as in vLLM's `speculative_config`
    (`SpeculativeConfig(method="ngram", prompt_lookup_max=3)`), kept in `options`, and read as
    attributes (`config.prompt_lookup_max`).
    """

    method: str
    num_speculative_tokens: int
    model: str | None
    adaptive: bool
    drafter_invariant: bool
    options: Options

    def __init__(
        self,
        method: str,
        num_speculative_tokens: int | None = None,
        model: str | None = None,
        adaptive: bool = False,
        drafter_invariant: bool = False,
        options: Options | None = None,
        **method_keys: Any,
    ) -> None:
        entry = registry.method(method)
        if options is None:
            options = entry.make_options(method_keys, COMMON_KEYS)
        else:
            if type(options) is not entry.options:
                raise ConfigError(f"options for method {method!r} must be {entry.options.__name__}, got {type(options).__name__}")
            if method_keys:
                entry.make_options(method_keys, COMMON_KEYS)  # names the unknown keys, if any
                options = dataclasses.replace(options, **method_keys)
        k = entry.default_k if num_speculative_tokens is None else num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ConfigError(f"num_speculative_tokens must be an integer >= 1, got {k!r}")
        if k > 64:
            raise ConfigError(f"num_speculative_tokens must be <= 64, got {k}")
        if model is not None and not isinstance(model, str):
            raise ConfigError(f"model must be a string, got {model!r}")
        if not isinstance(adaptive, bool):
            raise ConfigError(f"adaptive must be true or false, got {adaptive!r}")
        if not isinstance(drafter_invariant, bool):
            raise ConfigError(f"drafter_invariant must be true or false, got {drafter_invariant!r}")
        for name, value in (("method", method), ("num_speculative_tokens", k), ("model", model), ("adaptive", adaptive),
                            ("drafter_invariant", drafter_invariant), ("options", options)):
            object.__setattr__(self, name, value)
        options.check(self)

    def __getattr__(self, name: str) -> Any:
        # The method's own keys read as attributes; only reached when normal lookup fails.
        options = self.__dict__.get("options")
        if options is not None and not name.startswith("__") and name in options.__dataclass_fields__:
            return getattr(options, name)
        method = self.__dict__.get("method")
        raise AttributeError(f"speculative config for method {method!r} has no key {name!r}")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SpeculativeConfig:
        if not isinstance(data, dict):
            raise ConfigError(f"speculative config must be a JSON object, got {type(data).__name__}")
        if "method" not in data:
            raise ConfigError("speculative config needs a 'method'")
        if "options" in data:
            raise ConfigError("give the method's keys flat in the speculative config, not under 'options'")
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
        if registry.method(self.method).takes_model and self.model:
            parts.append("self" if self.model == "target" else Path(self.model).name)
        parts += self.options.label()
        parts.append(f"k={self.num_speculative_tokens}")
        parts += self.options.label_after_k()
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
        """The config as flat JSON-able keys: the common ones, then the method's."""
        data = {name: getattr(self, name) for name in COMMON_KEYS}
        data.update({k: list(v) if isinstance(v, tuple) else v for k, v in self.options.to_dict().items()})
        return data

    def defaults(self) -> dict[str, Any]:
        """Every key's default for this method (k: the method's default k)."""
        entry = registry.method(self.method)
        data = {"method": self.method, "num_speculative_tokens": entry.default_k, "model": None, "adaptive": False,
                "drafter_invariant": False}
        data.update({f.name: f.default for f in dataclasses.fields(entry.options)})
        return data
