"""Weights in 2 MiB pages against 4 KiB pages (`specdec/models/huge_pages.py`), in one process.

Loads the default model twice, once with `SPECDEC_HUGE_PAGES=0` (4 KiB pages) and once with its
matrices moved into huge pages, then plain-decodes the first turns of `--prompts` Spec-Bench prompts
with each, alternating prompt by prompt, timing every pass. Reports the median decoding pass, the
prompts' prefill time and tokens/s each way, and whether the outputs are identical (they must be).

    python benchmarks/huge_pages_ab.py --prompts 12
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch

from specdec.bench.data import load_records
from specdec.config import SamplingParams
from specdec.engine import Engine
from specdec.models import huge_pages, load_model
from specdec.models.prompts import PromptEncoder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--data", type=Path, default=Path("../shared/data/norm/spec_bench.jsonl"))
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if (reason := huge_pages.unavailable_reason()) is not None:
        raise SystemExit(f"nothing to compare: {reason}")
    torch.set_num_threads(args.threads)
    os.environ[huge_pages.ENV] = "0"
    small = load_model(None)
    os.environ[huge_pages.ENV] = "1"
    huge = load_model(None)
    targets = {"4 KiB": small, "2 MiB": huge}
    passes: dict[str, dict[str, list[float]]] = {name: defaultdict(list) for name in targets}
    current = [""]
    for name, target in targets.items():
        backend = target.backend
        forward = backend.forward

        def timed(*a, _forward=forward, **kw):
            start = time.perf_counter()
            out = _forward(*a, **kw)
            if current[0]:
                passes[current[0]]["decode" if a[1].shape[-1] == 1 else "prefill"].append(time.perf_counter() - start)
            return out

        backend.forward = timed
    encoder = PromptEncoder(small)
    records = load_records(args.data)
    chosen = records[:: max(1, len(records) // args.prompts)][: args.prompts]
    prompts = [encoder.encode([{"role": "user", "content": r.turns[0]}]) for r in chosen]
    engines = {name: Engine(target) for name, target in targets.items()}
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    seconds, tokens, outputs = defaultdict(float), defaultdict(int), defaultdict(list)
    for engine in engines.values():
        engine.generate(prompts[0][:16], SamplingParams(temperature=0.0, max_tokens=4))  # warm
    for i, ids in enumerate(prompts):
        for name in ("4 KiB", "2 MiB") if i % 2 else ("2 MiB", "4 KiB"):
            current[0] = name
            start = time.perf_counter()
            result = engines[name].generate(ids, params)
            seconds[name] += time.perf_counter() - start
            current[0] = ""
            tokens[name] += len(result.token_ids)
            outputs[name].append(result.token_ids)
    report = {"huge_page_bytes": huge.backend.huge_page_bytes, "identical": outputs["4 KiB"] == outputs["2 MiB"],
              "systems": {}}
    for name in targets:
        p = passes[name]
        row = {"decode_pass_ms": 1000 * statistics.median(p["decode"]), "decode_passes": len(p["decode"]),
               "prefill_s": sum(p["prefill"]), "tokens_per_s": tokens[name] / seconds[name]}
        report["systems"][name] = row
        print(f"{name}: decoding pass {row['decode_pass_ms']:.3f} ms (median of {row['decode_passes']}), "
              f"prefills {row['prefill_s']:.2f} s, {row['tokens_per_s']:.1f} tok/s")
    ratio = report["systems"]["2 MiB"]["tokens_per_s"] / report["systems"]["4 KiB"]["tokens_per_s"]
    print(f"2 MiB over 4 KiB: {ratio:.3f}x tokens/s; outputs identical: {report['identical']}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
