"""Incremental detokenization with stop strings, for streaming and for final text."""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class TextUpdate:
    """delta: new text safe to show; kept_tokens: how many of the added tokens belong to the
    output (fewer when a stop string ended it); stopped: a stop string was found."""

    delta: str
    kept_tokens: int
    stopped: bool


class TextAssembler:
    """Turns committed token ids into text, finds stop strings, and holds back text that could
    still change: an incomplete UTF-8 character, or the start of a stop string."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.token_ids: list[int] = []
        self.text = ""  # the whole output text so far (stop string excluded)
        self.emitted = 0  # characters of self.text already returned as deltas

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _find_stop(self, text: str, search_from: int) -> int:
        hits = [i for s in self.stop if (i := text.find(s, search_from)) >= 0]
        return min(hits) if hits else -1

    def add(self, new_ids: list[int]) -> TextUpdate:
        previous_len = len(self.text)
        longest_stop = max((len(s) for s in self.stop), default=0)
        search_from = max(0, previous_len - longest_stop)
        kept = len(new_ids)
        stopped = False
        text = self._decode(self.token_ids + new_ids)
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
