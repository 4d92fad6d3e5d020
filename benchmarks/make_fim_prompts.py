"""Build benchmarks/fim_prompts.jsonl and fim_prompts_held_out.jsonl: fill-in-the-middle prompts
(an editor's completion at a cursor) cut from real public code on any Python install, the
standard library's modules. Each record is the code before the cursor (`turns[0]`), the code
after it (`suffix`) and the code that was there (`middle`, for reference); three categories:
`line` (one statement), `block` (2-6 lines) and `body` (a function's whole body after its
docstring). The held-out file cuts from other modules, to check that a setting chosen on the
first holds. Run once; the JSONL files are committed so that every machine benchmarks the same
prompts (the source is the CPython that made them, see `python`)."""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import sys
from pathlib import Path

DEV = ["heapq", "bisect", "colorsys", "calendar", "statistics", "glob", "fractions", "ipaddress"]
HELD_OUT = ["difflib", "csv", "configparser", "zipfile", "tarfile", "gettext"]
PER_CATEGORY = 8
BEFORE, AFTER = 60, 30  # lines of context kept before and after the cursor


def bodies(module: str) -> list[tuple[list[str], int, int]]:
    """(source lines, first, last) of each function body of 3-15 lines after its docstring."""
    lines = inspect.getsource(importlib.import_module(module)).splitlines(keepends=True)
    out = []
    for node in ast.walk(ast.parse("".join(lines))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body[1:] if ast.get_docstring(node) is not None else node.body
            if body:
                first, last = body[0].lineno - 1, body[-1].end_lineno  # 0-based, exclusive end
                if 3 <= last - first <= 15 and all(line.strip() for line in lines[first:last]):
                    out.append((lines, first, last))
    return sorted(out, key=lambda b: b[1])


def record(module: str, category: str, lines: list[str], start: int, end: int) -> dict:
    return {"id": f"fim-{category}-{module}-{start + 1}", "category": category,
            "turns": ["".join(lines[max(0, start - BEFORE):start])], "suffix": "".join(lines[end:end + AFTER]),
            "middle": "".join(lines[start:end])}


def build(modules: list[str]) -> list[dict]:
    found = [(m, b) for m in modules for b in bodies(m)]
    step = max(1, len(found) // PER_CATEGORY)
    out = []
    for c, category in enumerate(("line", "block", "body")):
        for m, (lines, first, last) in found[c::step][:PER_CATEGORY]:
            if category == "line":
                start, end = first + 1, first + 2  # a statement inside the body, with code on both sides
            elif category == "block":
                start, end = first, min(last, first + 6)
            else:
                start, end = first, last
            out.append(record(m, category, lines, start, end))
    return out


def main() -> None:
    here = Path(__file__).parent
    for name, modules in (("fim_prompts.jsonl", DEV), ("fim_prompts_held_out.jsonl", HELD_OUT)):
        out = build(modules)
        (here / name).write_text("".join(json.dumps(r) + "\n" for r in out), encoding="utf-8")
        print(f"wrote {len(out)} prompts to {here / name} (Python {sys.version.split()[0]})")


if __name__ == "__main__":
    main()
