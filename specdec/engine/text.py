"""Incremental detokenization with stop strings, for streaming and for final text."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class TextUpdate:
    """delta: new text safe to show; kept_tokens: how many of the added tokens belong to the
    output (fewer when a stop string ended it); stopped: a stop string was found."""

    delta: str
    kept_tokens: int
    stopped: bool


# Tokens decoded again before the new ones: the text of the new tokens is read off a decode of
# the last WINDOW tokens and them, not of the whole output (whose cost, every step, grows with
# the output's length).
WINDOW = 16
_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")


class TextAssembler:
    """Turns committed token ids into text, finds stop strings, and holds back text that could
    still change: an incomplete UTF-8 character, or the start of a stop string.

    `text` is always the decode of every token so far. Each step decodes the last WINDOW tokens,
    then them and the new ones: where the first is the end of `text` (so nothing spans the
    window's start: no character split across it, no space stripped or cleaned at it), the
    second's text replaces it; otherwise the whole output is decoded again."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.token_ids: list[int] = []
        self.text = ""  # the whole output text so far (stop string excluded)
        self.emitted = 0  # characters of self.text already returned as deltas
        self._special = set(tokenizer.all_special_ids)
        # A fast tokenizer that cleans up no spaces decodes as its `tokenizers` backend does:
        # called directly, without transformers' conversions around it (two decodes a step).
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend = backend if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True) else None

    def _decode(self, ids: list[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=True)
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _joins(self, token: int) -> bool:
        """Whether a run of byte pieces may go on through this token."""
        return token in self._special or bool(_BYTE_PIECE.fullmatch(self.tokenizer.convert_ids_to_tokens(token) or ""))

    def _decode_with(self, new_ids: list[int]) -> str:
        """The decode of every token so far and `new_ids`."""
        start = len(self.token_ids) - WINDOW
        # A run of byte pieces (<0xNN>, SentencePiece's byte fallback) decodes as a whole: valid
        # UTF-8, or a replacement character for every byte. The window starts outside one (the
        # special tokens a decode skips may sit inside it).
        while start > 0 and all(self._joins(token) for token in self.token_ids[start - 1 : start + 1]):
            start -= 1
        if start > 0:
            window = self.token_ids[start:]
            tail = self._decode(window)
            if tail and self.text.endswith(tail):
                return self.text[: len(self.text) - len(tail)] + self._decode(window + new_ids)
        return self._decode(self.token_ids + new_ids)

    def _find_stop(self, text: str, search_from: int) -> int:
        hits = [i for s in self.stop if (i := text.find(s, search_from)) >= 0]
        return min(hits) if hits else -1

    def add(self, new_ids: list[int]) -> TextUpdate:
        previous_len = len(self.text)
        longest_stop = max((len(s) for s in self.stop), default=0)
        search_from = max(0, previous_len - longest_stop)
        kept = len(new_ids)
        stopped = False
        text = self._decode_with(new_ids)
        if self.stop and (cut := self._find_stop(text, search_from)) >= 0:
            # Keep tokens up to the one that completes the stop string.
            stopped = True
            for kept in range(1, len(new_ids) + 1):
                if self._find_stop(self._decode(self.token_ids + new_ids[:kept]), search_from) >= 0:
                    break
            text = text[:cut]
        self.token_ids.extend(new_ids[:kept])
        self.text = text
        return TextUpdate(delta=self._release(final=stopped), kept_tokens=kept, stopped=stopped)

    def finish(self) -> str:
        """Release whatever was held back; call once when the output ends."""
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        end = len(self.text)
        if not final:
            if self.text.endswith("\ufffd"):  # a multi-byte character is not complete yet
                end = len(self.text.rstrip("\ufffd"))
            for s in self.stop:  # the text may be the start of a stop string
                for n in range(min(len(s) - 1, end), 0, -1):
                    if self.text[end - n : end] == s[:n]:
                        end -= n
                        break
        end = max(end, self.emitted)
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the printable character each byte is written as."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


class TokenBytes:
    """Each token's own bytes and text, as OpenAI's logprobs report them (`token`, `bytes`).

    A token can be part of a UTF-8 character (byte-level BPE splits them; SentencePiece falls back
    to `<0xNN>` bytes), so its bytes come from the tokenizer's vocabulary, not from decoding it
    alone: byte-level vocabularies through GPT-2's byte alphabet, SentencePiece ones with `▁` as a
    space and byte pieces as their byte. Its text is those bytes decoded, an incomplete character
    written as `bytes:\\xNN` escapes (as OpenAI does). Special tokens are their own name.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        # The whole table at once: afterwards nothing touches the tokenizer (which must not be
        # used from two threads at once).
        decoder = json.loads(tokenizer.backend_tokenizer.to_str()).get("decoder") or {}
        alphabet = _byte_level_alphabet() if decoder.get("type") == "ByteLevel" else {}
        special = set(tokenizer.all_special_ids)
        pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        self.table = [self._bytes(i, piece, alphabet, special) for i, piece in enumerate(pieces)]

    @staticmethod
    def _bytes(token: int, piece: str | None, alphabet: dict[str, int], special: set[int]) -> bytes:
        if token in special or piece is None:
            return (piece or "").encode()
        if alphabet and all(c in alphabet for c in piece):
            return bytes(alphabet[c] for c in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])
        return piece.replace("\u2581", " ").encode()

    def bytes(self, token: int) -> bytes:
        return self.table[token] if 0 <= token < len(self.table) else b""

    def text(self, token: int) -> str:
        raw = self.bytes(token)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "".join(f"bytes:\\x{b:02x}" for b in raw) if not raw.isascii() else raw.decode("latin-1")
