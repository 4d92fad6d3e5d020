"""Prompts to token ids: raw text as is, a chat through the model's chat template.

Below the library (`specdec.api.LLM` encodes with it) so that the server encodes without
building an engine: `PromptEncoder` holds only a model's tokenizer and name. A base model without
a chat template (Gemma 3 270M's GGUF) gets a chat as plain text (:func:`plain_chat`), with a
one-line notice, so that `generate`, `bench`, `tune`, `verify` and the server run it too.
"""

from __future__ import annotations

import logging

from specdec.errors import PromptError
from specdec.models.loader import LoadedModel

log = logging.getLogger(__name__)

Message = dict[str, str]
Prompt = str | list[Message]


class PromptEncoder:
    """Encodes prompts for one model (a fast tokenizer must not be used from two threads at once:
    give each thread its own encoder, over its own copy of the tokenizer)."""

    def __init__(self, target: LoadedModel) -> None:
        self.target = target
        self._noticed = False  # the plain-text notice, once

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


def plain_chat(messages: list[Message]) -> str:
    """A chat as plain text, for a model without a chat template: a lone user message is its
    text (a base model continues it); otherwise each message on its own paragraph, after its role
    ("User: ...", "Assistant: ..."), ending with "Assistant:" for the model to go on."""
    if len(messages) == 1 and messages[0]["role"] == "user":
        return str(messages[0]["content"])
    turns = [f"{str(m['role']).capitalize()}: {m['content']}" for m in messages]
    return "\n\n".join([*turns, "Assistant:"])
