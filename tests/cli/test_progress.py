"""Progress of long runs (bench, tune) when stderr is not a terminal: a line per prompt."""

from __future__ import annotations

import io

from rich.console import Console

from specdec.cli import main


def test_progress_prints_a_line_per_prompt_when_not_a_terminal(monkeypatch) -> None:
    out = io.StringIO()
    monkeypatch.setattr(main, "err", Console(file=out, force_terminal=False))
    with main.prompt_progress("bench", 3) as advance:
        for record in range(3):
            advance(record)
    lines = out.getvalue().splitlines()
    assert [line.split(",")[0] for line in lines] == ["bench: 1/3 prompts", "bench: 2/3 prompts", "bench: 3/3 prompts"]
    assert all(line.endswith("s") for line in lines)
