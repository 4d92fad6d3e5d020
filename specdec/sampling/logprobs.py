"""Log-probabilities of chosen tokens, and the most likely alternatives, from logits."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLogprob:
    """A token, its log-probability under the model at its position, and the `top` most likely
    tokens there with theirs (most likely first; ties in token id order)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """logits: [n, vocab], the model's at the n positions that chose `tokens` (n of them).

    Each row is normalised alone (a log-softmax of one row), so a position's values are bitwise
    the same whichever other positions share the pass.
    """
    if logits.dim() != 2 or logits.shape[0] != len(tokens):
        raise ValueError(f"need logits [len(tokens)={len(tokens)}, vocab], got shape {tuple(logits.shape)}")
    out = []
    for row, token in zip(logits, tokens):
        logp = torch.log_softmax(row.float(), dim=-1)  # [vocab]
        best: tuple[tuple[int, float], ...] = ()
        if top:
            # A stable sort: equal log-probabilities keep token id order.
            order = torch.sort(logp, descending=True, stable=True).indices[:top]
            best = tuple((int(t), float(logp[t])) for t in order)
        out.append(TokenLogprob(int(token), float(logp[token]), best))
    return out
