"""Report files for a benchmark: Markdown tables and PNG plots (matplotlib, no display)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)


def plot_speedup_by_category(report: dict[str, Any], path: Path) -> None:
    """Bars: speedup over its own plain decoding, per category, for every non-baseline system."""
    systems = [name for name, base in report["baselines"].items() if base is not None]
    categories = sorted(report["systems_by_category"])
    width = 0.8 / max(1, len(systems))
    fig, ax = plt.subplots(figsize=(max(6, len(categories) * 0.7) + (3 if len(systems) > 2 else 0), 4))
    for i, name in enumerate(systems):
        values = [report["systems_by_category"][c][name]["speedup"] for c in categories]
        ax.bar([x + i * width for x in range(len(categories))], values, width, label=_label(report, name))
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([x + width * (len(systems) - 1) / 2 for x in range(len(categories))], categories, rotation=45, ha="right")
    ax.set_ylabel("speedup over own plain decoding")
    ax.set_title(f"{report['model']}: speedup over plain decoding by category")
    if len(systems) > 2:  # outside the axes, where it hides no bar
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    else:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _label(report: dict[str, Any], name: str) -> str:
    """The primary speculative system is called "specdec" in tables; plots name its config."""
    return f"specdec {report['method_label']}" if name == "specdec" else name


def plot_acceptance_by_position(report: dict[str, Any], path: Path) -> None:
    """Line: fraction of drafted tokens accepted at each draft position, overall and per
    category; with several speculative systems, overall per system."""
    fig, ax = plt.subplots(figsize=(6, 4))
    speculative = [n for n, s in report["systems"].items() if s.get("per_position_acceptance")]
    if len(speculative) > 1:
        lines = [(name, report["systems"][name]) for name in speculative]
    else:
        lines = [("overall", report["overall"])] + sorted(report["categories"].items())
    positions = max((len(s.get("per_position_acceptance") or []) for _, s in lines), default=0)
    ax.set_xticks(range(1, positions + 1))
    for name, stats in lines:
        per_position = stats.get("per_position_acceptance") or []
        if per_position:
            style = {"linewidth": 3, "color": "black"} if name == "overall" else {"linewidth": 1.5, "alpha": 0.8}
            ax.plot(range(1, len(per_position) + 1), per_position, marker="o", label=_label(report, name), **style)
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"acceptance by draft position ({report['method_label']})")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _costs(summary: dict[str, Any]) -> str:
    """Two cells: target tokens per output token, and CPU milliseconds per output token."""
    target, cpu = summary.get("target_tokens_per_output_token"), summary.get("cpu_s_per_output_token")
    return f"{'-' if target is None else format(target, '.2f')} | {'-' if cpu is None else format(cpu * 1000, '.1f')}"


def markdown(report: dict[str, Any], plots: list[str]) -> str:
    lines = [
        f"# specdec bench: {report['model']}, {report['method_label']}",
        "",
        f"Data: `{report['data']}`, {report['max_tokens']} tokens max per turn, greedy. "
        "Speedup = tokens/s over the system's own plain decoding, measured interleaved in one process.",
        "",
        "| category | prompts | identical | plain tok/s | spec tok/s | speedup | acceptance | mean accepted length "
        "| target tokens per token | CPU ms per token |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in sorted(report["categories"].items()) + [("**overall**", report["overall"])]:
        lines.append(
            f"| {name} | {s['prompts']} | {s['identical']}/{s['prompts']} | {s['tokens_per_s_baseline']:.1f} | "
            f"{s['tokens_per_s']:.1f} | {s['speedup']:.2f}x | {s.get('acceptance_rate', 0):.2f} | {s.get('mean_accepted_length', 0):.2f} "
            f"| {_costs(s)} |"
        )
    if len(report["systems"]) > 2:
        lines += ["", "| system | tokens/s | speedup over own plain | identical | acceptance | mean accepted length "
                      "| target tokens per token | CPU ms per token |",
                  "|---|---|---|---|---|---|---|---|"]
        for name, s in report["systems"].items():
            speedup = f"{s['speedup']:.2f}x" if "speedup" in s else "(baseline)"
            identical = f"{s['identical']}/{s['prompts']}" if "identical" in s else "-"
            accept = f"{s['acceptance_rate']:.2f} | {s['mean_accepted_length']:.2f}" if "acceptance_rate" in s else "- | -"
            lines.append(f"| {name} | {s['tokens_per_s']:.1f} | {speedup} | {identical} | {accept} | {_costs(s)} |")
        compared = [n for n, base in report["baselines"].items() if base is not None]
        lines += ["", "Speedup over own plain decoding, per category:", "",
                  "| category | " + " | ".join(compared) + " |", "|---|" + "---|" * len(compared)]
        for category, systems in sorted(report["systems_by_category"].items()):
            lines.append(f"| {category} | " + " | ".join(f"{systems[n]['speedup']:.2f}x" for n in compared) + " |")
    lines.append("")
    lines += [f"![{p}]({p})" for p in plots]
    return "\n".join(lines) + "\n"


def write_report_files(report: dict[str, Any], directory: Path) -> list[Path]:
    """Write report.md, speedup_by_category.png and acceptance_by_position.png into `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    plot_speedup_by_category(report, directory / "speedup_by_category.png")
    plot_acceptance_by_position(report, directory / "acceptance_by_position.png")
    names = ["speedup_by_category.png", "acceptance_by_position.png"]
    (directory / "report.md").write_text(markdown(report, names))
    return [directory / "report.md", *(directory / n for n in names)]
