"""What a target pass costs right after a wider one, and what timing it there does to the cost curve.

First, 1-token passes one after another right after a 32-token pass and right after a 2-token
pass (the median of each position over `--rounds`). Then the curve of `specdec costs` measured
two ways in one process, the ways taking turns round by round: timed as passes come (each size
once a round, ascending, right after the previous size's pass and the first after the widest:
how `specdec costs` timed them before round 16) and in steady state (`specdec.bench.cost`'s way:
each size after WARM_PASSES untimed passes of its own, the widest first).

    python benchmarks/steady_costs.py --context 64 --sizes 1,2,4,8,16,32
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdec.bench.cost import WARM_PASSES
from specdec.models import ModelRunner, load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=64, help="tokens in the cache before each pass")
    parser.add_argument("--sizes", default="1,2,4,8,16,32", help="tokens per pass, comma-separated (1 first)")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sizes = sorted(int(s) for s in args.sizes.split(","))
    loaded = load_model(None)
    runner = ModelRunner(loaded)
    widest = max(sizes + [32])
    cache = runner.new_cache(args.context + widest + 1)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, loaded.vocab_size, (args.context + widest,), generator=generator).tolist()
    runner.forward(cache, tokens[: args.context], last_only=True)

    def timed(n: int) -> float:
        start = time.perf_counter()
        runner.forward(cache, tokens[args.context : args.context + n])
        seconds = time.perf_counter() - start
        cache.rollback(args.context)
        return seconds

    print(f"{loaded.describe()}, {args.context} cached tokens, {args.threads} threads")
    for wide in (32, 2):
        runs = []
        for _ in range(args.rounds):
            timed(wide)
            runs.append([timed(1) for _ in range(6)])
        cells = " ".join(f"{statistics.median(run[i] for run in runs) * 1e3:.2f}" for i in range(6))
        print(f"1-token passes in turn after a {wide}-token pass: {cells} ms")

    ways = {"as passes come": {n: [] for n in sizes}, "steady state": {n: [] for n in sizes}}
    for _ in range(args.rounds):
        timed(sizes[-1])  # as when the previous round's widest pass came just before
        for n in sizes:
            ways["as passes come"][n].append(timed(n))
        for n in reversed(sizes):
            for _ in range(WARM_PASSES):
                timed(n)
            ways["steady state"][n].append(timed(n))
    print("ms per pass (cost / plain step)")
    for way, times in ways.items():
        plain = statistics.median(times[sizes[0]])
        cells = "  ".join(f"{n}: {statistics.median(t) * 1e3:.2f} ({statistics.median(t) / plain:.2f})"
                          for n, t in times.items())
        print(f"{way:15s} {cells}")


if __name__ == "__main__":
    main()
