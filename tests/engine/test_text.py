"""TextAssembler: incremental text with stop strings and incomplete characters held back."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders
from tokenizers.models import BPE
from transformers import PreTrainedTokenizerFast

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


def _sentencepiece_like():
    """A tokenizer decoding as Llama 2's and Gemma's do: pieces with `▁` for a space, byte pieces
    <0xNN> joined into characters, the first piece's leading space stripped."""
    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), "▁", "▁the", "▁a", "s", "'", "▁.",
              ".", "▁n't", "é", "▁ok", "!"]
    backend = Tokenizer(BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=[], byte_fallback=True, unk_token="<unk>"))
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.mark.parametrize("kind", ["byte-level", "sentencepiece-like"])
def test_text_is_always_the_whole_outputs_decode(kind: str, tokenizer) -> None:
    # Each step decodes a window of the last tokens and the new ones, not the whole output: the
    # text must still be the whole output's decode after every step, through characters split
    # across tokens (byte tokens, emoji), special tokens, stripped spaces.
    decoder = tokenizer if kind == "byte-level" else _sentencepiece_like()
    if kind == "byte-level":
        pool = ids(decoder, "Hello, wörld! It's 🙂 a test . — ok") + [decoder.eos_token_id]
    else:
        pool = list(range(len(decoder)))
    for seed in range(20):
        rng = random.Random(seed)
        text = TextAssembler(decoder)
        added: list[int] = []
        streamed = ""
        while len(added) < 120:
            chunk = [rng.choice(pool) for _ in range(rng.randint(1, 4))]
            # Byte pieces in runs, as a character's UTF-8 bytes come.
            if kind != "byte-level" and rng.random() < 0.3:
                chunk = [3 + b for b in "é🙂".encode()[rng.randint(0, 5):]]
            added += chunk
            streamed += text.add(chunk).delta
            assert text.text == decoder.decode(added, skip_special_tokens=True), (seed, len(added))
        if kind == "byte-level":  # (random byte pieces make invalid runs, which turn text already
            # released into replacement characters: a stream of them is not its final text)
            assert streamed + text.finish() == text.text


def test_decodes_through_the_backend_unless_transformers_cleans_up(tokenizer) -> None:
    assert TextAssembler(tokenizer)._backend is not None  # the default model's: no clean-up
    cleaning = _sentencepiece_like()
    cleaning.clean_up_tokenization_spaces = True
    assert TextAssembler(cleaning)._backend is None
    added = [cleaning.convert_tokens_to_ids("▁ok"), 3 + ord("a"), cleaning.eos_token_id, 3 + ord("b")]
    text = TextAssembler(cleaning)
    text.add(added)
    assert text.text == cleaning.decode(added, skip_special_tokens=True)


def test_a_run_of_byte_pieces_is_decoded_whole() -> None:
    # A run of byte pieces longer than the window, then an invalid byte: the whole run turns into
    # replacement characters, text before the window included.
    decoder = _sentencepiece_like()
    byte = lambda b: 3 + b  # noqa: E731 (<0xNN>'s id)
    text = TextAssembler(decoder)
    added = [decoder.convert_tokens_to_ids("▁ok")] + [byte(0x61)] * 30
    text.add(added)
    for chunk in ([byte(0x62)], [decoder.eos_token_id], [byte(0xFF)], [byte(0x63)]):
        added += chunk
        text.add(chunk)
        assert text.text == decoder.decode(added, skip_special_tokens=True)
    assert text.text.count("\ufffd") == 33
