"""logits_to_probs: temperature, top-k, top-p and min-p on hand-made logits, and properties on
random logits. sample: shape checks, seeded determinism and its
distribution."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.config import SamplingParams
from specdec.sampling import logits_to_probs, sample

# Probabilities 0.4, 0.3, 0.2, 0.1 (in that order of tokens 2, 0, 3, 1) as logits.
PROBS = torch.tensor([0.3, 0.1, 0.4, 0.2])
LOGITS = PROBS.log()


def kept(probs: torch.Tensor) -> set[int]:
    return set(torch.nonzero(probs > 0).flatten().tolist())


def params(**kwargs) -> SamplingParams:
    return SamplingParams(**({"temperature": 1.0} | kwargs))


def test_greedy_is_one_hot_at_argmax() -> None:
    logits = torch.tensor([[0.5, 3.0, -1.0, 2.9], [9.0, 0.0, 0.0, 0.0]])
    probs = logits_to_probs(logits, SamplingParams(temperature=0.0))
    assert probs.dtype == torch.float32
    assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]))


def test_temperature_one_is_softmax() -> None:
    probs = logits_to_probs(LOGITS, params())
    torch.testing.assert_close(probs, PROBS)


@pytest.mark.parametrize("temperature", [0.25, 0.5, 2.0, 10.0])
def test_temperature_scales_logits(temperature: float) -> None:
    probs = logits_to_probs(LOGITS, params(temperature=temperature))
    expected = PROBS ** (1 / temperature)
    torch.testing.assert_close(probs, expected / expected.sum())


def test_low_temperature_sharpens_and_high_flattens() -> None:
    cold = logits_to_probs(LOGITS, params(temperature=0.1))
    hot = logits_to_probs(LOGITS, params(temperature=100.0))
    assert cold[2] > 0.9
    assert hot.max() - hot.min() < 0.01


@pytest.mark.parametrize(
    ("top_k", "expected"),
    [(1, {2}), (2, {2, 0}), (3, {2, 0, 3}), (4, {0, 1, 2, 3}), (0, {0, 1, 2, 3}), (100, {0, 1, 2, 3})],
)
def test_top_k_keeps_the_k_most_likely(top_k: int, expected: set[int]) -> None:
    probs = logits_to_probs(LOGITS, params(top_k=top_k))
    assert kept(probs) == expected
    # The kept tokens keep their relative probabilities.
    mask = torch.tensor([i in expected for i in range(4)])
    torch.testing.assert_close(probs, torch.where(mask, PROBS, 0.0) / PROBS[mask].sum())


@pytest.mark.parametrize(
    ("top_p", "expected"),
    [
        (0.05, {2}),  # the top token is always kept
        (0.39, {2}),  # reached by the top token alone
        (0.41, {2, 0}),
        (0.69, {2, 0}),
        (0.71, {2, 0, 3}),
        (0.89, {2, 0, 3}),
        (0.91, {0, 1, 2, 3}),
        (1.0, {0, 1, 2, 3}),
    ],
)
def test_top_p_keeps_smallest_prefix_reaching_p(top_p: float, expected: set[int]) -> None:
    # top_p values sit clearly on one side of each cumulative sum (0.4, 0.7, 0.9, 1.0).
    probs = logits_to_probs(LOGITS, params(top_p=top_p))
    assert kept(probs) == expected
    assert probs.sum().item() == pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize(
    ("min_p", "expected"),
    [
        (0.0, {0, 1, 2, 3}),
        (0.24, {0, 1, 2, 3}),
        (0.26, {2, 0, 3}),
        (0.49, {2, 0, 3}),
        (0.51, {2, 0}),
        (0.74, {2, 0}),
        (0.76, {2}),
    ],
)
def test_min_p_drops_tokens_below_fraction_of_top(min_p: float, expected: set[int]) -> None:
    probs = logits_to_probs(LOGITS, params(min_p=min_p))
    assert kept(probs) == expected


def test_filters_compose_top_k_then_top_p_then_min_p() -> None:
    # top_k=3 leaves 0.4, 0.3, 0.2 -> renormalised 4/9, 3/9, 2/9; top_p=0.5 then needs two.
    probs = logits_to_probs(LOGITS, params(top_k=3, top_p=0.5))
    assert kept(probs) == {2, 0}
    torch.testing.assert_close(probs, torch.tensor([3 / 7, 0.0, 4 / 7, 0.0]))
    # Without top_k the same top_p also keeps two; with min_p=0.8 only the top survives.
    assert kept(logits_to_probs(LOGITS, params(top_p=0.5, min_p=0.8))) == {2}


def test_batched_rows_are_independent() -> None:
    logits = torch.stack([LOGITS, LOGITS.flip(0), torch.zeros(4)])[None]  # [1, 3, 4]
    probs = logits_to_probs(logits, params(top_k=2))
    assert probs.shape == (1, 3, 4)
    assert kept(probs[0, 0]) == {2, 0}
    assert kept(probs[0, 1]) == {1, 3}  # flipped: 0.2, 0.4, 0.1, 0.3
    assert probs[0, 2].sum().item() == pytest.approx(1.0)  # ties at the k-th value are all kept


def test_scalar_logits_are_rejected() -> None:
    with pytest.raises(ValueError, match="vocab"):
        logits_to_probs(torch.tensor(1.0), params())


def test_minus_infinity_logits_get_zero_probability() -> None:
    logits = torch.tensor([0.0, float("-inf"), 1.0, float("-inf")])
    probs = logits_to_probs(logits, params(top_p=0.99))
    assert probs[1] == 0 and probs[3] == 0
    assert probs.sum().item() == pytest.approx(1.0)


# --- properties on random logits -------------------------------------------------------------

logit_rows = st.lists(st.floats(-20, 20, allow_nan=False, width=32), min_size=2, max_size=40)


@settings(max_examples=150, deadline=None)
@given(
    row=logit_rows,
    temperature=st.floats(0.05, 5.0),
    top_k=st.integers(0, 50),
    top_p=st.floats(0.01, 1.0),
    min_p=st.floats(0.0, 0.99),
)
def test_probs_are_a_distribution_containing_the_top_token(
    row: list[float], temperature: float, top_k: int, top_p: float, min_p: float
) -> None:
    logits = torch.tensor(row)
    probs = logits_to_probs(logits, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p))
    assert torch.isfinite(probs).all()
    assert (probs >= 0).all()
    assert probs.sum().item() == pytest.approx(1.0, abs=1e-5)
    full = torch.softmax(logits / temperature, -1)  # float32, as the implementation computes it
    # The most likely token survives (among tokens tied in float32, one of them).
    assert (probs[full == full.max()] > 0).any()
    on = probs > 0
    # Every filter keeps a most-likely prefix: no dropped token is more likely than a kept one.
    if (~on).any():
        assert full[on].min() >= full[~on].max()
    if top_k:
        assert logits[on].min() >= torch.topk(logits, min(top_k, len(row))).values[-1]


@settings(max_examples=150, deadline=None)
@given(row=logit_rows, top_p=st.floats(0.01, 0.999))
def test_top_p_kept_set_is_the_smallest_prefix_of_the_sorted_order(row: list[float], top_p: float) -> None:
    logits = torch.tensor(row)
    full = torch.softmax(logits, -1)  # float32, as the implementation computes it
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=top_p))
    on = probs > 0
    # A prefix: every kept token is at least as likely as every dropped one.
    if (~on).any():
        assert full[on].min() >= full[~on].max()
    # The smallest such prefix: its mass reaches top_p, and without its least likely token it does not.
    kept_mass = full[on].sum().item()
    assert kept_mass >= top_p - 1e-5
    assert kept_mass - full[on].min().item() < top_p + 1e-5
    # Kept tokens keep their relative probabilities.
    torch.testing.assert_close(probs[on], full[on] / full[on].sum())


@settings(max_examples=100, deadline=None)
@given(row=logit_rows, min_p=st.floats(0.001, 0.99))
def test_min_p_keeps_exactly_the_tokens_above_the_threshold(row: list[float], min_p: float) -> None:
    logits = torch.tensor(row)
    full = torch.softmax(logits, -1)
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, min_p=min_p))
    threshold = min_p * full.max()
    margin = 1e-6 * full.max()
    assert ((full > threshold + margin) <= (probs > 0)).all()
    assert ((full < threshold - margin) <= (probs == 0)).all()


# --- sample ----------------------------------------------------------------------------------


def test_sample_needs_a_batch_of_rows() -> None:
    with pytest.raises(ValueError, match=r"\[batch, vocab\]"):
        sample(torch.tensor([0.5, 0.5]), None)


def test_sample_is_seeded_and_follows_zeros() -> None:
    probs = torch.tensor([[0.0, 0.5, 0.5, 0.0]]).expand(2000, 4)
    first = sample(probs, torch.Generator().manual_seed(7))
    second = sample(probs, torch.Generator().manual_seed(7))
    assert first.shape == (2000,)
    assert torch.equal(first, second)
    assert set(first.tolist()) == {1, 2}
    assert not torch.equal(first, sample(probs, torch.Generator().manual_seed(8)))
    assert math.isclose(first.float().mean().item(), 1.5, abs_tol=0.05)


def test_sample_follows_the_distribution_of_each_row() -> None:
    """Frequencies over 40,000 draws per row within a few standard errors of the row's
    probabilities, rows unnormalized and different; zero-probability tokens, the first and the
    last among them, never drawn."""
    gen = torch.Generator().manual_seed(3)
    weights = torch.tensor([[0.0, 2.0, 0.5, 0.0, 1.5, 0.0], [1.0, 0.0, 0.0, 3.0, 0.0, 4.0]])
    draws = 40_000
    tokens = sample(weights.repeat_interleave(draws, dim=0), gen).view(2, draws)
    for row, w in zip(tokens, weights):
        p = (w / w.sum()).double()
        freq = torch.bincount(row, minlength=len(w)).double() / draws
        assert torch.all(freq[p == 0] == 0)
        assert torch.all((freq - p).abs() <= 5 * (p * (1 - p) / draws).sqrt() + 1e-12)


def test_sample_needs_positive_mass() -> None:
    with pytest.raises(ValueError, match="positive mass"):
        sample(torch.zeros(1, 4), None)


def test_sample_draws_a_last_token_of_tiny_mass() -> None:
    """A row whose only mass sits in its last token draws it every time."""
    probs = torch.zeros(500, 8)
    probs[:, -1] = 1e-30
    assert set(sample(probs, torch.Generator().manual_seed(0)).tolist()) == {7}


# --- extreme temperatures ------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1e-38, 1e-45, 5e-324, 1e-300, 1e-8])
@pytest.mark.parametrize("filters", [{}, {"top_p": 0.9}, {"top_k": 3}, {"min_p": 0.5}])
def test_tiny_temperature_is_the_greedy_one_hot(temperature: float, filters: dict) -> None:
    # Logits spread over +-30, with a masked token: dividing them by T overflows float32 (and
    # float64 below 1e-300), and T itself rounds to 0 in float32 below 1.4e-45.
    logits = torch.tensor([[3.0, 30.0, -30.0, float("-inf"), 29.9], [-5.0, -4.0, -4.5, -6.0, -20.0]])
    probs = logits_to_probs(logits, params(temperature=temperature, **filters))
    greedy = logits_to_probs(logits, SamplingParams(temperature=0.0))
    assert torch.equal(probs, greedy)
    tokens = sample(probs, torch.Generator().manual_seed(0))
    assert tokens.tolist() == [1, 1]


def test_tiny_temperature_splits_exact_ties_evenly() -> None:
    probs = logits_to_probs(torch.tensor([2.0, 7.0, 7.0, 1.0]), params(temperature=1e-40))
    assert probs.tolist() == [0.0, 0.5, 0.5, 0.0]


@pytest.mark.parametrize("top_p", [0.0, 1e-300, 5e-324, 1e-45])
def test_a_top_p_that_rounds_to_zero_keeps_the_top_token(top_p: float) -> None:
    probs = logits_to_probs(LOGITS, params(top_p=top_p))
    assert probs.tolist() == [0.0, 0.0, 1.0, 0.0]


def test_min_p_of_one_keeps_the_top_token_and_its_ties() -> None:
    assert logits_to_probs(LOGITS, params(min_p=1.0)).tolist() == [0.0, 0.0, 1.0, 0.0]
    assert logits_to_probs(torch.tensor([2.0, 7.0, 7.0, 1.0]), params(min_p=1.0)).tolist() == [0.0, 0.5, 0.5, 0.0]


def test_infinite_temperature_is_uniform_over_finite_logits() -> None:
    probs = logits_to_probs(torch.tensor([2.0, float("-inf"), -9.0, 40.0]), params(temperature=float("inf")))
    torch.testing.assert_close(probs, torch.tensor([1 / 3, 0.0, 1 / 3, 1 / 3]))


@settings(max_examples=100, deadline=None)
@given(row=logit_rows, temperature=st.floats(5e-324, 1e-3) | st.floats(1e3, 1e300), top_p=st.floats(0.01, 1.0))
def test_any_positive_temperature_gives_a_distribution(row: list[float], temperature: float, top_p: float) -> None:
    logits = torch.tensor(row) * 1e3  # up to +-20000: overflows float32 once divided by T < 1.7e-34
    probs = logits_to_probs(logits, SamplingParams(temperature=temperature, top_p=top_p))
    assert torch.isfinite(probs).all() and (probs >= 0).all()
    assert probs.sum().item() == pytest.approx(1.0, abs=1e-5)
    unfiltered = logits_to_probs(logits, SamplingParams(temperature=temperature))
    assert (probs[unfiltered == unfiltered.max()] > 0).any()  # a most likely token survives (ties: one of them)
    sample(probs[None], torch.Generator().manual_seed(0))  # multinomial accepts it


def _nucleus_by_full_sort(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The reference: rank the whole vocabulary, drop each token whose mass before reaches top_p."""
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    drop_sorted = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= top_p
    drop_sorted[..., 0] = False
    return torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)


@pytest.mark.parametrize("first", [1, 4, 256])
@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.999])
def test_top_p_partial_sort_drops_what_a_full_sort_drops(monkeypatch: pytest.MonkeyPatch, first: int, top_p: float) -> None:
    # Rows from peaked to flat over a 5,000-token vocabulary: their nuclei end after 1 to
    # thousands of tokens, so the ranked width must grow (past the vocabulary's size at the end).
    from specdec.sampling import probs as probs_module

    monkeypatch.setattr(probs_module, "NUCLEUS_FIRST", first)
    generator = torch.Generator().manual_seed(7)
    scales = torch.tensor([12.0, 4.0, 1.0, 0.2, 0.02])[:, None]  # [rows, 1]; no ties, whose order is arbitrary
    logits = torch.randn(5, 5000, generator=generator) * scales  # [rows, vocab]
    probs = torch.softmax(logits, dim=-1)
    dropped = probs_module.outside_nucleus(probs, top_p)
    assert torch.equal(dropped, _nucleus_by_full_sort(probs, top_p))
    assert torch.equal(dropped[None], probs_module.outside_nucleus(probs[None], top_p))  # any leading shape
