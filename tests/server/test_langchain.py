"""LangChain's ChatOpenAI against the server, as its users call it: bind_tools with a round trip
through a ToolMessage, with_structured_output by JSON schema and by function calling, logprobs,
and streaming (text, and tool-call chunks); each the same on the speculative and the plain
route."""

from __future__ import annotations

import pytest
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field


@tool
def get_time(city: str) -> str:
    """Time in a city."""
    return "10:42"


class Planet(BaseModel):
    name: str = Field(max_length=20)
    moons: int


def chat_model(server, route: str, **kwargs) -> ChatOpenAI:
    return ChatOpenAI(base_url=f"{server.url}/v1", api_key="unused", model=route, temperature=0, max_retries=0,
                      **{"max_tokens": 60} | kwargs)


def test_bind_tools_round_trip(server) -> None:
    question = HumanMessage("What time is it in Oslo?")
    spec, plain = chat_model(server, "spec", max_tokens=40), chat_model(server, "plain", max_tokens=40)
    calls = [llm.bind_tools([get_time], tool_choice="get_time", parallel_tool_calls=False).invoke([question])
             for llm in (spec, plain)]
    assert [c["name"] for c in calls[0].tool_calls] == ["get_time"]
    assert calls[0].tool_calls[0]["args"] == calls[1].tool_calls[0]["args"] and "city" in calls[0].tool_calls[0]["args"]
    # The tool's result back, in one history for both routes (a call's id is part of the prompt).
    call = calls[0].tool_calls[0]
    history = [question, calls[0], ToolMessage(get_time.invoke(call["args"]), tool_call_id=call["id"])]
    finals = [llm.bind_tools([get_time], tool_choice="none").invoke(history) for llm in (spec, plain)]
    assert finals[0].content and not finals[0].tool_calls and finals[0].content == finals[1].content


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_with_structured_output(server, method: str) -> None:
    got = [chat_model(server, route).with_structured_output(Planet, method=method)
           .invoke("Describe Mars as JSON with its name and number of moons.") for route in ("spec", "plain")]
    assert isinstance(got[0], Planet) and got[0] == got[1]


def test_logprobs(server) -> None:
    got = [chat_model(server, route, max_tokens=12).bind(logprobs=True, top_logprobs=2).invoke("Say hi")
           for route in ("spec", "plain")]
    content = [m.response_metadata["logprobs"]["content"] for m in got]
    assert len(content[0]) == 12 or got[0].response_metadata["finish_reason"] == "stop"
    assert content[0] == content[1] and all(len(c["top_logprobs"]) == 2 for c in content[0])


def test_streaming(server) -> None:
    spec, plain = chat_model(server, "spec", max_tokens=24), chat_model(server, "plain", max_tokens=24)
    text = "".join(chunk.content for chunk in spec.stream("Name three colours."))
    assert text and text == plain.invoke("Name three colours.").content
    bound = spec.bind_tools([get_time], tool_choice="get_time", parallel_tool_calls=False)
    chunks = list(bound.stream("What time is it in Oslo?"))
    assert len(chunks) > 3  # the call arrives in pieces
    merged = chunks[0]
    for chunk in chunks[1:]:
        merged += chunk
    assert [(c["name"], c["args"]) for c in merged.tool_calls] == [
        (c["name"], c["args"]) for c in bound.invoke("What time is it in Oslo?").tool_calls]
