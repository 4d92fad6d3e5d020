"""Bad input gets a 4xx with an OpenAI-style error body, never a 500, and the server stays
healthy. Hand-picked cases, then a hypothesis fuzz of malformed bodies."""

from __future__ import annotations

import json
import os
import random
import threading
import time

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdec.models import LoadedModel
from specdec.server.config import ServerConfig
from specdec.server.runtime import ServerThread, build_state
from tests.server.conftest import ROUTES
from tests.server.test_api import metrics

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
        (COMPLETIONS, {"model": "plain", "prompt": "hi", "top_p": 1.5}, 400, "top_p"),
        (COMPLETIONS, {"model": "plain", "prompt": "hi", "min_p": -1}, 400, "min_p"),
        (CHAT, {"model": "plain", "messages": [{"role": "user", "content": "hi"}],
                "response_format": {"type": "json_object", "json_schema": {"name": "x"}}}, 400, "response_format.json_schema"),
        (COMPLETIONS, {"model": "plain", "prompt": "hi", "response_format": {"type": "json_object"}}, 400, "response_format"),
        (CHAT, {"model": "plain", "messages": [{"role": "user", "content": "hi"}], "modalities": ["audio"]}, 400,
         "modalities.0"),
        (CHAT, {"model": "plain", "messages": [{"role": "user", "content": "hi"}], "store": "yes"}, 400, "store"),
        (COMPLETIONS, {"model": "plain", "prompt": "hi", "n": 0}, 400, "n"),
        (COMPLETIONS, {"model": "plain", "prompt": "hi", "stop": [""]}, 400, "stop"),
        (COMPLETIONS, {"model": "plain", "prompt": "hi", "stream": "yes"}, 400, "stream"),
        (COMPLETIONS, {"model": "plain", "prompt": "hi", "bogus": 1}, 400, "bogus"),
        (COMPLETIONS, {"model": "plain", "prompt": "hi", "presence_penalty": 2.5}, 400, "presence_penalty"),
        (COMPLETIONS, {"model": "plain", "prompt": "hi", "frequency_penalty": -3}, 400, "frequency_penalty"),
        (COMPLETIONS, {"model": "plain", "prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
        (COMPLETIONS, {"model": "plain", "prompt": "hi", "logit_bias": {"x1": 1}}, 400, "logit_bias.x1"),
        (COMPLETIONS, {"model": "plain", "prompt": "hi", "logit_bias": {"5": 101}}, 400, "logit_bias.5"),
        (COMPLETIONS, {"model": "plain", "prompt": "hi", "logit_bias": {"99999999": 1}}, 400, "logit_bias"),
        (COMPLETIONS, {"model": "plain", "prompt": "hi", "logprobs": 21}, 400, "logprobs"),
        (COMPLETIONS, {"model": "plain", "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
        (COMPLETIONS, {"model": "plain", "prompt": "hi", "echo": "yes"}, 400, "echo"),
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
        (CHAT, {"model": "plain", "messages": MESSAGES, "top_logprobs": 2}, 400, "top_logprobs"),
        (CHAT, {"model": "plain", "messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
        (CHAT, {"model": "plain", "messages": MESSAGES, "logprobs": 1}, 400, "logprobs"),
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


@pytest.mark.parametrize(("path", "raw", "content_type", "param", "message"), [
    (CHAT, b'{"model": "plain", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', None,
     "temperature", "not a finite number"),
    (COMPLETIONS, b'{"model": "plain", "prompt": "hi", "logit_bias": {"5": -Infinity}}', None, "logit_bias.5",
     "not a finite number"),
    (CHAT, json.dumps({"model": "plain", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "x"}}]}]}).encode(), None,
     "messages.0.content.1", "images are not supported by this model"),
    (CHAT, b'{"model": "plain", "messages": [{"role": "user", "content": "\xff"}]}', None, None,
     "could not parse the JSON body"),
    (CHAT, b'{"model": "plain", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None, None,
     "could not parse the JSON body"),
    (CHAT, json.dumps({"model": "plain", "messages": MESSAGES}).encode(), "text/plain", None,
     "Content-Type must be application/json"),
    (COMPLETIONS, b'{"model": "plain", "prompt": [true, 5]}', None, "prompt", "token ids must be integers"),
    (COMPLETIONS, b'{"model": "plain", "prompt": [[5.0, 6]]}', None, "prompt", "token ids must be integers"),
    (COMPLETIONS, b'{"model": "plain", "prompt": "hi", "logit_bias": {"5": true}}', None, "logit_bias.5", None),
])
def test_errors_say_what_is_wrong(tiny_server: ServerThread, path: str, raw: bytes, content_type: str | None,
                                  param: str | None, message: str | None) -> None:
    response = _post(tiny_server, path, raw=raw, content_type=content_type or "application/json")
    _assert_openai_error(response, 400, param)
    if message is not None:
        assert message in response.json()["error"]["message"]


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8,
)
FIELDS = ["model", "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n", "stream",
          "speculative", "stream_options", "ignore_eos", "min_p", "presence_penalty", "frequency_penalty",
          "repetition_penalty", "logit_bias", "logprobs", "top_logprobs", "echo"]


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
    response = _post(tiny_server, CHAT, {"model": "spec", "messages": MESSAGES, "max_tokens": 3, "ignore_eos": True})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] >= 1
    scheduler = tiny_server.server.config.app.state.specdec.scheduler
    assert scheduler.alive and scheduler.running == 0


# --- robustness: the cases of issue 13 -----------------------------------------------------------


def _metric(server: ServerThread, route: str, reason: str) -> float:
    key = ("specdec_requests_total", (("finish_reason", reason), ("route", route)))
    return metrics(server).get(key, 0.0)


@pytest.mark.parametrize(
    ("path", "raw", "param"),
    [
        (COMPLETIONS, '{"model": "plain", "prompt": "a \\ud800 b"}', "prompt"),
        (COMPLETIONS, '{"model": "plain", "prompt": ["ok", "\\udfff"]}', "prompt.1"),
        (COMPLETIONS, '{"model": "plain", "prompt": "hi", "stop": ["\\ud800"]}', "stop.0"),
        (COMPLETIONS, '{"model": "pl\\ud800ain", "prompt": "hi"}', "model"),
        (CHAT, '{"model": "plain", "messages": [{"role": "user", "content": "\\ud800"}]}', "messages.0.content"),
        (CHAT, '{"model": "plain", "messages": [{"role": "user", "content": [{"type": "text", "text": "x\\udc00"}]}]}',
         "messages.0.content.0.text"),
        (CHAT, '{"model": "plain", "messages": [{"role": "user", "content": "hi"}], "\\ud800": 1}', "\\ud800"),
    ],
)
def test_lone_surrogates_get_a_400(tiny_server: ServerThread, path: str, raw: str, param: str) -> None:
    response = _post(tiny_server, path, raw=raw.encode())
    _assert_openai_error(response, 400, param)
    assert "surrogate" in response.json()["error"]["message"]


def test_invalid_json_names_no_param(tiny_server: ServerThread) -> None:
    response = _post(tiny_server, CHAT, raw=b'{"model": "plain", "messages": [}')
    _assert_openai_error(response, 400)
    assert response.json()["error"]["param"] is None and response.json()["error"]["code"] == "json_invalid"


@pytest.mark.parametrize(
    ("speculative", "param", "message"),
    [
        ({"num_speculative_tokens": -1}, "speculative.num_speculative_tokens", "must be an integer in 0..64"),
        ({"num_speculative_tokens": 65}, "speculative.num_speculative_tokens", "must be an integer in 0..64"),
        ({"num_speculative_tokens": "2"}, "speculative.num_speculative_tokens", "must be an integer in 0..64"),
        ({"num_speculative_tokens": True}, "speculative.num_speculative_tokens", "must be an integer in 0..64"),
        ({"num_speculative_tokens": 2.5}, "speculative.num_speculative_tokens", "must be an integer in 0..64"),
        ({}, "speculative", "must be true, false or"),
        ({"num_speculative_tokens": 2, "k": 1}, "speculative.k", "unknown field"),
        ({"drafter_invariant": "yes"}, "speculative.drafter_invariant", "must be true or false"),
        ("on", "speculative", "must be true, false or"),
        (3, "speculative", "must be true, false or"),
    ],
)
def test_bad_speculative_fields_name_the_field(tiny_server: ServerThread, speculative: object, param: str, message: str) -> None:
    response = _post(tiny_server, COMPLETIONS, {"model": "spec", "prompt": "hi", "speculative": speculative})
    _assert_openai_error(response, 400, param)
    assert response.json()["error"]["message"] == f"{param}: {message}" or message in response.json()["error"]["message"]
    assert ".bool" not in response.json()["error"]["message"]


def test_a_prompt_exactly_at_the_context_limit_is_refused(tiny_server: ServerThread) -> None:
    # max_model_len is 256: a 256-token prompt leaves no room for output; 255 leaves one token.
    at_limit = _post(tiny_server, COMPLETIONS, {"model": "plain", "prompt": [5] * 256, "max_tokens": 1})
    _assert_openai_error(at_limit, 400, "prompt")
    assert at_limit.json()["error"]["code"] == "context_length_exceeded"
    below = _post(tiny_server, COMPLETIONS, {"model": "plain", "prompt": [5] * 255, "max_tokens": 1})
    assert below.status_code == 200, below.text
    assert below.json()["usage"] == {"prompt_tokens": 255, "completion_tokens": 1, "total_tokens": 256,
                                     "prompt_tokens_details": {"cached_tokens": 0}}


def test_a_tiny_temperature_samples_the_greedy_token(tiny_server: ServerThread) -> None:
    body = {"model": "spec", "prompt": "one two three one two", "max_tokens": 12, "ignore_eos": True}
    greedy = _post(tiny_server, COMPLETIONS, body | {"temperature": 0})
    for temperature in (1e-38, 5e-324):
        tiny = _post(tiny_server, COMPLETIONS, body | {"temperature": temperature, "seed": 1})
        assert tiny.status_code == 200, tiny.text
        assert tiny.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]


def test_a_body_over_the_limit_gets_a_413(tiny_server: ServerThread) -> None:
    limit = tiny_server.server.config.app.state.specdec.config.max_request_bytes
    assert limit == 4 << 20  # the default
    big = json.dumps({"model": "plain", "prompt": "x" * limit}).encode()
    response = _post(tiny_server, COMPLETIONS, raw=big)  # Content-Length: refused before reading
    _assert_openai_error(response, 413)
    assert response.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: refused once the bytes read pass the limit
        for start in range(0, len(big), 1 << 16):
            yield big[start:start + (1 << 16)]

    response = httpx.post(f"{tiny_server.url}{COMPLETIONS}", content=chunks(), headers={"content-type": "application/json"}, timeout=60)
    _assert_openai_error(response, 413)
    assert httpx.get(f"{tiny_server.url}/health").status_code == 200


def test_a_long_prompt_is_tokenized_off_the_event_loop(tiny_server: ServerThread, monkeypatch: pytest.MonkeyPatch) -> None:
    # A prompt that fits is tokenized in full (one too long for the context is refused from its
    # size first): a tokenizer made slow (1.5 s a prompt) stands for a long prompt's tokenizing.
    encoder = tiny_server.server.state.encoder
    encode = encoder.encode

    def slow(*args, **kwargs):
        time.sleep(1.5)
        return encode(*args, **kwargs)

    monkeypatch.setattr(encoder, "encode", slow)
    result: dict[str, object] = {}

    def send() -> None:
        start = time.monotonic()
        result["response"] = _post(tiny_server, COMPLETIONS, {"model": "plain", "prompt": "hi", "max_tokens": 1})
        result["seconds"] = time.monotonic() - start

    thread = threading.Thread(target=send)
    thread.start()
    worst = 0.0
    while thread.is_alive():
        start = time.monotonic()
        assert httpx.get(f"{tiny_server.url}/health", timeout=30).status_code == 200
        worst = max(worst, time.monotonic() - start)
        time.sleep(0.02)
    thread.join()
    assert result["response"].status_code == 200  # type: ignore[attr-defined]
    assert result["seconds"] > 1.0 and worst < 0.5, (result["seconds"], worst)


def test_refusals_and_failures_are_counted(tiny_server: ServerThread, monkeypatch: pytest.MonkeyPatch) -> None:
    before = {(route, reason): _metric(tiny_server, route, reason)
              for route in ("plain", "") for reason in ("rejected", "error", "abort")}
    _assert_openai_error(_post(tiny_server, COMPLETIONS, {"model": "plain", "prompt": "hi", "top_p": 2}), 400)
    _assert_openai_error(_post(tiny_server, COMPLETIONS, {"model": "plain", "prompt": [5] * 256}), 400)
    _assert_openai_error(_post(tiny_server, COMPLETIONS, {"model": "nope", "prompt": "hi"}), 404)
    _assert_openai_error(_post(tiny_server, CHAT, raw=b"{"), 400)
    _assert_openai_error(_post(tiny_server, CHAT, raw=b" " * ((4 << 20) + 1)), 413)
    # A prefill that fails: the request gets a 503, and the failure is counted once.
    engine = tiny_server.server.config.app.state.specdec.scheduler.engine

    def broken_add(seq: object) -> None:
        raise RuntimeError("injected prefill failure")

    monkeypatch.setattr(engine, "_add", broken_add)  # admission's private step: admit itself runs
    failed = _post(tiny_server, COMPLETIONS, {"model": "plain", "prompt": "hi", "max_tokens": 2})
    monkeypatch.undo()
    _assert_openai_error(failed, 503)
    after = {key: _metric(tiny_server, *key) for key in before}
    assert after[("plain", "rejected")] - before[("plain", "rejected")] == 2
    assert after[("", "rejected")] - before[("", "rejected")] == 3
    assert after[("plain", "error")] - before[("plain", "error")] == 1
    assert after[("plain", "abort")] == before[("plain", "abort")] and after[("", "error")] == before[("", "error")]


def test_a_full_queue_refuses_whole_requests_and_aborts_nothing(tiny_model: LoadedModel) -> None:
    config = ServerConfig(routes=ROUTES, max_model_len=256, max_num_seqs=1, max_waiting=4, graceful_shutdown_s=1)
    server = ServerThread(build_state(config, loaded=tiny_model)).start()
    scheduler = server.server.config.app.state.specdec.scheduler
    long = {"model": "plain", "prompt": "hi", "max_tokens": 250, "ignore_eos": True}
    try:
        held = [threading.Thread(target=_post, args=(server, COMPLETIONS, long)) for _ in range(4)]
        for thread in held:  # one runs, three wait
            thread.start()
        deadline = time.monotonic() + 10
        while scheduler.waiting < 3 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert scheduler.waiting == 3
        # Two sequences do not fit beside three waiting: the whole request is refused, none queued.
        full = _post(server, COMPLETIONS, {"model": "plain", "prompt": ["a", "b"], "max_tokens": 1})
        _assert_openai_error(full, 429)
        assert full.json()["error"]["code"] == "queue_full"
        # More sequences than the queue holds at all: never servable, so a 400 rather than a 429.
        many = _post(server, COMPLETIONS, {"model": "plain", "prompt": [[5]] * 10, "max_tokens": 1})
        _assert_openai_error(many, 400, "n")
        for thread in held:
            thread.join()
        counts = {reason: _metric(server, "plain", reason) for reason in ("length", "abort", "rejected")}
        assert counts == {"length": 4, "abort": 0, "rejected": 2}
        assert scheduler.running == 0 and scheduler.waiting == 0
    finally:
        server.stop()


# --- a seeded fuzz of hostile requests, with a greedy stream running through it ------------------

HOSTILE_EXAMPLES = int(os.environ.get("SPECDEC_FUZZ_EXAMPLES", "160"))
WRONG_VALUES = [None, True, False, 0, -1, 1.5, 2**70, "x", "", [], {}, [1, "a"], {"a": 1}, [[]]]
OVER_LIMIT = (4 << 20) + 1


def _base(rng: random.Random) -> tuple[str, dict]:
    """A valid request that generates at most 3 tokens."""
    body: dict = {"model": rng.choice(["plain", "spec", "fixed"]), "max_tokens": rng.randint(1, 3)}
    if rng.random() < 0.5:
        return COMPLETIONS, body | {"prompt": rng.choice(["hi", "one two three", [5, 6, 7], ["a", "b"]])}
    return CHAT, body | {"messages": [{"role": "user", "content": "hi"}]}


def _hostile(rng: random.Random, category: int) -> tuple[str, bytes, bool]:
    """One hostile request: (path, raw body, send it chunked)."""
    path, body = _base(rng)
    raw: bytes | None = None
    chunked = False
    if category == 0:  # malformed JSON
        valid = json.dumps(body).encode()
        raw = rng.choice([valid[: rng.randrange(len(valid))], rng.randbytes(rng.randint(1, 64)), b"", b"null", b"[]",
                          valid + b" trailing", b"[" * 100_000, valid.replace(b"}", b', "temperature": NaN}'),
                          valid.replace(b"}", b', "temperature": Infinity}'), b'{"model": "plain", "prompt": "\xff\xfe"}'])
    elif category == 1:  # a field of the wrong type
        body[rng.choice(FIELDS + ["messages", "max_completion_tokens", "user", "logit_bias"])] = rng.choice(WRONG_VALUES)
    elif category == 2:  # unknown fields
        body[rng.choice(["bogus", "tools", "functions", "response_format", "echo", "best_of", "", "\u00e9"])] = rng.choice(WRONG_VALUES + [1])
    elif category == 3:  # max_tokens out of range
        body["max_tokens"] = rng.choice([-5, 0, -(2**63), 2**63, 10**30, 1.5, "10", True])
    elif category == 4:  # lone surrogates (json.dumps writes them as \\ud800 escapes)
        lone = rng.choice(["\ud800", "\udfff", "a\udc00b"])
        if "prompt" in body:
            body[rng.choice(["prompt", "stop", "model", "user"])] = lone
        else:
            body["messages"] = [{"role": "user", "content": rng.choice([lone, [{"type": "text", "text": lone}]])}]
    elif category == 5:  # a body over the limit, with and without Content-Length
        raw = json.dumps(body | {"user": "x" * OVER_LIMIT}).encode()
        chunked = rng.random() < 0.5
    elif category == 6:  # an unknown model
        body["model"] = rng.choice(["nope", "", "SPEC", "plain ", "gpt-4o"])
    elif category == 7:  # bad speculative fields
        body["speculative"] = rng.choice([{"num_speculative_tokens": -1}, {"num_speculative_tokens": 65},
                                          {"num_speculative_tokens": 2**70}, {"num_speculative_tokens": "2"},
                                          {"num_speculative_tokens": 7}, {"k": 2}, {}, "on", 1, [4], None])
        if rng.random() < 0.3:
            body["model"], body["speculative"] = "plain", {"num_speculative_tokens": 2}
    elif category == 8:  # tiny, huge and out-of-range temperatures
        body["temperature"] = rng.choice([1e-38, 5e-324, 1e-300, 1e-7, 100.0, 100.0001, 1e308, -1e-38, -0.0])
    elif category == 9:  # empty or odd messages
        path = CHAT
        body.pop("prompt", None)
        body["messages"] = rng.choice([[], [{"role": "user", "content": ""}], [{"role": "user", "content": "   "}],
                                       [{"role": "user", "content": []}], [{"role": "tool", "content": "hi"}],
                                       [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}],
                                       [{"role": "assistant", "content": "hi"}]])
    elif category == 10:  # n too large, or too many sequences
        body["n"] = rng.choice([17, 0, -1, 10**9, 16])
        if body["n"] == 16 and "prompt" in body:
            body["prompt"] = [[5]] * 20  # 320 sequences: more than the queue holds
    elif category == 11:  # stop of the wrong type
        body["stop"] = rng.choice([5, [1], {"a": "b"}, ["a"] * 17, [""], "", [None]])
    elif category == 12:  # odd prompts
        path = COMPLETIONS
        body.pop("messages", None)
        body["prompt"] = rng.choice([[], [[]], [[5, -1]], [2**40], [["a"]], [5, "a"], [5] * 256, "word " * 300, [1.5]])
    elif category == 13:  # sampling parameters at and past their bounds
        name, value = rng.choice([("top_p", 0), ("top_p", 1e-300), ("top_k", -5), ("top_k", 2**40), ("min_p", 1),
                                  ("min_p", 0.999), ("seed", -1), ("seed", 2**64), ("seed", 2**63 - 1), ("ignore_eos", "yes")])
        body[name] = value
    else:  # a valid request, streamed or not, now and then with a small temperature
        body["stream"] = rng.random() < 0.5
        if rng.random() < 0.5:
            body["temperature"] = rng.choice([0, 1e-30, 0.7])
    return path, raw if raw is not None else json.dumps(body).encode(), chunked


def _send(server: ServerThread, path: str, raw: bytes, chunked: bool) -> httpx.Response:
    content = (raw[i:i + (1 << 16)] for i in range(0, len(raw), 1 << 16)) if chunked else raw
    return httpx.post(f"{server.url}{path}", content=content, headers={"content-type": "application/json"}, timeout=60)


def test_hostile_requests_never_get_a_5xx_nor_disturb_a_stream(tiny_server: ServerThread) -> None:
    client = openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    stream_kwargs = dict(model="spec", prompt="one two three one two three", max_tokens=40, temperature=0,
                         extra_body={"ignore_eos": True})

    def streamed() -> tuple[str, str | None]:
        text, finish = [], None
        for chunk in client.completions.create(stream=True, **stream_kwargs):
            text.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        return "".join(text), finish

    alone = streamed()
    assert alone[1] == "length" and alone[0]
    done = threading.Event()
    during: list[tuple[str, str | None]] = []
    failures: list[BaseException] = []

    def keep_streaming() -> None:
        try:
            while not done.is_set():
                during.append(streamed())
        except BaseException as exc:  # noqa: BLE001  reported by the test thread
            failures.append(exc)

    streamer = threading.Thread(target=keep_streaming)
    streamer.start()
    rng = random.Random(13)
    statuses: dict[int, int] = {}
    try:
        for i in range(HOSTILE_EXAMPLES):
            path, raw, chunked = _hostile(rng, i % 15)
            response = _send(tiny_server, path, raw, chunked)
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            assert response.status_code < 500, (i, raw[:300], response.text)
            if response.status_code >= 400:
                _assert_openai_error(response, response.status_code)
            assert httpx.get(f"{tiny_server.url}/health").json()["status"] == "ok", (i, raw[:300])
    finally:
        done.set()
        streamer.join(60)
    assert not failures, failures
    assert len(during) >= 2 and all(result == alone for result in during), (alone, during)
    assert statuses.get(200, 0) >= 10 and statuses.get(413, 0) >= 5 and statuses.get(400, 0) >= HOSTILE_EXAMPLES // 2, statuses
    scheduler = tiny_server.server.config.app.state.specdec.scheduler
    deadline = time.monotonic() + 5
    while (scheduler.running or scheduler.waiting) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert scheduler.running == 0 and scheduler.waiting == 0


def test_max_tokens_past_the_context_is_refused_not_cut(tiny_server: ServerThread) -> None:
    # 200 prompt tokens on a 256-token context: 56 fit. Asked for more, OpenAI answers 400 (before:
    # the output was cut at 56 without a word); unset, the output runs to the context.
    over = _post(tiny_server, COMPLETIONS, {"model": "plain", "prompt": [5] * 200, "max_tokens": 57})
    _assert_openai_error(over, 400, "max_tokens")
    assert over.json()["error"]["code"] == "context_length_exceeded" and "at most 56 fit" in over.json()["error"]["message"]
    assert _post(tiny_server, COMPLETIONS, {"model": "plain", "prompt": [5] * 200, "max_tokens": 56}).status_code == 200
    chat = {"model": "plain", "messages": [{"role": "user", "content": "hi"}]}
    over = _post(tiny_server, CHAT, chat | {"max_completion_tokens": 1000})
    _assert_openai_error(over, 400, "max_completion_tokens")
    assert _post(tiny_server, CHAT, chat).status_code == 200


def test_health_shows_no_pid(tiny_server: ServerThread) -> None:
    health = httpx.get(f"{tiny_server.url}/health").json()
    assert health["status"] == "ok" and "pid" not in health
