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
