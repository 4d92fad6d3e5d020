"""Training text for draft heads: prompts, and the target's own answers to them.

A head learns to predict what the target says, so the best text to learn on is the target's own
output (self-distillation, as Medusa-2, HASS and EAGLE-3 do). Prompts come from a JSONL file in
the benchmark format (`{"id", "turns": [...]}`; never Spec-Bench or MT-bench), from
Python's standard library on this machine (functions with docstrings, as code requests), and from
the target itself (requests it writes when given an empty user turn). The
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
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


def text_prompts(path: str | Path, count: int, exclude: set[str], seed: int = 0) -> list[Prompt]:
    """The prompts of the file whose raw text :func:`text_records` takes: a seeded sample of
    `count`, leaving out the ids in `exclude`."""
    pool = [p for p in file_prompts(path) if p.id not in exclude]
    return random.Random(seed + 1).sample(pool, min(count, len(pool)))


def text_records(target: LoadedModel, path: str | Path, count: int, exclude: set[str], seed: int = 0,
                 max_tokens: int = 512) -> list[dict]:
    """Fixed text (EAGLE-1 trained on fixed text, not on the target's answers): the raw text of
    a seeded sample of `count` prompts of the file, leaving out the ids in `exclude` (prompts
    whose answers are in the training data, so none of a held-out answer's prompt is trained
    on). Each record is `{"id", "category", "kind": "text", "prompt_ids": [], "answer_ids"}`:
    every position counts, and it never enters the held-out split (that stays answers)."""
    records = []
    for prompt in text_prompts(path, count, exclude, seed):
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

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    written = 0
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a", encoding="utf-8") as sink:

        def finish(prompt: Prompt, seq: Sequence) -> None:
            nonlocal written
            record = {"id": prompt.id, "category": prompt.category, "prompt_ids": seq.prompt_ids,
                      "answer_ids": seq.result.token_ids}
            sink.write(json.dumps(record) + "\n")
            sink.flush()
            written += 1
            on_answer(record)

        decode_rows(target, ((prompt, ids, params) for prompt, ids in encoded()), rows,
                    max_prompt_tokens + max_tokens + 1, should_stop, finish)
    return written


def decode_rows(target: LoadedModel, requests: Iterator[tuple[Any, list[int], SamplingParams]], rows: int,
                max_model_len: int, should_stop: Callable[[], bool], finish: Callable[[Any, Sequence], None]) -> None:
    """Decode `(owner, prompt ids, params)` requests through the batched engine, `rows` at a
    time, calling `finish(owner, sequence)` as each ends. Once `should_stop()` holds, no request
    joins; the running ones finish."""
    engine = BatchEngine(target, max_rows=rows, max_model_len=max_model_len, max_draft=1)
    owners: dict[int, Any] = {}

    def done(seq: Sequence) -> None:
        engine.remove(seq)
        finish(owners.pop(seq.id), seq)

    exhausted = False
    while True:
        while not exhausted and not should_stop() and engine.running < rows:
            item = next(requests, None)
            if item is None:
                exhausted = True
                break
            owner, ids, params = item
            first = engine.admit(ids, params)
            owners[first.sequence.id] = owner
            if first.finished:
                done(first.sequence)
        if not engine.running:
            break
        for output in engine.step():
            if output.finished:
                done(output.sequence)


# Requests the target writes itself (Magpie: Xu et al., 2024). An aligned chat model given its
# template up to an empty user turn writes a plausible user request; answered, these requests
# cover the open-ended chat (writing, advice, explanations, small programs) that the prompt
# files lack, in the target's own words. Sampled at temperature 1 with a little of the tail cut.
SELF_PREFIX = "self:"
SELF_TEMPERATURE = 1.0
SELF_TOP_P = 0.95
SELF_WORDS = (3, 150)  # fewer words is rarely a request; more is usually a ramble
SHARED_RUN = 12  # words: a request sharing this long a run with a benchmark prompt is dropped
_WORD = re.compile(r"\w+")


def open_user_turn(target: LoadedModel) -> list[int]:
    """The target's chat template up to where a user's request begins (its system prompt and
    the user turn's header), as token ids."""
    tokenizer = target.tokenizer
    mark = "\x00request\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": mark}], tokenize=False) \
        if tokenizer.chat_template is not None else ""
    if mark not in text:
        raise ConfigError(f"--self-prompts needs a chat model: {target.name}'s tokenizer has no chat template with a user turn")
    return list(tokenizer(text[: text.index(mark)], add_special_tokens=False)["input_ids"])


def word_runs(text: str, length: int = SHARED_RUN) -> set[tuple[str, ...]]:
    """Every run of `length` consecutive words of the text, lower-cased."""
    words = [w.lower() for w in _WORD.findall(text)]
    return {tuple(words[i:i + length]) for i in range(len(words) - length + 1)}


def excluded_runs(paths: Iterable[str | Path]) -> set[tuple[str, ...]]:
    """The word runs of every turn of the prompt files (benchmarks) no training request may share."""
    runs: set[tuple[str, ...]] = set()
    for path in paths:
        for number, line in enumerate(Path(path).expanduser().read_text(encoding="utf-8").split("\n"), 1):
            if line.strip():
                try:
                    turns = json.loads(line)["turns"]
                except (json.JSONDecodeError, KeyError, TypeError) as exc:
                    raise ConfigError(f"{path}:{number}: not a prompt record ({exc})") from None
                for turn in turns:
                    runs |= word_runs(str(turn))
    return runs


class RequestFilter:
    """The usable requests among written attempts (`{"attempt", "text", "finished"}`), judged in
    attempt order and only over attempts 0..n-1 all written, so that a killed and resumed run
    keeps exactly what an uninterrupted one does. Usable: ended by the model (not cut at the
    token limit), of SELF_WORDS words, not a repeat of an earlier one, and sharing no word run
    with `exclude`. Judging stops at `count` kept."""

    def __init__(self, count: int, exclude: set[tuple[str, ...]] = frozenset()) -> None:
        self.count = count
        self.exclude = exclude
        self.kept: list[Prompt] = []
        self.judged = 0  # attempts 0..judged-1 are judged
        self._waiting: dict[int, dict] = {}
        self._seen: set[str] = set()

    @property
    def full(self) -> bool:
        return len(self.kept) >= self.count

    def add(self, attempt: dict) -> None:
        self._waiting[attempt["attempt"]] = attempt
        while not self.full and self.judged in self._waiting:
            self._judge(self._waiting.pop(self.judged))
            self.judged += 1

    def _judge(self, attempt: dict) -> None:
        text = attempt["text"].strip()
        words = " ".join(_WORD.findall(text.lower()))
        if not attempt["finished"] or not SELF_WORDS[0] <= words.count(" ") + 1 <= SELF_WORDS[1] or words in self._seen:
            return
        if self.exclude and word_runs(text) & self.exclude:
            return
        self._seen.add(words)
        self.kept.append(Prompt(f"{SELF_PREFIX}{attempt['attempt']}", "self", text))


def self_prompts(target: LoadedModel, count: int, out: Path, *, seed: int = 0, rows: int = 32, max_tokens: int = 128,
                 exclude: set[tuple[str, ...]] = frozenset(), attempts_per_request: int = 4,
                 should_stop: Callable[[], bool] = lambda: False,
                 on_kept: Callable[[Prompt], None] = lambda request: None) -> list[Prompt]:
    """Up to `count` requests the target writes itself from its open user turn
    (:func:`open_user_turn`), attempt n sampled with its own seed, at most
    `attempts_per_request` attempts a request. Every attempt is appended to `out` as it ends,
    so a rerun continues where a killed one stopped and keeps the same requests
    (:class:`RequestFilter`)."""
    if count <= 0:
        return []
    prefix = open_user_turn(target)
    _drop_partial_line(out)
    chosen = RequestFilter(count, exclude)
    written = set()
    for attempt in read_answers(out):
        chosen.add(attempt)
        written.add(attempt["attempt"])
    for request in chosen.kept:
        on_kept(request)

    def requests() -> Iterator[tuple[int, list[int], SamplingParams]]:
        for n in range(count * attempts_per_request):
            if n not in written:
                yield n, prefix, SamplingParams(max_tokens=max_tokens, temperature=SELF_TEMPERATURE, top_p=SELF_TOP_P,
                                                seed=seed * 1_000_003 + n)

    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a", encoding="utf-8") as sink:

        def finish(n: int, seq: Sequence) -> None:
            attempt = {"attempt": n, "text": target.tokenizer.decode(seq.result.token_ids, skip_special_tokens=True),
                       "finished": seq.result.finish_reason == "stop"}
            sink.write(json.dumps(attempt) + "\n")
            sink.flush()
            before = len(chosen.kept)
            chosen.add(attempt)
            for request in chosen.kept[before:]:
                on_kept(request)

        if not chosen.full:
            decode_rows(target, requests(), rows, len(prefix) + max_tokens + 1,
                        lambda: should_stop() or chosen.full, finish)
    return chosen.kept


def _drop_partial_line(path: Path) -> None:
    """Cut a JSONL file back to its last complete line (a killed run may leave half of one)."""
    if not path.is_file():
        return
    text = path.read_text(encoding="utf-8")
    if text and not text.endswith("\n"):
        path.write_text(text[: text.rfind("\n") + 1], encoding="utf-8")
