"""One `specdec train-draft` run: the target answers training prompts (kept as they come, so a
rerun continues), then a head trains on the answers within the run's budget, resuming from its
checkpoint. The CLI parses and reports; the budget and resume rules live here."""

from __future__ import annotations

import contextlib
import dataclasses
import random
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from specdec.methods import head_family
from specdec.errors import ConfigError
from specdec.models.loader import LoadedModel
from specdec.training.corpus import (Prompt, back_translations, excluded_runs, generate_answers, read_answers,
                                     select_prompts, self_prompts, source_id, task_prompts, text_records)
from specdec.training.heads import (BF16, BUDGET_FIELDS, CHECKPOINT_FILE, MACHINE_FIELDS, Progress, TrainConfig,
                                    saved_settings, train_head, training_device)

ANSWERS_FILE = "answers.jsonl"
REQUESTS_FILE = "self_prompts.jsonl"  # every request the target wrote for --self-prompts, kept or not

# progress(label, total) -> a context whose value is called once per item done
ProgressFactory = Callable[[str, int], AbstractContextManager[Callable[[object], None]]]


@contextlib.contextmanager
def _silent(label: str, total: int) -> Iterator[Callable[[object], None]]:
    yield lambda item: None


@dataclass(frozen=True)
class TrainRun:
    """What a run does (the options of `specdec train-draft`). `head_options`: the options of
    the `arch` family given (e.g. {"ttt_steps": 4} from --ttt-steps), the rest at the family's
    defaults; an option of another family is refused."""

    out_dir: Path
    arch: str
    data: Path | None = None
    answers: int = 2000
    code_prompts: int = 300
    answer_tokens: int = 160
    answer_time: float | None = None
    max_time: float | None = None
    max_tokens: int | None = None
    draft_vocab: int = 8192
    head_options: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    init: Path | None = None
    answers_from: Path | None = None
    text: int = 0
    tasks: int = 0
    self_prompts: int = 0
    exclude: tuple[Path, ...] = ()
    answer_rows: int = 32
    batch_tokens: int = TrainConfig.batch_tokens
    bf16: str = "auto"
    device: str = "cpu"
    checkpoint_every: float = TrainConfig.checkpoint_every_s
    resume: bool = False

    def check(self) -> None:
        """ConfigError for what would fail later: before the target loads."""
        head_family(self.arch).make_options(self.head_options)  # an unknown architecture, or another's options
        if self.max_time is None and self.max_tokens is None:
            raise ConfigError("give a budget: --max-time SECONDS and/or --max-tokens N")
        if not self.resume and ((self.out_dir / ANSWERS_FILE).exists() or (self.out_dir / CHECKPOINT_FILE).exists()):
            raise ConfigError(f"{self.out_dir} holds an earlier run: pass --resume to continue it, or choose another --out")
        if self.answers_from is not None and not self.answers_from.is_file():
            raise ConfigError(f"answers file not found: {self.answers_from}")
        if self.text and self.data is None:
            raise ConfigError("--text takes its text from the prompts of --data: give --data")
        if self.tasks and self.data is None:
            raise ConfigError("--tasks builds its requests from the prompts of --data: give --data")
        if self.self_prompts and self.answers_from is not None:
            raise ConfigError("--self-prompts are answered by this run: leave out --answers-from")
        for path in self.exclude:
            if not path.is_file():
                raise ConfigError(f"--exclude file not found: {path}")
        if self.answer_rows < 1 or self.batch_tokens < 64 or self.checkpoint_every < 0:
            raise ConfigError("--answer-rows must be at least 1, --batch-tokens at least 64 and --checkpoint-every at least 0")
        if self.bf16 not in BF16:
            raise ConfigError(f"--bf16 must be one of {', '.join(BF16)}, got {self.bf16!r}")
        training_device(self.device)  # one this machine has


def resumed_config(out_dir: Path, fresh: TrainConfig) -> TrainConfig:
    """The settings of the run a --resume continues; its budget too, unless this run gives one
    (a larger --max-time or --max-tokens trains longer); this run's device and bfloat16 choice."""
    path = out_dir / CHECKPOINT_FILE
    if not path.is_file():
        return fresh
    saved = saved_settings(torch.load(path, weights_only=False, map_location="cpu")["config"])  # written on any device
    keep = {k: v for k, v in saved.items() if k in TrainConfig.__dataclass_fields__ and k not in MACHINE_FIELDS
            and (k not in BUDGET_FIELDS or getattr(fresh, k) is None)}
    keep["head_options"] = head_family(keep.get("arch", fresh.arch)).make_options(keep["head_options"])
    return dataclasses.replace(fresh, **keep)


def answer(target: LoadedModel, prompts: list[Prompt], path: Path, label: str, run: TrainRun, out_of_time: Callable[[], bool],
           progress: ProgressFactory) -> None:
    """The target's answers to the prompts not yet in `path`, appended to it."""
    done = {r["id"] for r in read_answers(path)}
    with progress(label, len(prompts)) as advance:
        for _ in range(sum(p.id in done for p in prompts)):
            advance(None)
        generate_answers(target, prompts, path, max_tokens=run.answer_tokens, rows=run.answer_rows,
                         should_stop=out_of_time, on_answer=advance)


def train_draft(target: LoadedModel, run: TrainRun, *, start: float | None = None, progress: ProgressFactory = _silent,
                note: Callable[[str], None] = lambda message: None,
                on_progress: Callable[[Progress], None] = lambda p: None) -> tuple[TrainConfig, dict[str, Any]]:
    """Answer, then train. `start` is when the run began (its clock: loading the target counts
    against --max-time). Returns the training settings used and train_head's result."""
    run.check()
    start = time.monotonic() if start is None else start
    answers_path = run.out_dir / ANSWERS_FILE
    if run.answers_from is not None:
        answers_path = run.answers_from
    else:
        prompts = select_prompts(run.data, run.answers, run.code_prompts, run.seed)
        if run.tasks:  # mixed in, so that a run cut short by --answer-time has some of each
            prompts += task_prompts(run.data, run.tasks, {p.id for p in prompts}, run.seed)
            random.Random(run.seed + 3).shuffle(prompts)
        answer_time = run.answer_time
        if answer_time is None:
            answer_time = run.max_time / 2 if run.max_time is not None else float("inf")
        out_of_time = lambda: time.monotonic() - start >= answer_time  # noqa: E731
        if run.self_prompts:  # mixed in too; every one is written before any is answered
            with progress("writing requests", run.self_prompts) as advance:
                requests = self_prompts(target, run.self_prompts, run.out_dir / REQUESTS_FILE, seed=run.seed,
                                        rows=run.answer_rows, exclude=excluded_runs(run.exclude), should_stop=out_of_time,
                                        on_kept=advance)
            note(f"{len(requests)} requests written by the target ({run.out_dir / REQUESTS_FILE})")
            prompts += requests
            random.Random(run.seed + 4).shuffle(prompts)
        answer(target, prompts, answers_path, "answering", run, out_of_time, progress)
        if run.tasks and not out_of_time():  # the target's translations, translated back into English
            answer(target, back_translations(target, read_answers(answers_path)), answers_path, "translating back", run,
                   out_of_time, progress)
    records = read_answers(answers_path)
    note(f"{len(records)} answers ({sum(len(r['answer_ids']) for r in records)} answer tokens) in {answers_path}")
    if run.text:
        answered = {r["id"] for r in records} | {source_id(r["id"]) for r in records}
        fixed = text_records(target, run.data, run.text, answered, run.seed)
        records += fixed
        note(f"{len(fixed)} fixed texts ({sum(len(r['answer_ids']) for r in fixed)} tokens) from {run.data}")
    remaining = None if run.max_time is None else max(0.0, run.max_time - (time.monotonic() - start))
    if run.resume and run.max_time is not None and (run.out_dir / CHECKPOINT_FILE).is_file():
        remaining = run.max_time  # training had started: --max-time is its whole budget, earlier runs included
    config = TrainConfig(arch=run.arch, head_options=head_family(run.arch).make_options(run.head_options),
                         draft_vocab_size=run.draft_vocab, max_tokens=run.max_tokens, seed=run.seed, max_time=remaining,
                         batch_tokens=run.batch_tokens, bf16=run.bf16, device=run.device,
                         checkpoint_every_s=run.checkpoint_every)
    if run.resume:  # a resumed run keeps the first run's settings, its training budget included
        config = resumed_config(run.out_dir, config)
    result = train_head(target, records, run.out_dir, config, resume=run.resume, init=run.init, on_progress=on_progress)
    return config, result
