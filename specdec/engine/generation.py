"""What a request produces: its tokens and text as they are committed, and the whole of it."""

from __future__ import annotations

from dataclasses import dataclass, field

from specdec.engine.stats import RequestStats


@dataclass(frozen=True)
class StreamChunk:
    """Tokens committed by one target step (after stop conditions), and their new text."""

    token_ids: list[int]
    text: str


@dataclass
class Generation:
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop" (EOS or stop string) or "length"
    stats: RequestStats = field(default_factory=RequestStats)
