"""Log-probabilities in OpenAI's two response shapes: chat's `logprobs.content` list and the
legacy completions' parallel lists (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`)."""

from __future__ import annotations

from typing import Any

from specdec.engine.text import TokenBytes
from specdec.sampling.logprobs import TokenLogprob


def chat_logprobs(items: list[TokenLogprob], names: TokenBytes) -> dict[str, Any]:
    """`choices[i].logprobs` of a chat completion (or of one streamed chunk)."""

    def entry(token: int, logprob: float) -> dict[str, Any]:
        return {"token": names.text(token), "logprob": logprob, "bytes": list(names.bytes(token))}

    content = [entry(item.token, item.logprob) | {"top_logprobs": [entry(t, lp) for t, lp in item.top]}
               for item in items]
    return {"content": content, "refusal": None}


def completion_logprobs(items: list[TokenLogprob | None], tokens: list[int], names: TokenBytes,
                        offset: int = 0) -> dict[str, Any]:
    """`choices[i].logprobs` of a completion: `items[j]` for `tokens[j]` (None: a prompt's first
    token, which nothing predicts); text offsets count characters from `offset`."""
    texts = [names.text(t) for t in tokens]
    offsets = []
    for text in texts:
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": texts,
        "token_logprobs": [None if item is None else item.logprob for item in items],
        "top_logprobs": [None if item is None else {names.text(t): lp for t, lp in item.top} for item in items],
        "text_offset": offsets,
    }
