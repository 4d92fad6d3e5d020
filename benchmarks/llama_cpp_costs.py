"""llama.cpp's cost curve beside specdec's, on the same GGUF file and threads, in one process.

For each n, the median time of a pass over n new tokens after `--context` cached ones, with
logits for every one of them (what a verification needs), through llama-cpp-python's batched
`eval` (`pip install llama-cpp-python==0.3.36`, an 8-minute compile; `make peers` builds llama.cpp's
C++ programs, not this); the cache is rolled back after each pass. specdec's curve is
`specdec costs`'s measurement (`specdec.bench.cost.step_costs`), taken in the same run.

    python benchmarks/llama_cpp_costs.py --max-verified 16 --json benchmarks/results/costs_llama_cpp.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from specdec.bench.cost import step_costs
from specdec.models.loader import default_model_path, load_model


def llama_cpp_costs(path: str, sizes: list[int], context: int, repeats: int, threads: int) -> dict[int, float]:
    import llama_cpp
    from llama_cpp import Llama

    llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=context + max(sizes) + 8,
                n_batch=512, logits_all=True, verbose=False)
    tokens = torch.randint(0, llm.n_vocab(), (context + max(sizes),), generator=torch.Generator().manual_seed(0)).tolist()
    llm.eval(tokens[:context])
    memory = llama_cpp.llama_get_memory(llm.ctx)
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for _ in range(repeats):
        for n in sizes:  # round-robin, so that machine noise falls on every size alike
            start = time.perf_counter()
            llm.eval(tokens[context : context + n])
            times[n].append(time.perf_counter() - start)
            llama_cpp.llama_memory_seq_rm(memory, -1, context, -1)
            llm.n_tokens = context
    return {n: statistics.median(t) for n, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-verified", type=int, default=16)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="write both curves here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sizes = list(range(1, args.max_verified + 1))
    loaded = load_model()
    curves = {
        f"specdec {loaded.describe()}": step_costs(loaded, sizes, context=args.context, repeats=args.repeats),
        "llama.cpp (llama-cpp-python batched eval)": llama_cpp_costs(str(default_model_path()), sizes, args.context,
                                                                      args.repeats, args.threads),
    }
    print(f"pass over n tokens after {args.context} cached, {args.threads} threads: ms (cost / plain step)")
    print("n    " + "  ".join(f"{name:>44s}" for name in curves))
    for n in sizes:
        print(f"{n:<4d} " + "  ".join(f"{c[n] * 1e3:>35.2f} ({c[n] / c[1]:.2f})" for c in curves.values()))
    for name, c in curves.items():
        print(f"{name}: decode-only {1 / c[1]:.1f} tokens/s (one plain step)")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"context": args.context, "threads": args.threads, "repeats": args.repeats,
                       "curves": {name: {"seconds": {str(n): s for n, s in c.items()},
                                         "cost_over_plain_step": {str(n): s / c[1] for n, s in c.items()}}
                                  for name, c in curves.items()}}, handle, indent=2)


if __name__ == "__main__":
    main()
