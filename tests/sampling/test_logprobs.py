"""token_logprobs: each row's log-softmax at the chosen token, the top alternatives in order
(ties by token id), and bitwise the same for a row alone or among others."""

from __future__ import annotations

import pytest
import torch

from specdec.sampling.logprobs import token_logprobs


def test_values_and_top_order() -> None:
    logits = torch.tensor([[0.0, 2.0, 2.0, -1.0], [3.0, 0.0, 1.0, 1.0]])
    out = token_logprobs(logits, [3, 0], top=3)
    logp = torch.log_softmax(logits, dim=-1)
    assert [o.token for o in out] == [3, 0]
    assert out[0].logprob == pytest.approx(float(logp[0, 3])) and out[1].logprob == pytest.approx(float(logp[1, 0]))
    assert [t for t, _ in out[0].top] == [1, 2, 0]  # 1 and 2 tie: id order
    assert [t for t, _ in out[1].top] == [0, 2, 3]
    assert all(a >= b for (_, a), (_, b) in zip(out[1].top, out[1].top[1:]))
    assert token_logprobs(logits, [1, 1], top=0)[0].top == ()


def test_rows_are_bitwise_alone_or_together() -> None:
    logits = torch.randn(6, 5000, generator=torch.Generator().manual_seed(0)) * 4
    tokens = [5, 17, 4000, 2, 2, 999]
    together = token_logprobs(logits, tokens, top=5)
    for i, token in enumerate(tokens):
        assert token_logprobs(logits[i : i + 1], [token], top=5)[0] == together[i]


def test_shape_check() -> None:
    with pytest.raises(ValueError, match="len\\(tokens\\)"):
        token_logprobs(torch.zeros(2, 4), [1], top=0)
