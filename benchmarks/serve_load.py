"""Load benchmark of the server: speculation on, off and load-aware, at rising concurrency.

Drives the server over HTTP with the official `openai` client, streaming, on Spec-Bench prompts
(first turns, cycled in file order, the same sequence for every mode and level). For each mode
and concurrency level it sends `--requests` requests, at most `concurrency` in flight, and
reports per-request latency (median, p95), time to first token (median), and aggregate output
tokens/s (all output tokens / the level's wall time). With `--rounds N` each level is run N
times, the modes taking turns in a rotated order, and the figures pool the rounds. Greedy
decoding, or sampling at `--temperature` (the OpenAI API's default is 1).

Without `--url` it starts `specdec serve` in a subprocess (so the client's threads do not share
a Python interpreter with the server) with three routes:

- `spec-on`: ngram, fixed k (`-k`, default 4);
- `spec-off`: plain decoding;
- `spec-load-aware`: ngram with the load schedule (`--schedule`, default the server's default).

With `--url` it drives a running server; name its routes with `--route-on/--route-off/--route-load-aware`.
`--threads` sets the started server's torch threads; the results record what the server reports
in /health, since its intra-op threads compete for the cores with the event loop and the client.

With `--library` (the default when it starts the server) it also decodes the 1-stream level's
requests plainly through the library (`LLM.chat`, one at a time, the server's threads), after the
server has stopped, and reports the server's 1-stream tokens/s as a fraction of that.

    python benchmarks/serve_load.py --requests 4 --max-tokens 32 --concurrency 1,2,4   # ~1 minute
    python benchmarks/serve_load.py --requests 32 --max-tokens 128 --json out/serve_load.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import openai

from specdec.bench.data import load_records
from specdec.server.config import DEFAULT_LOAD_SCHEDULE
from specdec.server.runtime import wait_healthy

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "norm" / "spec_bench.jsonl"
MODES = ("on", "off", "load-aware")


@dataclass(frozen=True)
class RequestResult:
    latency_s: float
    ttft_s: float
    tokens: int


@dataclass(frozen=True)
class LevelResult:
    mode: str
    concurrency: int
    requests: int
    tokens: int
    wall_s: float
    tokens_per_s: float
    latency_median_s: float
    latency_p95_s: float
    ttft_median_s: float


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) by linear interpolation between order statistics."""
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def one_request(client: openai.OpenAI, route: str, prompt: str, max_tokens: int, ignore_eos: bool,
                temperature: float = 0.0) -> RequestResult:
    start = time.perf_counter()
    first = None
    tokens = 0
    stream = client.chat.completions.create(
        model=route, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=temperature,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": ignore_eos},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content and first is None:
            first = time.perf_counter()
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    end = time.perf_counter()
    return RequestResult(end - start, (first or end) - start, tokens)


def run_level(client: openai.OpenAI, route: str, prompts: list[str], concurrency: int, requests: int,
              max_tokens: int, ignore_eos: bool, temperature: float = 0.0) -> tuple[list[RequestResult], float]:
    """Send `requests` requests, at most `concurrency` in flight; return them and the wall time."""
    batch = [prompts[i % len(prompts)] for i in range(requests)]
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda p: one_request(client, route, p, max_tokens, ignore_eos, temperature), batch))
    return results, time.perf_counter() - start


def summarise(mode: str, concurrency: int, runs: list[tuple[list[RequestResult], float]]) -> LevelResult:
    """One level's figures over all its rounds: tokens/s is all tokens over all wall time."""
    results = [r for batch, _ in runs for r in batch]
    wall = sum(seconds for _, seconds in runs)
    latencies = [r.latency_s for r in results]
    tokens = sum(r.tokens for r in results)
    return LevelResult(mode, concurrency, len(results), tokens, round(wall, 3), round(tokens / wall, 2),
                       round(statistics.median(latencies), 3), round(percentile(latencies, 0.95), 3),
                       round(statistics.median(r.ttft_s for r in results), 3))


def library_plain(args: argparse.Namespace, prompts: list[str], requests: int, threads: int | None) -> float:
    """Tokens/s of plain decoding through the library, one request at a time, on the requests
    the server's 1-stream level sent (tokens over wall time, prefill included, as there)."""
    import torch

    from specdec import LLM, SamplingParams

    if threads:
        torch.set_num_threads(threads)
    llm = LLM(args.model, dtype=args.dtype)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, ignore_eos=args.ignore_eos)
    llm.chat([{"role": "user", "content": prompts[0]}], SamplingParams(max_tokens=4), speculate=False)  # warm-up
    start, tokens = time.perf_counter(), 0
    for i in range(requests):
        out = llm.chat([{"role": "user", "content": prompts[i % len(prompts)]}], params, speculate=False)
        tokens += len(out.token_ids)
    return tokens / (time.perf_counter() - start)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    schedule = ", ".join(f"{n} = {k}" for n, k in sorted(args.schedule.items()))
    config = f"""
max_model_len = {args.max_model_len}
max_num_seqs = {max(args.concurrency)}

[routes.spec-on]
speculative = {{ method = "ngram", num_speculative_tokens = {args.k} }}
load_schedule = false

[routes.spec-off]

[routes.spec-load-aware]
speculative = {{ method = "ngram", num_speculative_tokens = {args.k} }}
load_schedule = {{ {schedule} }}
"""
    path = Path(tempfile.mkdtemp(prefix="serve_load_")) / "server.toml"
    path.write_text(config)
    port = free_port()
    command = [sys.executable, "-m", "specdec.cli.main", "serve", "--config", str(path), "--port", str(port)]
    if args.model:
        command += ["--model", args.model]
    if args.threads:
        command += ["--threads", str(args.threads)]
    if args.dtype != "auto":
        command += ["--dtype", args.dtype]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL if not args.verbose else None, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, timeout=300)
    return process, url


def server_threads(url: str) -> int | None:
    """The torch intra-op threads the server's scheduler runs with (None if it does not say)."""
    with urllib.request.urlopen(f"{url.rstrip('/')}/health", timeout=10) as response:
        return json.load(response).get("threads")


def print_table(levels: list[LevelResult]) -> None:
    header = f"{'mode':<11} {'conc':>4} {'reqs':>4} {'tokens':>6} {'tok/s':>8} {'lat p50 s':>9} {'lat p95 s':>9} {'ttft p50 s':>10}"
    print(header)
    print("-" * len(header))
    for r in levels:
        print(f"{r.mode:<11} {r.concurrency:>4} {r.requests:>4} {r.tokens:>6} {r.tokens_per_s:>8.1f} "
              f"{r.latency_median_s:>9.2f} {r.latency_p95_s:>9.2f} {r.ttft_median_s:>10.2f}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running server (default: start `specdec serve` in a subprocess)")
    parser.add_argument("--model", help="model for the started server (default: the default model)")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="Spec-Bench JSONL")
    parser.add_argument("--concurrency", default="1,2,4,8,16", help="comma-separated levels")
    parser.add_argument("--requests", type=int, default=0, help="requests per level (default: 2 x concurrency, at least 4)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="repeat each level this many times, the modes taking turns (default 1)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--ignore-eos", action="store_true", help="always generate max-tokens tokens")
    parser.add_argument("--temperature", type=float, default=0.0, help="sample at this temperature (0: greedy)")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated: on, off, load-aware")
    parser.add_argument("-k", type=int, default=4, help="k of the started server's speculative routes")
    parser.add_argument("--schedule", type=json.loads, default=DEFAULT_LOAD_SCHEDULE,
                        help='load schedule of the started server, JSON: \'{"1": 4, "4": 2, "8": 0}\'')
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--threads", type=int, help="torch threads of the started server (default: its default)")
    parser.add_argument("--dtype", default="auto", help="weight format of the started server and the library run "
                        "(auto, or e.g. r8)")
    parser.add_argument("--route-on", default="spec-on")
    parser.add_argument("--route-off", default="spec-off")
    parser.add_argument("--route-load-aware", default="spec-load-aware")
    parser.add_argument("--library", action=argparse.BooleanOptionalAction, default=None,
                        help="also time the library's plain decoding of the 1-stream requests "
                             "(default: on when the server is started here)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--verbose", action="store_true", help="show the started server's log")
    args = parser.parse_args(argv)
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.modes = [m.strip() for m in args.modes.split(",")]
    if set(args.modes) - set(MODES) or min(args.concurrency) < 1 or args.max_tokens < 1 or args.rounds < 1:
        parser.error("modes must be among on, off, load-aware; concurrency, max-tokens and rounds >= 1")
    args.schedule = {int(n): int(k) for n, k in args.schedule.items()}
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    prompts = [record.turns[0] for record in load_records(args.data)]
    process = None
    url = args.url
    if url is None:
        print("starting specdec serve ...", file=sys.stderr)
        process, url = start_server(args)
    routes = {"on": args.route_on, "off": args.route_off, "load-aware": args.route_load_aware}
    client = openai.OpenAI(base_url=f"{url.rstrip('/')}/v1", api_key="unused", max_retries=0, timeout=600)
    levels: list[LevelResult] = []
    threads = None
    try:
        for mode in args.modes:  # warm-up: one short request per route
            one_request(client, routes[mode], prompts[0], 4, False)
        threads = server_threads(url)  # after a request: the scheduler thread has surely started
        for concurrency in args.concurrency:
            requests = args.requests or max(4, 2 * concurrency)
            runs: dict[str, list[tuple[list[RequestResult], float]]] = {mode: [] for mode in args.modes}
            for round_ in range(args.rounds):
                # Modes take turns, in a rotated order each round, so that drift in the
                # machine's speed falls on all of them alike.
                shift = round_ % len(args.modes)
                for mode in args.modes[shift:] + args.modes[:shift]:
                    results, wall = run_level(client, routes[mode], prompts, concurrency, requests, args.max_tokens,
                                              args.ignore_eos, args.temperature)
                    runs[mode].append((results, wall))
                    tokens = sum(r.tokens for r in results)
                    print(f"  {mode} c={concurrency} round {round_ + 1}/{args.rounds}: {tokens / wall:.1f} tok/s",
                          file=sys.stderr)
            levels.extend(summarise(mode, concurrency, runs[mode]) for mode in args.modes)
    finally:
        if process is not None:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=60)
    print_table(levels)
    library = None
    single = next((level for level in levels if level.mode == "off" and level.concurrency == 1), None)
    if (args.library if args.library is not None else args.url is None) and single is not None:
        print("library plain decoding of the same requests ...", file=sys.stderr)
        library = round(library_plain(args, prompts, single.requests, threads), 2)
        print(f"library plain, 1 stream: {library:.1f} tok/s; the server's 1 stream (off): "
              f"{single.tokens_per_s:.1f} tok/s = {single.tokens_per_s / library:.2f}x")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = {"url": args.url, "model": args.model or "default", "max_tokens": args.max_tokens,
                "ignore_eos": args.ignore_eos, "temperature": args.temperature, "rounds": args.rounds, "k": args.k, "schedule": args.schedule,
                "data": str(args.data), "threads": threads, "dtype": args.dtype, "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}
        args.json.write_text(json.dumps({"meta": meta, "levels": [asdict(level) for level in levels],
                                         "library_plain_tokens_per_s": library}, indent=2))
        print(f"written to {args.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
