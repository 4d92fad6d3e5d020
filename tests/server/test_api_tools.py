"""Tool calling through the server with the official openai client: required and named choices
constrain the calls (they parse, validate against each function's schema, and are the same on
the speculative and plain routes, streamed or not), `auto` lets the model answer in text, the
client's tool loop (its assistant message with tool_calls, then a tool message) renders, and
bad tool requests are 400s that name the field. The fallback rendering and the reading of calls
are checked directly too."""

from __future__ import annotations

import json
import time

import httpx
import jsonschema
import openai
import pytest

from specdec.server.protocol import ChatCompletionRequest
from specdec.server.tools import CallScanner, calls_schema, cut_calls, may_be_calls, parse_calls, plan_tools

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Time in a city", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_time"}}


def calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]


def chat(client: openai.OpenAI, route: str, **kwargs):
    # No max_tokens: the output may run to the context (its 256 tokens hold the prompt's 202 and
    # what the calls take).
    return client.chat.completions.create(model=route, messages=MESSAGES, tools=TOOLS, temperature=0, **kwargs)


@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
def test_required_calls_validate_and_are_the_plain_routes(client: openai.OpenAI, tool_choice) -> None:
    spec, plain = chat(client, "spec", tool_choice=tool_choice), chat(client, "plain", tool_choice=tool_choice)
    assert spec.choices[0].finish_reason == plain.choices[0].finish_reason == "tool_calls"
    assert spec.choices[0].message.content is None
    got = calls(spec.choices[0].message)
    assert got == calls(plain.choices[0].message) and got
    for name, arguments in got:
        assert name == "get_time" or tool_choice == "required"
        jsonschema.validate(arguments, SCHEMAS[name])
    assert all(c.id.startswith("call_") and c.type == "function" for c in spec.choices[0].message.tool_calls)
    # Streamed as OpenAI streams calls: each call's id and name first, then its arguments' text
    # in fragments, the same calls.
    names, arguments, fragments, finish = {}, {}, 0, None
    for chunk in chat(client, "spec", tool_choice=tool_choice, stream=True):
        for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            if delta.id is not None:
                assert delta.index not in names and delta.function.name and delta.function.arguments == ""
                names[delta.index], arguments[delta.index] = delta.function.name, ""
            else:
                arguments[delta.index] += delta.function.arguments
                fragments += 1
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
    assert [(names[i], json.loads(arguments[i])) for i in sorted(names)] == got and finish == "tool_calls"
    assert fragments > len(got)  # arguments arrive in pieces, not whole
    assert [arguments[i] for i in sorted(names)] == [c.function.arguments for c in spec.choices[0].message.tool_calls]


def test_no_parallel_calls_is_one_call(client: openai.OpenAI) -> None:
    out = chat(client, "spec", tool_choice=NAMED, parallel_tool_calls=False)
    assert len(out.choices[0].message.tool_calls) == 1


def test_auto_may_answer_in_text_and_streams_it(client: openai.OpenAI) -> None:
    whole = chat(client, "spec", tool_choice="auto", max_tokens=24)
    if whole.choices[0].message.tool_calls is None:
        assert whole.choices[0].message.content
        streamed = "".join(c.choices[0].delta.content or "" for c in chat(client, "spec", tool_choice="auto", max_tokens=24,
                                                                          stream=True) if c.choices)
        assert streamed == whole.choices[0].message.content
    assert chat(client, "plain", tool_choice="auto", max_tokens=24).choices[0].message == whole.choices[0].message


def test_the_clients_tool_loop(client: openai.OpenAI) -> None:
    tools = [TOOLS[1]]
    first = client.chat.completions.create(model="spec", messages=MESSAGES, tools=tools, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=30, temperature=0)
    # The same request gets the same call ids, on either route and streamed or not, so the loop
    # replays exactly (ids were random, and the next turn's text depended on them).
    again = client.chat.completions.create(model="plain", messages=MESSAGES, tools=tools, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=30, temperature=0)
    assert again.choices[0].message.tool_calls == first.choices[0].message.tool_calls
    streamed = [d.id for c in client.chat.completions.create(model="spec", messages=MESSAGES, tools=tools,
                                                              tool_choice="required", parallel_tool_calls=False,
                                                              max_tokens=30, temperature=0, stream=True)
                if c.choices for d in c.choices[0].delta.tool_calls or [] if d.id is not None]
    assert streamed == [c.id for c in first.choices[0].message.tool_calls]
    message = first.choices[0].message
    history = [*MESSAGES, message, {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "10:42"}]
    second = client.chat.completions.create(model="spec", messages=history, tools=tools, tool_choice="none",
                                            max_tokens=16, temperature=0)
    assert second.choices[0].message.tool_calls is None and second.choices[0].message.content
    plain = client.chat.completions.create(model="plain", messages=history, tools=tools, tool_choice="none",
                                           max_tokens=16, temperature=0)
    assert plain.choices[0].message.content == second.choices[0].message.content


@pytest.mark.parametrize(("body", "param"), [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools.0.function.name"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "tools"),
    ({"messages": [{"role": "tool", "content": "1"}]}, "tool_call_id"),
    ({"messages": [{"role": "user", "content": None}]}, "content"),
    ({"functions": [{"name": "f"}]}, "functions"),
])
def test_bad_tool_requests_are_400s(server, body: dict, param: str) -> None:
    response = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                          json={"model": "spec", "messages": MESSAGES, "max_tokens": 4} | body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text


# --- the fallback rendering and the reading of calls, directly ---------------------------------

def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": MESSAGES} | fields)


def test_fallback_renders_tools_calls_and_results() -> None:
    history = [{"role": "system", "content": "Be brief."}, *MESSAGES,
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "10:42"}]
    plan = plan_tools(request(messages=history, tools=TOOLS), chat_template="{{ messages }}")
    system, user, assistant, tool = plan.messages
    assert system["role"] == "system" and '"name": "get_weather"' in system["content"]
    assert system["content"].endswith("Be brief.") and user == MESSAGES[0]
    assert json.loads(assistant["content"]) == [{"name": "get_time", "arguments": {"city": "Paris"}}]
    assert tool == {"role": "user", "content": "Result of call 1 (get_time): 10:42"}
    # The rendering never shows an id: another id for the same call renders the same text, and a
    # result for no known call says so.
    other = json.loads(json.dumps(history).replace("call_1", "call_zz9"))
    assert plan_tools(request(messages=other, tools=TOOLS), chat_template="{{ messages }}").messages == plan.messages
    orphan = [*MESSAGES, {"role": "tool", "tool_call_id": "call_x", "content": "10:42"}]
    assert plan_tools(request(messages=orphan, tools=TOOLS), None).messages[-1]["content"] == "Result of a call: 10:42"
    assert plan.template_tools is None and plan.structured is None and plan.callable == {"get_weather", "get_time"}
    # none: no tools rendered, nothing callable; a template that takes tools gets them.
    assert plan_tools(request(tools=TOOLS, tool_choice="none"), None).messages == MESSAGES
    assert plan_tools(request(tools=TOOLS), "{{ tools }}").template_tools[0]["function"]["name"] == "get_weather"


def test_required_constrains_to_the_calls_schema() -> None:
    plan = plan_tools(request(tools=TOOLS, tool_choice="required", parallel_tool_calls=False), None)
    schema = json.loads(plan.structured.spec)
    assert schema == calls_schema([t for t in request(tools=TOOLS).tools], parallel=False) and schema["maxItems"] == 1
    jsonschema.validate([{"name": "get_time", "arguments": {"city": "Oslo"}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "arguments": {"town": "Oslo"}}], schema)


def test_scanning_calls_as_they_arrive() -> None:
    text = '[{"name": "get_time", "arguments": {"city": "O\\"s}lo", "n": [1, {"a": 2}]}}, {"name": "get_weather", "arguments": {}}]'
    scanner, deltas = CallScanner(), []
    for i in range(0, len(text), 3):
        deltas += scanner.feed(text[i : i + 3])
    heads = [d for d in deltas if "id" in d]
    assert [(d["index"], d["function"]["name"]) for d in heads] == [(0, "get_time"), (1, "get_weather")]
    for index in (0, 1):
        streamed = "".join(d["function"]["arguments"] for d in deltas if d["index"] == index)
        assert json.loads(streamed) == json.loads(text)[index]["arguments"]
    calls = scanner.complete(frozenset({"get_time", "get_weather"}))
    assert [c["id"] for c in calls] == [d["id"] for d in heads]
    assert scanner.complete(frozenset({"get_time"})) is None  # a call to an unknown tool


def test_a_cut_output_keeps_its_whole_calls() -> None:
    names = frozenset({"get_time", "get_weather"})
    whole = '[{"name": "get_time", "arguments": {"city": "Oslo"}}, {"name": "get_weather", "arguments": {"city": "Rome"}}'
    for cut in (", ", ', {"name": "get_ti', ', {"name": "get_time", "arguments": {"city": "Ber'):
        calls = cut_calls(whole + cut, names, "req/0")
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
            ("get_time", {"city": "Oslo"}), ("get_weather", {"city": "Rome"})], cut
        assert [c["id"] for c in calls] == [c["id"] for c in parse_calls(whole + "]", names, "req/0")]
    assert cut_calls('[{"name": "get_time", "arguments": {"ci', names) == []
    assert cut_calls(whole, frozenset({"get_time"})) == [parse_calls(whole + "]", names)[0]]  # up to an unknown tool


def test_reading_calls() -> None:
    names = frozenset({"get_time"})
    read = parse_calls(' [{"name": "get_time", "arguments": {"city": "Oslo"}}]', names)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in read] == [("get_time", {"city": "Oslo"})]
    for text in ('[{"name": "other", "arguments": {}}]', '[{"name": "get_time"}]', "[]", "[1, 2]", "It is 10:42.", "[unclosed"):
        assert parse_calls(text, names) is None, text
    assert parse_calls('[{"name": "get_time", "arguments": {}}]', frozenset()) is None
    # Ids: one seed, the same ids; each call of an output and each seed, ids of their own.
    two = '[{"name": "get_time", "arguments": {}}, {"name": "get_time", "arguments": {}}]'
    ids = [c["id"] for c in parse_calls(two, names, "req/0")]
    assert ids == [c["id"] for c in parse_calls(two, names, "req/0")] and len(set(ids)) == 2
    assert set(ids).isdisjoint(c["id"] for c in parse_calls(two, names, "req/1"))
    assert all(i.startswith("call_") and len(i) == 29 for i in ids)
    assert may_be_calls("  ") and may_be_calls(' [{"na') and not may_be_calls("The [time]")


def test_a_constrained_output_cut_short_returns_whole_calls_only(client: openai.OpenAI) -> None:
    # Cut inside its first call: no call is whole, and the JSON fragment is not sent as content
    # (clients such as litellm fail on it).
    cities = [{"role": "user", "content": "What is the weather in Paris, Oslo, Rome, Berlin and Madrid?"}]
    out = client.chat.completions.create(model="spec", messages=cities, tools=TOOLS, temperature=0,
                                         tool_choice="required", max_tokens=20)
    assert out.choices[0].finish_reason == "length"
    assert out.choices[0].message.content is None and out.choices[0].message.tool_calls is None


def test_too_many_tools_for_the_context_names_tools(server) -> None:
    # 128 tools do not fit the test server's 256-token context, the message alone does: the
    # error names `tools`; a message that is itself too long still names `messages`.
    many = [{"type": "function", "function": {"name": f"tool_{i}", "description": "Does a thing", "parameters": TIME}}
            for i in range(128)]
    response = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                          json={"model": "spec", "messages": MESSAGES, "tools": many, "max_tokens": 4})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "tools" and error["code"] == "context_length_exceeded", error
    assert "128 tools" in error["message"]
    for words in (400, 800_000):  # 4 MB: refused by its bytes, never tokenized, with or without the tools
        long = [{"role": "user", "content": "word " * words}]
        start = time.monotonic()
        response = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                              json={"model": "spec", "messages": long, "tools": many[:1], "max_tokens": 4})
        assert response.status_code == 400 and response.json()["error"]["param"] == "messages", response.text[:300]
        assert time.monotonic() - start < 5
