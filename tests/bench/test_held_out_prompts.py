"""benchmarks/held_out_prompts.py: prompts a trained head never saw, for benchmarking it."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

from specdec.training.corpus import split_of
from specdec.training.heads import TrainConfig

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "held_out_prompts.py"


def test_only_unanswered_prompts_of_the_validation_split_per_category(tmp_path: Path) -> None:
    fraction = TrainConfig().validation_fraction
    ids = [f"p{i}" for i in range(400)]
    validation = [i for i in ids if split_of(i, fraction) == "validation"]
    assert len(validation) >= 4
    records = [{"id": i, "category": "ab"[n % 2], "turns": [f"prompt {i}"]} for n, i in enumerate(ids)]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    # The first held-out prompt was answered; the second was the source of a summary request.
    answers = tmp_path / "answers.jsonl"
    answers.write_text("".join(json.dumps({"id": i, "prompt_ids": [1], "answer_ids": [2]}) + "\n"
                               for i in (validation[0], f"summarize:{validation[1]}", ids[0])))
    out = tmp_path / "held_out.jsonl"
    subprocess.run([sys.executable, str(SCRIPT), "--data", str(data), "--exclude", str(answers), "--per-category", "100",
                    "--out", str(out)], check=True, capture_output=True)
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in written] == validation[2:]
    spec = importlib.util.spec_from_file_location("held_out_prompts", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    one_each = module.held_out(data.read_text().split("\n"), set(), 1, fraction)
    assert sorted(r["category"] for r in one_each) == ["a", "b"]


def test_prompts_a_runs_fixed_text_took_are_left_out(tmp_path: Path) -> None:
    from specdec.training.corpus import text_prompts

    fraction = TrainConfig().validation_fraction
    ids = [f"q{i}" for i in range(2000)]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"id": i, "category": "c", "turns": [f"prompt {i}"]}) + "\n" for i in ids))
    answers = tmp_path / "answers.jsonl"
    answers.write_text(json.dumps({"id": ids[0], "prompt_ids": [1], "answer_ids": [2]}) + "\n")
    # A run with --text 900 over these answers took about half of the unanswered prompts as text.
    texts = {p.id for p in text_prompts(data, 900, {ids[0]})}
    validation = [i for i in ids[1:] if split_of(i, fraction) == "validation"]
    assert ids[0] not in texts and set(validation) & texts and set(validation) - texts
    out = tmp_path / "held_out.jsonl"
    subprocess.run([sys.executable, str(SCRIPT), "--data", str(data), "--exclude", str(answers), "--exclude-text", "900",
                    "--per-category", "1000", "--out", str(out)], check=True, capture_output=True)
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == [i for i in validation if i not in texts]
