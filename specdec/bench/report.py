"""The benchmark report: JSON with the primary comparison on top, and terminal tables. Beside
each speedup, what it costs: the tokens the target processed per output token (target tok/tok)
and the process CPU time per output token (CPU ms/tok)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

PLAIN = "specdec plain"
SPEC = "specdec"


def build_report(raw: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    """`overall` and `categories` hold specdec speculative against specdec plain; `peers` the rest."""
    report = dict(meta)
    report["overall"] = raw["overall_by_system"][SPEC]
    report["categories"] = {cat: systems[SPEC] for cat, systems in raw["categories_by_system"].items()}
    report["systems"] = raw["overall_by_system"]
    report["systems_by_category"] = raw["categories_by_system"]
    report["systems_by_turn"] = raw["turns_by_system"]  # "1", "2", ...: every system on each turn of the records
    report["baselines"] = {name: info["baseline"] for name, info in raw["systems"].items()}
    report["prompts"] = raw["prompts"]
    return report


def _fmt(value: Any, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def _cpu_ms(summary: dict[str, Any]) -> str:
    """Process CPU milliseconds per generated token."""
    value = summary.get("cpu_s_per_output_token")
    return _fmt(None if value is None else value * 1000, ".1f")


def print_report(report: dict[str, Any], console: Console) -> None:
    prompt_table = Table(title="Per prompt (specdec vs its plain decoding)", show_lines=False)
    for col in ("id", "category", "tokens", "plain tok/s", "spec tok/s", "speedup", "identical", "accept", "mean len"):
        prompt_table.add_column(col, justify="right" if col not in ("id", "category") else "left", no_wrap=True)
    for p in report["prompts"]:
        s = p["systems"][SPEC]
        prompt_table.add_row(
            p["id"], p["category"], str(s["tokens"]), _fmt(s.get("tokens_per_s_baseline"), ".1f"), _fmt(s["tokens_per_s"], ".1f"),
            _fmt(s.get("speedup")) + "x", "yes" if s.get("identical") else "NO",
            _fmt(s.get("acceptance_rate")), _fmt(s.get("mean_accepted_length")),
        )
    console.print(prompt_table)

    table = Table(title=f"specdec bench: {report['model']}, {report['method_label']}, {report['max_tokens']} tokens max")
    for col in ("category", "prompts", "identical", "tokens", "plain tok/s", "spec tok/s", "speedup", "accept", "mean len",
                "target tok/tok", "CPU ms/tok"):
        table.add_column(col, justify="left" if col == "category" else "right", no_wrap=True)
    rows = sorted(report["categories"].items()) + [("overall", report["overall"])]
    for name, s in rows:
        table.add_row(
            name, str(s["prompts"]), f"{s['identical']}/{s['prompts']}", str(s["tokens"]),
            _fmt(s["tokens_per_s_baseline"], ".1f"), _fmt(s["tokens_per_s"], ".1f"), _fmt(s["speedup"]) + "x",
            _fmt(s.get("acceptance_rate")), _fmt(s.get("mean_accepted_length")),
            _fmt(s.get("target_tokens_per_output_token")), _cpu_ms(s),
        )
    console.print(table)

    if len(report["systems"]) > 2:
        peers = Table(title="All systems, same prompts, same process (speedup and identity against each one's own plain decoding)")
        for col in ("system", "tokens", "tok/s", "decode tok/s", "first token s", "speedup", "identical", "target tok/tok",
                    "CPU ms/tok"):
            peers.add_column(col, justify="left" if col == "system" else "right", no_wrap=True)
        for name, s in report["systems"].items():
            peers.add_row(
                name, str(s["tokens"]), _fmt(s["tokens_per_s"], ".1f"), _fmt(s.get("decode_tokens_per_s"), ".1f"),
                _fmt(s.get("ttft_s"), ".3f"),
                (_fmt(s["speedup"]) + "x") if "speedup" in s else "(baseline)",
                f"{s['identical']}/{s['prompts']}" if "identical" in s else "-",
                _fmt(s.get("target_tokens_per_output_token")), _cpu_ms(s),
            )
        console.print(peers)
        compared = [n for n, base in report["baselines"].items() if base is not None]
        by_category = Table(title="Speedup over own plain decoding, per category")
        by_category.add_column("category", no_wrap=True)
        for name in compared:
            by_category.add_column(name, justify="right")
        for category, systems in sorted(report["systems_by_category"].items()):
            by_category.add_row(category, *(_fmt(systems[n]["speedup"]) + "x" for n in compared))
        console.print(by_category)
