"""Predicted outputs on a code-edit workload: the plain route, the plain route with the original
code as the prediction, and the speculative route (its default drafter, prompt lookup) without
one, through the official `openai` client against an in-process `specdec serve`.

Edits: functions of Python's own standard library (5 to 30 lines, with a parameter), each with
the request "rewrite this function, renaming parameter P to P_value", the function in a code
block in the prompt; the prediction is that code block. The three arms run edit by edit,
interleaved, greedy, on the default model; every arm must give the plain route's text.

Reports tokens/s (completion tokens over summed wall time) per arm and its ratio to the plain
route, target passes, and the prediction's accepted and rejected tokens (OpenAI's usage fields).

    python benchmarks/predicted_outputs.py --edits 24 --json benchmarks/results/predicted_outputs.json
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import time
from pathlib import Path

import openai

from specdec.config import SpeculativeConfig
from specdec.models import load_model
from specdec.server.config import LoadSchedule, RouteConfig, ServerConfig
from specdec.server.runtime import ServerThread, build_state

MODULES = ["textwrap", "string", "shlex", "fnmatch", "posixpath", "html", "colorsys", "bisect", "heapq", "statistics",
           "difflib", "calendar", "base64", "quopri", "glob", "gettext", "locale", "tokenize", "ast", "inspect"]


def edits(count: int) -> list[dict]:
    """The first `count` suitable functions, by module and name."""
    found = []
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        for name, function in sorted(inspect.getmembers(module, inspect.isfunction)):
            if function.__module__ != module_name or name.startswith("_"):
                continue
            try:
                source = inspect.getsource(function)
            except (OSError, TypeError):
                continue
            params = [p for p in inspect.signature(function).parameters if p not in ("self", "cls")]
            if not params or not 5 <= source.count("\n") <= 30 or source.startswith((" ", "@")):
                continue
            code = f"```python\n{source}```"
            old, new = params[0], f"{params[0]}_value"
            found.append({"id": f"{module_name}.{name}", "code": code,
                          "prompt": f"Rewrite this Python function, renaming the parameter {old} to {new}:\n\n{code}"})
            if len(found) == count:
                return found
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--edits", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=384)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    # The speculative route as `specdec serve` has it by default (prompt lookup, k = 4); one
    # request at a time, so the load schedule keeps its k.
    routes = (RouteConfig("specdec", SpeculativeConfig("ngram", 4), LoadSchedule.from_mapping({1: 4, 2: 0}), 4),
              RouteConfig("specdec-plain"))
    server = ServerThread(build_state(ServerConfig(routes=routes, max_model_len=2048), loaded=load_model())).start()
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=600)
    arms = {"plain route": ("specdec-plain", False), "plain route + prediction": ("specdec-plain", True),
            "speculative route (ngram k=4)": ("specdec", False)}
    totals = {arm: {"tokens": 0, "seconds": 0.0, "passes": 0, "accepted_prediction": 0, "rejected_prediction": 0}
              for arm in arms}
    rows, identical = [], 0
    try:
        work = edits(args.edits)
        client.chat.completions.create(model="specdec-plain", messages=[{"role": "user", "content": "Say hi."}], max_tokens=8)
        for i, edit in enumerate(work):
            texts, row = {}, {"id": edit["id"]}
            for arm, (route, predicted) in arms.items():
                extra = {"prediction": {"type": "content", "content": edit["code"]}} if predicted else {}
                start = time.perf_counter()
                out = client.chat.completions.create(model=route, messages=[{"role": "user", "content": edit["prompt"]}],
                                                     max_tokens=args.max_tokens, temperature=0, **extra)
                seconds = time.perf_counter() - start
                texts[arm] = out.choices[0].message.content
                total = totals[arm]
                total["tokens"] += out.usage.completion_tokens
                total["seconds"] += seconds
                total["passes"] += out.model_extra["speculation"]["target_forward_passes"]
                if predicted:
                    details = out.usage.completion_tokens_details
                    total["accepted_prediction"] += details.accepted_prediction_tokens
                    total["rejected_prediction"] += details.rejected_prediction_tokens
                row[arm] = {"tokens": out.usage.completion_tokens, "seconds": round(seconds, 3)}
            same = len(set(texts.values())) == 1
            identical += same
            row["identical"] = same
            rows.append(row)
            print(f"[{i + 1}/{len(work)}] {edit['id']}: {row['plain route']['tokens']} tokens, "
                  + ", ".join(f"{arm} {row[arm]['seconds']:.2f} s" for arm in arms) + ("" if same else "  DIFFERENT"))
    finally:
        server.stop()
    plain_rate = totals["plain route"]["tokens"] / totals["plain route"]["seconds"]
    summary = {}
    for arm, total in totals.items():
        rate = total["tokens"] / total["seconds"]
        summary[arm] = total | {"tokens_per_s": round(rate, 2), "vs_plain": round(rate / plain_rate, 3)}
        print(f"{arm}: {rate:.1f} tok/s ({rate / plain_rate:.2f}x plain), {total['passes']} target passes"
              + (f", prediction tokens accepted {total['accepted_prediction']}, rejected {total['rejected_prediction']}"
                 if "prediction" in arm else ""))
    print(f"identical: {identical}/{len(rows)}")
    if args.json:
        args.json.write_text(json.dumps({"edits": len(rows), "identical": identical, "max_tokens": args.max_tokens,
                                         "summary": summary, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
