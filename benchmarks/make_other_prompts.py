"""Build benchmarks/other_prompts.jsonl: prompts that are not Spec-Bench's, from real public
text on any Python install: functions of the standard library (code tasks) and package
descriptions from installed distributions' metadata (summaries). Run once; the JSONL is
committed so that every machine benchmarks the same prompts."""

from __future__ import annotations

import inspect
import json
import importlib
import importlib.metadata
from pathlib import Path

CODE = [
    ("textwrap", "dedent", "Explain what this Python function does, step by step:\n\n{src}"),
    ("shlex", "quote", "Add type hints and a docstring to this Python function, and return the full function:\n\n{src}"),
    ("base64", "b32encode", "Rewrite this Python function to be easier to read, keeping its behaviour:\n\n{src}"),
    ("fnmatch", "translate", "Write three unit tests with pytest for this function:\n\n{src}"),
    ("json.decoder", "py_scanstring", "Explain this code and point out any edge cases:\n\n{src}"),
    ("string", "capwords", "Translate this Python function into JavaScript:\n\n{src}"),
]
SUMMARIES = ["rich", "typer", "click", "hypothesis", "safetensors", "accelerate"]


def main() -> None:
    out = []
    for module, name, template in CODE:
        src = inspect.getsource(getattr(importlib.import_module(module), name))
        out.append({"id": f"code-{module}.{name}", "category": "code", "turns": [template.format(src=src)]})
    for dist in SUMMARIES:
        text = importlib.metadata.metadata(dist).get_payload() or ""
        text = text.strip()[:2500]
        out.append({"id": f"summary-{dist}", "category": "summary", "turns": [f"Summarise this project description in a short paragraph:\n\n{text}"]})
    path = Path(__file__).with_name("other_prompts.jsonl")
    path.write_text("".join(json.dumps(r) + "\n" for r in out))
    print(f"wrote {len(out)} prompts to {path}")


if __name__ == "__main__":
    main()
