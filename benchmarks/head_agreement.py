"""Held-out agreement of EAGLE heads, side by side on the same records.

Each head's top-1 agreement with the target per draft position (`specdec train-draft`'s own
measure, `specdec.training.heads.evaluate`) on the answer tokens of the held-out split of one
answers file (the same hash split train-draft uses, so none of these records trained a head
trained on that file). Heads trained by different runs report on different held-out sets in
their report.json; this compares them on one.

    python benchmarks/head_agreement.py --answers heads/my-eagle/answers.jsonl \
        specdec/data/heads/eagle/SmolLM2-135M-Instruct heads/my-eagle --json agreement.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from specdec.drafters.eagle import EagleHead
from specdec.models import load_model
from specdec.training.corpus import read_answers, split_of
from specdec.training.heads import TargetView, TrainConfig, answer_start, evaluate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("heads", nargs="+", type=Path, help="EAGLE head directories")
    parser.add_argument("--answers", type=Path, required=True, help="an answers.jsonl written by train-draft")
    parser.add_argument("--sequences", type=int, default=TrainConfig.max_validation_sequences)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target = load_model(None)
    config = TrainConfig()
    held_out = [r for r in read_answers(args.answers) if split_of(r["id"], config.validation_fraction) == "validation"]
    held_out = held_out[: args.sequences]
    if not held_out:
        raise SystemExit(f"no held-out records in {args.answers}")
    sequences = [((r["prompt_ids"] + r["answer_ids"])[: config.max_seq_len], answer_start(r)) for r in held_out]
    report = {"answers": str(args.answers), "sequences": len(sequences),
              "answer_tokens": sum(len(r["answer_ids"]) for r in held_out), "heads": {}}
    for directory in args.heads:
        head = EagleHead.load(directory, target).eval()
        view = TargetView(target, head.config.target_layers, head.draft_ids)
        agreement = evaluate(head, view, sequences, config.ttt_steps)
        report["heads"][str(directory)] = agreement
        print(f"{str(directory):60s} " + "  ".join(f"{a:.3f}" for a in agreement), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
