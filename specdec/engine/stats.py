"""Per-request statistics, with the definitions every specdec surface reports under.

- drafted_tokens: tokens proposed by the drafter and verified by the target.
- accepted_tokens: drafted tokens that passed verification.
- acceptance_rate = accepted_tokens / drafted_tokens (0 when nothing was drafted).
- target_steps: target forward passes after prefill; each commits one or more tokens.
- mean_accepted_length = committed tokens / target_steps: tokens per target step, counting
  the token the target itself adds each step (recovered or bonus). Plain decoding scores 1.0;
  k drafted tokens all accepted every step scores k + 1.
- per_position_acceptance[i]: of the steps that drafted a token at position i (0-based), the
  fraction in which it was accepted.
- target_forward_passes = target_steps + 1 (the prefill).
- wall_time_s: from the request's start to its last token; tokens_per_s = generated_tokens /
  wall_time_s, prefill included.
- draft_time_s: time spent in the drafter proposing; verify_time_s: time spent in target
  passes after prefill and in acceptance. Their ratio per token is the draft/target cost
  ratio that `specdec tune` and `specdec estimate` use.
- rejected_steps: target steps in which a drafted token was rejected. Drafted tokens after a
  step's first rejection are never tested, so the probability that a tested drafted token is
  accepted is accepted_tokens / (accepted_tokens + rejected_steps) (`tested_acceptance`):
  the acceptance rate a of the expected-speedup formula, which acceptance_rate underestimates.
- undrafted_steps: target steps that verified an empty draft (nothing proposed, or
  speculation switched off by adaptive k); they cost what a plain step costs.
- target_tokens: tokens the target processed after prefill, drafts included (each step: the
  fed token and every drafted token or tree node, verified or not; a batch's padding is not
  counted). target_tokens_per_output_token = target_tokens / committed tokens: 1.0 for plain
  decoding, above it by the drafts the target rejected. Speculation buys speed with this extra
  compute.
- cpu_time_s: process CPU time (every thread) spent on the request: its prefill, and an equal
  share of each batch step it took part in (exact for a request decoded alone).
  cpu_s_per_output_token = cpu_time_s / generated_tokens.

Counts are taken before truncation at a stop condition, so committed tokens may exceed
generated_tokens by the tokens dropped after EOS, a stop string or max_tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose keys and values came from the prefix cache
    generated_tokens: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    committed_tokens: int = 0
    target_steps: int = 0
    prefill_time_s: float = 0.0
    wall_time_s: float = 0.0
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    undrafted_steps: int = 0
    rejected_steps: int = 0
    target_tokens: int = 0
    cpu_time_s: float = 0.0
    drafted_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)

    def record_step(self, drafted: int, accepted: int, draft_time_s: float = 0.0, verify_time_s: float = 0.0,
                    verified_tokens: int | None = None, cpu_time_s: float = 0.0) -> None:
        """One target step: `drafted` positions (a tree's depth), `accepted` of them kept;
        `verified_tokens` the tokens the target processed for it (default: a chain's drafted + 1)."""
        self.target_steps += 1
        self.target_tokens += drafted + 1 if verified_tokens is None else verified_tokens
        self.cpu_time_s += cpu_time_s
        self.draft_time_s += draft_time_s
        self.verify_time_s += verify_time_s
        self.undrafted_steps += drafted == 0
        self.rejected_steps += accepted < drafted
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        self.committed_tokens += accepted + 1
        grow = drafted - len(self.drafted_at)
        if grow > 0:
            self.drafted_at.extend([0] * grow)
            self.accepted_at.extend([0] * grow)
        for i in range(drafted):
            self.drafted_at[i] += 1
        for i in range(accepted):
            self.accepted_at[i] += 1

    def merge(self, other: RequestStats) -> None:
        """Add another request's counts and times to these (for totals over many requests)."""
        for name in ("prompt_tokens", "cached_tokens", "generated_tokens", "drafted_tokens", "accepted_tokens", "committed_tokens",
                     "target_steps", "prefill_time_s", "wall_time_s", "draft_time_s", "verify_time_s",
                     "undrafted_steps", "rejected_steps", "target_tokens", "cpu_time_s"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        grow = len(other.drafted_at) - len(self.drafted_at)
        if grow > 0:
            self.drafted_at.extend([0] * grow)
            self.accepted_at.extend([0] * grow)
        for i, (d, a) in enumerate(zip(other.drafted_at, other.accepted_at)):
            self.drafted_at[i] += d
            self.accepted_at[i] += a

    @property
    def target_forward_passes(self) -> int:
        return self.target_steps + 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def tested_acceptance(self) -> float:
        tested = self.accepted_tokens + self.rejected_steps
        return self.accepted_tokens / tested if tested else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return self.committed_tokens / self.target_steps if self.target_steps else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)]

    @property
    def target_tokens_per_output_token(self) -> float:
        return self.target_tokens / self.committed_tokens if self.committed_tokens else 0.0

    @property
    def cpu_s_per_output_token(self) -> float:
        return self.cpu_time_s / self.generated_tokens if self.generated_tokens else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.wall_time_s if self.wall_time_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "generated_tokens": self.generated_tokens,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_accepted_length": round(self.mean_accepted_length, 4),
            "per_position_acceptance": [round(x, 4) for x in self.per_position_acceptance],
            "target_forward_passes": self.target_forward_passes,
            "undrafted_steps": self.undrafted_steps,
            "rejected_steps": self.rejected_steps,
            "tested_acceptance": round(self.tested_acceptance, 4),
            "target_tokens": self.target_tokens,
            "target_tokens_per_output_token": round(self.target_tokens_per_output_token, 4),
            "cpu_time_s": round(self.cpu_time_s, 4),
            "cpu_s_per_output_token": round(self.cpu_s_per_output_token, 6),
            "draft_time_s": round(self.draft_time_s, 4),
            "verify_time_s": round(self.verify_time_s, 4),
            "wall_time_s": round(self.wall_time_s, 4),
            "tokens_per_s": round(self.tokens_per_s, 2),
        }
