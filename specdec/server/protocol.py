"""Request bodies of the OpenAI-compatible API, and OpenAI-style errors.

Fields follow OpenAI's API; specdec adds `top_k`, `min_p`, `ignore_eos` and `speculative`
(`false`, or `{"num_speculative_tokens": k}` with 0 <= k <= the route's cap). Unknown fields
are refused, as are OpenAI features specdec does not implement when set to anything but
their neutral value (penalties, logprobs, echo, best_of > 1).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr


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
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SpeculativeOverride(_Strict):
    num_speculative_tokens: int = Field(ge=0, le=64)


class StreamOptions(_Strict):
    include_usage: StrictBool = False


class _SamplingRequest(_Strict):
    model: StrictStr
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=100.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)  # -1 and 0 are off
    min_p: float = Field(default=0.0, ge=0.0, lt=1.0)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: StrictStr | list[StrictStr] | None = None
    n: int = Field(default=1, ge=1, le=16)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False
    speculative: StrictBool | SpeculativeOverride | None = None
    user: StrictStr | None = None
    presence_penalty: float = Field(default=0.0, ge=0.0, le=0.0)
    frequency_penalty: float = Field(default=0.0, ge=0.0, le=0.0)
    logit_bias: dict[str, float] | None = Field(default=None, max_length=0)


class CompletionRequest(_SamplingRequest):
    prompt: StrictStr | list[StrictStr] | list[int] | list[list[int]] = Field(min_length=1)
    echo: Literal[False] = False
    best_of: int = Field(default=1, ge=1, le=1)
    logprobs: None = None
    suffix: None = None


class ContentPart(_Strict):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer"]
    content: StrictStr | list[ContentPart]
    name: StrictStr | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: Literal[False] | None = None
    top_logprobs: None = None
