"""Request bodies of the OpenAI-compatible API, and OpenAI-style errors.

Fields follow OpenAI's API; specdec adds `top_k`, `min_p`, `repetition_penalty`, `ignore_eos`,
`structured_outputs` and `speculative` (`false`, or `{"num_speculative_tokens": k}` with 0 <= k
<= the route's cap). Structured outputs come as chat's `response_format` (`json_object`,
`json_schema`) or as `structured_outputs` (`json`, `regex` or `grammar`) on both endpoints.
Unknown fields are refused, as are OpenAI features specdec does not implement when set to
anything but their neutral value (best_of > 1, audio), and text that
is not valid Unicode (JSON's `\ud800` escapes decode to lone surrogates, which no tokenizer
takes). Fields that do not change what is generated here (`metadata`, `store`, `service_tier`,
`reasoning_effort`, `modalities: ["text"]`) are taken and ignored, as OpenAI's newer SDKs and
proxies send them; `seed` takes any integer.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, field_validator, model_validator
from pydantic_core import PydanticCustomError


class APIError(Exception):
    """An error returned as `{"error": {"message", "type", "param", "code"}}` with a 4xx status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None, code: str | None = None) -> dict[str, Any]:
    # Messages and params can quote the client's text (a field name); a lone surrogate in it
    # would make the response itself unencodable, so such characters are written as escapes.
    return {"error": {"message": printable(message), "type": type, "param": None if param is None else printable(param),
                      "code": code}}


def printable(text: str) -> str:
    """`text` with any lone surrogate written as a backslash escape, so it encodes as UTF-8."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def field_error(param: str, message: str) -> PydanticCustomError:
    """A validation error that names its field (`param`, dotted) itself; the app reports it with
    that param instead of the location pydantic would give."""
    return PydanticCustomError("invalid_field", "{message}", {"param": printable(param), "message": printable(message)})


def _bad_value(data: Any) -> tuple[str, str] | None:
    """The first value in parsed JSON that no field takes, as (dotted path, what is wrong): a
    string (value or key) that is not valid Unicode (JSON's `\ud800` escapes decode to lone
    surrogates), or a number that is NaN or infinite (Python's JSON reader takes `NaN` and
    `Infinity`). None when there is none. Iterative: JSON can nest deeper than the stack."""
    stack: list[tuple[Any, tuple[str, ...]]] = [(data, ())]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as exc:
                return ".".join(path), f"must be valid Unicode text; found a lone surrogate U+{ord(value[exc.start]):04X}"
        elif isinstance(value, float) and not math.isfinite(value):
            return ".".join(path), "is not a finite number"
        elif isinstance(value, dict):
            items = [(item, (*path, str(key))) for key, item in value.items()]
            stack.extend((key, (*path, str(key))) for key in value if isinstance(key, str))
            stack.extend(reversed(items))
        elif isinstance(value, list):
            stack.extend(reversed([(item, (*path, str(i))) for i, item in enumerate(value)]))
    return None


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# OpenAI request fields that would change what is generated and that specdec does not implement
# yet: refused by name, with what they are (any other unknown field is refused as unknown).
NOT_SUPPORTED = {
    "functions": "function calling (legacy; use tools)", "function_call": "function calling (legacy; use tool_choice)",
    "web_search_options": "web search", "verbosity": "verbosity control",
}


class SpeculativeOverride(_Strict):
    num_speculative_tokens: int | None = Field(default=None, ge=0, le=64)
    drafter_invariant: StrictBool | None = None


class StreamOptions(_Strict):
    include_usage: StrictBool = False


class _SamplingRequest(_Strict):
    model: StrictStr
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=100.0)
    top_p: float = Field(default=1.0, ge=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)  # -1 and 0 are off
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    seed: int | None = None  # any integer, as OpenAI takes it (reduced modulo 2**63)
    stop: StrictStr | list[StrictStr] | None = None
    n: int = Field(default=1, ge=1, le=16)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False
    speculative: StrictBool | SpeculativeOverride | None = None
    user: StrictStr | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=100.0)  # specdec's (HF's, vLLM's): 1 is off
    logit_bias: dict[StrictStr, StrictFloat] | None = Field(default=None, max_length=1024)
    # Fields that newer SDKs and proxies send and that do not change what is generated here:
    # taken and ignored (`store` keeps nothing; `service_tier` and `reasoning_effort` have one
    # tier and no reasoning model to steer), or refused when set to what specdec does not do.
    structured_outputs: StructuredOutputs | None = None
    metadata: dict[StrictStr, StrictStr] | None = Field(default=None, max_length=16)
    store: StrictBool | None = None
    service_tier: StrictStr | None = None
    reasoning_effort: StrictStr | None = None
    prompt_cache_key: StrictStr | None = None  # specdec reuses a prompt's KV by itself
    safety_identifier: StrictStr | None = None

    @model_validator(mode="before")
    @classmethod
    def _not_supported(cls, data: Any) -> Any:
        """Refuse NOT_SUPPORTED fields by name; take them when null (clients send that)."""
        if isinstance(data, dict) and any(name in data for name in NOT_SUPPORTED):
            for name, what in NOT_SUPPORTED.items():
                if data.get(name) is not None:
                    raise field_error(name, f"{name}: {what} is not supported by specdec yet")
            data = {key: value for key, value in data.items() if key not in NOT_SUPPORTED}
        return data

    @model_validator(mode="before")
    @classmethod
    def _valid_values(cls, data: Any) -> Any:
        found = _bad_value(data)
        if found is not None:
            path, what = found
            raise field_error(path or "body", what)
        return data

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        """Token ids (as JSON keys: decimal strings) to biases in [-100, 100]."""
        for key, bias in (value or {}).items():
            if not key.isascii() or not key.isdigit():
                raise field_error(f"logit_bias.{key}", "keys must be token ids (decimal integers)")
            if not -100 <= bias <= 100:
                raise field_error(f"logit_bias.{key}", f"bias must be in [-100, 100], got {bias}")
        return value

    @field_validator("speculative", mode="before")
    @classmethod
    def _speculative(cls, value: Any) -> Any:
        """true, false, or {"num_speculative_tokens": k, "drafter_invariant": bool} (either or
        both); errors name the field at fault (a union's own errors would name the union's first
        member: "speculative.bool")."""
        if value is None or isinstance(value, (bool, SpeculativeOverride)):
            return value
        shape = 'must be true, false or {"num_speculative_tokens": k, "drafter_invariant": true|false}'
        if not isinstance(value, dict):
            raise field_error("speculative", shape)
        for name in value:
            if name not in ("num_speculative_tokens", "drafter_invariant"):
                raise field_error(f"speculative.{name}", "unknown field; the fields are num_speculative_tokens "
                                                         "and drafter_invariant")
        if not value:
            raise field_error("speculative", shape)
        k = value.get("num_speculative_tokens")
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= 64):
            raise field_error("speculative.num_speculative_tokens", "must be an integer in 0..64")
        invariant = value.get("drafter_invariant")
        if invariant is not None and not isinstance(invariant, bool):
            raise field_error("speculative.drafter_invariant", "must be true or false")
        return SpeculativeOverride(num_speculative_tokens=k, drafter_invariant=invariant)


class CompletionRequest(_SamplingRequest):
    # Token ids are integers: true or 5.0 are not taken for one.
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=0)  # 0 only with echo: score the prompt
    echo: StrictBool = False
    best_of: int = Field(default=1, ge=1, le=1)
    logprobs: int | None = Field(default=None, ge=0, le=20)  # OpenAI's legacy API takes up to 5
    suffix: StrictStr | None = None  # fill in the middle, for a model with FIM tokens

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value: Any) -> Any:
        """Errors that say what a prompt may be (a union's own would name its first member)."""
        if isinstance(value, str) or not isinstance(value, list):
            if not isinstance(value, str):
                raise field_error("prompt", "must be text, a list of texts, token ids, or a list of token-id lists")
            return value
        flat = [x for item in value for x in (item if isinstance(item, list) else [item])]
        if any(isinstance(x, (bool, float)) for x in flat):
            raise field_error("prompt", "token ids must be integers (not booleans or floats)")
        return value

    @model_validator(mode="after")
    def _echo_to_score(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise field_error("max_tokens", "must be >= 1 (0 only with echo, to score the prompt)")
        return self


class ContentPart(_Strict):
    type: Literal["text"]
    text: StrictStr


class FunctionCall(_Strict):
    name: StrictStr
    arguments: StrictStr  # JSON text, as OpenAI sends it


class ToolCall(_Strict):
    id: StrictStr
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: StrictStr | list[ContentPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls (its content may then be null)
    tool_call_id: StrictStr | None = None  # a tool message answers this call
    # What the openai client echoes back of an assistant message it got: taken when null.
    refusal: None = None
    annotations: list[Any] | None = Field(default=None, max_length=0)
    audio: None = None
    function_call: None = None

    @model_validator(mode="after")
    def _shape(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise field_error("content", "is required (null only on an assistant message with tool_calls)")
        if self.tool_calls is not None and self.role != "assistant":
            raise field_error("tool_calls", "only an assistant message has tool_calls")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise field_error("tool_call_id", "a tool message needs tool_call_id, and only a tool message has one")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class FunctionDefinition(_Strict):
    name: StrictStr = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None takes no arguments
    strict: StrictBool | None = None  # the schema is enforced either way when a call is required


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: StrictStr


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Strict):
    name: StrictStr = Field(min_length=1, max_length=64)
    description: StrictStr | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")  # None: any JSON object
    strict: StrictBool | None = None  # the schema is enforced either way


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise field_error("response_format.json_schema", 'goes with type "json_schema", and only with it')
        return self


class StructuredOutputs(_Strict):
    """specdec's extension (vLLM's field): exactly one of a JSON schema, a regular expression
    the whole output matches, or an EBNF grammar (xgrammar's dialect, starting at `root`)."""

    json_: dict[str, Any] | None = Field(default=None, alias="json")
    regex: StrictStr | None = Field(default=None, min_length=1)
    grammar: StrictStr | None = Field(default=None, min_length=1)

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        if sum(v is not None for v in (self.json_, self.regex, self.grammar)) != 1:
            raise field_error("structured_outputs", "takes exactly one of json, regex and grammar")
        return self


class Prediction(_Strict):
    """OpenAI's predicted output: text the answer is expected to mostly repeat."""

    type: Literal["content"]
    content: StrictStr | list[ContentPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: StrictBool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    prediction: Prediction | None = None
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    # Audio is not implemented: taken at its neutral value only.
    modalities: list[Literal["text"]] | None = None
    audio: None = None
    parallel_tool_calls: StrictBool | None = None

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        """A content part this text model cannot read is refused as such (not as a wrong type)."""
        unreadable = {"image_url": "images", "input_audio": "audio", "file": "files"}
        messages = data.get("messages") if isinstance(data, dict) else None
        for i, message in enumerate(messages if isinstance(messages, list) else ()):
            content = message.get("content") if isinstance(message, dict) else None
            for j, part in enumerate(content if isinstance(content, list) else ()):
                if isinstance(part, dict) and part.get("type") in unreadable:
                    raise field_error(f"messages.{i}.content.{j}", f"{unreadable[part['type']]} are not supported by this model")
        return data

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise field_error("top_logprobs", "needs logprobs: true")
        return self

    @model_validator(mode="after")
    def _tool_choice_names_a_tool(self) -> ChatCompletionRequest:
        names = [tool.function.name for tool in self.tools or ()]
        if len(set(names)) != len(names):
            raise field_error("tools", "function names must be distinct")
        choice = self.tool_choice
        if choice in ("auto", "required") or isinstance(choice, NamedToolChoice):
            if not names:
                raise field_error("tool_choice", "needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise field_error("tool_choice.function.name", f"{choice.function.name!r} is not one of the tools")
        if self.tools and (self.response_format is not None and self.response_format.type != "text"
                           or self.structured_outputs is not None) and choice not in ("none",):
            raise field_error("tools", "cannot go with a structured output unless tool_choice is \"none\"")
        return self

