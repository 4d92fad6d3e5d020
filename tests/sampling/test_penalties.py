"""Logit bias and penalties (specdec.sampling.penalties) against a plain reference written from
their definitions, position by position; the histories of chain and tree positions; bitwise the
same for a position verified alone or among others; SamplingParams' checks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.config import SamplingParams
from specdec.errors import ConfigError
from specdec.sampling.penalties import History, chain_paths, tree_paths

VOCAB = 12


def reference(logits: list[float], params: SamplingParams, prompt: list[int], output: list[int]) -> list[float]:
    """One position's logits after `prompt` and `output` (generated so far), from the definitions."""
    out = []
    for token, value in enumerate(logits):
        value += dict(params.logit_bias).get(token, 0.0)
        if token in prompt or token in output:
            r = params.repetition_penalty
            value = value / r if value > 0 else value * r
        count = output.count(token)
        value -= params.frequency_penalty * count
        value -= params.presence_penalty * (count > 0)
        out.append(value)
    return out


PARAMS = SamplingParams(presence_penalty=0.7, frequency_penalty=0.4, repetition_penalty=1.3, logit_bias={3: 5.0, 7: -100})


def test_chain_positions_read_the_drafts_before_them() -> None:
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0))
    prompt, output, draft = [1, 2, 2], [5, 5, 9], [9, 4, 5]
    history = History(PARAMS, VOCAB, prompt)
    history.add(output)
    got = history.adjust(logits, chain_paths(draft))
    for j in range(4):
        want = reference(logits[j].tolist(), PARAMS, prompt, output + draft[:j])
        torch.testing.assert_close(got[j], torch.tensor(want), rtol=0, atol=1e-5)


def test_tree_positions_read_their_ancestors() -> None:
    tokens, parents = (4, 6, 4, 8), (-1, -1, 0, 1)  # 4 -> 4, and 6 -> 8
    assert tree_paths(tokens, parents) == [[], [4], [6], [4, 4], [6, 8]]
    assert chain_paths([1, 2]) == [[], [1], [1, 2]]
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(1))
    history = History(PARAMS, VOCAB, [0])
    got = history.adjust(logits, tree_paths(tokens, parents))
    for j, path in enumerate(tree_paths(tokens, parents)):
        torch.testing.assert_close(got[j], torch.tensor(reference(logits[j].tolist(), PARAMS, [0], path)), rtol=0, atol=1e-5)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, VOCAB - 1), max_size=6), st.lists(st.integers(0, VOCAB - 1), max_size=5),
       st.floats(-2, 2), st.floats(-2, 2), st.floats(0.5, 2))
def test_a_position_is_bitwise_the_same_alone_or_among_others(output, draft, presence, frequency, repetition) -> None:
    # What makes penalties lossless under speculation: verifying position j with the others is
    # bitwise what plain decoding computes there after committing the draft's first j tokens.
    params = SamplingParams(presence_penalty=presence, frequency_penalty=frequency, repetition_penalty=repetition,
                            logit_bias={1: 2.5})
    logits = torch.randn(len(draft) + 1, VOCAB, generator=torch.Generator().manual_seed(len(output)))
    together = History(params, VOCAB, [0, 3])
    together.add(output)
    batch = together.adjust(logits, chain_paths(draft))
    for j in range(len(draft) + 1):
        alone = History(params, VOCAB, [0, 3])
        alone.add(output + draft[:j])
        assert torch.equal(alone.adjust(logits[j : j + 1], [[]])[0], batch[j])


def test_bias_only_leaves_counts_alone_and_copies() -> None:
    logits = torch.zeros(2, VOCAB)
    history = History(SamplingParams(logit_bias={2: -3.0}), VOCAB, [2])
    history.add([2, 2])
    got = history.adjust(logits, chain_paths([2]))
    assert got[:, 2].tolist() == [-3.0, -3.0] and got.sum().item() == -6.0
    assert logits.abs().sum() == 0  # the input is not modified


def test_checks() -> None:
    with pytest.raises(ValueError, match="one path per position"):
        History(PARAMS, VOCAB, [0]).adjust(torch.zeros(2, VOCAB), [[]])
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        History(SamplingParams(logit_bias={VOCAB: 1.0}), VOCAB, [0])
    for bad in ({"presence_penalty": 2.5}, {"frequency_penalty": float("nan")}, {"repetition_penalty": 0.0},
                {"repetition_penalty": float("inf")}, {"logit_bias": {-1: 1.0}}, {"logit_bias": {True: 1.0}},
                {"logit_bias": {1: 101.0}}, {"logprobs": 21}, {"logprobs": True}, {"prompt_logprobs": 1}):
        with pytest.raises(ConfigError):
            SamplingParams(**bad)
    params = SamplingParams(logit_bias={5: 1, 2: -1.5})
    assert params.logit_bias == ((2, -1.5), (5, 1.0)) and params.adjusts_logits
    assert not SamplingParams().adjusts_logits and not SamplingParams(logprobs=3).adjusts_logits
