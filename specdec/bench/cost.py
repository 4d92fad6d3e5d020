"""Measured cost of one target pass by the number of tokens it verifies.

Speculation pays when the tokens a step commits outweigh what the longer pass costs, so the
ratio cost(n tokens) / cost(1 token) on this machine is what k must be chosen against.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch

from specdec.models.loader import LoadedModel
from specdec.models.runner import ModelRunner

WARM_PASSES = 3  # untimed passes of a size before each timed one (see step_costs)


def step_costs(
    loaded: LoadedModel, sizes: list[int], context: int = 256, repeats: int = 15,
    layers: Sequence[int] | None = None, last_only: bool = False,
) -> dict[int, float]:
    """Median seconds of a target pass over n new tokens after `context` cached ones, per n.
    With `layers`, a pass of only those layers (a layer_skip draft); with `last_only`, logits
    for the last position alone (a draft's catch-up pass) instead of every one (verification).

    Sizes take turns round by round, so that machine noise falls on all of them alike, and each
    is timed in its own steady state, as decoding runs: after WARM_PASSES untimed passes of its
    size, the sizes of a round from the widest down. The passes after a wider one run slower for
    a while (benchmarks/results/README.md, "Pass costs"): timed there, the plain step, the ratios'
    denominator, is inflated and every wider pass looks cheaper than it is.
    """
    runner = ModelRunner(loaded, layers)
    cache = runner.new_cache(context + max(sizes) + 1)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, loaded.vocab_size, (context + max(sizes),), generator=generator).tolist()
    if context:
        runner.forward(cache, tokens[:context], last_only=True)
    times: dict[int, list[float]] = {n: [] for n in sizes}
    widest_first = sorted(sizes, reverse=True)
    for _ in range(repeats):
        for n in widest_first:
            block = tokens[context : context + n]
            for _ in range(WARM_PASSES):
                runner.forward(cache, block, last_only=last_only)
                cache.rollback(context)
            start = time.perf_counter()
            runner.forward(cache, block, last_only=last_only)
            times[n].append(time.perf_counter() - start)
            cache.rollback(context)
    return {n: statistics.median(ts) for n, ts in times.items()}


def prefill_rates(loaded: LoadedModel, lengths: list[int], repeats: int = 3) -> dict[int, float]:
    """Prompt tokens per second of a prefill of n tokens into an empty cache, per n (the median of
    `repeats`, measured round-robin): what a long prompt waits before its first token."""
    runner = ModelRunner(loaded)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, loaded.vocab_size, (max(lengths),), generator=generator).tolist()
    caches = {n: runner.new_cache(n + 1) for n in lengths}
    times: dict[int, list[float]] = {n: [] for n in lengths}
    for _ in range(repeats):
        for n in lengths:
            start = time.perf_counter()
            runner.forward(caches[n], tokens[:n], last_only=True)
            times[n].append(time.perf_counter() - start)
            caches[n].rollback(0)
    return {n: n / statistics.median(ts) for n, ts in times.items()}
