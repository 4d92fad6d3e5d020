"""Sampled generation with top-p (T 0.7, top_p 0.9, 96 tokens, 8 Spec-Bench prompts): top-p's
partial sort against the whole-vocabulary sort it replaced, alternating prompt by prompt in one
process, plain and with ngram k=4.

    python benchmarks/top_p_ab.py
"""

from __future__ import annotations

import json
import time

import torch

from specdec.api import LLM
from specdec.config import SamplingParams
from specdec.sampling import probs

PROMPTS = "../shared/data/norm/spec_bench.jsonl"


def full_sort(probs_: torch.Tensor, top_p: float) -> torch.Tensor:
    """The rule before: rank the whole vocabulary, drop each token whose mass before reaches top_p."""
    sorted_probs, order = torch.sort(probs_, dim=-1, descending=True)
    drop = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= top_p
    drop[..., 0] = False
    return torch.zeros_like(drop).scatter(-1, order, drop)


def main() -> None:
    partial = probs.outside_nucleus
    sorts = {"full sort": full_sort, "partial sort": partial}
    records = [json.loads(line) for line in open(PROMPTS, encoding="utf-8")][::60][:8]
    for label, config in (("plain", None), ("ngram k=4", {"method": "ngram", "num_speculative_tokens": 4})):
        llm = LLM(speculative_config=config) if config else LLM()
        seconds = dict.fromkeys(sorts, 0.0)
        tokens = dict.fromkeys(sorts, 0)
        for i, record in enumerate(records):
            for name in sorted(sorts, reverse=i % 2 == 0):  # alternate which goes first
                probs.outside_nucleus = sorts[name]
                start = time.perf_counter()
                out = llm.chat([{"role": "user", "content": record["turns"][0]}],
                               SamplingParams(max_tokens=96, temperature=0.7, top_p=0.9, seed=i))
                seconds[name] += time.perf_counter() - start
                tokens[name] += len(out.token_ids)
        probs.outside_nucleus = partial
        print(label, {name: round(tokens[name] / seconds[name], 1) for name in sorts}, "tok/s")


if __name__ == "__main__":
    main()
