"""Training text for draft heads: prompts, and the target's own answers to them.

A head learns to predict what the target says, so the best text to learn on is the target's own
output (self-distillation, as Medusa-2, HASS and EAGLE-3 do). Prompts come from a JSONL file in
the benchmark format (`{"id", "turns": [...]}`; never Spec-Bench or MT-bench) and from
Python's standard library on this machine (functions with docstrings, as code requests). The
target answers each prompt with plain greedy decoding, many rows at a time; every answer is
appended to a JSONL file as soon as it is done, so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import ast
import hashlib
import json
import random
import re
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from specdec.config import SamplingParams
from specdec.engine.batch import BatchEngine, Sequence
from specdec.errors import ConfigError
from specdec.models.loader import LoadedModel


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    text: str


def file_prompts(path: str | Path) -> list[Prompt]:
    """The first turn of every record of a benchmark-format JSONL file."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ConfigError(f"training prompts not found: {path}")
    prompts = []
    for number, line in enumerate(path.read_text(encoding="utf-8").split("\n"), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            prompts.append(Prompt(str(record["id"]), str(record.get("category", "")), str(record["turns"][0])))
        except (json.JSONDecodeError, KeyError, IndexError, TypeError) as exc:
            raise ConfigError(f"{path}:{number}: not a prompt record ({exc})") from None
    if not prompts:
        raise ConfigError(f"no prompts in {path}")
    return prompts


def stdlib_prompts(limit: int, seed: int = 0, per_module: int = 3) -> list[Prompt]:
    """Code requests built from the standard library's documented functions: write a function
    from its signature and docstring, or explain a short one."""
    if limit <= 0:
        return []
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if not p.name.startswith("_"))
    rng = random.Random(seed)
    rng.shuffle(files)
    prompts: list[Prompt] = []
    for path in files:
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        source, taken = path.read_text(encoding="utf-8"), 0
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            if not doc or len(doc) < 40:
                continue
            summary = doc.split("\n\n")[0].replace("\n", " ")
            ident = f"stdlib/{path.stem}.{node.name}:{node.lineno}"  # names repeat within a module
            code = ast.get_source_segment(source, node) or ""
            if rng.random() < 0.5 or len(code.splitlines()) > 30:
                text = f"Write a Python function `{node.name}({ast.unparse(node.args)})` that does this: {summary}"
            else:
                text = f"Explain what this Python function does:\n\n```python\n{code}\n```"
            prompts.append(Prompt(ident, "code", text))
            taken += 1
            if taken == per_module or len(prompts) >= limit:
                break  # a few functions a module: variety over depth
        if len(prompts) >= limit:
            break
    return prompts


def select_prompts(path: str | Path | None, count: int, code_count: int, seed: int = 0) -> list[Prompt]:
    """A seeded sample: `count` prompts of the file and `code_count` standard-library code
    requests, shuffled together (the same list every run, so answering can resume)."""
    rng = random.Random(seed)
    chosen = []
    if count > 0:
        if path is None:
            raise ConfigError("give the training prompts (--data), or ask for code prompts only (--answers 0)")
        pool = file_prompts(path)
        chosen = rng.sample(pool, min(count, len(pool)))
    chosen += stdlib_prompts(code_count, seed)
    rng.shuffle(chosen)
    return chosen


def text_records(target: LoadedModel, path: str | Path, count: int, exclude: set[str], seed: int = 0,
                 max_tokens: int = 512) -> list[dict]:
    """Fixed text (EAGLE-1 trained on fixed text, not on the target's answers): the raw text of
    a seeded sample of `count` prompts of the file, leaving out the ids in `exclude` (prompts
    whose answers are in the training data, so none of a held-out answer's prompt is trained
    on). Each record is `{"id", "category", "kind": "text", "prompt_ids": [], "answer_ids"}`:
    every position counts, and it never enters the held-out split (that stays answers)."""
    pool = [p for p in file_prompts(path) if p.id not in exclude]
    chosen = random.Random(seed + 1).sample(pool, min(count, len(pool)))
    records = []
    for prompt in chosen:
        ids = target.tokenizer(prompt.text)["input_ids"][:max_tokens]
        records.append({"id": f"text:{prompt.id}", "category": prompt.category, "kind": "text", "prompt_ids": [],
                        "answer_ids": list(ids)})
    return records


# Prompts whose text is an article or a dialogue after a one-line instruction: the sources of
# summarization-like requests.
SUMMARY_SOURCES = ("t0_cnn_dailymail", "t0_multi_news", "t0_samsum", "t0_duorc", "t0_quoref", "t0_wiki_hop")
SUMMARY_TEMPLATES = ("Summarize: {}", "Summarize the following text in a few sentences.\n\n{}",
                     "Write a short summary of this:\n{}")
TRANSLATION_TEMPLATES = (("German", "Translate English to German: {}"), ("French", "Translate English to French: {}"),
                         ("Spanish", "Translate English to Spanish: {}"))
BACK_TRANSLATION = "Translate {language} to English: {text}"
TRANSLATION_PREFIX = "translate:"
SUMMARY_PREFIX = "summarize:"
_INSTRUCTION = re.compile(r"^[A-Z][^\n:]{15,100}:\s+")  # "Summarize this dialogue: ", not a speaker's "Amy: "
_LABEL = re.compile(r"^(?:Article|Dialogue|Text|Passage|Movie plot|Summary|Information)\s*:\s*")
_SENTENCE = re.compile(r"(?<=[.!?])\s+")


def task_prompts(path: str | Path, count: int, exclude: set[str], seed: int = 0, max_words: int = 180) -> list[Prompt]:
    """Summarization- and translation-like requests built from the text of prompts of the file
    that are not in `exclude` (the answered ones, so that no held-out answer's text trains):
    half "summarize" requests over the article or dialogue of a prompt (its instruction line
    dropped, at most `max_words` words), half requests to translate one of a prompt's sentences
    out of English. A translation's answer, the target's own German, French or Spanish, becomes
    a request to translate it back (:func:`back_translations`): the direction summarization and
    translation benchmarks ask for, on text the target wrote."""
    if count <= 0:
        return []
    rng = random.Random(seed + 2)
    pool = [p for p in file_prompts(path) if p.id not in exclude]
    rng.shuffle(pool)
    summaries, translations = [], []
    for prompt in pool:
        if prompt.category in SUMMARY_SOURCES and len(summaries) < count // 2:
            words = article(prompt.text).split(" ")
            if len(words) >= 60:
                body = " ".join(words[:max_words])
                summaries.append(Prompt(f"{SUMMARY_PREFIX}{prompt.id}", "summarization", rng.choice(SUMMARY_TEMPLATES).format(body)))
        elif len(translations) < count - count // 2:
            sentences = [s.strip() for s in _SENTENCE.split(prompt.text.replace("\n", " "))
                         if 6 <= len(s.split()) <= 40 and s.isascii()]
            if sentences:
                language, template = rng.choice(TRANSLATION_TEMPLATES)
                translations.append(Prompt(f"{TRANSLATION_PREFIX}{language}:{prompt.id}", "translation",
                                           template.format(rng.choice(sentences))))
        if len(summaries) + len(translations) >= count:
            break
    return summaries + translations


def article(text: str) -> str:
    """A prompt's text without its instruction: leading short lines that end in ':' or '?', an
    instruction before a colon on the first line, and a label such as "Article:"."""
    text = text.strip()
    for _ in range(3):
        first, _, rest = text.partition("\n")
        if not rest or len(first.split()) >= 20 or not first.rstrip().endswith((":", "?")):
            break
        text = rest.strip()
    return _LABEL.sub("", _INSTRUCTION.sub("", text, count=1), count=1)


def source_id(identifier: str) -> str:
    """The id of the prompt of the file a request of :func:`task_prompts` (or its back
    translation) was built from; any other id as it is."""
    if identifier.startswith(SUMMARY_PREFIX):
        return identifier[len(SUMMARY_PREFIX):]
    for prefix in (TRANSLATION_PREFIX, "back" + TRANSLATION_PREFIX):
        if identifier.startswith(prefix):
            return identifier[len(prefix):].split(":", 1)[-1]
    return identifier


def back_translations(target: LoadedModel, records: list[dict]) -> list[Prompt]:
    """For each answered translation request, the request to translate the target's answer back
    into English (the answer's special tokens and surrounding space dropped; empty ones skipped)."""
    prompts = []
    for record in records:
        if not record["id"].startswith(TRANSLATION_PREFIX):
            continue
        language = record["id"][len(TRANSLATION_PREFIX):].split(":", 1)[0]
        text = target.tokenizer.decode(record["answer_ids"], skip_special_tokens=True).strip()
        if text:
            prompts.append(Prompt(f"back{record['id']}", "translation", BACK_TRANSLATION.format(language=language, text=text)))
    return prompts


def split_of(identifier: str, validation_fraction: float) -> str:
    """'validation' or 'train', fixed by a hash of the id (stable across runs and machines)."""
    digest = int(hashlib.sha256(identifier.encode()).hexdigest()[:8], 16)
    return "validation" if digest / 0xFFFFFFFF < validation_fraction else "train"


def read_answers(path: Path) -> list[dict]:
    """The records of an answers file; a truncated last line (a killed run) is dropped."""
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").split("\n"):
        if not line:
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return records


def generate_answers(
    target: LoadedModel,
    prompts: list[Prompt],
    out: Path,
    *,
    max_prompt_tokens: int = 320,
    max_tokens: int = 160,
    rows: int = 16,
    should_stop: Callable[[], bool] = lambda: False,
    on_answer: Callable[[dict], None] = lambda record: None,
) -> int:
    """Answer the prompts not yet in `out` with the target's greedy decoding, `rows` at a time;
    append each answer as `{"id", "category", "prompt_ids", "answer_ids"}`. Prompts longer than
    `max_prompt_tokens` are skipped. Returns how many answers were written."""
    done = {record["id"] for record in read_answers(out)}
    if out.is_file() and out.read_text(encoding="utf-8") and not out.read_text(encoding="utf-8").endswith("\n"):
        _drop_partial_line(out)
    tokenizer = target.tokenizer

    def encoded() -> Iterator[tuple[Prompt, list[int]]]:
        for prompt in prompts:
            if prompt.id in done:
                continue
            messages = [{"role": "user", "content": prompt.text}]
            if tokenizer.chat_template is not None:
                ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
                ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
            else:
                ids = tokenizer(prompt.text)["input_ids"]
            if len(ids) <= max_prompt_tokens:
                yield prompt, ids

    engine = BatchEngine(target, max_rows=rows, max_model_len=max_prompt_tokens + max_tokens + 1, max_draft=1)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    queue = encoded()
    owners: dict[int, Prompt] = {}
    written = 0
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a", encoding="utf-8") as sink:

        def finish(seq: Sequence) -> None:
            nonlocal written
            prompt = owners.pop(seq.id)
            record = {"id": prompt.id, "category": prompt.category, "prompt_ids": seq.prompt_ids,
                      "answer_ids": seq.result.token_ids}
            sink.write(json.dumps(record) + "\n")
            sink.flush()
            written += 1
            on_answer(record)

        exhausted = False
        while True:
            while not exhausted and not should_stop() and engine.running < rows:
                item = next(queue, None)
                if item is None:
                    exhausted = True
                    break
                prompt, ids = item
                seq = Sequence(ids, params)
                owners[seq.id] = prompt
                if engine.add(seq).finished:
                    engine.remove(seq)
                    finish(seq)
            if not engine.running:
                break
            for output in engine.step():
                if output.finished:
                    engine.remove(output.sequence)
                    finish(output.sequence)
    return written


def _drop_partial_line(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    path.write_text(text[: text.rfind("\n") + 1], encoding="utf-8")
