"""How well a head's own probabilities predict what the target accepts: the ground under
`draft_confidence`.

Generates greedy answers to the prompts of `--data` (first turns, `--per-category` of each) with
the EAGLE head drafting a chain of `-k` tokens every step, no floor, and records for every
drafted token the head's top probability and the chain's probability so far (the product of the
head's probabilities along it, what the floor reads), and whether the target accepted the chain
through that token. Prints, per draft position, the share accepted in bins of each; `--json`
writes the bins.

    python benchmarks/head_calibration.py --data benchmarks/results/tune_prompts.jsonl \
        --json benchmarks/results/head_calibration_tune_29m.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from specdec.bench.data import load_records, select
from specdec.config import SamplingParams, SpeculativeConfig
from specdec.drafters.eagle import EagleDrafter
from specdec.engine import Engine
from specdec.methods import build_drafter
from specdec.models import load_model
from specdec.models.prompts import PromptEncoder

EDGES = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


class RecordingDrafter(EagleDrafter):
    """An EAGLE drafter that keeps, for every proposal, where it was made, its tokens and the
    head's top probability for each."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.proposals: list[tuple[int, list[int], list[float]]] = []
        self._tops: list[float] = []

    def _logits(self, state: torch.Tensor) -> torch.Tensor:
        logits = super()._logits(state)
        self._tops.append(float(torch.softmax(logits[0], dim=-1).max()))
        return logits

    def propose(self, context, k, params, generator):
        self._tops = []
        proposal = super().propose(context, k, params, generator)
        self.proposals.append((len(context), proposal.tokens, self._tops[: len(proposal.tokens)]))
        return proposal

    def fork(self) -> RecordingDrafter:
        return self  # one request at a time: the engine's fork is this drafter


def drafted_tokens(drafter: RecordingDrafter, output: list[int]) -> list[dict]:
    """Per drafted token: its position in the chain, the head's top probability, the chain's
    probability through it, and whether the target's tokens (`output`: prompt and answer) hold
    the chain through it."""
    rows = []
    for start, tokens, tops in drafter.proposals:
        chance, held = 1.0, True
        for j, (token, top) in enumerate(zip(tokens, tops)):
            chance *= top
            held = held and start + j < len(output) and output[start + j] == token
            rows.append({"position": j, "top": top, "chance": chance, "accepted": held})
    return rows


def bins(rows: list[dict], key: str) -> list[dict]:
    found = []
    for low, high in zip(EDGES, EDGES[1:]):
        inside = [r for r in rows if low <= r[key] < high or (high == 1.0 and r[key] == 1.0)]
        if inside:
            found.append({"from": low, "to": high, "tokens": len(inside),
                          "accepted": round(sum(r["accepted"] for r in inside) / len(inside), 3)})
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--per-category", type=int, default=None)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("-k", type=int, default=4)
    parser.add_argument("--head", default=None, help="a head directory (default: the one shipped for the model)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target = load_model(None)
    config = {"method": "eagle", **({"model": args.head} if args.head else {})}
    head = build_drafter(SpeculativeConfig.from_dict(config), target).head
    records = select(load_records(args.data), args.per_category)
    encoder = PromptEncoder(target)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    rows = []
    for record in records:
        ids = encoder.encode([{"role": "user", "content": record.turns[0]}])
        drafter = RecordingDrafter(head)
        result = Engine(target, drafter, args.k).generate(ids, params)
        rows += drafted_tokens(drafter, ids + result.token_ids)
    report = {"model": target.name, "data": str(args.data), "prompts": len(records), "k": args.k,
              "max_tokens": args.max_tokens, "head": args.head or "shipped", "positions": []}
    for j in range(args.k):
        at = [r for r in rows if r["position"] == j]
        report["positions"].append({"position": j + 1, "tokens": len(at),
                                    "accepted": round(sum(r["accepted"] for r in at) / max(1, len(at)), 3),
                                    "by_top": bins(at, "top"), "by_chance": bins(at, "chance")})
    for position in report["positions"]:
        print(f"draft position {position['position']}: {position['tokens']} tokens, {position['accepted']:.3f} accepted")
        print("  chain probability   tokens  accepted")
        for b in position["by_chance"]:
            print(f"  {b['from']:.1f}-{b['to']:.1f}            {b['tokens']:6d}  {b['accepted']:.3f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
