"""TextAssembler: incremental text with stop strings and incomplete characters held back."""

from __future__ import annotations

import pytest

from specdec.engine.text import TextAssembler
from specdec.models import LoadedModel


@pytest.fixture(scope="module")
def tokenizer(default_model: LoadedModel):
    return default_model.tokenizer


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_without_stop_strings_text_flows_through(tokenizer) -> None:
    text = TextAssembler(tokenizer)
    tokens = ids(tokenizer, "Hello there, general")
    deltas = [text.add([t]) for t in tokens]
    assert all(not d.stopped and d.kept_tokens == 1 for d in deltas)
    assert "".join(d.delta for d in deltas) + text.finish() == "Hello there, general"
    assert text.text == "Hello there, general"


def test_incomplete_character_is_held_back(tokenizer) -> None:
    smile = ids(tokenizer, "🙂")
    assert len(smile) == 2
    text = TextAssembler(tokenizer)
    assert text.add(ids(tokenizer, "ok ")).delta == "ok "
    assert text.add(smile[:1]).delta == ""  # half a character: nothing to show yet
    assert text.add(smile[1:]).delta == "🙂"
    assert text.finish() == ""


def test_stop_string_across_steps(tokenizer) -> None:
    tokens = ids(tokenizer, "Mon, Wednes")  # 'Mon', ',', ' Wed', 'nes'
    text = TextAssembler(tokenizer, stop=("Wednesday",))
    first = text.add(tokens[:3])
    assert first.delta == "Mon, "  # ' Wed' could start the stop string: held back
    assert not first.stopped
    second = text.add(tokens[3:] + ids(tokenizer, "day is here"))
    assert second.stopped
    assert second.kept_tokens == 2  # 'nes' and 'day' complete the stop string
    assert text.text == "Mon, "
    assert second.delta == ""
    assert text.token_ids == tokens + ids(tokenizer, "day is here")[:1]


def test_held_back_prefix_is_released_when_it_is_not_a_stop(tokenizer) -> None:
    text = TextAssembler(tokenizer, stop=("Wednesday",))
    assert text.add(ids(tokenizer, "Mon, Wed")).delta == "Mon, "
    update = text.add(ids(tokenizer, "ding bells"))
    assert not update.stopped
    assert update.delta == "Wedding bells"


def test_finish_releases_held_back_text(tokenizer) -> None:
    text = TextAssembler(tokenizer, stop=("Wednesday",))
    assert text.add(ids(tokenizer, "Mon, Wed")).delta == "Mon, "
    assert text.finish() == "Wed"


def test_earliest_stop_string_wins(tokenizer) -> None:
    text = TextAssembler(tokenizer, stop=("three", "two"))
    update = text.add(ids(tokenizer, "one two three four"))
    assert update.stopped
    assert text.text == "one "
    assert update.delta == "one "
