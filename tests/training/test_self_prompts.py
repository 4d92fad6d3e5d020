"""Requests the target writes itself (--self-prompts): which are kept, and a killed run that
resumes to what an uninterrupted one writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specdec.errors import ConfigError
from specdec.models import LoadedModel
from specdec.training.corpus import RequestFilter, excluded_runs, open_user_turn, read_answers, self_prompts

BENCHMARK = "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences"


def _attempt(n: int, text: str, finished: bool = True) -> dict:
    return {"attempt": n, "text": text, "finished": finished}


def test_the_filter_keeps_finished_new_requests_of_sane_length(tmp_path: Path) -> None:
    benchmark = tmp_path / "bench.jsonl"
    benchmark.write_text(json.dumps({"id": 1, "turns": [BENCHMARK + " and must-see attractions."]}) + "\n")
    attempts = [
        _attempt(0, "Can you suggest a good book about gardening?"),
        _attempt(1, "Can you suggest a book about the history of Rome?", finished=False),  # cut at the limit
        _attempt(2, "Hi"),  # too short
        _attempt(3, "  can you SUGGEST a good book about gardening  "),  # a repeat of 0, by its words
        _attempt(4, "Please " + BENCHMARK.lower() + "!"),  # shares 12 words with the benchmark
        _attempt(5, " ".join(["word"] * 151)),  # too long
        _attempt(6, "How do I boil an egg so that the yolk stays soft?"),
        _attempt(7, "What is a good name for a cat?"),
    ]
    chosen = RequestFilter(3, excluded_runs([benchmark]))
    for attempt in attempts:
        chosen.add(attempt)
    assert [(p.id, p.category) for p in chosen.kept] == [("self:0", "self"), ("self:6", "self"), ("self:7", "self")]
    assert chosen.kept[0].text == "Can you suggest a good book about gardening?"
    # Without the benchmark, attempt 4 is kept, and judging stops at the count.
    unfiltered = RequestFilter(2)
    for attempt in attempts:
        unfiltered.add(attempt)
    assert [p.id for p in unfiltered.kept] == ["self:0", "self:4"] and unfiltered.full


def test_the_filter_judges_in_attempt_order_whatever_order_attempts_end_in() -> None:
    attempts = [_attempt(n, f"Tell me one fact about the number {n % 3} please.") for n in range(6)]
    in_order, shuffled = RequestFilter(10), RequestFilter(10)
    for attempt in attempts:
        in_order.add(attempt)
    for n in (5, 3, 4, 1, 2):  # attempt 0 not yet written: nothing after it is judged
        shuffled.add(attempts[n])
    assert shuffled.kept == [] and shuffled.judged == 0
    shuffled.add(attempts[0])
    assert shuffled.kept == in_order.kept and [p.id for p in in_order.kept] == ["self:0", "self:1", "self:2"]


def test_the_open_user_turn_is_the_template_before_a_request(tiny_native: LoadedModel) -> None:
    prefix = open_user_turn(tiny_native)
    full = tiny_native.tokenizer.apply_chat_template([{"role": "user", "content": "hello there"}], tokenize=False)
    assert tiny_native.tokenizer.decode(prefix) == full[: full.index("hello there")]


def test_a_model_without_a_chat_template_is_refused(tiny_native: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tiny_native.tokenizer, "chat_template", None)
    with pytest.raises(ConfigError, match="chat template"):
        open_user_turn(tiny_native)


def test_a_stopped_run_resumes_to_the_uninterrupted_attempts(tiny_native: LoadedModel, tmp_path: Path) -> None:
    # A random model rarely ends its turn, so almost every attempt is dropped and the run makes
    # all 4 x 3 attempts: sampled, seeded per attempt, three rows at a time.
    whole = tmp_path / "whole.jsonl"
    kept = self_prompts(tiny_native, 3, whole, rows=3, max_tokens=6)
    written = sorted(read_answers(whole), key=lambda a: a["attempt"])
    assert [a["attempt"] for a in written] == list(range(len(written))) and len(written) >= 3
    assert len({a["text"] for a in written}) > 1  # each attempt its own seed

    parts = tmp_path / "parts.jsonl"
    admitted = []
    self_prompts(tiny_native, 3, parts, rows=3, max_tokens=6, should_stop=lambda: admitted.append(1) or len(admitted) > 4)
    first = read_answers(parts)
    assert 0 < len(first) < len(written)
    resumed = []
    assert self_prompts(tiny_native, 3, parts, rows=3, max_tokens=6, on_kept=resumed.append) == kept
    assert sorted(read_answers(parts), key=lambda a: a["attempt"]) == written
    assert resumed == kept
