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


def test_target_tokens_count_every_verified_token_and_cpu_time_adds_up() -> None:
    stats = RequestStats(generated_tokens=7)
    stats.record_step(drafted=3, accepted=1, cpu_time_s=0.5)  # a chain: the fed token and 3 drafts
    stats.record_step(drafted=2, accepted=2, verified_tokens=7, cpu_time_s=0.25)  # a tree of 6 nodes, depth 2
    stats.record_step(drafted=0, accepted=0)  # a plain step
    assert stats.target_tokens == 4 + 7 + 1
    assert stats.committed_tokens == 2 + 3 + 1
    assert stats.target_tokens_per_output_token == pytest.approx(12 / 6)
    assert stats.cpu_s_per_output_token == pytest.approx(0.75 / 7)
    other = RequestStats(generated_tokens=1)
    other.record_step(0, 0, cpu_time_s=0.25)
    stats.merge(other)
    assert (stats.target_tokens, stats.cpu_time_s) == (13, 1.0)
    assert stats.to_dict()["target_tokens_per_output_token"] == round(13 / 7, 4)
    assert RequestStats().target_tokens_per_output_token == 0.0 == RequestStats().cpu_s_per_output_token
