"""Sampled generation with top-p (T 0.7, top_p 0.9, 96 tokens, 8 Spec-Bench prompts): top-p's
partial sort against the whole-vocabulary sort it replaced, alternating prompt by prompt in one
process, plain and with ngram k=4.

    python benchmarks/top_p_ab.py
"""
import json, time, torch
from specdec.api import LLM
from specdec.config import SamplingParams
from specdec.sampling import probs as P

def full_sort(probs, top_p):
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    drop = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= top_p
    drop[..., 0] = False
    return torch.zeros_like(drop).scatter(-1, order, drop)

partial = P.outside_nucleus
recs = [json.loads(l) for l in open("../shared/data/norm/spec_bench.jsonl")][::60][:8]
for label, cfg in (("plain", None), ("ngram k=4", {"method": "ngram", "num_speculative_tokens": 4})):
    llm = LLM(speculative_config=cfg) if cfg else LLM()
    times = {"full sort": 0.0, "partial sort": 0.0}; tokens = {"full sort": 0, "partial sort": 0}
    for i, r in enumerate(recs):
        for name, fn in (("full sort", full_sort), ("partial sort", partial)) if i % 2 else (("partial sort", partial), ("full sort", full_sort)):
            P.outside_nucleus = fn
            t = time.perf_counter()
            out = llm.chat([{"role": "user", "content": r["turns"][0]}], SamplingParams(max_tokens=96, temperature=0.7, top_p=0.9, seed=i))
            times[name] += time.perf_counter() - t; tokens[name] += len(out.token_ids)
    print(label, {n: round(tokens[n] / times[n], 1) for n in times}, "tok/s")
