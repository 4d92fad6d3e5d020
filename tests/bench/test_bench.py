"""specdec bench: data selection, conversations, the report's keys and its figures."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from specdec.bench.data import BenchDataError, Record, load_records, select
from specdec.bench.runner import RunResult, System, run_bench, run_conversation
from specdec.engine.stats import RequestStats

SPEC_BENCH = Path(__file__).resolve().parents[3] / "shared" / "data" / "norm" / "spec_bench.jsonl"


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_select_takes_first_n_per_category(tmp_path: Path) -> None:
    rows = [{"id": str(i), "category": "ab"[i % 2], "turns": [f"q{i}"]} for i in range(10)]
    records = load_records(write_jsonl(tmp_path / "d.jsonl", rows))
    chosen = select(records, per_category=2)
    assert [r.id for r in chosen] == ["0", "1", "2", "3"]
    assert [r.id for r in select(records, 1, ["b"])] == ["1"]
    with pytest.raises(BenchDataError, match="unknown categories: c"):
        select(records, 1, ["c"])


def test_malformed_data_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"id": "1", "category": "x", "turns": ["ok"]}\n{"id": "2", "turns": []}\n')
    with pytest.raises(BenchDataError, match=r"bad.jsonl:2"):
        load_records(path)


def test_records_are_split_at_newlines_only(tmp_path: Path) -> None:
    # JSON keeps U+2028 (a line separator to str.splitlines) unescaped: the training prompts hold some.
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"id": "1", "turns": ["one\u2028two\x85three"]}, ensure_ascii=False) + "\n",
                    encoding="utf-8")
    assert load_records(path)[0].turns == ("one\u2028two\x85three",)


@pytest.mark.skipif(not SPEC_BENCH.exists(), reason="shared data not present")
def test_spec_bench_file_loads_with_its_categories() -> None:
    records = load_records(SPEC_BENCH)
    assert len(records) == 480
    assert len({r.category for r in records}) == 13
    assert all(len(r.turns) == 2 for r in records if r.category == "writing")


def test_second_turn_sees_the_systems_own_first_answer() -> None:
    seen: list[list[dict]] = []

    def fake(messages: list[dict]) -> RunResult:
        seen.append(messages)
        return RunResult([len(messages)], f"answer{len(messages)}", 0.1)

    results = run_conversation(System("fake", fake), Record("1", "x", ("first", "second")))
    assert len(results) == 2
    assert seen[1] == [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "answer1"},
        {"role": "user", "content": "second"},
    ]


def test_tallies_speedup_and_identity_against_own_baseline() -> None:
    def system(name: str, seconds: float, tokens: list[int], baseline: str | None = None) -> System:
        stats = RequestStats(prefill_time_s=seconds / 4) if name == "fast" else None  # a specdec run says it
        return System(name, lambda messages: RunResult(tokens, "t", seconds, stats), baseline)

    raw = run_bench(
        [system("plain", 2.0, [1, 2, 3, 4]), system("fast", 1.0, [1, 2, 3, 4], "plain"), system("wrong", 1.0, [9], "plain")],
        [Record("a", "x", ("q",)), Record("b", "y", ("q1", "q2"))],
    )
    fast = raw["overall_by_system"]["fast"]
    assert fast["speedup"] == pytest.approx(2.0)
    assert fast["identical"] == 2 and fast["prompts"] == 2
    assert raw["overall_by_system"]["wrong"]["identical"] == 0
    assert raw["categories_by_system"]["y"]["fast"]["tokens"] == 8
    # Per turn: both records have a first turn, one a second.
    assert raw["turns_by_system"]["1"]["fast"]["tokens"] == 8 and raw["turns_by_system"]["2"]["fast"]["tokens"] == 4
    assert raw["turns_by_system"]["2"]["fast"]["speedup"] == pytest.approx(2.0)
    # Time to first token, a turn's mean, where the system reports it.
    assert fast["ttft_s"] == pytest.approx(0.25) and "ttft_s" not in raw["overall_by_system"]["plain"]


def test_every_system_reports_target_tokens_and_cpu_time_per_output_token() -> None:
    def spin(seconds: float) -> None:  # CPU time the tally must see
        end = time.process_time() + seconds
        while time.process_time() < end:
            pass

    def specdec_like(messages: list[dict]) -> RunResult:
        spin(0.02)
        stats = RequestStats()
        stats.record_step(drafted=3, accepted=1)  # 4 target tokens for 2 committed
        stats.record_step(drafted=3, accepted=3)  # 4 for 4
        return RunResult([1] * 7, "t", 0.1, stats)

    def peer(plain: bool) -> Callable[[list[dict]], RunResult]:
        return lambda messages: RunResult([1, 2, 3, 4], "t", 0.1, plain=plain)

    raw = run_bench([System("plain", peer(True)), System("spec", specdec_like, "plain"),
                     System("peer lookup", peer(False), "plain")], [Record("a", "x", ("q",)), Record("b", "x", ("q",))])
    systems = raw["overall_by_system"]
    assert systems["spec"]["target_tokens_per_output_token"] == round(8 / 6, 4)
    assert systems["plain"]["target_tokens_per_output_token"] == 1.0
    assert systems["peer lookup"]["target_tokens_per_output_token"] is None  # it speculates, and does not say how much
    assert systems["spec"]["cpu_s_per_output_token"] >= 0.04 / 14
    assert systems["spec"]["cpu_s_per_output_token"] > systems["plain"]["cpu_s_per_output_token"]


@pytest.mark.real  # the real model, in a subprocess
def test_bench_cli_writes_report(tmp_path: Path) -> None:
    data = write_jsonl(
        tmp_path / "mini.jsonl",
        [
            {"id": "c1", "category": "code", "turns": ["Write a Python function that adds two numbers."]},
            {"id": "t1", "category": "chat", "turns": ["Name three colours.", "Now name three more."]},
            {"id": "c2", "category": "code", "turns": ["Print hello world in C."]},
        ],
    )
    out = tmp_path / "report.json"
    result = subprocess.run(
        [sys.executable, "-m", "specdec.cli.main", "bench", "--data", str(data), "--per-category", "1",
         "--max-tokens", "16", "--json", str(out), "-k", "3", "--report-dir", str(tmp_path / "rep"),
         "--compare", '{"method": "layer_skip", "num_speculative_tokens": 2, "adaptive": true}'],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert report["overall"]["prompts"] == 2
    # Greedy speculation is lossless: every prompt's output matches plain decoding.
    assert report["overall"]["identical"] == 2
    assert report["overall"]["speedup"] > 0
    assert set(report["categories"]) == {"code", "chat"}
    for category in report["categories"].values():
        assert {"speedup", "identical", "prompts", "acceptance_rate", "mean_accepted_length",
                "target_tokens_per_output_token", "cpu_s_per_output_token"} <= set(category)
    assert report["systems"]["specdec plain"]["target_tokens_per_output_token"] == 1.0
    assert report["speculative_config"]["num_speculative_tokens"] == 3
    assert 0 < report["systems"]["specdec plain"]["ttft_s"] < 60
    assert "overall" in result.stdout
    # The compared config ran on the same prompts, measured against the same plain decoding.
    compared = report["systems"]["specdec layer_skip k=2 adaptive"]
    assert compared["identical"] == 2 and compared["prompts"] == 2
    assert report["baselines"]["specdec layer_skip k=2 adaptive"] == "specdec plain"
    assert report["compared"] == ["specdec", "specdec layer_skip k=2 adaptive"]
    markdown = (tmp_path / "rep" / "report.md").read_text()
    assert "| **overall** | 2 | 2/2 |" in markdown
    assert "| category | specdec | specdec layer_skip k=2 adaptive |" in markdown
    for png in ("speedup_by_category.png", "acceptance_by_position.png"):
        assert (tmp_path / "rep" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"![{png}]({png})" in markdown


def test_a_drafters_cost_per_drafted_token_is_reported() -> None:
    from specdec.bench.runner import Tally
    from specdec.engine.stats import RequestStats

    plain, spec = Tally(), Tally()
    plain.add([RunResult(list(range(100)), "", 2.0)], None)  # 20 ms an output token
    stats = RequestStats()
    stats.record_step(drafted=4, accepted=3, draft_time_s=0.012)
    stats.record_step(drafted=4, accepted=4, draft_time_s=0.020)
    spec.add([RunResult(list(range(9)), "", 0.1, stats)], True)
    summary = spec.summary(plain)
    assert summary["draft_s_per_drafted_token"] == pytest.approx(0.004)
    assert summary["drafted_token_cost"] == pytest.approx(0.2)
    assert "draft_s_per_drafted_token" not in plain.summary(None)
