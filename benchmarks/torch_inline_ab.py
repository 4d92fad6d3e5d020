"""What running torch's own operations inline between passes saves (`kernels.torch_ops_inline`).

Each system generates the first turns of `--prompts` Spec-Bench prompts (spread over the file)
twice in one process, prompt by prompt: once as specdec runs (acceptance, penalties, logprobs and
a lookup drafter's or head's proposal with torch on one thread), once with torch's threads left as
they are (as before round 17: a torch operation over a vocabulary then leaves OpenMP workers
spinning on the cores the next pass needs). Reports tokens/s each way, the ratio, and how many
outputs the two runs share (greedy: all; sampled: the same seed, but torch's reductions on more
threads round differently, so a token may differ).

    python benchmarks/torch_inline_ab.py --prompts 8 --threads 2
    python benchmarks/torch_inline_ab.py --batch 16 --temperature 0.7   # one BatchEngine, 16 rows
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path

import torch

from specdec import kernels
from specdec.bench.data import load_records
from specdec.config import SamplingParams, SpeculativeConfig
from specdec.engine import Engine
from specdec.engine.batch import BatchEngine
from specdec.methods import build_drafter
from specdec.models import load_model
from specdec.models.backend import cpu_model
from specdec.models.prompts import PromptEncoder

SYSTEMS = {  # name: (speculative config or None, temperature)
    "plain, greedy": (None, 0.0),
    "plain, T=0.7": (None, 0.7),
    "ngram k=4, T=0.7": ({"method": "ngram"}, 0.7),
    "eagle k=3, T=1.0": ({"method": "eagle", "num_speculative_tokens": 3}, 1.0),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=0, help="instead: one BatchEngine of this many rows, plain")
    parser.add_argument("--temperature", type=float, default=0.7, help="with --batch")
    parser.add_argument("--data", type=Path, default=Path("../shared/data/norm/spec_bench.jsonl"))
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    inline = kernels.torch_ops_inline
    mode = ["inline"]
    kernels.torch_ops_inline = lambda: inline() if mode[0] == "inline" else contextlib.nullcontext()
    target = load_model(None)
    encoder = PromptEncoder(target)
    report = {"cpu": cpu_model(), "kernel_path": target.kernel_path, "threads": args.threads}
    if args.batch:
        records = load_records(args.data)[: args.batch]
        prompts = [encoder.encode([{"role": "user", "content": r.turns[0]}])[:200] for r in records]
        times: dict[str, list[float]] = {"inline": [], "threaded": []}
        for round_ in range(6):
            for name in ("threaded", "inline") if round_ % 2 else ("inline", "threaded"):
                mode[0] = name
                engine = BatchEngine(target, len(prompts), 2048)
                for i, ids in enumerate(prompts):
                    engine.admit(ids, SamplingParams(temperature=args.temperature, seed=i, max_tokens=48, ignore_eos=True))
                steps = []
                for _ in range(40):
                    start = time.perf_counter()
                    engine.step()
                    steps.append(time.perf_counter() - start)
                times[name].append(statistics.median(steps[5:]))
        step = {name: statistics.median(v) for name, v in times.items()}
        report["batch"] = {"rows": len(prompts), "temperature": args.temperature,
                           "step_ms": {name: 1000 * s for name, s in step.items()},
                           "inline_over_threaded": step["threaded"] / step["inline"]}
        print(f"{len(prompts)} rows, T={args.temperature}: a step {1000 * step['threaded']:.2f} ms threaded, "
              f"{1000 * step['inline']:.2f} inline ({step['threaded'] / step['inline']:.3f}x)")
    else:
        records = load_records(args.data)
        chosen = records[:: max(1, len(records) // args.prompts)][: args.prompts]
        prompts = [encoder.encode([{"role": "user", "content": r.turns[0]}]) for r in chosen]
        report["systems"] = {}
        for name, (config, temperature) in SYSTEMS.items():
            # An engine per way: one engine would reuse its last prompt's prefill for the second run.
            engines = {}
            for run in ("inline", "threaded"):
                drafter, k = None, 0
                if config is not None:
                    spec = SpeculativeConfig.from_dict(config)
                    drafter, k = build_drafter(spec, target), spec.num_speculative_tokens
                engines[run] = Engine(target, drafter, k)
                engines[run].generate(prompts[0][:16], SamplingParams(temperature=0.0, max_tokens=4))  # warm
            params = SamplingParams(temperature=temperature, seed=1, max_tokens=args.max_tokens)
            seconds, tokens, same = {"inline": 0.0, "threaded": 0.0}, {"inline": 0, "threaded": 0}, 0
            for i, ids in enumerate(prompts):
                outputs = {}
                for run in ("threaded", "inline") if i % 2 else ("inline", "threaded"):
                    mode[0] = run
                    start = time.perf_counter()
                    result = engines[run].generate(ids, params)
                    seconds[run] += time.perf_counter() - start
                    tokens[run] += len(result.token_ids)
                    outputs[run] = result.token_ids
                same += outputs["inline"] == outputs["threaded"]
            rate = {run: tokens[run] / seconds[run] for run in seconds}
            report["systems"][name] = {"tokens_per_s": rate, "inline_over_threaded": rate["inline"] / rate["threaded"],
                                       "same_output": same, "prompts": len(prompts)}
            print(f"{name:18s} threaded {rate['threaded']:6.1f} tok/s, inline {rate['inline']:6.1f} "
                  f"({rate['inline'] / rate['threaded']:.3f}x), same output {same}/{len(prompts)}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
