"""What one drafted token of a head costs against one plain target step, side by side.

Loads the default model (its default format), warms a 64-token context, then alternates: one
plain target step (one token into the KV cache, rolled back after) and one EAGLE draft token
(the shipped head, packed in each `--format`: its layer at one position and its scores), and
Medusa's K tokens (one pass), `--repeats` times each; reports the medians and the ratio.

Alone, a draft token looks cheap; in the engine it also changes what the next target pass
costs (PyTorch's operations leave its worker threads spinning on the cores the kernels need).
`--engine-prompts N` measures that too: N Spec-Bench prompts (`--data`), each generated with
plain decoding and with `eagle` (k = 1) in every format, interleaved prompt by prompt in one
process; it reports tokens/s, the speedup over plain decoding, and per step the drafting and
the verification pass in milliseconds.

    python benchmarks/head_cost.py --threads 2 --engine-prompts 10
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch

from specdec.bench.data import load_records
from specdec.config import SamplingParams, SpeculativeConfig
from specdec.drafters.eagle import EagleDrafter
from specdec.engine import Engine
from specdec.methods import build_drafter
from specdec.models import ModelRunner, load_model
from specdec.models.prompts import PromptEncoder

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
    parser.add_argument("--format", action="append", default=None,
                        help="EAGLE weight formats (repeatable; default: drafting's own, q8 on the kernels, and int8)")
    parser.add_argument("--engine-prompts", type=int, default=0, help="also generate this many prompts in the engine")
    parser.add_argument("--data", type=Path, default=Path("../shared/data/norm/spec_bench.jsonl"))
    parser.add_argument("--max-tokens", type=int, default=128)
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
    formats = args.format or list(dict.fromkeys([EagleDrafter(eagle.head).weight_format, "int8"]))
    for fmt in formats:
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
    if args.engine_prompts:
        report["engine"] = in_engine(target, eagle.head, formats, args.data, args.engine_prompts, args.max_tokens)
    for key, value in report.items():
        if key == "engine":
            print(f"in the engine: {value['prompts']} prompts, {value['max_tokens']} tokens each")
            for name, row in value.items():
                if isinstance(row, dict):
                    print(f"  {name:12s} {row['tokens_per_s']:6.1f} tok/s  {row['speedup']:.2f}x  "
                          f"{row['tokens_per_step']:.2f} tokens/step  draft {row['draft_ms_per_step']:.2f} ms  "
                          f"verify {row['verify_ms_per_step']:.2f} ms a step  identical {row['identical']}/{value['prompts']}")
        else:
            print(f"{key}: {value:.4g}" if isinstance(value, float) else f"{key}: {value}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")


def in_engine(target, head, formats: list[str], data: Path, prompts: int, max_tokens: int) -> dict:
    """Plain decoding and eagle k = 1 in each format over the first turns of `prompts` prompts
    spread over the file, interleaved prompt by prompt (the machine's drift falls on all alike)."""
    records = load_records(data)
    chosen = records[:: max(1, len(records) // prompts)][:prompts]
    encoder = PromptEncoder(target)
    encoded = [encoder.encode([{"role": "user", "content": record.turns[0]}]) for record in chosen]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    engines = {"plain": Engine(target), **{f"eagle_{fmt}": Engine(target, EagleDrafter(head, fmt), 1) for fmt in formats}}
    totals = {name: {"tokens": 0, "seconds": 0.0, "steps": 0, "draft_s": 0.0, "verify_s": 0.0} for name in engines}
    outputs: dict[str, list[list[int]]] = {name: [] for name in engines}
    for engine in engines.values():
        engine.generate(encoded[0][:16], dataclasses.replace(params, max_tokens=4))  # warm
    for ids in encoded:
        for name, engine in engines.items():
            start = time.perf_counter()
            result = engine.generate(ids, params)
            total = totals[name]
            total["seconds"] += time.perf_counter() - start
            stats = result.stats
            total["tokens"] += len(result.token_ids)
            total["steps"] += stats.target_steps
            total["draft_s"] += stats.draft_time_s
            total["verify_s"] += stats.verify_time_s
            outputs[name].append(result.token_ids)
    plain_rate = totals["plain"]["tokens"] / totals["plain"]["seconds"]
    report = {"prompts": len(encoded), "max_tokens": max_tokens}
    for name, total in totals.items():
        rate = total["tokens"] / total["seconds"]
        report[name] = {"tokens_per_s": rate, "speedup": rate / plain_rate,
                        "tokens_per_step": total["tokens"] / total["steps"],
                        "draft_ms_per_step": 1000 * total["draft_s"] / total["steps"],
                        "verify_ms_per_step": 1000 * total["verify_s"] / total["steps"],
                        "identical": sum(a == b for a, b in zip(outputs[name], outputs["plain"]))}
    return report


if __name__ == "__main__":
    main()
