"""`specdec tune`: measure speculative configurations on your own prompts and recommend one.

Every candidate (a drafter at each k, and adaptively at its largest k) and plain decoding run
every prompt, interleaved as in `specdec bench` (`run_bench`), greedy, with one loaded target.
For each candidate, per category and overall, the report sets the measured speedup beside the
speedup the acceptance model predicts from the same run's measured quantities (Leviathan et
al., 2023; `specdec.engine.estimate`):

- a, tested acceptance: accepted / (accepted + rejected steps), the probability that a drafted
  token the target tested was accepted. (accepted / drafted, the acceptance rate every surface
  reports, also counts the tokens drafted after a step's first rejection, never tested.)
- k_eff, effective k: drafted tokens per drafting step (a step that proposed at least one
  token). For a fixed-k model drafter it is k (less only where the token budget cut a draft);
  `ngram` proposes at most min(k, n - 1) tokens for a match of n, and adaptive k varies.
- plain step: plain decoding's verify_time_s / target_steps (same prompts, same scope).
- c, draft cost per token: (draft_time_s / drafted tokens) / plain step.
- v, verification cost: (verify_time_s / target_steps) / plain step, over all the
  candidate's steps.
- f, drafting fraction: drafting steps / target_steps. Steps with nothing drafted (no n-gram
  match, adaptive k switched off) commit one token.

    predicted tokens per step = f * (1 - a^(k_eff + 1)) / (1 - a) + (1 - f)
    predicted speedup         = predicted tokens per step / (f * k_eff * c + v)

With f = 1 this is exactly `expected_speedup(a, k_eff, c, v)`. The measured speedup is the
ratio of tokens/s with prefill and per-token overheads included, which the prediction leaves
out; the model also assumes every drafted token is accepted independently with probability a.

`draft_time_s` includes a model drafter's pass over the prompt at each request's first step, a
cost the measured speedup pays too. The recommendation is the candidate with the best measured
speedup, per category and overall, among those whose greedy output was identical to plain
decoding, or null (plain decoding) where none beats plain decoding.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

from specdec import methods as registry
from specdec.api import LLM, Message
from specdec.bench.data import Record
from specdec.bench.runner import Runner, RunResult, System, run_bench, specdec_runner
from specdec.config import SamplingParams, SpeculativeConfig
from specdec.drafters.head_files import shipped_dir
from specdec.engine.estimate import expected_tokens_per_step
from specdec.engine.stats import RequestStats
from specdec.errors import ConfigError
from specdec.models.loader import LoadedModel
from specdec.models.qlinear import QUANTIZED_FORMATS

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)
from matplotlib.lines import Line2D  # noqa: E402

PLAIN = "plain"
OVERALL = "overall"


def base_methods() -> list[dict[str, Any]]:
    """The drafters tuned when none are named, as the registry gives them (each method's `tuned`)."""
    return [{"method": m.name, **m.tuned} for m in registry.methods() if m.tuned is not None]


def default_methods(target) -> list[dict[str, Any]]:
    """The base methods for this target: without the int8 self-draft when the target's own weights
    are int8 or int4 already (such a copy costs as much as the target); with the methods that
    need a trained head (EAGLE, the hybrid, Medusa) when such a head ships for the target; with
    its known draft model when it has one."""
    quantized = target.backend.weight_format.startswith(QUANTIZED_FORMATS)
    methods = [m for m in base_methods() if not (quantized and m.get("quantization") == "int8")]
    heads = [{"method": m.name} for m in registry.methods()
             if m.head is not None and shipped_dir(m.head, target.name) is not None]
    return methods + registry.target_methods(target) + heads


@dataclass(frozen=True)
class Candidate:
    """One configuration to measure: `name` is its label, `drafter` the label without k."""

    name: str
    drafter: str
    config: SpeculativeConfig

    @property
    def k(self) -> int:
        return self.config.num_speculative_tokens  # type: ignore[return-value]  # set by the config


def parse_method(text: str) -> dict[str, Any]:
    """A method as given on the command line: a registered name, or a JSON object."""
    text = text.strip()
    if not text.startswith("{"):
        return {"method": text}
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--methods {text!r} is not valid JSON: {exc.msg} at column {exc.colno}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--methods {text!r} must be a method name or a JSON object")
    return data


def parse_ks(text: str) -> list[int]:
    """'1,2,4' -> [1, 2, 4]."""
    try:
        ks = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise ConfigError(f"--k must be a comma-separated list of integers, got {text!r}") from None
    if not ks or ks[0] < 1:
        raise ConfigError(f"--k values must be integers >= 1, got {text!r}")
    return ks


def build_candidates(methods: list[dict[str, Any]], ks: list[int] | None = None, adaptive: bool = True,
                     trees: bool = True) -> list[Candidate]:
    """Every method at every k (its default grid unless `ks`, or its own num_speculative_tokens),
    adaptively at its largest k, and, for a method that drafts trees and is given neither a k
    nor a tree, each of its registered trees (`tune_trees`) unless `trees` is off; for a head
    given no k, tree or floor, its chains under a confidence floor (`tune_floors`). Raises
    ConfigError for an invalid method."""
    if not methods:
        raise ConfigError("give at least one method to tune")
    candidates = []
    for method in methods:
        if not isinstance(method.get("method"), str):
            raise ConfigError(f"a method needs a 'method' name: {json.dumps(method)}")
        if "adaptive" in method:
            raise ConfigError("'adaptive' is not set per method: tune measures each method adaptively too (--no-adaptive turns that off)")
        registered = registry.method(method["method"])
        base = {key: value for key, value in method.items() if key != "num_speculative_tokens"}
        if "num_speculative_tokens" in method:
            grid = [method["num_speculative_tokens"]]
        else:
            grid = list(ks) if ks else list(registered.tune_ks)
        configs = [SpeculativeConfig.from_dict({**base, "num_speculative_tokens": k}) for k in grid]
        if adaptive:
            configs.append(SpeculativeConfig.from_dict({**base, "num_speculative_tokens": max(grid), "adaptive": True}))
        if trees and "num_speculative_tokens" not in method and "tree_width" not in method:
            configs += [SpeculativeConfig.from_dict({**base, "num_speculative_tokens": k, "tree_width": width,
                                                     "tree_nodes": nodes}) for k, width, nodes in registered.tune_trees]
        if not {"num_speculative_tokens", "draft_confidence", "draft_p_min", "tree_width"} & set(method):
            configs += [SpeculativeConfig.from_dict({**base, **floor}) for floor in registered.tune_floors]
        # Names as every specdec table gives them ("draft_model self int8 k=4 adaptive", "eagle
        # k=3 tree 2x6"); the drafter is the name without k (a tree's shape kept).
        candidates += [Candidate(c.label, drafter_label(c.label), c) for c in configs]
    names = [c.name for c in candidates]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ConfigError(f"a method is given twice: {', '.join(repeated)}")
    return candidates


def drafter_label(label: str) -> str:
    """A candidate's name without its k: "eagle k=3 tree 2x6" -> "eagle tree 2x6", "eagle k=3
    conf>=0.2" -> "eagle conf>=0.2", "draft_model m k=6 p>=0.5" -> "draft_model m p>=0.5"."""
    found = re.match(r"(.*?) k=\d+(.*)", label)
    if not found:
        return label
    shape = re.findall(r" (head k=\w+|tree \d+x\d+|conf>=[\d.e-]+|p>=[\d.e-]+|lookup>=\d+)", found.group(2))
    return " ".join([found.group(1), *shape])


def pin_candidates(candidates: list[Candidate], target: LoadedModel) -> list[Candidate]:
    """Each candidate with what its config leaves to the target made explicit (layer_skip without
    `layers` or `profile` means whatever profile ships for the model), so that the recommendation
    names what was measured."""
    return [dataclasses.replace(c, config=registry.pinned(c.config, target)) for c in candidates]


def _recording(run: Runner, sink: list[RequestStats]) -> Runner:
    def wrapped(messages: list[Message]) -> RunResult:
        result = run(messages)
        if result.stats is not None:
            sink.append(result.stats)
        return result

    return wrapped


def measure(
    target: LoadedModel,
    candidates: list[Candidate],
    records: list[Record],
    params: SamplingParams,
    on_prompt: Callable[[Record], None] | None = None,
    warmup: list[Message] | None = None,
) -> tuple[dict[str, Any], dict[str, dict[str, RequestStats]]]:
    """Run plain decoding and every candidate on every record, interleaved (`run_bench`).

    Returns run_bench's tallies and the summed RequestStats per scope (each category, and
    OVERALL) and system, which hold the draft and verification times the prediction needs.
    """
    if not records:
        raise ConfigError("no prompts to tune on")
    if not params.greedy:
        raise ConfigError("tune measures greedy decoding")
    # No prefix cache: every candidate prefills each prompt whole, timed alike.
    plain = LLM(loaded=target, prefix_cache_mb=0)
    llms = {c.name: LLM(speculative_config=c.config, loaded=target, prefix_cache_mb=0) for c in candidates}
    sinks: dict[str, list[RequestStats]] = {name: [] for name in [PLAIN, *llms]}
    systems = [System(PLAIN, _recording(specdec_runner(plain, params, False), sinks[PLAIN]))]
    systems += [System(name, _recording(specdec_runner(llm, params, True), sinks[name]), PLAIN) for name, llm in llms.items()]
    if warmup is not None:
        for system in systems:  # the first generation of a process pays one-off allocation costs
            system.run(warmup)
        for sink in sinks.values():
            sink.clear()
    stats: dict[str, dict[str, RequestStats]] = defaultdict(lambda: {name: RequestStats() for name in sinks})

    def collect(record: Record) -> None:
        for name, sink in sinks.items():
            for request in sink:
                stats[record.category][name].merge(request)
                stats[OVERALL][name].merge(request)
            sink.clear()
        if on_prompt is not None:
            on_prompt(record)

    raw = run_bench(systems, records, on_prompt=collect)
    return raw, dict(stats)


def predict(config: RequestStats, plain: RequestStats) -> dict[str, Any]:
    """The measured quantities of one candidate in one scope, and the speedup the acceptance
    model predicts from them (module docstring)."""
    plain_step_s = plain.verify_time_s / plain.target_steps if plain.target_steps else 0.0
    steps = config.target_steps
    if not steps or plain_step_s <= 0:
        return {"plain_step_s": plain_step_s, "target_steps": steps, "predicted_speedup": None}
    drafting_steps = steps - config.undrafted_steps
    f = drafting_steps / steps
    v = config.verify_time_s / steps / plain_step_s
    out: dict[str, Any] = {
        "plain_step_s": plain_step_s,
        "target_steps": steps,
        "drafting_steps": drafting_steps,
        "drafted_tokens": config.drafted_tokens,
        "accepted_tokens": config.accepted_tokens,
        "rejected_steps": config.rejected_steps,
        "draft_time_s": config.draft_time_s,
        "verify_time_s": config.verify_time_s,
        "drafting_fraction": f,
        "verify_cost": v,
    }
    if config.drafted_tokens:
        a = config.tested_acceptance
        k_eff = config.drafted_tokens / drafting_steps
        c = config.draft_time_s / config.drafted_tokens / plain_step_s
        tokens_per_step = f * expected_tokens_per_step(a, k_eff) + (1 - f)  # type: ignore[arg-type]  # k may be fractional
        cost = f * k_eff * c + v
    else:  # nothing drafted: every step commits one token
        a = k_eff = c = None
        tokens_per_step = 1.0
        cost = config.draft_time_s / steps / plain_step_s + v
    out.update(
        acceptance=a, k_eff=k_eff, draft_cost=c,
        predicted_tokens_per_step=tokens_per_step, predicted_speedup=tokens_per_step / cost,
    )
    return out


def _scope(measured: dict[str, Any], config: RequestStats, plain: RequestStats) -> dict[str, Any]:
    entry = {key: measured.get(key) for key in (
        "prompts", "identical", "tokens", "tokens_per_s", "tokens_per_s_baseline", "speedup",
        "acceptance_rate", "mean_accepted_length", "per_position_acceptance",
        "target_tokens_per_output_token", "cpu_s_per_output_token",
    )}
    entry.update(predict(config, plain))
    predicted, speedup = entry["predicted_speedup"], entry["speedup"]
    entry["relative_difference"] = predicted / speedup - 1 if predicted is not None and speedup else None
    return entry


def compact(config: SpeculativeConfig) -> dict[str, Any]:
    """The config's keys that differ from the defaults (method and k always)."""
    defaults = config.defaults()
    return {
        key: value for key, value in config.to_dict().items()
        if key in ("method", "num_speculative_tokens") or value != defaults.get(key)
    }


def analyse(
    candidates: list[Candidate], raw: dict[str, Any], stats: dict[str, dict[str, RequestStats]], meta: dict[str, Any]
) -> dict[str, Any]:
    """The tune result: every candidate's measured and predicted numbers per scope, the plain
    baseline, and the recommendation."""
    categories = sorted(raw["categories_by_system"])
    configs = []
    for c in candidates:
        entry: dict[str, Any] = {
            "name": c.name, "drafter": c.drafter, "k": c.k, "adaptive": c.config.adaptive,
            "speculative_config": compact(c.config),
            OVERALL: _scope(raw["overall_by_system"][c.name], stats[OVERALL][c.name], stats[OVERALL][PLAIN]),
            "categories": {
                cat: _scope(raw["categories_by_system"][cat][c.name], stats[cat][c.name], stats[cat][PLAIN])
                for cat in categories
            },
        }
        configs.append(entry)

    def plain_scope(measured: dict[str, Any], s: RequestStats) -> dict[str, Any]:
        return {**measured, "plain_step_s": s.verify_time_s / s.target_steps if s.target_steps else None}

    plain = {
        OVERALL: plain_scope(raw["overall_by_system"][PLAIN], stats[OVERALL][PLAIN]),
        "categories": {cat: plain_scope(raw["categories_by_system"][cat][PLAIN], stats[cat][PLAIN]) for cat in categories},
    }
    result = dict(meta)
    result.update(categories=categories, plain=plain, configs=configs)
    result["recommended"] = recommend(configs, categories)
    return result


def recommend(configs: list[dict[str, Any]], categories: list[str]) -> dict[str, Any]:
    """Per category and overall, the config with the best measured speedup among those whose
    output was identical to plain decoding, or None (plain decoding) where none beats it; in
    the format `SpeculativeConfig.from_file(path, category)` loads."""

    def pick(scope_of: Callable[[dict[str, Any]], dict[str, Any]]) -> dict[str, Any] | None:
        # Greedy speculation is lossless: a config whose output differed from plain decoding on
        # some prompt is a bug to report, not a candidate.
        scored = [
            (scope_of(c)["speedup"], c) for c in configs
            if scope_of(c).get("speedup") is not None and scope_of(c)["identical"] == scope_of(c)["prompts"]
        ]
        if not scored:
            return None
        speedup, best = max(scored, key=lambda pair: pair[0])
        return best if speedup > 1.0 else None

    def measured(best: dict[str, Any] | None, scope: dict[str, Any] | None) -> dict[str, Any]:
        if best is None or scope is None:
            return {"name": "plain decoding", "speedup": 1.0}
        return {"name": best["name"], "speedup": scope["speedup"], "predicted_speedup": scope["predicted_speedup"],
                "acceptance_rate": scope["acceptance_rate"], "mean_accepted_length": scope["mean_accepted_length"]}

    overall = pick(lambda c: c[OVERALL])
    per_category = {cat: pick(lambda c, cat=cat: c["categories"][cat]) for cat in categories}
    return {
        "speculative_config": overall["speculative_config"] if overall else None,
        "per_category": {cat: best["speculative_config"] if best else None for cat, best in per_category.items()},
        "measured": {
            OVERALL: measured(overall, overall[OVERALL] if overall else None),
            "per_category": {cat: measured(best, best["categories"][cat] if best else None) for cat, best in per_category.items()},
        },
    }


# Report files ---------------------------------------------------------------------------------


def _num(value: Any, spec: str = ".2f", suffix: str = "") -> str:
    return "-" if value is None else format(value, spec) + suffix


def _rel(value: Any) -> str:
    return "-" if value is None else f"{value * 100:+.0f}%"


CONFIG_COLUMNS = (
    "config", "identical", "tok/s", "speedup", "predicted", "pred. vs meas.", "target tok/tok", "CPU ms/tok", "accept",
    "mean len", "pred. len", "k_eff", "drafting", "c (draft/token)", "v (verify)",
)


def config_row(c: dict[str, Any], scope: dict[str, Any]) -> list[str]:
    """One table row: the columns of CONFIG_COLUMNS, formatted."""
    return [
        c["name"], f"{scope['identical']}/{scope['prompts']}", _num(scope["tokens_per_s"], ".1f"),
        _num(scope["speedup"], ".2f", "x"), _num(scope.get("predicted_speedup"), ".2f", "x"),
        _rel(scope.get("relative_difference")), _num(scope.get("target_tokens_per_output_token")),
        _num(None if scope.get("cpu_s_per_output_token") is None else scope["cpu_s_per_output_token"] * 1000, ".1f"),
        _num(scope.get("acceptance_rate")), _num(scope.get("mean_accepted_length")),
        _num(scope.get("predicted_tokens_per_step")), _num(scope.get("k_eff")), _num(scope.get("drafting_fraction")), _num(scope.get("draft_cost"), ".3f"),
        _num(scope.get("verify_cost")),
    ]


def _table(header: tuple[str, ...] | list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


def recommendation_rows(result: dict[str, Any]) -> list[list[str]]:
    """category, recommended config, its measured and predicted speedup, plain tok/s."""
    measured = result["recommended"]["measured"]
    rows = []
    for cat in [*result["categories"], OVERALL]:
        m = measured[OVERALL] if cat == OVERALL else measured["per_category"][cat]
        plain = result["plain"][OVERALL] if cat == OVERALL else result["plain"]["categories"][cat]
        rows.append([
            f"**{cat}**" if cat == OVERALL else cat, m["name"], _num(m["speedup"], ".2f", "x"),
            _num(m.get("predicted_speedup"), ".2f", "x"), _num(plain["tokens_per_s"], ".1f"), str(plain["prompts"]),
        ])
    return rows


RECOMMENDATION_COLUMNS = ("category", "recommended", "measured speedup", "predicted", "plain tok/s", "prompts")

DEFINITIONS = """\
Speedup: tokens/s over plain decoding of the same prompts, measured interleaved in one process
(prefill included). Predicted: the acceptance model (`specdec.engine.estimate`) fed this run's
measured quantities: tested acceptance a = accepted / (accepted + steps with a rejection),
effective k (k_eff: drafted tokens per drafting step; for
`ngram`, which proposes at most min(k, n - 1) tokens for a match of n, and for adaptive k it is
below k), drafting fraction f (steps that drafted anything), draft cost per token
c = (draft_time_s / drafted tokens) / plain step, and verification cost
v = (verify_time_s / target steps) / plain step, where plain step = plain decoding's
verify_time_s / target steps:

    predicted = (f * (1 - a^(k_eff + 1)) / (1 - a) + 1 - f) / (f * k_eff * c + v)

which is expected_speedup(a, k_eff, c, v) when every step drafts (f = 1). "pred. vs meas." is
predicted / measured - 1. Mean len: committed tokens per target step, counting the target's own
token; pred. len: the numerator above, its prediction. Where pred. len differs from mean len,
the acceptance model is what misses, not the costs: it takes every tested token to be accepted
independently with probability a, while acceptance within a step is correlated. c includes a model drafter's pass over each prompt. The recommendation is the
config with the best measured speedup among those with output identical to plain decoding, or
plain decoding where none beats it.

What the speedup costs: target tok/tok is the tokens the target processed after prefill, drafts
included, per committed token (1.0 for plain decoding: the rest are rejected drafts); CPU ms/tok is
the process's CPU time (all threads, prefill included) per generated token. Speculation raises
both while it lowers the time per token.
"""


def markdown(result: dict[str, Any], plots: list[str]) -> str:
    lines = [
        f"# specdec tune: {result['model']}",
        "",
        f"Data: `{result['data']}`, {result['prompts']} prompts, {result['max_tokens']} tokens max per turn, "
        f"greedy, {result['device']}.",
        "",
        "## Recommendation",
        "",
        *_table(RECOMMENDATION_COLUMNS, recommendation_rows(result)),
        "",
        "`recommended.json` holds these configs: `specdec generate --speculative-config recommended.json`, "
        "or `SpeculativeConfig.from_file(path, category=...)`.",
        "",
        "## Overall",
        "",
        *_table(CONFIG_COLUMNS, [config_row(c, c[OVERALL]) for c in result["configs"]]),
        "",
        DEFINITIONS,
    ]
    for cat in result["categories"]:
        plain = result["plain"]["categories"][cat]
        lines += [
            f"## {cat}", "", f"Plain decoding: {_num(plain['tokens_per_s'], '.1f')} tokens/s, {plain['prompts']} prompts.", "",
            *_table(CONFIG_COLUMNS, [config_row(c, c["categories"][cat]) for c in result["configs"]]), "",
        ]
    lines += [f"![{p}]({p})" for p in plots]
    return "\n".join(lines) + "\n"


def _by_drafter(result: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    groups: dict[str, list[dict[str, Any]]] = {}
    for c in result["configs"]:
        groups.setdefault(c["drafter"], []).append(c)
    return groups


def plot_speedup_by_k(result: dict[str, Any], path: Path) -> None:
    """Overall speedup against k per drafter: measured solid, predicted dashed, adaptive k as
    markers at its largest k (filled: measured, hollow: predicted)."""
    fig, ax = plt.subplots(figsize=(8.5, 4.5))
    handles = []
    for i, (drafter, configs) in enumerate(_by_drafter(result).items()):
        color = f"C{i}"
        fixed = sorted((c for c in configs if not c["adaptive"]), key=lambda c: c["k"])
        ks = [c["k"] for c in fixed]
        ax.plot(ks, [c[OVERALL]["speedup"] for c in fixed], "-o", color=color)
        predicted = [c[OVERALL].get("predicted_speedup") for c in fixed]
        ax.plot(ks, [float("nan") if p is None else p for p in predicted], "--", color=color)
        for c in configs:
            if c["adaptive"]:
                ax.plot([c["k"]], [c[OVERALL]["speedup"]], "*", color=color, markersize=14)
                if c[OVERALL].get("predicted_speedup") is not None:
                    ax.plot([c["k"]], [c[OVERALL]["predicted_speedup"]], "*", color=color, markersize=14, markerfacecolor="none")
        handles.append(Line2D([], [], color=color, linewidth=6, label=drafter))
    handles += [
        Line2D([], [], color="gray", marker="o", label="measured"),
        Line2D([], [], color="gray", linestyle="--", label="predicted"),
        Line2D([], [], color="gray", marker="*", markersize=12, linestyle="none", label="adaptive, measured"),
        Line2D([], [], color="gray", marker="*", markersize=12, linestyle="none", markerfacecolor="none", label="adaptive, predicted"),
        Line2D([], [], color="black", linewidth=0.8, label="plain decoding"),
    ]
    ax.axhline(1.0, color="black", linewidth=0.8)
    all_ks = sorted({c["k"] for c in result["configs"]})
    ax.set_xticks(all_ks)
    ax.set_xlabel("k (most tokens drafted per step; adaptive: its largest)")
    ax.set_ylabel("speedup over plain decoding")
    ax.set_title(f"{result['model']}: speedup by k ({result['prompts']} prompts)")
    ax.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_acceptance_by_position(result: dict[str, Any], path: Path) -> None:
    """Per drafter, at its largest fixed k: the fraction of tokens drafted at each position
    that were accepted (overall)."""
    fig, ax = plt.subplots(figsize=(6, 4))
    longest = 0
    for i, (drafter, configs) in enumerate(_by_drafter(result).items()):
        fixed = [c for c in configs if not c["adaptive"]] or configs
        c = max(fixed, key=lambda c: c["k"])
        per_position = c[OVERALL].get("per_position_acceptance") or []
        if per_position:
            longest = max(longest, len(per_position))
            ax.plot(range(1, len(per_position) + 1), per_position, "-o", color=f"C{i}", label=c["name"])
    ax.set_xticks(range(1, longest + 1))
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance")
    ax.set_ylim(0, 1.05)
    ax.set_title("acceptance by draft position")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(result: dict[str, Any], directory: Path) -> list[Path]:
    """Write recommended.json, tune.json, report.md, speedup_by_k.png and
    acceptance_by_position.png into `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    plots = ["speedup_by_k.png", "acceptance_by_position.png"]
    plot_speedup_by_k(result, directory / plots[0])
    plot_acceptance_by_position(result, directory / plots[1])
    (directory / "recommended.json").write_text(json.dumps(result["recommended"], indent=2) + "\n")
    (directory / "tune.json").write_text(json.dumps(result, indent=2) + "\n")
    (directory / "report.md").write_text(markdown(result, plots))
    return [directory / name for name in ("recommended.json", "tune.json", "report.md", *plots)]
