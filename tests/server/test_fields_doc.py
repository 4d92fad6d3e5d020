"""The server docs' table of request fields is the request models': every field they take is listed
with its endpoint, a field listed as accepted and ignored validates, and one listed as refused is
refused by name (at a non-neutral value) and taken at its neutral one."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from specdec.server.protocol import NOT_SUPPORTED, ChatCompletionRequest, CompletionRequest

README = Path(__file__).parents[2] / "docs" / "server.md"
BASE = {"chat": {"model": "m", "messages": [{"role": "user", "content": "hi"}]}, "completions": {"model": "m", "prompt": "hi"}}
MODELS = {"chat": ChatCompletionRequest, "completions": CompletionRequest}
# A value each accepted-and-ignored field may take, and a non-neutral one for each refused field.
IGNORED_VALUES = {"user": "u", "metadata": {"k": "v"}, "store": False, "service_tier": "auto", "reasoning_effort": "low",
                  "prompt_cache_key": "k", "safety_identifier": "s", "modalities": ["text"]}
REFUSED_VALUES = {"audio": {"voice": "alloy"}, "best_of": 2} | {name: [{"type": "function"}] for name in NOT_SUPPORTED}
NEUTRAL_VALUES = {"best_of": 1}


def table() -> dict[str, tuple[list[str], str]]:
    text = README.read_text(encoding="utf-8")
    block = text[text.index("<!-- request-fields -->"): text.index("<!-- /request-fields -->")]
    rows = {}
    for match in re.finditer(r"^\| `(\w+)` \| (\w+) \| ([^|]+) \|$", block, re.M):
        name, endpoint, what = match.groups()
        rows[name] = (["chat", "completions"] if endpoint == "both" else [endpoint], what)
    return rows


def fields(endpoint: str) -> set[str]:
    return {f.alias or name for name, f in MODELS[endpoint].model_fields.items()}


def test_every_field_is_listed_with_its_endpoints() -> None:
    rows = table()
    for endpoint in ("chat", "completions"):
        listed = {name for name, (endpoints, _) in rows.items() if endpoint in endpoints}
        refused_by_name = set(NOT_SUPPORTED) if endpoint == "chat" else set()
        assert listed == fields(endpoint) | refused_by_name, endpoint


@pytest.mark.parametrize("name", sorted(table()))
def test_each_row_says_what_the_model_does(name: str) -> None:
    endpoints, what = table()[name]
    for endpoint in endpoints:
        model, base = MODELS[endpoint], BASE[endpoint]
        if what.startswith("accepted and ignored"):
            model.model_validate(base | {name: IGNORED_VALUES[name]})
        elif what.startswith("refused"):
            with pytest.raises(ValidationError) as info:
                model.model_validate(base | {name: REFUSED_VALUES[name]})
            error = info.value.errors()[0]
            assert name in (error.get("ctx") or {}).get("param", "") or error["loc"][0] == name
            model.model_validate(base | {name: NEUTRAL_VALUES.get(name)})  # null, or 1 for best_of
        else:
            assert what.startswith(("supported", "extension")), what
