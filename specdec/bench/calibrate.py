"""Choose the layers of a self-draft (`layer_skip`) by measured acceptance and measured cost.

1. The target decodes each sample prompt greedily; prompt plus answer is the reference.
2. Acceptance of a layer set is teacher-forced: one pass of the draft (those layers, the
   target's norm and head) over each reference gives its greedy choice at every answer
   position; the fraction equal to the target's token is the draft's greedy acceptance rate
   on the target's own path, which is exactly what greedy verification checks.
3. Each layer but the first and last is ranked by the acceptance of the draft without it
   alone; layers are then dropped in that order (least missed first), down to `min_layers`,
   measuring the acceptance of every set on the way. (Dropping one layer at a time greedily
   by re-measuring every candidate at each step costs the square of the layer count in
   passes; the ranking costs a linear number.)
4. For every set on that path, a draft step is timed against a target step, and the
   expected speedup for each k comes from the acceptance, that cost ratio and the measured
   cost of verifying k + 1 tokens (:mod:`specdec.engine.estimate`). The best set and k win.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from specdec.bench.cost import step_costs
from specdec.engine.estimate import expected_speedup
from specdec.config import SamplingParams
from specdec.drafters.layer_skip import LayerSkipProfile
from specdec.engine import Engine
from specdec.models.loader import LoadedModel
from specdec.models.runner import ModelRunner, check_layer_subset


@dataclass(frozen=True)
class Reference:
    prompt_ids: list[int]
    answer_ids: list[int]


def references(target: LoadedModel, prompts: Sequence[list[int]], max_tokens: int) -> list[Reference]:
    engine = Engine(target)
    params = SamplingParams(max_tokens=max_tokens)
    refs = [Reference(list(p), engine.generate(list(p), params).token_ids) for p in prompts]
    return [r for r in refs if len(r.answer_ids) >= 2]


@torch.inference_mode()
def teacher_forced_acceptance(target: LoadedModel, layers: Sequence[int], refs: Sequence[Reference]) -> float:
    """Fraction of answer tokens that the draft running `layers` predicts greedily."""
    runner = ModelRunner(target, layers)
    matched = total = 0
    for ref in refs:
        cache = runner.new_cache(len(ref.prompt_ids) + len(ref.answer_ids))
        # The prompt's last position predicts the answer's first token, each answer token the
        # next; the LM head runs on those positions only.
        first = runner.forward(cache, ref.prompt_ids, last_only=True).logits  # [1, vocab]
        rest = runner.forward(cache, ref.answer_ids[:-1]).logits  # [answer - 1, vocab]
        predicted = torch.cat([first, rest]).argmax(-1)  # [answer]
        matched += int((predicted == torch.tensor(ref.answer_ids)).sum())
        total += len(ref.answer_ids)
    return matched / total


def draft_step_cost(target: LoadedModel, layers: Sequence[int], context: int = 256, repeats: int = 10) -> float:
    """Median time of a one-token draft step with `layers` over that of a target step."""
    runners = [ModelRunner(target), ModelRunner(target, layers)]
    prompt = torch.randint(0, target.vocab_size, (context,), generator=torch.Generator().manual_seed(0)).tolist()
    caches = [r.new_cache(context + 1) for r in runners]
    for runner, cache in zip(runners, caches):
        runner.forward(cache, prompt, last_only=True)
    times: list[list[float]] = [[], []]
    for _ in range(repeats):  # alternate, so machine noise falls on both alike
        for i, (runner, cache) in enumerate(zip(runners, caches)):
            start = time.perf_counter()
            runner.forward(cache, prompt[:1])
            times[i].append(time.perf_counter() - start)
            cache.rollback(context)
    return statistics.median(times[1]) / statistics.median(times[0])


def calibrate_layer_skip(
    target: LoadedModel,
    prompts: Sequence[list[int]],
    max_tokens: int = 64,
    min_layers: int | None = None,
    max_k: int = 8,
    progress: Callable[[str], None] | None = None,
) -> LayerSkipProfile:
    """Measure and choose the layers for `target`'s self-draft; see the module docstring."""
    say = progress or (lambda message: None)
    num_layers = target.num_layers
    check_layer_subset(target, range(num_layers))  # the model family must support subsets
    min_layers = max(2, min_layers if min_layers is not None else num_layers // 3)
    say(f"decoding {len(prompts)} reference answers")
    refs = references(target, prompts, max_tokens)
    if not refs:
        raise ValueError("no prompt gave an answer of at least 2 tokens to calibrate on")

    # 3. Rank the layers by how much the draft misses each alone, then drop them in that order.
    every = list(range(num_layers))
    alone = {}
    for layer in every[1:-1]:
        alone[layer] = teacher_forced_acceptance(target, [i for i in every if i != layer], refs)
        say(f"without layer {layer}: acceptance {alone[layer]:.3f}")
    order = sorted(alone, key=lambda layer: -alone[layer])
    path: list[tuple[tuple[int, ...], float]] = []
    for dropped in range(1, num_layers - min_layers + 1):
        layers = tuple(sorted(set(every) - set(order[:dropped])))
        acceptance = alone[order[0]] if dropped == 1 else teacher_forced_acceptance(target, layers, refs)
        path.append((layers, acceptance))
        say(f"{len(layers)} layers: acceptance {acceptance:.3f}")

    # 4. Cost of each set, and the best k for it.
    say("timing draft and verification passes")
    verify = step_costs(target, list(range(1, max_k + 2)), repeats=8)
    verify_cost = {n: verify[n] / verify[1] for n in verify}
    candidates = []
    for layers, acceptance in path:
        cost = draft_step_cost(target, layers)
        speedups = {k: expected_speedup(acceptance, k, cost, verify_cost[k + 1]) for k in range(1, max_k + 1)}
        k = max(speedups, key=speedups.__getitem__)
        candidates.append({
            "num_layers": len(layers), "layers": list(layers), "acceptance": round(acceptance, 4),
            "cost_ratio": round(cost, 4), "num_speculative_tokens": k, "expected_speedup": round(speedups[k], 4),
        })
    chosen = max(candidates, key=lambda c: c["expected_speedup"])
    return LayerSkipProfile(
        model=target.name,
        num_layers=num_layers,
        layers=tuple(chosen["layers"]),
        acceptance=chosen["acceptance"],
        cost_ratio=chosen["cost_ratio"],
        num_speculative_tokens=chosen["num_speculative_tokens"],
        expected_speedup=chosen["expected_speedup"],
        calibration={
            "drop_order": order, "acceptance_without": {str(k): round(v, 4) for k, v in alone.items()},
            "prompts": len(refs), "answer_tokens": sum(len(r.answer_ids) for r in refs),
            "max_tokens": max_tokens, "verify_cost": {str(n): round(v, 4) for n, v in verify_cost.items()},
        },
        candidates=candidates,
    )
