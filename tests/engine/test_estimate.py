"""The acceptance model (specdec.engine.estimate) and `specdec estimate`."""

from __future__ import annotations


import pytest

from specdec.engine.estimate import expected_speedup, expected_tokens_per_step




@pytest.mark.parametrize(("acceptance", "k"), [(0.0, 1), (0.3, 2), (0.8, 4), (0.95, 8), (1.0, 3)])
def test_expected_tokens_is_the_sum_over_positions(acceptance: float, k: int) -> None:
    # Position i (0-based) is reached with probability a^i; the target's own token is position 0.
    assert expected_tokens_per_step(acceptance, k) == pytest.approx(sum(acceptance**i for i in range(k + 1)))


@pytest.mark.parametrize(
    ("args", "acceptance", "k", "draft_cost", "verify_cost"),
    [
        (["-a", "0.8", "-k", "4", "--draft-cost", "0.1"], 0.8, 4, 0.1, 1.0),
        (["--acceptance", "0.6", "--num-speculative-tokens", "3", "--draft-cost", "0.05", "--verify-cost", "1.3"], 0.6, 3, 0.05, 1.3),
        (["-a", "0", "-k", "2", "--draft-cost", "0.2"], 0.0, 2, 0.2, 1.0),
    ],
)
def test_estimate_prints_the_formula(
    run_cli,
    args: list[str], acceptance: float, k: int, draft_cost: float, verify_cost: float,
) -> None:
    code, out, err = run_cli("estimate", *args)
    assert code == 0, err
    tokens = (1 - acceptance ** (k + 1)) / (1 - acceptance)
    speedup = tokens / (k * draft_cost + verify_cost)
    assert f"expected tokens per target step: {tokens:.2f}" in out
    assert f"expected speedup over plain decoding: {speedup:.2f}x" in out


def test_estimate_example_from_the_readme(run_cli) -> None:
    code, out, _ = run_cli("estimate", "-a", "0.8", "-k", "4", "--draft-cost", "0.1")
    assert code == 0
    assert out.splitlines() == ["expected tokens per target step: 3.36", "expected speedup over plain decoding: 2.40x"]


def test_estimate_every_draft_accepted(run_cli) -> None:
    # a = 1: (1 - a^(k+1)) / (1 - a) is 0/0; every step commits k + 1 tokens.
    code, out, err = run_cli("estimate", "-a", "1", "-k", "5", "--draft-cost", "0.2")
    assert code == 0, err
    assert "expected tokens per target step: 6.00" in out
    assert f"expected speedup over plain decoding: {6 / (5 * 0.2 + 1):.2f}x" in out
    assert expected_speedup(1.0, 5, 0.0) == 6.0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-a", "1.5", "-k", "4", "--draft-cost", "0.1"], "--acceptance must be in [0, 1]"),
        (["-a", "-0.1", "-k", "4", "--draft-cost", "0.1"], "--acceptance must be in [0, 1]"),
        (["-a", "nan", "-k", "4", "--draft-cost", "0.1"], "--acceptance must be in [0, 1]"),
        (["-a", "0.5", "-k", "0", "--draft-cost", "0.1"], "-k must be >= 1"),
        (["-a", "0.5", "-k", "2", "--draft-cost", "-1"], "--draft-cost must be a number >= 0"),
        (["-a", "0.5", "-k", "2", "--draft-cost", "inf"], "--draft-cost must be a number >= 0"),
        (["-a", "0.5", "-k", "2", "--draft-cost", "0", "--verify-cost", "0"], "--verify-cost must be a number > 0"),
    ],
)
def test_estimate_bad_input_is_one_line_error(
    run_cli, args: list[str], message: str
) -> None:
    code, out, err = run_cli("estimate", *args)
    assert code == 2
    assert not out
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ") and message in lines[0], lines[0]
