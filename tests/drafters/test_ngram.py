"""Prompt lookup: exact cases, and agreement with a plain reference implementation.

The rule: the last n tokens (n = n_max .. n_min, longest first) are looked up earlier in the
context; the latest earlier occurrence wins, and a match of n tokens proposes the
min(k, max(1, n - 1)) tokens that followed it (fewer at the end of the context)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.config import SamplingParams, SpeculativeConfig
from specdec.methods import build_drafter
from specdec.drafters.ngram import NgramDrafter, find_continuation


def find(context: list[int], n_min: int = 1, n_max: int = 4, k: int = 4) -> list[int]:
    return find_continuation(np.asarray(context, dtype=np.int64), n_min, n_max, k)


def reference(context: list[int], n_min: int, n_max: int, k: int) -> list[int]:
    """Plain loops: for n from n_max down, the latest earlier occurrence of the last n tokens."""
    length = len(context)
    for n in range(n_max, n_min - 1, -1):
        if n > length - 1:
            continue
        suffix = context[length - n :]
        for start in range(length - n - 1, -1, -1):  # occurrences other than the suffix itself
            if context[start : start + n] == suffix:
                return context[start + n : start + n + min(k, max(1, n - 1))]
    return []


def test_whole_suffix_match() -> None:
    assert find([1, 2, 3, 4, 1, 2, 3], k=2) == [4, 1]
    assert find([1, 2, 3, 4, 1, 2, 3], k=1) == [4]


def test_longest_n_is_tried_first() -> None:
    # [1, 2] occurred at 0 (followed by 3); [2] alone occurred last at 4 (followed by 4).
    context = [1, 2, 3, 9, 2, 4, 1, 2]
    assert find(context, n_min=1, n_max=2, k=2) == [3]
    assert find(context, n_min=1, n_max=1, k=2) == [4]


def test_most_recent_occurrence_wins() -> None:
    assert find([1, 2, 7, 1, 2, 8, 1, 2], n_min=2, n_max=2, k=1) == [8]
    assert find([1, 2, 7, 5, 1, 2, 7, 6, 1, 2, 7], n_min=3, n_max=3, k=3) == [6, 1]


def test_no_match_is_empty() -> None:
    assert find([1, 2, 3, 4]) == []
    assert find([5, 6, 7, 5, 8], n_min=2) == []  # only a 1-gram repeats


@pytest.mark.parametrize(("k", "expected"), [(1, [7]), (2, [7, 8]), (3, [7, 8, 1]), (10, [7, 8, 1, 2, 3])])
def test_proposal_length_is_k_capped_by_match_length(k: int, expected: list[int]) -> None:
    # A 6-token match proposes at most 5 tokens.
    context = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4, 5, 6]
    assert find(context, n_min=1, n_max=6, k=k) == expected


@pytest.mark.parametrize("n", [1, 2])
def test_short_matches_propose_one_token(n: int) -> None:
    assert find([4, 5, 6, 7, 4, 5], n_min=n, n_max=n, k=8) == [6]


def test_proposal_stops_at_the_end_of_the_context() -> None:
    # [7, 7, 7] matches at 0 and may propose 2 tokens; only one follows it.
    assert find([7, 7, 7, 7], n_min=3, n_max=3, k=4) == [7]


def test_overlapping_occurrence() -> None:
    # The suffix [7, 7] also occurs one position earlier, overlapping itself.
    assert find([7, 7, 7], n_min=2, n_max=2, k=4) == [7]


def test_n_min_bound() -> None:
    context = [1, 2, 5, 1, 2]
    assert find(context, n_min=2, n_max=3, k=2) == [5]
    assert find(context, n_min=3, n_max=4, k=2) == []


def test_n_max_bound() -> None:
    context = [1, 2, 3, 8, 4, 2, 3, 9, 1, 2, 3]
    assert find(context, n_min=1, n_max=3, k=4) == [8, 4]  # [1, 2, 3] at 0
    assert find(context, n_min=1, n_max=2, k=4) == [9]  # [2, 3] last at 5


@pytest.mark.parametrize("context", [[], [4]])
def test_too_short_contexts(context: list[int]) -> None:
    assert find(context) == []


@settings(max_examples=300, deadline=None)
@given(
    context=st.lists(st.integers(0, 4), max_size=40),
    n_min=st.integers(1, 4),
    extra=st.integers(0, 3),
    k=st.integers(1, 8),
)
def test_agrees_with_reference(context: list[int], n_min: int, extra: int, k: int) -> None:
    n_max = n_min + extra
    result = find(context, n_min, n_max, k)
    assert result == reference(context, n_min, n_max, k)
    if result:
        # The continuation follows an earlier occurrence of a suffix of length n_min .. n_max.
        assert any(
            context[start : start + n] == context[len(context) - n :]
            and context[start + n : start + n + len(result)] == result
            and len(result) <= min(k, max(1, n - 1))
            for n in range(n_min, n_max + 1)
            for start in range(0, len(context) - n)
        )


def test_drafter_proposes_deterministically() -> None:
    drafter = build_drafter(SpeculativeConfig(method="ngram", prompt_lookup_min=1, prompt_lookup_max=3), None)
    assert isinstance(drafter, NgramDrafter)
    assert (drafter.n_min, drafter.n_max) == (1, 3)
    drafter.begin([1, 2, 3], 32)
    proposal = drafter.propose([1, 2, 3, 4, 5, 1, 2, 3], 3, SamplingParams(), None)
    assert proposal.tokens == [4, 5]
    assert proposal.probs is None
    drafter.commit([1, 2, 3, 4, 5, 1, 2, 3, 4], 1)
    assert drafter.propose([5, 6], 3, SamplingParams(temperature=1.0), None).tokens == []
