"""Benchmark prompt files: JSONL, one record a line, `{"id", "category", "turns": [user messages]}`;
a fill-in-the-middle record has one turn, the code before the cursor, and `"suffix"`, the code after it."""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from specdec.errors import SpecDecError


class BenchDataError(SpecDecError):
    """The benchmark data file is missing or malformed."""


@dataclass(frozen=True)
class Record:
    id: str
    category: str
    turns: tuple[str, ...]
    suffix: str | None = None  # a fill-in-the-middle record: turns[0] is the prefix


def load_records(path: str | Path) -> list[Record]:
    path = Path(path)
    if path.is_dir():
        raise BenchDataError(f"{path} is a directory, not a data file: give the JSONL file itself")
    if not path.is_file():
        raise BenchDataError(f"data file not found: {path}")
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8").split("\n"), start=1):
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
            turns = raw["turns"]
            if isinstance(turns, str):
                turns = [turns]
            if not turns or not all(isinstance(t, str) and t.strip() for t in turns):
                raise ValueError("'turns' must be a non-empty list of non-empty strings")
            suffix = raw.get("suffix")  # a field name
            if suffix is not None and (not isinstance(suffix, str) or len(turns) != 1):
                raise ValueError("a fill-in-the-middle record has one turn (the prefix) and a 'suffix' string")
            records.append(Record(str(raw.get("id", number)), str(raw.get("category", "default")), tuple(turns), suffix))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise BenchDataError(f"{path}:{number}: not a benchmark record ({exc})") from None
    if not records:
        raise BenchDataError(f"{path} holds no records")
    return records


def select(records: list[Record], per_category: int | None = None, categories: list[str] | None = None) -> list[Record]:
    """The first `per_category` records of each category (in file order), optionally only some categories."""
    if categories:
        known = {r.category for r in records}
        unknown = sorted(set(categories) - known)
        if unknown:
            raise BenchDataError(f"unknown categories: {', '.join(unknown)}; the file has: {', '.join(sorted(known))}")
        records = [r for r in records if r.category in categories]
    if per_category is None:
        return records
    if per_category < 1:
        raise BenchDataError(f"--per-category must be >= 1, got {per_category}")
    taken: dict[str, int] = defaultdict(int)
    chosen = []
    for record in records:
        if taken[record.category] < per_category:
            taken[record.category] += 1
            chosen.append(record)
    return chosen
