"""Fixed-text training records: the raw text of prompts not answered, every position counted."""

from __future__ import annotations

import json
from pathlib import Path

from specdec.models import LoadedModel
from specdec.training.corpus import text_records
from specdec.training.heads import answer_start


def test_text_records_leave_out_answered_prompts(default_model: LoadedModel, tmp_path: Path) -> None:
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"id": f"p{i}", "category": "c", "turns": [f"Some text, number {i}."]}) + "\n"
                            for i in range(5)))
    records = text_records(default_model, data, 10, exclude={"p1", "p3"})
    assert sorted(r["id"] for r in records) == ["text:p0", "text:p2", "text:p4"]
    for record in records:
        number = record["id"][-1]
        assert record["answer_ids"] == default_model.tokenizer(f"Some text, number {number}.")["input_ids"]
        assert record["kind"] == "text" and answer_start(record) == 0  # every position counts
    assert len(text_records(default_model, data, 2, exclude=set())) == 2
