"""What a request produces: its tokens and text as they are committed, and the whole of it."""

from __future__ import annotations

from dataclasses import dataclass, field

from specdec.engine.stats import RequestStats
from specdec.sampling.logprobs import TokenLogprob


@dataclass(frozen=True)
class StreamChunk:
    """Tokens committed by one target step (after stop conditions), and their new text;
    with SamplingParams.logprobs, one TokenLogprob per token."""

    token_ids: list[int]
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass
class Generation:
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop" (EOS or stop string), "length", or "error" (see `error`)
    error: str | None = None  # why the request failed: its structured output has no instance past this output
    # With SamplingParams.logprobs: one per output token; with prompt_logprobs, one per prompt
    # token (None for the first, which nothing predicts).
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    stats: RequestStats = field(default_factory=RequestStats)
