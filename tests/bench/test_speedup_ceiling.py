"""benchmarks/speedup_ceiling.py: a drafter's ceiling is its mean accepted length, read from a
bench result for every speculative system and category (plain systems and peers without
acceptance left out)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "speedup_ceiling.py"


@pytest.fixture(scope="module")
def ceiling():
    spec = importlib.util.spec_from_file_location("speedup_ceiling", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


RESULT = {
    "systems": {
        "specdec plain": {"tokens_per_s": 100.0, "mean_accepted_length": 1.0},
        "specdec": {"speedup": 1.2, "mean_accepted_length": 1.5},
        "llama.cpp prompt lookup": {"speedup": 0.5},
    },
    "systems_by_category": {
        "qa": {"specdec plain": {"mean_accepted_length": 1.0}, "specdec": {"speedup": 1.1, "mean_accepted_length": 1.25}},
        "extraction": {"specdec": {"speedup": 1.8, "mean_accepted_length": 3.0}},
    },
}


def test_rows_are_the_speculative_systems_with_their_ceilings(ceiling):
    assert ceiling.rows(RESULT) == [("specdec", "all", 1.5, 1.2), ("specdec", "qa", 1.25, 1.1),
                                    ("specdec", "extraction", 3.0, 1.8)]


def test_main_names_the_ceilings_below_the_target(ceiling, tmp_path, monkeypatch, capsys):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(RESULT), encoding="utf-8")
    monkeypatch.setattr(sys, "argv", ["speedup_ceiling.py", str(path), "--target", "1.6"])
    ceiling.main()
    out = capsys.readouterr().out
    assert "1.250x" in out  # pass cost for the whole run: 1.5 / 1.2
    short = out.split("ceilings below 1.6x")[1]
    assert "specdec / all (1.50)" in short and "specdec / qa (1.25)" in short and "extraction" not in short


def test_a_result_without_speculation_is_an_error(ceiling, tmp_path, monkeypatch):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"systems": {"specdec plain": {"mean_accepted_length": 1.0}}}), encoding="utf-8")
    monkeypatch.setattr(sys, "argv", ["speedup_ceiling.py", str(path)])
    with pytest.raises(SystemExit, match="no speculative system"):
        ceiling.main()
