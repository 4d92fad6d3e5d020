"""A plain step beside another busy specdec process: how much slower than quiet.

Two specdec workers or replicas on one machine are the common case. This measures, in one run,
the median plain step (one token after `--context` cached ones) of the default model quiet, then
while a second process makes passes of `--load-tokens` tokens back to back (a verifying or
prefilling neighbour), then quiet again; each process uses its default threads unless
`--threads` is given. The ratio busy / quiet is what the neighbour costs (a fair share of two
cores between two processes would be 2x).

    python benchmarks/contention.py --json benchmarks/results/contention.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from specdec.models.backend import cpu_model
from specdec.models.loader import load_model
from specdec.models.runner import ModelRunner

# The neighbour: passes of N tokens after 64 cached ones, until its deadline or until killed.
NEIGHBOUR = """
import sys, time, torch
from specdec.models.loader import load_model
from specdec.models.runner import ModelRunner
tokens, seconds = int(sys.argv[1]), float(sys.argv[2])
if len(sys.argv) > 3:
    torch.set_num_threads(int(sys.argv[3]))
loaded = load_model("default")
runner = ModelRunner(loaded, None)
cache = runner.new_cache(64 + tokens + 1)
ids = torch.randint(0, loaded.vocab_size, (64 + tokens,), generator=torch.Generator().manual_seed(1)).tolist()
runner.forward(cache, ids[:64], last_only=True)
print("ready", flush=True)
deadline = time.monotonic() + seconds
passes = 0
while time.monotonic() < deadline:
    runner.forward(cache, ids[64:], last_only=False)
    cache.rollback(64)
    passes += 1
print("passes", passes, flush=True)
"""


def step_times(runner: ModelRunner, context: int, seconds: float) -> list[float]:
    """Plain steps after `context` cached tokens for about `seconds`: each step's seconds."""
    cache = runner.new_cache(context + 2)
    ids = torch.randint(0, runner.loaded.vocab_size, (context + 1,), generator=torch.Generator().manual_seed(0)).tolist()
    runner.forward(cache, ids[:context], last_only=True)
    times: list[float] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        start = time.perf_counter()
        runner.forward(cache, ids[context:], last_only=True)
        times.append(time.perf_counter() - start)
        cache.rollback(context)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--load-tokens", type=int, default=64, help="tokens in each of the neighbour's passes")
    parser.add_argument("--seconds", type=float, default=10.0, help="measuring time of each phase")
    parser.add_argument("--threads", type=int, default=None, help="torch threads of both processes (default: torch's)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model("default")
    runner = ModelRunner(loaded, None)
    step_times(runner, args.context, 1.0)  # warm-up
    quiet_before = step_times(runner, args.context, args.seconds)
    command = [sys.executable, "-c", NEIGHBOUR, str(args.load_tokens), str(args.seconds + 60)]
    neighbour = subprocess.Popen(command + ([str(args.threads)] if args.threads else []), stdout=subprocess.PIPE, text=True)
    try:
        assert neighbour.stdout is not None and neighbour.stdout.readline().strip() == "ready", "the neighbour did not start"
        time.sleep(1.0)
        busy = step_times(runner, args.context, args.seconds)
    finally:
        neighbour.kill()
        neighbour.wait()
    quiet_after = step_times(runner, args.context, args.seconds)
    quiet = statistics.median(quiet_before + quiet_after)
    result = {
        "cpu": cpu_model(), "kernel_path": loaded.kernel_path, "threads": torch.get_num_threads(),
        "context": args.context, "load_tokens": args.load_tokens,
        "quiet_step_ms": quiet * 1e3, "busy_step_ms": statistics.median(busy) * 1e3,
        "busy_p90_ms": sorted(busy)[int(0.9 * len(busy))] * 1e3,
        "busy_over_quiet": statistics.median(busy) / quiet, "steps": {"quiet": len(quiet_before) + len(quiet_after), "busy": len(busy)},
    }
    print(json.dumps(result, indent=2))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
