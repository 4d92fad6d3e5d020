"""Held-out prompts for benchmarking a trained head: prompts of a training-prompt file that the
head never saw, in `specdec bench`'s record format.

A prompt is held out when its id falls in train-draft's validation hash split (whose answers no
run trains on), no given answers file holds it, or a request built from it (`--tasks`' summaries
and translations carry their source's id), and no run's fixed text (`--text`, which samples
outside the answered prompts only) took it: `--exclude-text N` for each such run. The first `--per-category` of each category are
written, in file order, so that a rerun writes the same file.

    python benchmarks/held_out_prompts.py --data ../shared/data/train/norm/train_prompts.jsonl \
        --exclude runs/eagle/answers.jsonl --exclude-text 8000 --per-category 1 --out held_out.jsonl
    specdec bench --data held_out.jsonl --method eagle ...
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specdec.training.corpus import read_answers, source_id, split_of, text_prompts
from specdec.training.heads import TrainConfig


def held_out(lines: list[str], answered: set[str], per_category: int, fraction: float) -> list[dict]:
    """The records of `lines` (JSONL) in the validation split and not in `answered`, at most
    `per_category` of each category."""
    taken: dict[str, int] = {}
    out = []
    for line in lines:
        if not line.strip():
            continue
        record = json.loads(line)
        identifier, category = str(record["id"]), record.get("category", "")
        if split_of(identifier, fraction) != "validation" or identifier in answered:
            continue
        if taken.get(category, 0) < per_category:
            taken[category] = taken.get(category, 0) + 1
            out.append(record)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, required=True, help="training prompts (never benchmark prompts)")
    parser.add_argument("--exclude", type=Path, action="append", default=[], help="answers files whose prompts to leave out")
    parser.add_argument("--exclude-text", type=int, action="append", default=[], metavar="N",
                        help="also leave out the prompts whose fixed text a run with --text N over the --exclude "
                             "answers trained on (seed 0); repeat for each such run")
    parser.add_argument("--per-category", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    ids = {r["id"] for path in args.exclude for r in read_answers(path)}
    answered = {source_id(i) for i in ids}
    runs = ids | answered  # what text_records leaves out of its sample
    for count in args.exclude_text:
        answered |= {p.id for p in text_prompts(args.data, count, runs)}
    records = held_out(args.data.read_text(encoding="utf-8").split("\n"), answered, args.per_category,
                       TrainConfig().validation_fraction)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    print(f"{len(records)} held-out prompts in {args.out}")


if __name__ == "__main__":
    main()
