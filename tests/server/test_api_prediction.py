"""Predicted outputs through the server with the official openai client: the prediction drafts
the request on any route, the text is the plain route's (streamed or not), and usage counts the
prediction's accepted and rejected tokens as OpenAI does."""

from __future__ import annotations

import httpx
import openai

from specdec.models import LoadedModel
from tests.drafters.test_prediction import real_edit


def test_a_prediction_drafts_and_changes_nothing(client: openai.OpenAI, default_model: LoadedModel) -> None:
    messages, _ = real_edit(default_model)
    code = messages[0]["content"].split("\n\n", 1)[1]

    def chat(route: str, **kwargs):
        return client.chat.completions.create(model=route, messages=messages, max_tokens=80, temperature=0, **kwargs)

    plain = chat("plain")
    assert plain.usage.completion_tokens_details is None
    for route in ("plain", "spec"):
        predicted = chat(route, prediction={"type": "content", "content": code})
        assert predicted.choices[0].message.content == plain.choices[0].message.content
        details = predicted.usage.completion_tokens_details
        stats = predicted.model_extra["speculation"]
        assert details.accepted_prediction_tokens == stats["accepted_tokens"] > 10
        assert details.rejected_prediction_tokens == stats["drafted_tokens"] - stats["accepted_tokens"]
        assert stats["target_forward_passes"] < plain.usage.completion_tokens // 2
    streamed = chat("plain", prediction={"type": "content", "content": [{"type": "text", "text": code}]}, stream=True,
                    stream_options={"include_usage": True})
    chunks = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == plain.choices[0].message.content
    assert chunks[-1].usage.completion_tokens_details.accepted_prediction_tokens > 10
    # Speculation turned off: the prediction is not drafted from.
    off = chat("spec", prediction={"type": "content", "content": code}, extra_body={"speculative": False})
    assert off.choices[0].message.content == plain.choices[0].message.content
    assert off.model_extra["speculation"]["drafted_tokens"] == 0 and off.usage.completion_tokens_details is None


def test_a_bad_prediction_is_a_400(server) -> None:
    for prediction, param in (({"type": "code", "content": "x"}, "prediction.type"), ({"type": "content"}, "prediction.content")):
        response = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                              json={"model": "plain", "messages": [{"role": "user", "content": "hi"}], "prediction": prediction})
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
