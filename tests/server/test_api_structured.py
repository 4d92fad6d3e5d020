"""Structured outputs through the server with the official openai client: response_format
json_schema (also through the client's pydantic `parse`), json_object, and the
`structured_outputs` extension (regex, grammar) on completions; the speculative route gives the
plain route's text, streamed or not, every JSON output validates, and bad specs are 400s that
name the field."""

from __future__ import annotations

import json
from typing import Annotated

import httpx
import jsonschema
import openai
import pydantic
import pytest

MESSAGES = [{"role": "user", "content": "Describe the planet Mars: its name, its moons and one fact."}]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                           "moons": {"type": "array", "items": {"type": "string", "maxLength": 20},
                                                     "maxItems": 4},
                                           "fact": {"type": "string", "maxLength": 60}},
          "required": ["name", "moons", "fact"], "additionalProperties": False}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "planet", "schema": SCHEMA, "strict": True}}


def chat(client: openai.OpenAI, route: str, response_format: dict, **kwargs):
    return client.chat.completions.create(model=route, messages=MESSAGES, max_tokens=96, temperature=0,
                                          response_format=response_format, **kwargs)


@pytest.mark.parametrize("response_format", [JSON_SCHEMA, {"type": "json_object"}], ids=["json_schema", "json_object"])
def test_json_outputs_validate_and_are_the_plain_routes(client: openai.OpenAI, response_format: dict) -> None:
    spec, plain = chat(client, "spec", response_format), chat(client, "plain", response_format)
    assert spec.choices[0].message.content == plain.choices[0].message.content
    assert spec.choices[0].finish_reason == "stop"
    document = json.loads(spec.choices[0].message.content)
    jsonschema.validate(document, SCHEMA if response_format["type"] == "json_schema" else {"type": "object"})
    if response_format["type"] == "json_schema":  # json_object's short answer finds nothing to look up
        assert spec.model_extra["speculation"]["drafted_tokens"] > 0
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in
                       chat(client, "spec", response_format, stream=True) if chunk.choices)
    assert streamed == plain.choices[0].message.content


class Planet(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=30)
    moons: list[Annotated[str, pydantic.Field(max_length=20)]] = pydantic.Field(max_length=4)
    fact: str = pydantic.Field(max_length=60)


def test_the_clients_parse_gets_its_model(client: openai.OpenAI) -> None:
    parsed = client.chat.completions.parse(model="spec", messages=MESSAGES, max_tokens=128, temperature=0,
                                           response_format=Planet)
    planet = parsed.choices[0].message.parsed
    assert isinstance(planet, Planet) and planet.name


def test_sampled_json_validates(client: openai.OpenAI) -> None:
    finished = 0
    for seed in range(3):
        out = client.chat.completions.create(model="spec", messages=MESSAGES, max_tokens=128, temperature=0.8,
                                             seed=seed, response_format=JSON_SCHEMA)
        if out.choices[0].finish_reason == "stop":  # a document cut by max_tokens cannot validate
            jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)
            finished += 1
    assert finished >= 2  # the schema's lengths leave room to finish within 128 tokens


@pytest.mark.parametrize("extension", [{"regex": r"(Yes|No), because [a-z ,]{10,60}\."},
                                       {"grammar": 'root ::= "The answer is " ("yes" | "no") "."'}],
                         ids=["regex", "grammar"])
def test_completions_take_a_regex_and_a_grammar(client: openai.OpenAI, extension: dict) -> None:
    def complete(route: str) -> str:
        out = client.completions.create(model=route, prompt="Q: Is the sky blue on a clear day?\nA:", max_tokens=40,
                                        temperature=0, extra_body={"structured_outputs": extension})
        assert out.choices[0].finish_reason == "stop"
        return out.choices[0].text

    text = complete("spec")
    assert text == complete("plain")
    if "regex" in extension:
        assert text.startswith(("Yes, because ", "No, because ")) and text.endswith(".")
    else:
        assert text in ("The answer is yes.", "The answer is no.")


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
     "response_format.json_schema.schema", "JSON schema does not compile"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "json_schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type", None),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex", "regular expression does not compile"),
    ({"structured_outputs": {"grammar": "root ::= missing"}}, "structured_outputs.grammar", "grammar does not compile"),
    ({"structured_outputs": {"regex": "a", "grammar": "root ::= \"a\""}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "structured_outputs", "not both"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos", "ignore_eos cannot go"),
    # What the grammar would not enforce: a $ref outside the schema, a required recursion with no
    # end; and a compile error says what is wrong without the grammar library's source path.
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "https://example.com/a.json"}}, "required": ["a"]}}}},
     "response_format.json_schema.schema", "points outside the schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/n", "$defs": {
        "n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}, "required": ["next"]}}}}}},
     "response_format.json_schema.schema", "no finite instance"),
])
def test_bad_structured_requests_are_400s(server, body: dict, param: str, message: str | None) -> None:
    response = httpx.post(f"{server.url}/v1/chat/completions",
                          json={"model": "spec", "messages": MESSAGES, "max_tokens": 4} | body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    if message is not None:
        assert message in error["message"]
    assert ".cc:" not in error["message"] and "/project/" not in error["message"]
