"""Tool calling: tools in the prompt, calls in the output, calls constrained when required.

The model's own chat template renders `tools` when it takes them (its text names `tools`). The
default model's (SmolLM2's) and Gemma's do not; for those specdec renders a documented fallback:

- a system message (before the conversation's own, or as its start) lists each function as JSON
  (name, description, parameters) and asks for calls as a JSON array
  `[{"name": ..., "arguments": {...}}]` and nothing else;
- an assistant message's `tool_calls` become that array as its text;
- a `tool` message becomes a user message `Result of call N (NAME): CONTENT`, N counting the
  conversation's calls from 1: the call's id is not rendered, so a tool loop's text does not depend
  on ids.

A call's id is a digest of the request's messages and tools, the choice's index and the call's:
the same request gets the same ids, streamed or not, on any route.

The output is read back as calls when it is such an array naming known tools. With
`tool_choice` "required" or a named function the output is constrained to it (a structured
output: each call's arguments follow its function's parameter schema, at most one call without
`parallel_tool_calls`), so the calls always parse and validate, and they are exact under
speculation like any structured output. With "auto" the model chooses (free text, read as calls
when it is an array of calls); "none" renders no tools.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

from specdec.sampling.params import StructuredOutput
from specdec.server.protocol import ChatCompletionRequest, NamedToolChoice, Tool

FALLBACK_INSTRUCTIONS = (
    "You can call these functions:\n{functions}\n"
    "To call functions, reply with only a JSON array of calls, each "
    '{{"name": <function name>, "arguments": <an object of its parameters>}}, and nothing else.'
)


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools do: the messages to render, whether to pass `tools` to the
    template, the output's constraint, and which function names its calls may take (empty: the
    output is text only)."""

    messages: list[dict[str, Any]]
    template_tools: list[dict[str, Any]] | None
    structured: StructuredOutput | None
    callable: frozenset[str]


def _arguments_schema(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


def calls_schema(tools: list[Tool], parallel: bool) -> dict[str, Any]:
    """The JSON schema of the output's calls: an array of at least one (exactly one when not
    `parallel`) {name, arguments} with each function's own argument schema."""
    call = [{"type": "object", "properties": {"name": {"enum": [t.function.name]}, "arguments": _arguments_schema(t)},
             "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    schema: dict[str, Any] = {"type": "array", "items": call[0] if len(call) == 1 else {"anyOf": call}, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _fallback_messages(body: ChatCompletionRequest, tools: list[Tool]) -> list[dict[str, Any]]:
    functions = "\n".join(json.dumps({"name": t.function.name, "description": t.function.description or "",
                                      "parameters": _arguments_schema(t)}) for t in tools)
    instructions = FALLBACK_INSTRUCTIONS.format(functions=functions)
    calls: dict[str, tuple[int, str]] = {}  # each earlier call's number and function, by id
    for m in body.messages:
        for c in m.tool_calls or []:
            calls.setdefault(c.id, (len(calls) + 1, c.function.name))
    messages = [_plain(m, calls) for m in body.messages]
    if tools:
        if messages and messages[0]["role"] == "system":
            messages[0] = {"role": "system", "content": instructions + "\n\n" + messages[0]["content"]}
        else:
            messages.insert(0, {"role": "system", "content": instructions})
    return messages


def _plain(message, calls: dict[str, tuple[int, str]]) -> dict[str, Any]:
    """A message as text the model's template takes, without tool fields (a tool result names its
    call by number and function, from `calls`, never by id)."""
    if message.role == "tool":
        number, name = calls.get(message.tool_call_id, (None, None))
        which = f"call {number} ({name})" if number is not None else "a call"
        return {"role": "user", "content": f"Result of {which}: {message.text()}"}
    role = "system" if message.role == "developer" else message.role
    text = message.text()
    if message.tool_calls:
        calls = json.dumps([{"name": c.function.name, "arguments": _loads(c.function.arguments)} for c in message.tool_calls])
        text = f"{text}\n{calls}" if text else calls
    return {"role": role, "content": text}


def _loads(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments  # the client's text as it is


def _template_messages(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    """Messages for a template that renders tools itself (transformers' chat format)."""
    out = []
    for m in body.messages:
        message: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.function.name, "arguments": _loads(c.function.arguments)}}
                                     for c in m.tool_calls]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        out.append(message)
    return out


def plan_tools(body: ChatCompletionRequest, chat_template: str | None) -> ToolPlan:
    """How to render and constrain a chat request with (or without) tools."""
    choice = body.tool_choice or ("auto" if body.tools else "none")
    tools = list(body.tools or ()) if choice != "none" else []
    if isinstance(choice, NamedToolChoice):
        tools = [t for t in tools if t.function.name == choice.function.name]
    template_takes_tools = chat_template is not None and "tools" in chat_template
    if template_takes_tools:
        messages = _template_messages(body)
        template_tools = [t.model_dump(exclude_none=True) for t in tools] or None
    else:
        messages, template_tools = _fallback_messages(body, tools), None
    structured = None
    if tools and choice != "auto":
        parallel = body.parallel_tool_calls is not False
        structured = StructuredOutput.json_schema(calls_schema(tools, parallel))
    return ToolPlan(messages, template_tools, structured, frozenset(t.function.name for t in tools))


# A call's start, up to its arguments' first character: `[` or `,`, {"name": "N", "arguments": .
_CALL_HEAD = re.compile(r'\s*[\[,]\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_-]{1,64})"\s*,\s*"arguments"\s*:\s*(?=\S)')
_CLOSE = re.compile(r"\s*\}")


@dataclass
class CallScanner:
    """Reads calls out of an output as it grows: a JSON array of {"name": N, "arguments": {...}}
    objects, name first (as the constrained output and the fallback's instructions have them).
    `feed` returns OpenAI's streamed tool-call deltas for what is new: a call's index, id, type
    and name once its head is complete, then its arguments' text as it arrives."""

    id_seed: str = ""  # what the calls' ids derive from (`call_id_seeds`)
    text: str = ""
    calls: list[dict[str, str]] = field(default_factory=list)  # id, name, arguments (their text so far)
    _at: int = 0  # where the next call's head (or the array's end) starts
    _args_from: int | None = None  # where the open call's arguments start
    _sent: int = 0  # how much of the text went out as the open call's arguments

    def feed(self, new: str) -> list[dict[str, Any]]:
        self.text += new
        deltas: list[dict[str, Any]] = []
        while True:
            if self._args_from is None:
                head = _CALL_HEAD.match(self.text, self._at)
                if head is None:
                    return deltas
                number = f"{self.id_seed}/{len(self.calls)}".encode()
                call = {"id": f"call_{hashlib.sha256(number).hexdigest()[:24]}", "name": head.group(1), "arguments": ""}
                self.calls.append(call)
                self._args_from = self._sent = head.end()
                deltas.append({"index": len(self.calls) - 1, "id": call["id"], "type": "function",
                               "function": {"name": call["name"], "arguments": ""}})
            end = _value_end(self.text, self._args_from)
            stop = len(self.text) if end is None else end
            if stop > self._sent:
                fragment = self.text[self._sent : stop]
                self.calls[-1]["arguments"] += fragment
                self._sent = stop
                deltas.append({"index": len(self.calls) - 1, "function": {"arguments": fragment}})
            close = _CLOSE.match(self.text, end) if end is not None else None
            if close is None:
                return deltas
            self._at, self._args_from = close.end(), None

    def complete(self, callable: frozenset[str]) -> list[dict[str, Any]] | None:
        """The calls in OpenAI's form when the whole text is an array of calls to `callable`
        tools with object arguments; None otherwise."""
        try:
            parsed = json.loads(self.text)
        except ValueError:
            return None
        if (not isinstance(parsed, list) or not parsed or len(parsed) != len(self.calls)
                or any(not isinstance(c, dict) or set(c) != {"name", "arguments"} or c["name"] not in callable
                       or not isinstance(c["arguments"], dict) for c in parsed)):
            return None
        return [_openai(c) for c in self.calls]

    def closed(self, callable: frozenset[str]) -> list[dict[str, Any]]:
        """The calls whose objects closed, in OpenAI's form, up to the first that is not a call to
        a `callable` tool with object arguments: what an output cut short still holds whole."""
        out = []
        for c in self.calls if self._args_from is None else self.calls[:-1]:
            try:
                arguments = json.loads(c["arguments"])
            except ValueError:
                break
            if c["name"] not in callable or not isinstance(arguments, dict):
                break
            out.append(_openai(c))
        return out


def _openai(call: dict[str, str]) -> dict[str, Any]:
    """A scanned call (id, name, arguments' text) in OpenAI's form."""
    return {"id": call["id"], "type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}


def _value_end(text: str, start: int) -> int | None:
    """The index after the JSON object or array starting at `start`; None while it is not
    complete yet (strings and their escapes respected)."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def call_id_seeds(body: ChatCompletionRequest) -> list[str]:
    """What the calls of each of a request's choices take their ids from: a digest of the request's
    messages and tools, and the choice's index. The same request gets the same ids, so a tool loop
    at temperature 0 replays exactly, and the speculative and plain routes agree."""
    digest = hashlib.sha256(body.model_dump_json(include={"messages", "tools"}).encode()).hexdigest()[:16]
    return [f"{digest}/{choice}" for choice in range(body.n)]


def parse_calls(text: str, callable: frozenset[str], id_seed: str = "") -> list[dict[str, Any]] | None:
    """The output as OpenAI tool calls (each call's arguments as the model wrote them, ids from
    `id_seed`), or None when it is not an array of calls to known tools."""
    if not callable:
        return None
    scanner = CallScanner(id_seed=id_seed)
    scanner.feed(text)
    return scanner.complete(callable)


def cut_calls(text: str, callable: frozenset[str], id_seed: str = "") -> list[dict[str, Any]]:
    """The whole calls of an output that hit its token limit mid-array (a constrained output
    writes call after call): each one complete, the cut one dropped; empty when none closed."""
    scanner = CallScanner(id_seed=id_seed)
    scanner.feed(text)
    return scanner.closed(callable)


def may_be_calls(text: str) -> bool:
    """Whether an output so far may still turn out to be calls (nothing but whitespace, or an
    array's start): a stream holds its text back until it is not."""
    stripped = text.lstrip()
    return not stripped or stripped.startswith("[")
