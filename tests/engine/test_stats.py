"""RequestStats: the metric definitions, and totals over requests."""

from __future__ import annotations

import pytest

from specdec.engine.stats import RequestStats


def test_definitions_follow_the_recorded_steps() -> None:
    stats = RequestStats()
    stats.record_step(drafted=3, accepted=3)  # all accepted, plus a bonus token
    stats.record_step(drafted=2, accepted=0)  # first rejected: one recovered token
    stats.record_step(drafted=0, accepted=0)  # nothing to draft: a plain step
    assert stats.acceptance_rate == pytest.approx(3 / 5)
    assert stats.mean_accepted_length == pytest.approx((4 + 1 + 1) / 3)
    assert stats.per_position_acceptance == [0.5, 0.5, 1.0]
    assert stats.target_forward_passes == 4


def test_merge_adds_counts_and_positions() -> None:
    a, b = RequestStats(), RequestStats()
    a.record_step(1, 1)
    b.record_step(3, 2)
    b.wall_time_s = 2.0
    a.merge(b)
    assert (a.drafted_tokens, a.accepted_tokens, a.committed_tokens, a.target_steps) == (4, 3, 5, 2)
    assert a.drafted_at == [2, 1, 1] and a.accepted_at == [2, 1, 0]
    assert a.wall_time_s == 2.0
