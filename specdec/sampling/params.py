"""How to pick tokens: the sampling parameters of one request (frozen, validated)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from specdec.errors import ConfigError

STRUCTURED_KINDS = ("json", "regex", "grammar")


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on what a request may generate (`specdec.sampling.grammar`).

    kind "json": a JSON document; spec is a JSON schema's text, or "" for any JSON object.
    kind "regex": spec is a regular expression the whole output matches.
    kind "grammar": spec is an EBNF grammar (xgrammar's dialect; the rule `root` starts it).
    """

    kind: Literal["json", "regex", "grammar"]
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise ConfigError(f"structured output kind must be one of {', '.join(STRUCTURED_KINDS)}; got {self.kind!r}")
        if not isinstance(self.spec, str):
            raise ConfigError(f"structured output spec must be text, got {type(self.spec).__name__}")
        if self.kind != "json" and not self.spec:
            raise ConfigError(f"a {self.kind} structured output needs its {self.kind}")
        if self.kind == "json" and self.spec:
            try:
                schema = json.loads(self.spec)
            except ValueError as exc:
                raise ConfigError(f"the JSON schema is not JSON: {exc}") from None
            if not isinstance(schema, dict):
                raise ConfigError("a JSON schema must be a JSON object")

    @property
    def what(self) -> str:
        """The kind in words, for messages."""
        return {"json": "JSON schema", "regex": "regular expression", "grammar": "EBNF grammar"}[self.kind]

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str | None = None) -> StructuredOutput:
        """A JSON document following `schema` (a dict or its text); None: any JSON object."""
        if schema is None:
            return cls("json")
        return cls("json", schema if isinstance(schema, str) else json.dumps(schema))


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. `temperature == 0` is greedy decoding.

    top_k = 0 and top_p = 1 and min_p = 0 turn those filters off; top_p = 0 and min_p = 1 keep
    only the most likely token (min_p: every token tied with it), as OpenAI's API allows.
    stop_token_ids: token ids that end the output as the model's EOS does (not part of it), even
        with ignore_eos: a fill-in-the-middle request ends at the model's FIM control tokens.
    drafter_invariant: sample each token as argmax(log p + Gumbel noise keyed by the seed and the
        token's position), so a seeded request gives the same tokens whatever the drafter, k,
        batch or load, speculation on or off (see `specdec.sampling.invariant`).
    presence_penalty, frequency_penalty (OpenAI's, in [-2, 2]), repetition_penalty (> 0; 1 is
        off) and logit_bias ({token id: bias in [-100, 100]}): applied to the target's logits at
        every position from the tokens before it (`specdec.sampling.penalties`).
    logprobs: None for none; n >= 0 to report each output token's log-probability and the n
        most likely tokens' at its position (the model's own distribution, before temperature,
        penalties, bias and filters). prompt_logprobs: also each prompt token's (after the first).
    structured: a grammar the output must follow (`StructuredOutput`): the target's logits at
        every position are masked by the grammar's state after the tokens before it. The output
        ends at the model's EOS once the grammar is complete, so ignore_eos cannot go with it.
    prediction: token ids the output is expected to mostly repeat (OpenAI's predicted outputs):
        the request's drafter proposes them (`specdec.drafters.prediction`); they never change
        what is generated, only how many target passes it takes.
    """

    max_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    drafter_invariant: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None
    prompt_logprobs: bool = False
    structured: StructuredOutput | None = None
    prediction: tuple[int, ...] = ()

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
        if not 0 <= self.top_p <= 1:
            raise ConfigError(f"top_p must be in [0, 1], got {self.top_p!r}")
        if not 0 <= self.min_p <= 1:
            raise ConfigError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if any(not s for s in self.stop):
            raise ConfigError("stop strings must be non-empty")
        if not isinstance(self.drafter_invariant, bool):
            raise ConfigError(f"drafter_invariant must be true or false, got {self.drafter_invariant!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ConfigError(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
        if not 0 < self.repetition_penalty < float("inf"):
            raise ConfigError(f"repetition_penalty must be a finite number > 0 (1 is off), got {self.repetition_penalty!r}")
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        pairs: dict[int, float] = {}
        for token, value in bias:
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise ConfigError(f"logit_bias keys must be token ids >= 0, got {token!r}")
            if isinstance(value, bool) or not -100 <= value <= 100:
                raise ConfigError(f"logit_bias values must be in [-100, 100], got {value!r} for token {token}")
            pairs[token] = float(value)
        object.__setattr__(self, "logit_bias", tuple(sorted(pairs.items())))
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= 20):
            raise ConfigError(f"logprobs must be None or an integer in 0..20, got {self.logprobs!r}")
        if not isinstance(self.prompt_logprobs, bool):
            raise ConfigError(f"prompt_logprobs must be true or false, got {self.prompt_logprobs!r}")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ConfigError("stop_token_ids must be token ids (integers >= 0)")
        object.__setattr__(self, "prediction", tuple(self.prediction))
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.prediction):
            raise ConfigError("prediction must be token ids (integers >= 0)")
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise ConfigError(f"structured must be a StructuredOutput, got {type(self.structured).__name__}")
        if self.structured is not None and self.ignore_eos:
            raise ConfigError("ignore_eos cannot go with a structured output: the output ends where the grammar does")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def adjusts_logits(self) -> bool:
        """Whether a bias or a penalty changes the target's logits."""
        return (bool(self.logit_bias) or self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)
