"""The acceptance model (specdec.engine.estimate) and `specdec estimate`."""

from __future__ import annotations


import pytest

from specdec.engine.estimate import expected_speedup, expected_tokens_from_positions, expected_tokens_per_step




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
        (["-k", "2", "--draft-cost", "0.1"], "give -a/--acceptance and -k, or --per-position"),
        (["--per-position", "0.5,0.3", "-a", "0.5"], "not both"),
        (["--per-position", "0.5,x"], "comma-separated numbers"),
        (["--per-position", "0.3,0.5"], "cannot grow with depth"),
        (["--per-position", "1.2"], "must be in [0, 1]"),
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


def test_per_position_acceptance_gives_the_measured_tokens_per_step(run_cli) -> None:
    # Independent positions with rate a: p_i = a^i, and the two formulas agree.
    a, k = 0.7, 4
    assert expected_tokens_from_positions([a ** i for i in range(1, k + 1)]) == pytest.approx(expected_tokens_per_step(a, k))
    # A tree of depth 3 whose depths were accepted in 60%, 35% and 10% of steps; verifying its
    # 6 nodes cost 1.8 plain steps, each of the 3 head passes 5% of one.
    code, out, err = run_cli("estimate", "--per-position", "0.6,0.35,0.1", "--draft-cost", "0.05", "--verify-cost", "1.8")
    assert code == 0, err
    assert "expected tokens per target step: 2.05" in out
    assert f"expected speedup over plain decoding: {2.05 / (3 * 0.05 + 1.8):.2f}x" in out
