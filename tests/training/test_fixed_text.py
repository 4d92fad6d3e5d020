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


def test_task_prompts_summarize_and_translate_other_prompts(tiny_native: LoadedModel, tmp_path: Path) -> None:
    from specdec.training.corpus import back_translations, source_id, task_prompts

    article = " ".join(f"word{i}" for i in range(80))
    records = [{"id": "news", "category": "t0_cnn_dailymail", "turns": [f"Summarise the article:\n\nArticle: {article}"]},
               {"id": "chat", "category": "t0_samsum", "turns": ["Summarize this dialogue: Amy: hi\nBob: " + article]},
               {"id": "taken", "category": "t0_cnn_dailymail", "turns": [f"Summarise:\n\n{article}"]},
               {"id": "q", "category": "t0_sciq", "turns": ["Short. The sun emits light that plants use to grow. Why?"]},
               {"id": "none", "category": "t0_sciq", "turns": ["Too short to translate."]}]
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    prompts = {p.id: p for p in task_prompts(data, 10, exclude={"taken"})}
    assert sorted(source_id(i) for i in prompts) == ["chat", "news", "q"]  # none excluded, none without a sentence
    news = prompts["summarize:news"].text
    assert news.endswith(article) and "Article:" not in news and "Summarise" not in news  # the instruction dropped
    assert prompts["summarize:chat"].text.endswith("Amy: hi\nBob: " + article)  # a speaker's name kept
    (translation,) = [p for i, p in prompts.items() if i.startswith("translate:")]
    assert translation.text.endswith(": The sun emits light that plants use to grow.")
    language = translation.id.split(":")[1]
    answer = tiny_native.tokenizer("Die Sonne")["input_ids"]
    back = back_translations(tiny_native, [{"id": translation.id, "answer_ids": answer},
                                           {"id": "summarize:news", "answer_ids": answer}])
    assert [(p.id, p.text) for p in back] == [(f"back{translation.id}", f"Translate {language} to English: Die Sonne")]
    assert source_id(back[0].id) == "q" and source_id("stdlib/os.path:3") == "stdlib/os.path:3"
