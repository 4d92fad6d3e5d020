"""Logits to the probabilities we sample from: temperature, then top-k, top-p and min-p."""

from __future__ import annotations

import torch

from specdec import kernels
from specdec.sampling.params import SamplingParams


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """[..., vocab] -> [...] int64: each row's most likely token (its first maximum), as
    `logits.argmax(-1)`; on specdec's kernels for float32 logits on the CPU (PyTorch's CPU argmax
    over a vocabulary is several times slower than a max and a scan)."""
    if logits.dtype == torch.float32 and logits.device.type == "cpu" and logits.numel() and kernels.available():
        return kernels.argmax(logits)
    return logits.argmax(-1)


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Turn logits into the distribution that sampling draws from.

    logits: [..., vocab] -> probs: [..., vocab], float32, rows sum to 1.
    Filters, in order: temperature scaling; top-k keeps the k most likely tokens; top-p keeps
    the smallest set of most likely tokens whose mass reaches top_p; min-p drops tokens below
    min_p times the most likely token's probability. The most likely token always survives.
    Greedy (temperature 0) is a one-hot at the argmax.

    Any positive temperature is safe: logits are shifted so that the largest is 0 before
    dividing, so every scaled logit is <= 0 and the softmax never overflows. A temperature so
    small that the division underflows or divides by a float32 zero gives the limit, a one-hot
    at the argmax (uniform over exact ties), never NaN.
    """
    if logits.dim() < 1:
        raise ValueError(f"logits must have a vocab dimension, got shape {tuple(logits.shape)}")
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(argmax(logits), logits.shape[-1]).float()
    # Shift by the row maximum, then scale: (logits - max) / T <= 0 (softmax is shift-invariant).
    # With a tiny T, `shifted / T` is -inf below the maximum and 0 / 0 = NaN at it (T rounds to 0
    # in float32 below 1.4e-45); an infinite T gives -inf / inf = NaN at masked tokens. Both are
    # put back to their limits: 0 at the maximum, -inf where the logit was -inf.
    raw = logits
    shifted = logits - logits.amax(dim=-1, keepdim=True)  # [..., vocab], <= 0
    logits = shifted / params.temperature
    logits = torch.where(shifted == 0, 0.0, logits)
    logits = torch.where(shifted == float("-inf"), float("-inf"), logits)
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        # Ranked on the logits as given: the shift can round apart logits into a tie.
        kth = torch.topk(raw, params.top_k, dim=-1).values[..., -1:]  # [..., 1]
        logits = logits.masked_fill(raw < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1:
        probs = probs.masked_fill(outside_nucleus(probs, params.top_p), 0.0)
    if params.min_p > 0:
        threshold = params.min_p * probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


# Top-p ranks only this many of the most likely tokens first (a partial sort), and more only
# where their mass falls short of top_p: sorting a whole 49k-262k vocabulary costs about a
# plain decoding step per row, a partial sort a fortieth of it.
NUCLEUS_FIRST = 256


def outside_nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """probs: [..., vocab] -> bool [..., vocab]: the tokens top-p drops, all but the smallest
    set of most likely tokens whose mass reaches top_p (the top token always stays).

    Ranked by a partial sort of the `width` most likely tokens, widened until every row's
    set ends inside them: once the mass before a ranked token reaches top_p, it and every
    token below it are dropped, so the rest of the vocabulary need not be ranked."""
    vocab = probs.shape[-1]
    width = min(vocab, NUCLEUS_FIRST)
    while True:
        ranked_probs, order = torch.topk(probs, width, dim=-1)  # [..., width], descending
        # Mass strictly before each token: a token is kept while that mass is below top_p.
        mass_before = torch.cumsum(ranked_probs, dim=-1) - ranked_probs
        drop_ranked = mass_before >= top_p
        # The top token's mass before is 0, and a top_p below float32's smallest (1e-300)
        # rounds to 0 too: keep it explicitly, or nothing would be left.
        drop_ranked[..., 0] = False
        if width == vocab or bool(drop_ranked[..., -1].all()):
            break
        width = min(vocab, width * 8)
    keep = torch.zeros(probs.shape, dtype=torch.bool, device=probs.device).scatter(-1, order, ~drop_ranked)
    return ~keep


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Draw one token per row. probs: [batch, vocab] (need not sum to 1) -> tokens: [batch].

    By the inverse of each row's cumulative distribution, summed in float64: one uniform a row,
    where torch.multinomial draws a random number per vocabulary entry (for a large vocabulary,
    about as long as a plain decoding step). A token of probability 0 is never drawn:
    the first index whose running sum exceeds u lies where the sum rose.
    """
    if probs.dim() != 2:
        raise ValueError(f"probs must be [batch, vocab], got shape {tuple(probs.shape)}")
    cdf = probs.double().cumsum(dim=-1)  # [batch, vocab]
    total = cdf[:, -1:]
    if not bool((total > 0).all()):
        raise ValueError("every row of probs needs some positive mass")
    u = torch.rand(total.shape, generator=generator, dtype=torch.float64, device=probs.device) * total
    tokens = torch.searchsorted(cdf, u, right=True).squeeze(-1)  # [batch]
    vocab = probs.shape[-1]
    if bool((tokens >= vocab).any()):  # u rounded up to the total: the last token with mass
        last = vocab - 1 - (probs.flip(-1) > 0).int().argmax(dim=-1)
        tokens = torch.where(tokens >= vocab, last, tokens)
    return tokens
