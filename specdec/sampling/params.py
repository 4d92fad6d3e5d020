"""How to pick tokens: the sampling parameters of one request (frozen, validated)."""

from __future__ import annotations

from dataclasses import dataclass

from specdec.errors import ConfigError


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. `temperature == 0` is greedy decoding.

    top_k = 0 and top_p = 1 and min_p = 0 turn those filters off; top_p = 0 and min_p = 1 keep
    only the most likely token (min_p: every token tied with it), as OpenAI's API allows.
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
        if not 0 <= self.top_p <= 1:
            raise ConfigError(f"top_p must be in [0, 1], got {self.top_p!r}")
        if not 0 <= self.min_p <= 1:
            raise ConfigError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if any(not s for s in self.stop):
            raise ConfigError("stop strings must be non-empty")
        if not isinstance(self.drafter_invariant, bool):
            raise ConfigError(f"drafter_invariant must be true or false, got {self.drafter_invariant!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
