"""The expected gain of speculation from acceptance and costs (Leviathan et al., 2023).

With each drafted token accepted with probability `acceptance` independently of the others
(the model's assumption), a step that drafts k tokens commits on average

    E[tokens per step] = (1 - a^(k + 1)) / (1 - a)        (k + 1 when a = 1)

counting the token the target adds itself. The step costs k draft passes at `draft_cost`
each (one draft pass over a target step) plus a target pass over k + 1 tokens, which costs
`verify_cost` target steps (1 where verification is as cheap as a plain step, as on a GPU at
low batch; measured on the CPU by `specdec costs`). The expected speedup over plain decoding is

    E[tokens per step] / (k * draft_cost + verify_cost).

Measured acceptance need not be independent from position to position, and a token tree's is
not a chain's: with p_i the fraction of steps whose drafted token at depth i was accepted (the
`per_position_acceptance` specdec reports; for a tree, some node at depth i on the accepted
path), a step commits on average

    E[tokens per step] = 1 + p_1 + ... + p_d

whatever the dependence, d being the chain's k or the tree's depth. The tree's verification
cost is that of a pass over all its nodes (+ 1).
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


def expected_tokens_from_positions(per_position: list[float]) -> float:
    """1 + the sum of the per-position acceptances (non-increasing, in [0, 1])."""
    if not per_position:
        raise ValueError("per-position acceptance needs at least one position")
    if any(not 0 <= p <= 1 for p in per_position):
        raise ValueError(f"per-position acceptances must be in [0, 1], got {per_position}")
    if any(b > a for a, b in zip(per_position, per_position[1:])):
        raise ValueError(f"per-position acceptances cannot grow with depth (depth i needs depth i - 1), got {per_position}")
    return 1.0 + sum(per_position)
