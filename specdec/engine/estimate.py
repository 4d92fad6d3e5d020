"""The expected gain of speculation from acceptance and costs (Leviathan et al., 2023).

With each drafted token accepted with probability `acceptance` independently of the others
(the model's assumption), a step that drafts k tokens commits on average

    E[tokens per step] = (1 - a^(k + 1)) / (1 - a)        (k + 1 when a = 1)

counting the token the target adds itself. The step costs k draft passes at `draft_cost`
each (one draft pass over a target step) plus a target pass over k + 1 tokens, which costs
`verify_cost` target steps (1 where verification is as cheap as a plain step, as on a GPU at
low batch; measured on the CPU by `specdec costs`). The expected speedup over plain decoding is

    E[tokens per step] / (k * draft_cost + verify_cost).
"""

from __future__ import annotations


def expected_tokens_per_step(acceptance: float, k: int) -> float:
    if not 0 <= acceptance <= 1:
        raise ValueError(f"acceptance must be in [0, 1], got {acceptance}")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    if acceptance == 1:
        return float(k + 1)
    return (1 - acceptance ** (k + 1)) / (1 - acceptance)


def expected_speedup(acceptance: float, k: int, draft_cost: float, verify_cost: float = 1.0) -> float:
    if draft_cost < 0 or verify_cost <= 0:
        raise ValueError("draft_cost must be >= 0 and verify_cost > 0")
    return expected_tokens_per_step(acceptance, k) / (k * draft_cost + verify_cost)
