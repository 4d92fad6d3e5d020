"""Drafter-invariant sampling (Daliri, Musco and Suresh 2024, "Coupling without Communication
and Drafter-Invariant Speculative Decoding").

The token at sequence position `position` is the Gumbel-max sample
argmax(log target_probs + g), with g[v] = -log(-log(u[v])) and u uniform noise drawn from a
generator keyed by (seed, position) alone. That is an exact sample of target_probs, and it is
a function of the seed, the position and the target's distribution only: nothing a drafter
does can change it. Verification then keeps a drafted token exactly when it equals the target's
Gumbel-max token at its position (the greedy rule on perturbed logits), and adds the target's
token at the first mismatch or after the last draft. A seeded request therefore gives the same
tokens with speculation on or off, any drafter, any k, adaptive pauses, in any batch.

A model drafter drafts with the same noise, argmax(log draft_probs + g): when its distribution
is close to the target's the two maxima coincide often (Pr[accept] >= (1 - TV) / (1 + TV),
TV the total variation between them), against 1 - TV for the standard rule.
"""

from __future__ import annotations

import torch

# splitmix64 constants: the (seed, position) key is mixed into one 63-bit generator seed.
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1, _MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_MASK = (1 << 64) - 1


def _key(seed: int, position: int) -> int:
    z = (seed * _GOLDEN + position + 1) & _MASK
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK
    return (z ^ (z >> 31)) >> 1


def gumbel_noise(seed: int, position: int, vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[vocab] Gumbel(0, 1) noise for one position, the same on every call with this key."""
    generator = torch.Generator(device=device).manual_seed(_key(seed, position))
    uniform = torch.rand(vocab, generator=generator, device=device).clamp_(1e-20, 1.0 - 1e-7)
    return -torch.log(-torch.log(uniform))


def perturbed_log_probs(probs: torch.Tensor, seed: int, first_position: int) -> torch.Tensor:
    """probs: [n, vocab], the distributions at positions first_position .. + n - 1 ->
    [n, vocab] log probs plus each position's noise (-inf where a probability is 0)."""
    return perturbed_at_depths(probs, seed, first_position, list(range(probs.shape[0])))


def invariant_tokens(probs: torch.Tensor, seed: int, first_position: int) -> list[int]:
    """The Gumbel-max token at each of the n positions. probs: [n, vocab]."""
    return perturbed_log_probs(probs, seed, first_position).argmax(-1).tolist()


def perturbed_at_depths(probs: torch.Tensor, seed: int, base: int, depths: list[int]) -> torch.Tensor:
    """probs: [n, vocab], row r the distribution at sequence position base + depths[r] (a chain's
    depths are 0, 1, ...; a tree row after node i sits at its depth) -> [n, vocab] perturbed
    log probs: the invariant token at each row is their argmax. Each position's noise is drawn
    once, however many tree rows share its depth."""
    noise = {depth: gumbel_noise(seed, base + depth, probs.shape[-1], probs.device) for depth in dict.fromkeys(depths)}
    return probs.log() + torch.stack([noise[depth] for depth in depths])
