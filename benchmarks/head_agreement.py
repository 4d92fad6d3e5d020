"""Held-out agreement of EAGLE heads, side by side on the same records.

Each head's top-1 agreement with the target per draft position (`specdec train-draft`'s own
measure, `specdec.training.heads.evaluate`) on the answer tokens of the held-out split of one
answers file (the same hash split train-draft uses, so none of these records trained a head
trained on that file). Heads trained by different runs report on different held-out sets in
their report.json; this compares them on one.

With `--prompts FILE` (a benchmark file, never trained on) instead: the target's own greedy
answers to the first turn of `--per-category` prompts of each category, up to `--max-tokens`,
and each head's agreement on them, in all and per category. At the first position this is
what eagle's acceptance at k = 1 will be on those prompts, without timing anything.

    python benchmarks/head_agreement.py --answers heads/my-eagle/answers.jsonl \
        specdec/data/heads/eagle/SmolLM2-135M-Instruct heads/my-eagle --json agreement.json
    python benchmarks/head_agreement.py --prompts ../shared/data/norm/spec_bench.jsonl \
        --per-category 3 specdec/data/heads/eagle/SmolLM2-135M-Instruct heads/my-eagle
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import torch

from specdec.bench.data import load_records, select
from specdec.drafters.eagle import EagleHead
from specdec.engine import Engine
from specdec.methods import EagleTrainOptions
from specdec.models import LoadedModel, load_model
from specdec.models.prompts import PromptEncoder
from specdec.sampling.params import SamplingParams
from specdec.training.corpus import read_answers, split_of
from specdec.training.heads import TargetView, TrainConfig, answer_start, evaluate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("heads", nargs="+", type=Path, help="EAGLE head directories")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--answers", type=Path, help="an answers.jsonl written by train-draft")
    source.add_argument("--prompts", type=Path, help="a benchmark JSONL file: the target answers its prompts")
    parser.add_argument("--per-category", type=int, default=3, help="with --prompts: prompts of each category")
    parser.add_argument("--max-tokens", type=int, default=128, help="with --prompts: longest answer")
    parser.add_argument("--sequences", type=int, default=TrainConfig.max_validation_sequences)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target = load_model(None)
    if args.prompts:
        report = on_prompts(target, args.heads, args.prompts, args.per_category, args.max_tokens)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(report, indent=2) + "\n")
        return
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
        agreement = evaluate(head, view, sequences, config.head_options)
        report["heads"][str(directory)] = agreement
        print(f"{str(directory):60s} " + "  ".join(f"{a:.3f}" for a in agreement), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")


def on_prompts(target: LoadedModel, heads: list[Path], prompts: Path, per_category: int, max_tokens: int) -> dict:
    """Each head's agreement on the target's greedy answers to benchmark prompts, per category."""
    records = select(load_records(prompts), per_category)
    encoder, engine = PromptEncoder(target), Engine(target)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    limit = TrainConfig.max_seq_len
    by_category: dict[str, list[tuple[list[int], int]]] = defaultdict(list)
    for record in records:
        prompt_ids = encoder.encode([{"role": "user", "content": record.turns[0]}])
        answer = engine.generate(prompt_ids, params).token_ids
        # The last `limit` tokens (training's longest sequence), the answer whole where it fits;
        # counted from the first position whose prediction is an answer token (answer_start's).
        sequence = (prompt_ids + answer)[-limit:]
        by_category[record.category].append((sequence, max(0, len(sequence) - len(answer) - 2)))
    report = {"prompts": str(prompts), "per_category": per_category, "max_tokens": max_tokens, "heads": {}}
    for directory in heads:
        head = EagleHead.load(directory, target).eval()
        view = TargetView(target, head.config.target_layers, head.draft_ids)
        every = [s for group in by_category.values() for s in group]
        options = EagleTrainOptions()  # the draft depths training measures
        result = {"all": evaluate(head, view, every, options),
                  **{c: evaluate(head, view, group, options) for c, group in by_category.items()}}
        report["heads"][str(directory)] = result
        print(str(directory))
        for name, agreement in result.items():
            print(f"  {name:20s} " + "  ".join(f"{a:.3f}" for a in agreement), flush=True)
    return report


if __name__ == "__main__":
    main()
