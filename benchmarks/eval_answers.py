"""An evaluation set for draft heads that no compared head trained on, and prompts to train on without it.

Writes (1) the target's greedy answers to N prompts of a training-prompt file whose ids fall in
train-draft's held-out hash split and that no given answers file holds (so no head trained by
train-draft on that file trained on them): evaluate heads on it with `head_agreement.py`; and
(2) optionally, the file's other prompts (none in the held-out split, none answered in the
given files), for a fixed-text run (`train-draft --text`) that must not see the evaluation text.

    python benchmarks/eval_answers.py --data ../shared/data/train/norm/train_prompts.jsonl \
        --exclude heads/a/answers.jsonl --count 64 --out eval_answers.jsonl --rest train_rest.jsonl
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specdec.models import load_model
from specdec.training.corpus import file_prompts, generate_answers, read_answers, split_of
from specdec.training.heads import TrainConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, required=True, help="training prompts (never benchmark prompts)")
    parser.add_argument("--exclude", type=Path, action="append", default=[], help="answers files to leave out")
    parser.add_argument("--count", type=int, default=64, help="prompts to answer")
    parser.add_argument("--out", type=Path, required=True, help="answers file to write (a rerun continues it)")
    parser.add_argument("--rest", type=Path, default=None, help="write the prompts left for training here")
    args = parser.parse_args()
    answered = {r["id"] for path in args.exclude for r in read_answers(path)}
    fraction = TrainConfig().validation_fraction
    prompts = file_prompts(args.data)
    held_out = [p for p in prompts if split_of(p.id, fraction) == "validation" and p.id not in answered]
    if args.rest is not None:
        keep = {p.id for p in prompts if split_of(p.id, fraction) != "validation" and p.id not in answered}
        lines = [line for line in args.data.read_text(encoding="utf-8").split("\n")
                 if line.strip() and str(json.loads(line)["id"]) in keep]
        args.rest.write_text("\n".join(lines) + "\n", encoding="utf-8")
        print(f"{len(lines)} prompts for training in {args.rest}")
    generate_answers(load_model(None), held_out[: args.count], args.out)
    print(f"{len(read_answers(args.out))} evaluation answers in {args.out} "
          f"(of {len(held_out)} held-out prompts not answered in --exclude)")


if __name__ == "__main__":
    main()
