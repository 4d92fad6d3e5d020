"""Frozen, validated configuration: how to sample, and how to speculate.

The speculative config uses the vocabulary of serving stacks (vLLM's `speculative_config`):
`method`, `num_speculative_tokens`, `model`, `prompt_lookup_min`, `prompt_lookup_max`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import Any

from specdec.errors import ConfigError

# Defaults per method, chosen by measurement (see README, "Choosing k").
DEFAULT_NUM_SPECULATIVE_TOKENS = {"ngram": 4, "draft_model": 4}


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. `temperature == 0` is greedy decoding.

    top_k = 0 and top_p = 1 and min_p = 0 turn those filters off.
    """

    max_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class SpeculativeConfig:
    """What drafts the guesses and how many.

    method: a registered drafter name (`ngram`, `draft_model`).
    num_speculative_tokens: k, the most tokens drafted per target step (>= 1).
    model: the draft model for `draft_model` (same forms as the target: a GGUF path, a
        Hugging Face model directory, or `default`).
    prompt_lookup_min / prompt_lookup_max: n-gram sizes `ngram` tries, longest first.
    """

    method: str
    num_speculative_tokens: int | None = None
    model: str | None = None
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 6

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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
