"""Bad input gets a 4xx with an OpenAI-style error body, never a 500, and the server stays
healthy. Hand-picked cases, then a hypothesis fuzz of malformed bodies."""

from __future__ import annotations

import json
import os

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdec.server.runtime import ServerThread

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "hi"}]


def _post(server: ServerThread, path: str, body: object = None, *, raw: bytes | None = None,
          content_type: str = "application/json") -> httpx.Response:
    content = raw if raw is not None else json.dumps(body).encode()
    return httpx.post(f"{server.url}{path}", content=content, headers={"content-type": content_type}, timeout=60)


def _assert_openai_error(response: httpx.Response, status: int, param: str | None = None) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        (COMPLETIONS, {"model": "plain", "prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
        (COMPLETIONS, {"model": "plain", "prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
        (COMPLETIONS, {"model": "plain", "prompt": "hi", "temperature": "hot"}, 400, "temperature"),
        (COMPLETIONS, {"model": "plain", "prompt": "hi", "top_p": 0}, 400, "top_p"),
        (COMPLETIONS, {"model": "plain", "prompt": "hi", "n": 0}, 400, "n"),
        (COMPLETIONS, {"model": "plain", "prompt": "hi", "stop": [""]}, 400, "stop"),
        (COMPLETIONS, {"model": "plain", "prompt": "hi", "stream": "yes"}, 400, "stream"),
        (COMPLETIONS, {"model": "plain", "prompt": "hi", "bogus": 1}, 400, "bogus"),
        (COMPLETIONS, {"model": "plain", "prompt": "hi", "presence_penalty": 0.5}, 400, "presence_penalty"),
        (COMPLETIONS, {"model": "plain", "prompt": [99999999]}, 400, "prompt"),
        (COMPLETIONS, {"model": "plain", "prompt": "   "}, 400, "prompt"),
        (COMPLETIONS, {"model": "plain"}, 400, "prompt"),
        (COMPLETIONS, {"model": "nope", "prompt": "hi"}, 404, "model"),
        (COMPLETIONS, {"model": 5, "prompt": "hi"}, 400, "model"),
        (COMPLETIONS, {"model": "spec", "prompt": "hi", "speculative": {"num_speculative_tokens": -1}}, 400, None),
        (COMPLETIONS, {"model": "spec", "prompt": "hi", "speculative": "on"}, 400, None),
        (COMPLETIONS, {"model": "plain", "prompt": "word " * 300}, 400, "prompt"),
        (CHAT, {"model": "plain", "messages": [{"role": "user", "content": "word " * 300}]}, 400, "messages"),
        (CHAT, {"model": "plain", "messages": []}, 400, "messages"),
        (CHAT, {"model": "plain", "messages": [{"role": "wizard", "content": "hi"}]}, 400, None),
        (CHAT, {"model": "plain", "messages": [{"role": "user"}]}, 400, None),
        (CHAT, {"model": "plain", "messages": MESSAGES, "logprobs": True}, 400, "logprobs"),
        (CHAT, [1, 2, 3], 400, None),
    ],
)
def test_bad_requests_get_openai_errors(tiny_server: ServerThread, path: str, body: object, status: int, param: str | None) -> None:
    _assert_openai_error(_post(tiny_server, path, body), status, param)


def test_malformed_json_and_unknown_paths(tiny_server: ServerThread) -> None:
    _assert_openai_error(_post(tiny_server, CHAT, raw=b'{"model": "plain", "messages": [}'), 400)
    _assert_openai_error(_post(tiny_server, CHAT, raw=b"\xff\xfe not utf-8"), 400)
    _assert_openai_error(_post(tiny_server, CHAT, raw=b"model=plain", content_type="application/x-www-form-urlencoded"), 400)
    _assert_openai_error(httpx.get(f"{tiny_server.url}/v1/nothing"), 404)
    _assert_openai_error(httpx.get(f"{tiny_server.url}/v1/completions"), 405)


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8,
)
FIELDS = ["model", "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n", "stream",
          "speculative", "stream_options", "ignore_eos", "min_p"]


@st.composite
def request_bodies(draw: st.DrawFn) -> dict:
    """Mostly-plausible bodies with some fields replaced by arbitrary JSON."""
    body = {"model": draw(st.sampled_from(["plain", "spec", "fixed", "nope"])), "max_tokens": draw(st.integers(-2, 4))}
    body["prompt" if draw(st.booleans()) else "messages"] = draw(st.sampled_from(["hi", MESSAGES, [5, 6], ""]))
    for name in draw(st.lists(st.sampled_from(FIELDS), max_size=4)):
        body[name] = draw(JSON_VALUES)
    if isinstance(body.get("max_tokens"), int) and not isinstance(body["max_tokens"], bool):
        body["max_tokens"] = max(-2, min(body["max_tokens"], 4))  # keep valid requests short
    if isinstance(body.get("n"), int):
        body["n"] = min(body["n"], 3)
    return body


# SPECDEC_FUZZ_EXAMPLES=2000 for a long fuzz run; 80 keeps the suite fast.
@settings(max_examples=int(os.environ.get("SPECDEC_FUZZ_EXAMPLES", "80")), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from([CHAT, COMPLETIONS]), body=request_bodies() | JSON_VALUES)
def test_fuzzed_bodies_never_get_a_5xx(tiny_server: ServerThread, path: str, body: object) -> None:
    response = _post(tiny_server, path, body)
    assert response.status_code < 500, (body, response.text)
    if response.status_code >= 400:
        _assert_openai_error(response, response.status_code)


def test_server_is_healthy_after_the_fuzz(tiny_server: ServerThread) -> None:
    assert httpx.get(f"{tiny_server.url}/health").json()["status"] == "ok"
    response = _post(tiny_server, CHAT, {"model": "spec", "messages": MESSAGES, "max_tokens": 3})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] >= 1
    scheduler = tiny_server.server.config.app.state.specdec.scheduler
    assert scheduler.alive and scheduler.running == 0
