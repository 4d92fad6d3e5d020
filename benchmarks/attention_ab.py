"""Versions of specdec's kernels side by side in one process: attention over the KV cache, alone
and in a batch step.

Each `--variant NAME=SOURCE` is built as `kernels_ab.py` builds it (a directory of kernel sources,
or `git:REV`). Two measures, rounds interleaving the variants so that the machine's drift hits
them alike:

- attention alone (`attend_cached`): for each `--case ROWS:CONTEXT:QUERIES`, the model's shape
  (SmolLM2: 9 query heads over 3 key/value heads of 64) over a float16 cache, one call per layer
  for 30 layers, each layer its own cache (as a pass reads them: nothing left in the caches
  between layers); the fastest of 5 calls per round, the median over rounds. Every variant's
  output is checked bitwise equal to the first's;
- with `--batch-rows N`: the default model's batch step (`BatchEngine.step`, plain decoding) over
  N Spec-Bench prompts (`--data`), the variants alternating step by step (their bits are equal,
  so every step continues the same sequences); the median step per variant.

    python benchmarks/attention_ab.py --variant before=git:HEAD~1 --variant after=specdec/kernels
    python benchmarks/attention_ab.py --variant before=git:HEAD~1 --variant after=specdec/kernels \\
        --case 16:150:1 --batch-rows 16 --json benchmarks/results/attention_ab.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from kernels_ab import built_variants, use
from specdec import kernels
from specdec.bench.data import load_records
from specdec.config import SamplingParams
from specdec.engine.batch import BatchEngine
from specdec.models.backend import cpu_model
from specdec.models.loader import load_model
from specdec.models.prompts import PromptEncoder

CASES = ["1:300:1", "1:300:5", "1:1000:1", "1:1000:2", "1:1000:5", "4:400:4", "16:150:1", "16:150:2", "16:400:1"]
LAYERS, HEADS, KV_HEADS, HEAD_DIM = 30, 9, 3, 64


def attention_alone(variants: dict, cases: list[tuple[int, int, int]], rounds: int) -> dict:
    isa = kernels.ISAS[kernels.default_isa()]
    no_slots = torch.zeros(0, dtype=torch.int32)
    generator = torch.Generator().manual_seed(0)
    report = {}
    for rows, context, queries in cases:
        size = (rows, KV_HEADS, context + 8, HEAD_DIM)
        keys = [torch.randn(size, generator=generator).half() for _ in range(LAYERS)]
        values = [torch.randn(size, generator=generator).half() for _ in range(LAYERS)]
        q = torch.randn(rows, HEADS, queries, HEAD_DIM, generator=generator)
        counts = (torch.arange(queries, dtype=torch.int32) + context - queries + 1).repeat(rows, 1).contiguous()
        times = {name: [] for name in variants}
        outputs = {}
        for _ in range(rounds):
            for name, module in variants.items():
                samples = []
                for _ in range(5):
                    start = time.perf_counter()
                    out = [module.attend_cached(q, keys[i], values[i], counts, no_slots, HEAD_DIM ** -0.5, isa)
                           for i in range(LAYERS)]
                    samples.append(time.perf_counter() - start)
                times[name].append(min(samples))
                outputs[name] = out
        first = next(iter(variants))
        report[f"{rows}:{context}:{queries}"] = {
            **{name: 1e3 * statistics.median(t) for name, t in times.items()},
            "bitwise_equal": all(all(torch.equal(a, b) for a, b in zip(outputs[first], outputs[name])) for name in variants)}
    return report


def batch_step(variants: dict, rows: int, steps: int, data: Path) -> dict:
    model = load_model()
    encoder = PromptEncoder(model)
    records = load_records(data)
    prompts = [encoder.encode([{"role": "user", "content": r.turns[0]}]) for r in records[:: max(1, len(records) // rows)][:rows]]
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    engine = BatchEngine(model, max_rows=rows, max_model_len=max(len(p) for p in prompts) + steps + 16)
    for ids in prompts:
        engine.admit(ids, params)
    times = {name: [] for name in variants}
    names = list(variants)
    for step in range(steps):
        name = names[step % len(names)]
        use(model.backend, variants[name])
        start = time.perf_counter()
        engine.step()
        times[name].append(time.perf_counter() - start)
    contexts = [len(ids) for ids in prompts]
    return {"rows": rows, "steps": steps, "prompt_tokens_mean": sum(contexts) / len(contexts),
            **{name: 1e3 * statistics.median(t) for name, t in times.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", action="append", required=True, metavar="NAME=SOURCE",
                        help="a kernel source directory or git:REV (repeatable; the first is the baseline)")
    parser.add_argument("--case", action="append", default=None, metavar="ROWS:CONTEXT:QUERIES",
                        help=f"attention alone (repeatable; default: {' '.join(CASES)})")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--batch-rows", type=int, default=0, help="also time the batch step over this many prompts")
    parser.add_argument("--batch-steps", type=int, default=120)
    parser.add_argument("--data", type=Path, default=Path("../shared/data/norm/spec_bench.jsonl"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    variants = built_variants(args.variant)
    cases = [tuple(int(x) for x in case.split(":")) for case in (args.case or CASES)]
    report = {"cpu": cpu_model(), "path": kernels.default_isa(),
              "threads": args.threads, "attention_ms_30_layers": attention_alone(variants, cases, args.rounds)}
    names = list(variants)
    print(f"attention alone, {LAYERS} layers, ms (path {report['path']}, {args.threads} threads)")
    for case, row in report["attention_ms_30_layers"].items():
        cells = "  ".join(f"{name} {row[name]:.3f}" for name in names)
        print(f"  rows:context:queries {case:>10s}  {cells}  {names[-1]}/{names[0]} {row[names[-1]] / row[names[0]]:.3f}"
              f"  bitwise equal: {row['bitwise_equal']}")
    if args.batch_rows:
        row = report["batch_step_ms"] = batch_step(variants, args.batch_rows, args.batch_steps, args.data)
        cells = "  ".join(f"{name} {row[name]:.2f}" for name in names)
        print(f"batch step, {row['rows']} rows, {row['steps']} steps from prompts of {row['prompt_tokens_mean']:.0f} "
              f"tokens on average, ms: {cells}  {names[-1]}/{names[0]} {row[names[-1]] / row[names[0]]:.3f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
