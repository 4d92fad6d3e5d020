"""Prompt lookup's k policies compared without timing noise: fixed k against adaptive k.

Prompt lookup is deterministic and greedy output does not depend on the draft, so a policy's
whole run on a prompt follows from the prompt and its greedy output: at each step the drafter
proposes from the context, the accepted prefix is where the proposal meets the output, and the
step costs one target pass over 1 + drafted tokens. This script records the greedy outputs of
held-out Spec-Bench prompts (the 4th to 7th of each category, none of which the benchmarks
use), measures on this machine what a pass over n tokens costs against a plain step
(`specdec.bench.cost.step_costs`), and replays each policy: `FixedK` at every k, and
`AdaptiveK` itself (fed each step's drafted and accepted tokens, with the measured verification
time and a free draft). Drafting time is left out: it is under 2% of a plain step for lookup.
It reports each policy's speedup: plain steps over the replayed cost.

    python benchmarks/replay_ngram.py --json benchmarks/results/replay_ngram.json   # ~4 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import numpy as np

from specdec.api import LLM
from specdec.bench.cost import step_costs
from specdec.bench.data import load_records
from specdec.config import SamplingParams, SpeculativeConfig
from specdec.drafters.ngram import find_continuation
from specdec.engine.adaptive import AdaptiveK, FixedK, SpeculationPolicy

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "norm" / "spec_bench.jsonl"


def replay(prompt: list[int], output: list[int], policy: SpeculationPolicy, cost: dict[int, float],
           lookup: SpeculativeConfig) -> float:
    """Plain steps a generation of `output` costs under `policy` (the first token is prefill's)."""
    plain = cost[1]
    position, spent = 0, 0.0
    while position < len(output) - 1:
        context = np.asarray(prompt + output[: position + 1], dtype=np.int64)
        k = min(policy.next_k(), len(output) - position - 2)
        draft = find_continuation(context, lookup.prompt_lookup_min, lookup.prompt_lookup_max, k) if k > 0 else []
        truth = output[position + 1 :]
        accepted = 0
        while accepted < len(draft) and draft[accepted] == truth[accepted]:
            accepted += 1
        verify = cost[len(draft) + 1]
        policy.observe(len(draft), accepted, 0.0, verify)
        spent += verify / plain
        position += accepted + 1
    return spent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default=str(DATA))
    parser.add_argument("--skip", type=int, default=3, help="prompts of each category to skip (the benchmarks' own)")
    parser.add_argument("--per-category", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--k-max", type=int, default=5)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()

    llm = LLM()
    by_category: dict[str, list] = defaultdict(list)
    for record in load_records(args.data):
        by_category[record.category].append(record)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    runs = []
    for records in by_category.values():
        for record in records[args.skip : args.skip + args.per_category]:
            prompt = llm.encode([{"role": "user", "content": record.turns[0]}])
            runs.append((prompt, llm.plain_engine.generate(prompt, params).token_ids))
    plain_steps = sum(len(output) - 1 for _, output in runs)
    print(f"{len(runs)} held-out prompts, {sum(len(output) for _, output in runs)} tokens")

    sizes = list(range(1, args.k_max + 2))
    cost = step_costs(llm.target, sizes, context=300, repeats=21)
    print("pass cost / plain step:", {n: round(cost[n] / cost[1], 2) for n in sizes})

    lookup = SpeculativeConfig(method="ngram")  # the default n-gram sizes
    policies = {f"fixed k={k}": (lambda k=k: FixedK(k)) for k in range(1, args.k_max + 1)}
    policies |= {f"adaptive k<={k}": (lambda k=k: AdaptiveK(k)) for k in range(2, args.k_max + 1)}
    results = {}
    for name, make in policies.items():
        # One policy object across prompts, as the engine keeps what adaptive k learned.
        policy = make()
        spent = sum(replay(prompt, output, policy, cost, lookup) for prompt, output in runs)
        results[name] = round(plain_steps / spent, 4)
        print(f"{name:16s} speedup {results[name]:.4f}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "prompts": len(runs), "max_tokens": args.max_tokens,
            "cost": {n: round(cost[n] / cost[1], 3) for n in sizes}, "speedup": results,
        }, indent=2) + "\n")


if __name__ == "__main__":
    main()
