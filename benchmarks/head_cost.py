"""What one drafted token of a head costs against one plain target step, side by side.

Loads the default model (its default format), warms a 64-token context, then alternates: one
plain target step (one token into the KV cache, rolled back after) and one EAGLE draft token
(the shipped head, packed in each `--format`: its layer at one position and its scores), and
Medusa's K tokens (one pass), `--repeats`
times each; reports the medians and the ratio. The README's "a draft token costs 4% of a
target step" comes from here.

    python benchmarks/head_cost.py --threads 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from specdec.config import SamplingParams, SpeculativeConfig
from specdec.methods import build_drafter
from specdec.drafters.eagle import EagleDrafter
from specdec.models import ModelRunner, load_model

GREEDY = SamplingParams(temperature=0.0)


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--format", action="append", default=None, help="EAGLE weight formats (repeatable; default int8)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target = load_model(None)
    runner = ModelRunner(target)
    context = list(range(1000, 1064))
    cache = runner.new_cache(len(context) + 8)
    states = runner.forward(cache, context, hidden_layers=range(target.num_layers)).layer_states

    def target_step() -> None:
        runner.forward(cache, [context[-1]], last_only=True)
        cache.rollback(len(context))  # every step sees the same cache

    report = {"model": target.name, "threads": args.threads, "plain_step_ms": median_ms(target_step, args.repeats)}
    eagle = build_drafter(SpeculativeConfig.from_dict({"method": "eagle"}), target)
    for fmt in args.format or ["int8"]:
        drafter = EagleDrafter(eagle.head, weight_format=fmt)
        drafter.begin(context, len(context) + 16)
        drafter.observe_target(torch.cat([states[i][:-1] for i in drafter.target_layers], dim=-1))
        drafter.propose(context, 1, GREEDY, None)  # the committed positions' entries, built once
        state, token = drafter._state, torch.tensor([context[-1]])
        # One drafted token: the head's layer at the next position (its slot rewritten every
        # time), then its scores over the draft vocabulary.
        ms = median_ms(lambda: drafter._logits(drafter._run(state, token, len(context) - 1)), args.repeats)
        report[f"eagle_{fmt}_token_ms"] = ms
        report[f"eagle_{fmt}_vs_step"] = ms / report["plain_step_ms"]
    medusa = build_drafter(SpeculativeConfig.from_dict({"method": "medusa"}), target)
    medusa.begin(context, len(context) + 16)
    medusa.observe_target(states[target.num_layers - 1][:-1])
    k = medusa.heads.config.num_heads
    ms = median_ms(lambda: medusa.propose(context, k, GREEDY, None), args.repeats)
    report["medusa_pass_ms"], report["medusa_heads"], report["medusa_vs_step"] = ms, k, ms / report["plain_step_ms"]
    for key, value in report.items():
        print(f"{key}: {value:.4g}" if isinstance(value, float) else f"{key}: {value}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
