"""Prompts to token ids. A model without a chat template (a base model, as Gemma 3 270M's GGUF)
gets a chat as plain text with a one-line notice, in the library, the CLI and the server."""

from __future__ import annotations

import copy
import dataclasses
import logging

import httpx
import pytest

from specdec import LLM, SamplingParams
from specdec.errors import PromptError
from specdec.models import LoadedModel
from specdec.models.prompts import PromptEncoder, plain_chat
from specdec.server.config import RouteConfig, ServerConfig
from specdec.server.runtime import ServerThread, build_state


@pytest.fixture
def base_model(tiny_model: LoadedModel) -> LoadedModel:
    """The tiny model with its chat template taken away."""
    tokenizer = copy.deepcopy(tiny_model.tokenizer)
    tokenizer.chat_template = None
    return dataclasses.replace(tiny_model, tokenizer=tokenizer)


def test_a_chat_is_plain_text_for_a_model_without_a_template(base_model: LoadedModel,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    encoder = PromptEncoder(base_model)
    chat = [{"role": "user", "content": "The cat sat on"}]
    with caplog.at_level(logging.WARNING):
        assert encoder.encode(chat) == encoder.encode("The cat sat on")
        encoder.encode([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}])
    notices = [r.message for r in caplog.records if "no chat template" in r.message]
    assert len(notices) == 1 and "plain text" in notices[0]  # once, not per prompt
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]
    assert plain_chat(conversation) == "System: Be brief.\n\nUser: Hi\n\nAssistant: Hello.\n\nUser: Bye\n\nAssistant:"
    with pytest.raises(PromptError, match="no chat template to render tools"):
        encoder.encode(chat, tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])


def test_the_library_and_the_server_run_a_base_model_on_chats(base_model: LoadedModel) -> None:
    chat = [{"role": "user", "content": "The cat sat on"}]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    out = LLM(loaded=base_model).chat(chat, params)
    assert out.token_ids == LLM(loaded=base_model).generate("The cat sat on", params)[0].token_ids
    server = ServerThread(build_state(ServerConfig((RouteConfig("plain"),), max_model_len=128), loaded=base_model)).start()
    try:
        reply = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                           json={"model": "plain", "messages": chat, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    finally:
        server.stop()
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"] == out.text
