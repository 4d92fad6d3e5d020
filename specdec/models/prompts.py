"""Prompts to token ids: raw text as is, a chat through the model's chat template.

Below the library (`specdec.api.LLM` encodes with it) so that the server encodes without
building an engine: `PromptEncoder` holds only a model's tokenizer and name.
"""

from __future__ import annotations

from specdec.errors import PromptError
from specdec.models.loader import LoadedModel

Message = dict[str, str]
Prompt = str | list[Message]


class PromptEncoder:
    """Encodes prompts for one model (a fast tokenizer must not be used from two threads at once:
    give each thread its own encoder, over its own copy of the tokenizer)."""

    def __init__(self, target: LoadedModel) -> None:
        self.target = target

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
            raise PromptError(f"{self.target.name} has no chat template; pass raw text instead")
        ids = self.tokenizer.apply_chat_template(prompt, tools=tools, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
