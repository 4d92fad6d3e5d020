"""Prompts to token ids: raw text as is, a chat through the model's chat template, and a
fill-in-the-middle request (:class:`Infill`) through the model's FIM tokens.

Below the library (`specdec.api.LLM` encodes with it) so that the server encodes without
building an engine: `PromptEncoder` holds only a model's tokenizer and name. A base model without
a chat template (Gemma 3 270M's GGUF) gets a chat as plain text (:func:`plain_chat`), with a
one-line notice, so that `generate`, `bench`, `tune`, `verify` and the server run it too.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from specdec.errors import PromptError
from specdec.models.loader import LoadedModel

log = logging.getLogger(__name__)

Message = dict[str, str]


@dataclass(frozen=True)
class Infill:
    """Fill in the middle: the text to generate goes between `prefix` and `suffix` (an editor's
    cursor). Encoded prefix-suffix-middle, the order code models are trained on; the output is
    the middle alone, ended by the model's end of text or a FIM control token."""

    prefix: str
    suffix: str


Prompt = str | list[Message] | Infill

# The FIM control tokens of the code-model families that have them: (prefix, suffix, middle),
# and the other control tokens that end a middle (a model may close it with one of them). Qwen2.5-
# Coder and CodeGemma use the first set, StarCoder and its kin the second, DeepSeek-Coder the third.
FIM_FORMATS = (
    (("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
     ("<|endoftext|>", "<|fim_pad|>", "<|file_sep|>", "<|repo_name|>", "<|file_separator|>")),
    (("<fim_prefix>", "<fim_suffix>", "<fim_middle>"), ("<|endoftext|>", "<fim_pad>", "<file_sep>", "<repo_name>")),
    (("<\uff5cfim\u2581begin\uff5c>", "<\uff5cfim\u2581hole\uff5c>", "<\uff5cfim\u2581end\uff5c>"),
     ("<\uff5cend\u2581of\u2581sentence\uff5c>",)),
)


@dataclass(frozen=True)
class FimTokens:
    """A tokenizer's FIM control token ids, and the ids that end a middle (besides the model's EOS)."""

    prefix: int
    suffix: int
    middle: int
    stops: tuple[int, ...]


def fim_tokens(tokenizer) -> FimTokens | None:
    """The first FIM format whose three control tokens are each one token of `tokenizer`, or None
    (a model without FIM training: an infill is refused rather than guessed at)."""
    vocab = tokenizer.get_vocab()
    for controls, ends in FIM_FORMATS:
        ids = [vocab.get(token) for token in controls]
        if all(i is not None for i in ids):
            stops = {vocab[token] for token in ends if token in vocab} | set(ids)
            return FimTokens(ids[0], ids[1], ids[2], tuple(sorted(stops)))
    return None


class PromptEncoder:
    """Encodes prompts for one model (a fast tokenizer must not be used from two threads at once:
    give each thread its own encoder, over its own copy of the tokenizer)."""

    def __init__(self, target: LoadedModel) -> None:
        self.target = target
        self._noticed = False  # the plain-text notice, once
        self._fim: FimTokens | None | bool = False  # looked up on first use

    @property
    def fim(self) -> FimTokens | None:
        """The model's FIM tokens, or None where it has none."""
        if self._fim is False:
            self._fim = fim_tokens(self.tokenizer)
        return self._fim  # type: ignore[return-value]

    def stop_token_ids(self, prompt: Prompt) -> tuple[int, ...]:
        """Token ids that end this prompt's output besides the model's EOS: a middle's ends."""
        fim = self.fim if isinstance(prompt, Infill) else None
        return fim.stops if fim is not None else ()

    @property
    def tokenizer(self):
        return self.target.tokenizer

    def encode(self, prompt: Prompt, tools: list[dict] | None = None) -> list[int]:
        """Token ids for a prompt: raw text as is, a chat through the chat template (with
        `tools` in the chat format of transformers, for a template that renders them)."""
        if isinstance(prompt, str):
            if not prompt.strip():
                raise PromptError("prompt is empty")
            return self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        if isinstance(prompt, Infill):
            return self.encode_infill(prompt)
        if not prompt or any(not isinstance(m, dict) or "role" not in m or "content" not in m for m in prompt):
            raise PromptError("a chat must be a non-empty list of {'role': ..., 'content': ...} messages")
        if not any(str(m["content"]).strip() for m in prompt):
            raise PromptError("chat messages are all empty")
        if self.tokenizer.chat_template is None:
            if tools:
                raise PromptError(f"{self.target.name} has no chat template to render tools with")
            if not self._noticed:
                log.warning("%s has no chat template: chat prompts are given to it as plain text", self.target.name)
                self._noticed = True
            return self.encode(plain_chat(prompt))
        ids = self.tokenizer.apply_chat_template(prompt, tools=tools, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


    def encode_infill(self, infill: Infill) -> list[int]:
        """[BOS] <prefix> prefix <suffix> suffix <middle>: the texts encoded as a prompt's text is,
        after what the tokenizer puts at a prompt's start (a BOS, for a model that takes one)."""
        fim = self.fim
        if fim is None:
            raise PromptError(f"{self.target.name} has no fill-in-the-middle tokens (such as <|fim_prefix|>, "
                              "<|fim_suffix|>, <|fim_middle|>): give a prompt without a suffix")
        if not isinstance(infill.prefix, str) or not isinstance(infill.suffix, str):
            raise PromptError("an infill's prefix and suffix must be text")
        if not (infill.prefix + infill.suffix).strip():
            raise PromptError("prompt and suffix are both empty")
        start = [t for t in self.tokenizer("", add_special_tokens=True)["input_ids"] if t not in self.target.eos_token_ids]
        text = self._text_ids
        return [*start, fim.prefix, *text(infill.prefix), fim.suffix, *text(infill.suffix), fim.middle]

    def _text_ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []


def plain_chat(messages: list[Message]) -> str:
    """A chat as plain text, for a model without a chat template: a lone user message is its
    text (a base model continues it); otherwise each message on its own paragraph, after its role
    ("User: ...", "Assistant: ..."), ending with "Assistant:" for the model to go on."""
    if len(messages) == 1 and messages[0]["role"] == "user":
        return str(messages[0]["content"])
    turns = [f"{str(m['role']).capitalize()}: {m['content']}" for m in messages]
    return "\n\n".join([*turns, "Assistant:"])
