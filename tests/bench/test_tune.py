"""specdec tune: the candidate grid, the prediction from measured quantities, the recommendation
and its file, and the command end to end on the real default model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from filelock import FileLock

from specdec.bench import tune
from specdec.cli.main import speculative_config
from specdec.config import SamplingParams, SpeculativeConfig
from specdec.engine.stats import RequestStats
from specdec.errors import ConfigError
from specdec.models.loader import LoadedModel

INT8_SELF = {"method": "draft_model", "model": "target", "quantization": "int8"}


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path




# The candidate grid ---------------------------------------------------------------------------


def test_default_grid_has_each_k_and_adaptive_at_the_largest() -> None:
    candidates = tune.build_candidates(tune.base_methods())
    by_drafter: dict[str, list[tune.Candidate]] = {}
    for c in candidates:
        by_drafter.setdefault(c.drafter, []).append(c)
    assert set(by_drafter) == {"ngram", "suffix", "lookahead W1 N3 G1", "layer_skip", "draft_model self int8",
                               "draft_model self int8 p>=0.5", "draft_model self int8 p>=0.75"}
    fixed = {d: [c.k for c in cs if not c.config.adaptive] for d, cs in by_drafter.items()}
    assert fixed == {"ngram": [1, 2, 3, 4, 6], "suffix": [4, 6, 8], "lookahead W1 N3 G1": [2, 3], "layer_skip": [1, 2, 3, 4],
                     "draft_model self int8": [1, 2, 3, 4], "draft_model self int8 p>=0.5": [4, 6],
                     "draft_model self int8 p>=0.75": [6]}
    adaptive = {d: [c.k for c in cs if c.config.adaptive] for d, cs in by_drafter.items() if "p>=" not in d}
    assert adaptive == {d: [max(ks)] for d, ks in fixed.items() if "p>=" not in d}
    int8 = by_drafter["draft_model self int8"][0].config
    assert (int8.model, int8.quantization) == ("target", "int8")


def test_k_list_and_a_methods_own_k() -> None:
    candidates = tune.build_candidates(
        [tune.parse_method("ngram"), tune.parse_method('{"method": "ngram", "prompt_lookup_max": 3, "num_speculative_tokens": 5}')],
        tune.parse_ks("3,1"), adaptive=False,
    )
    assert [(c.config.prompt_lookup_max, c.k) for c in candidates] == [(6, 1), (6, 3), (3, 5)]


def test_head_drafters_are_measured_with_their_trees_too() -> None:
    from specdec.methods import TUNE_FLOORS, TUNE_TREES

    candidates = tune.build_candidates([{"method": "eagle", "model": "h"}, {"method": "medusa", "model": "h"}], [3],
                                       adaptive=False)
    trees = [(c.drafter, c.k, c.config.tree_width, c.config.tree_nodes) for c in candidates if c.config.tree_width > 1]
    assert trees[: len(TUNE_TREES)] == [(f"eagle h tree {w}x{n}", k, w, n) for k, w, n in TUNE_TREES]
    assert {d for d, *_ in trees[len(TUNE_TREES):]} == {"medusa h tree 2x4", "medusa h tree 2x6", "medusa h tree 3x8"}
    chains = [(c.drafter, c.k, c.config.draft_confidence) for c in candidates
              if c.config.tree_width == 1 and c.config.method == "eagle"]
    assert chains == [("eagle h", 3, None), *((f"eagle h conf>={f['draft_confidence']:g}", f["num_speculative_tokens"],
                                               f["draft_confidence"]) for f in TUNE_FLOORS)]
    assert [(c.drafter, c.k) for c in candidates if c.config.method == "medusa" and c.config.tree_width == 1] == [
        ("medusa h", 3)]  # medusa drafts all its tokens in one pass: no floor
    # A method given its own tree or k is measured as given; --no-trees measures chains only.
    given = tune.build_candidates([{"method": "eagle", "model": "h", "tree_width": 2}], [3], adaptive=False)
    assert [(c.name, c.drafter) for c in given] == [("eagle h k=3 tree 2x8", "eagle h tree 2x8")]
    assert all(c.config.tree_width == 1 for c in tune.build_candidates([{"method": "eagle", "model": "h"}], [3],
                                                                        adaptive=False, trees=False))
    assert tune.drafter_label("hybrid k=3 tree 2x6 adaptive") == "hybrid tree 2x6" and tune.drafter_label("ngram k=4") == "ngram"
    assert tune.drafter_label("eagle k=3 conf>=0.2") == "eagle conf>=0.2"
    assert tune.drafter_label("hybrid k=4 head k=k conf>=0.3 adaptive") == "hybrid head k=k conf>=0.3"
    # A method given its own floor is measured with it at every k, without the registered floors.
    floored = tune.build_candidates([{"method": "eagle", "model": "h", "draft_confidence": 0.25}], [2, 3], adaptive=False,
                                    trees=False)
    assert [c.name for c in floored] == ["eagle h k=2 conf>=0.25", "eagle h k=3 conf>=0.25"]


@pytest.mark.parametrize(
    ("methods", "ks", "message"),
    [
        (["bogus"], None, "unknown speculative method 'bogus'"),
        (['{"method": "draft_model", "model": ""}'], None, "needs a draft model"),
        (['{"method": "ngram", "adaptive": true}'], None, "'adaptive' is not set per method"),
        (["ngram", "ngram"], None, "a method is given twice"),
        (["ngram"], "0,2", "--k values must be integers >= 1"),
        (["ngram"], "two", "comma-separated list of integers"),
        (['{"method": "ngram"'], None, "not valid JSON"),
    ],
)
def test_bad_methods_are_config_errors(methods: list[str], ks: str | None, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        tune.build_candidates([tune.parse_method(m) for m in methods], tune.parse_ks(ks) if ks else None)


# The prediction -------------------------------------------------------------------------------


def stats(steps: int, undrafted: int, drafted: int, accepted: int, draft_s: float, verify_s: float,
          rejected: int = 0) -> RequestStats:
    return RequestStats(target_steps=steps, undrafted_steps=undrafted, drafted_tokens=drafted, accepted_tokens=accepted,
                        committed_tokens=accepted + steps, draft_time_s=draft_s, verify_time_s=verify_s,
                        rejected_steps=rejected)


@pytest.mark.parametrize(
    ("config", "plain"),
    [
        (stats(20, 5, 45, 30, 0.09, 0.5, 9), stats(50, 50, 0, 0, 0.0, 1.0)),    # some steps draft nothing (ngram)
        (stats(40, 0, 160, 90, 1.6, 1.7, 25), stats(100, 100, 0, 0, 0.0, 2.5)),  # every step drafts k = 4
        (stats(10, 0, 30, 30, 0.3, 0.4), stats(10, 10, 0, 0, 0.0, 0.3)),     # everything accepted
    ],
)
def test_prediction_is_the_formula_on_measured_quantities(config: RequestStats, plain: RequestStats) -> None:
    got = tune.predict(config, plain)
    plain_step = plain.verify_time_s / plain.target_steps
    drafting = config.target_steps - config.undrafted_steps
    a = config.accepted_tokens / (config.accepted_tokens + config.rejected_steps)  # tested acceptance
    k_eff = config.drafted_tokens / drafting
    c = config.draft_time_s / config.drafted_tokens / plain_step
    v = config.verify_time_s / config.target_steps / plain_step
    f = drafting / config.target_steps
    per_drafting_step = k_eff + 1 if a == 1 else (1 - a ** (k_eff + 1)) / (1 - a)
    expected = (f * per_drafting_step + 1 - f) / (f * k_eff * c + v)
    assert got["predicted_speedup"] == pytest.approx(expected)
    assert (got["acceptance"], got["k_eff"], got["draft_cost"], got["verify_cost"], got["drafting_fraction"]) == pytest.approx(
        (a, k_eff, c, v, f)
    )
    if f == 1:  # with every step drafting it is the textbook formula
        assert got["predicted_speedup"] == pytest.approx(per_drafting_step / (k_eff * c + v))


def test_nothing_drafted_predicts_from_costs_alone() -> None:
    got = tune.predict(stats(10, 10, 0, 0, 0.01, 0.55), stats(10, 10, 0, 0, 0.0, 0.5))
    assert got["k_eff"] is None and got["acceptance"] is None
    assert got["predicted_speedup"] == pytest.approx(1 / (0.001 / 0.05 + 0.055 / 0.05))


# The recommendation ---------------------------------------------------------------------------


def config_entry(name: str, spec: dict[str, Any], speedups: dict[str, float], identical: int = 2) -> dict[str, Any]:
    def scope(s: float) -> dict[str, Any]:
        return {"speedup": s, "predicted_speedup": s * 0.9, "acceptance_rate": 0.5, "mean_accepted_length": 1.5,
                "prompts": 2, "identical": identical}

    return {"name": name, "speculative_config": spec, tune.OVERALL: scope(speedups[tune.OVERALL]),
            "categories": {cat: scope(s) for cat, s in speedups.items() if cat != tune.OVERALL}}


def test_recommendation_is_the_best_measured_or_plain(tmp_path: Path) -> None:
    ngram = {"method": "ngram", "num_speculative_tokens": 3}
    int8 = {**INT8_SELF, "num_speculative_tokens": 2, "adaptive": True}
    configs = [
        config_entry("ngram k=3", ngram, {tune.OVERALL: 1.3, "code": 1.6, "chat": 0.9, "math": 1.05}),
        config_entry("int8", int8, {tune.OVERALL: 1.1, "code": 1.2, "chat": 0.95, "math": 1.2}),
        # Faster everywhere, but its output differed from plain decoding: never recommended.
        config_entry("broken", {"method": "ngram", "num_speculative_tokens": 6}, dict.fromkeys([tune.OVERALL, "code", "chat", "math"], 3.0), 1),
    ]
    rec = tune.recommend(configs, ["chat", "code", "math"])
    assert rec["speculative_config"] == ngram
    assert rec["per_category"] == {"chat": None, "code": ngram, "math": int8}
    assert rec["measured"]["per_category"]["chat"]["name"] == "plain decoding"
    assert rec["measured"][tune.OVERALL]["speedup"] == 1.3

    path = tmp_path / "recommended.json"
    path.write_text(json.dumps(rec))
    assert SpeculativeConfig.from_file(path) == SpeculativeConfig.from_dict(ngram)
    assert SpeculativeConfig.from_file(path, category="math") == SpeculativeConfig.from_dict(int8)
    assert SpeculativeConfig.from_file(path, category="chat") is None


def test_cli_speculative_config_takes_a_file(tmp_path: Path) -> None:
    ngram = {"method": "ngram", "num_speculative_tokens": 3}
    rec = tmp_path / "recommended.json"
    rec.write_text(json.dumps({"speculative_config": ngram, "per_category": {}, "measured": {}}))
    assert speculative_config(str(rec), None, None, None) == SpeculativeConfig.from_dict(ngram)
    assert speculative_config(str(rec), None, 5, None).num_speculative_tokens == 5  # shorthands override
    single = tmp_path / "single.json"
    single.write_text(json.dumps({**INT8_SELF, "num_speculative_tokens": 2}))
    assert speculative_config(str(single), None, None, None) == SpeculativeConfig.from_dict({**INT8_SELF, "num_speculative_tokens": 2})
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps({"speculative_config": None, "per_category": {}}))
    assert speculative_config(str(plain), None, None, None) is None
    assert speculative_config('{"method": "ngram", "num_speculative_tokens": 2}', None, None, None).num_speculative_tokens == 2
    with pytest.raises(ConfigError, match="neither a JSON object nor an existing file"):
        speculative_config(str(tmp_path / "missing.json"), None, None, None)


# The command ----------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def mini_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_jsonl(
        tmp_path_factory.mktemp("tune-data") / "mini.jsonl",
        [
            {"id": "c1", "category": "code", "turns": ["Write a Python function that adds two numbers."]},
            {"id": "t1", "category": "chat", "turns": ["Name three colours.", "Now name three more."]},
            {"id": "c2", "category": "code", "turns": ["Print hello world in C."]},
        ],
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--data", "/no/such/file.jsonl"], "data file not found"),
        (["--methods", "bogus"], "unknown speculative method 'bogus'"),
        (["--category", "poetry"], "unknown categories: poetry"),
        (["--per-category", "0"], "--per-category must be >= 1"),
        (["--k", "1,x"], "comma-separated list of integers"),
    ],
)
def test_tune_bad_input_is_one_line_error(
    run_cli, mini_data: Path, args: list[str], message: str
) -> None:
    data = [] if "--data" in args else ["--data", str(mini_data)]
    code, out, err = run_cli("tune", *data, *args)
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ") and message in lines[0], lines[0]


@pytest.mark.parametrize("args", [["--methods", "bogus"], ["--k", "1,x"], ["--methods", "ngram", "--methods", "ngram"]])
def test_tune_checks_its_arguments_before_loading_the_model(
    run_cli, mini_data: Path, monkeypatch: pytest.MonkeyPatch, args: list[str]
) -> None:
    import specdec.models.loader as loader

    def no_load(*a: Any, **k: Any) -> None:
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(loader, "load_model", no_load)
    code, _, err = run_cli("tune", "--data", str(mini_data), *args)
    assert code == 2 and err.startswith("error: "), err


@pytest.mark.real
def test_measure_needs_prompts(default_model: LoadedModel) -> None:
    candidates = tune.build_candidates([{"method": "ngram"}], [2], adaptive=False)
    with pytest.raises(ConfigError, match="no prompts"):
        tune.measure(default_model, candidates, [], SamplingParams(max_tokens=4))


@pytest.fixture(scope="session")
def tuned(mini_data: Path, tmp_path_factory: pytest.TempPathFactory, worker_id: str
          ) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """One minute-long tune run for the whole session: under pytest-xdist the first worker to
    ask runs it into the session's shared temporary folder, and the others read its output."""
    shared = tmp_path_factory.getbasetemp() if worker_id == "master" else tmp_path_factory.getbasetemp().parent
    out, record = shared / "tune-out", shared / "tune-run.json"
    with FileLock(str(shared / "tune-run.lock")):
        if not record.exists():
            args = [sys.executable, "-m", "specdec.cli.main", "tune", "--data", str(mini_data), "--per-category", "1",
                    "--max-tokens", "8", "--methods", "ngram", "--methods", json.dumps(INT8_SELF), "--k", "2",
                    "--dtype", "float32", "--out", str(out)]
            done = subprocess.run(args, capture_output=True, text=True, timeout=600)
            record.write_text(json.dumps({"args": args, "returncode": done.returncode, "stdout": done.stdout,
                                          "stderr": done.stderr}))
    run = json.loads(record.read_text())
    return out, subprocess.CompletedProcess(run["args"], run["returncode"], run["stdout"], run["stderr"])


# The tests reading the `tuned` run (they stay on one worker where pytest-xdist's loadgroup does
# group them; the fixture holds either way).
ONE_TUNE_RUN = pytest.mark.xdist_group("tuned")


@ONE_TUNE_RUN
@pytest.mark.real
def test_tune_writes_results_and_files(tuned: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    out, result = tuned
    assert result.returncode == 0, result.stderr
    data = json.loads((out / "tune.json").read_text())
    names = [c["name"] for c in data["configs"]]
    # A draft model is measured under its p-min floors too (each with its own k).
    assert names == ["ngram k=2", "ngram k=2 adaptive", "draft_model self int8 k=2", "draft_model self int8 k=2 adaptive",
                     "draft_model self int8 k=4 p>=0.5", "draft_model self int8 k=6 p>=0.5",
                     "draft_model self int8 k=6 p>=0.75"]
    assert data["categories"] == ["chat", "code"] and data["prompts"] == 2
    for c in data["configs"]:
        for scope in [c[tune.OVERALL], *c["categories"].values()]:
            assert {"speedup", "predicted_speedup", "relative_difference", "acceptance_rate", "mean_accepted_length",
                    "k_eff", "draft_cost", "verify_cost", "identical", "prompts"} <= set(scope)
            assert scope["identical"] == scope["prompts"]  # greedy speculation is lossless
        assert c[tune.OVERALL]["prompts"] == 2
    assert 1 < data["configs"][2][tune.OVERALL]["k_eff"] <= 2  # a fixed k, cut only where the token budget ends
    assert "ngram k=2" in result.stdout and "Recommendation" in result.stdout

    markdown = (out / "report.md").read_text()
    assert "## Recommendation" in markdown and "## chat" in markdown and "## code" in markdown
    assert "| draft_model self int8 k=2 |" in markdown
    for png in ("speedup_by_k.png", "acceptance_by_position.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"![{png}]({png})" in markdown


@ONE_TUNE_RUN
@pytest.mark.real
def test_tune_prediction_recomputes_from_its_measurements(tuned: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    out, result = tuned
    assert result.returncode == 0, result.stderr
    data = json.loads((out / "tune.json").read_text())
    checked = 0
    for c in data["configs"]:
        for name, scope in [(tune.OVERALL, c[tune.OVERALL]), *c["categories"].items()]:
            plain = data["plain"][tune.OVERALL] if name == tune.OVERALL else data["plain"]["categories"][name]
            assert scope["plain_step_s"] == pytest.approx(plain["plain_step_s"])
            if not scope["drafted_tokens"]:
                continue
            step = plain["plain_step_s"]
            a = scope["accepted_tokens"] / (scope["accepted_tokens"] + scope["rejected_steps"])
            k_eff = scope["drafted_tokens"] / scope["drafting_steps"]
            f = scope["drafting_steps"] / scope["target_steps"]
            draft_cost = scope["draft_time_s"] / scope["drafted_tokens"] / step
            verify_cost = scope["verify_time_s"] / scope["target_steps"] / step
            tokens = k_eff + 1 if a == 1 else (1 - a ** (k_eff + 1)) / (1 - a)
            predicted = (f * tokens + 1 - f) / (f * k_eff * draft_cost + verify_cost)
            assert scope["predicted_speedup"] == pytest.approx(predicted)
            assert scope["relative_difference"] == pytest.approx(predicted / scope["speedup"] - 1)
            assert scope["acceptance_rate"] == pytest.approx(scope["accepted_tokens"] / scope["drafted_tokens"], abs=1e-4)
            checked += 1
    assert checked >= 4


@ONE_TUNE_RUN
@pytest.mark.real
def test_tune_recommendation_loads(tuned: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    out, result = tuned
    assert result.returncode == 0, result.stderr
    data = json.loads((out / "tune.json").read_text())
    path = out / "recommended.json"
    rec = json.loads(path.read_text())
    assert rec == data["recommended"]

    def best(scope_of) -> dict[str, Any] | None:
        lossless = [c for c in data["configs"] if scope_of(c)["identical"] == scope_of(c)["prompts"]]
        top = max(lossless, key=lambda c: scope_of(c)["speedup"])
        return top["speculative_config"] if scope_of(top)["speedup"] > 1 else None

    assert rec["speculative_config"] == best(lambda c: c[tune.OVERALL])
    loaded = SpeculativeConfig.from_file(path)
    assert loaded == (None if rec["speculative_config"] is None else SpeculativeConfig.from_dict(rec["speculative_config"]))
    for category in ("chat", "code"):
        assert rec["per_category"][category] == best(lambda c, cat=category: c["categories"][cat])
        loaded = SpeculativeConfig.from_file(path, category=category)
        expected = rec["per_category"][category]
        assert loaded == (None if expected is None else SpeculativeConfig.from_dict(expected))

    generated = subprocess.run(
        [sys.executable, "-m", "specdec.cli.main", "generate", "Count to five.", "--max-tokens", "8", "--stats",
         "--dtype", "float32", "--speculative-config", str(path)],  # the target the recommendation was tuned on
        capture_output=True, text=True, timeout=300,
    )
    assert generated.returncode == 0, generated.stderr
    if rec["speculative_config"] is None:
        assert "plain decoding" in generated.stderr
    else:
        spec = SpeculativeConfig.from_dict(rec["speculative_config"])
        assert spec.method in generated.stderr and f"k={spec.num_speculative_tokens}" in generated.stderr
