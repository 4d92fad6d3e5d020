"""Memory soak of the server: resident memory against its plan under sustained distinct prompts.

Starts `specdec serve` in a subprocess (default model unless `--model`; one plain route and one
ngram route, the prefix cache on), sends `--requests` distinct prompts of mixed lengths (the
training prompts, joined until each reaches its length in tokens, numbered so that no two share
a prefix past their first words), `--concurrency` at a time, a few tokens each, and reads the
server's `/health` after every `--every` requests: its resident bytes beside its plan (weights,
KV cache, prefix-cache budget). It reports the largest resident memory, the plan, and the
difference (the runtime overhead: Python, torch, the tokenizer, allocator slack), and writes the
series as JSON.

    python benchmarks/memory_soak.py --requests 120 --lengths 1000            # ~5 minutes on the default model
    python benchmarks/memory_soak.py --requests 400 --lengths 200,1000,1800 --json out/soak.json
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from specdec.models.loader import load_vocabulary
from specdec.server.runtime import wait_healthy

TRAIN = Path(__file__).resolve().parents[2] / "shared" / "data" / "train" / "norm" / "train_prompts.jsonl"
MIB = 1 << 20


def prompts(model: str | None, count: int, lengths: list[int]) -> list[str]:
    """`count` distinct texts, the i-th about lengths[i % len(lengths)] tokens of the model's tokenizer."""
    tokenizer = load_vocabulary(model).tokenizer
    source = [json.loads(line)["turns"][0] for line in TRAIN.read_text(encoding="utf-8").split("\n") if line.strip()]
    out, cursor = [], 0
    for i in range(count):
        want, parts, size = lengths[i % len(lengths)], [f"Request {i}: summarise these notes."], 0
        while size < want:
            text = source[cursor % len(source)]
            cursor += 1
            parts.append(text)
            size += len(tokenizer(text, add_special_tokens=False)["input_ids"])
        out.append("\n\n".join(parts))
    return out


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    config = f"""
max_model_len = {args.max_model_len}
max_num_seqs = {args.concurrency}
prefix_cache_mb = {args.prefix_cache_mb}

[routes.plain]

[routes.lookup]
speculative = {{ method = "ngram", num_speculative_tokens = 4 }}
"""
    path = Path(tempfile.mkdtemp(prefix="memory_soak_")) / "server.toml"
    path.write_text(config)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "specdec.cli.main", "serve", "--config", str(path), "--port", str(port)]
    if args.model:
        command += ["--model", args.model]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, timeout=300)
    return process, url


def memory(url: str) -> dict:
    return httpx.get(f"{url}/health", timeout=30).json()["memory"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--requests", type=int, default=120)
    parser.add_argument("--lengths", default="1000", help="prompt lengths in tokens, cycled (comma-separated)")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--every", type=int, default=10, help="read /health after this many requests")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--prefix-cache-mb", type=float, default=1392)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    texts = prompts(args.model, args.requests, lengths)
    process, url = start_server(args)
    series = []
    try:
        start = time.monotonic()
        first = memory(url)
        series.append({"requests": 0, "seconds": 0.0} | first)
        print(f"plan {first['plan_bytes'] / MIB:.0f} MiB, resident at start {first['resident_bytes'] / MIB:.0f} MiB")

        def one(i: int) -> None:
            body = {"model": ("plain", "lookup")[i % 2], "prompt": texts[i], "max_tokens": args.max_tokens, "temperature": 0}
            reply = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
            reply.raise_for_status()

        with ThreadPoolExecutor(args.concurrency) as pool:
            for done in range(0, args.requests, args.every):
                list(pool.map(one, range(done, min(done + args.every, args.requests))))
                now = memory(url)
                series.append({"requests": min(done + args.every, args.requests), "seconds": round(time.monotonic() - start, 1)} | now)
                print(f"{series[-1]['requests']:5d} requests  {series[-1]['seconds']:7.1f} s  resident "
                      f"{now['resident_bytes'] / MIB:6.0f} MiB  prefix cache holds {now['prefix_cache_held_bytes'] / MIB:6.0f} MiB")
    finally:
        process.terminate()
        process.wait(30)
    peak = max(s["resident_bytes"] for s in series)
    plan = series[-1]["plan_bytes"]
    summary = {"requests": args.requests, "lengths": lengths, "plan_bytes": plan, "peak_resident_bytes": peak,
               "overhead_bytes": peak - plan, "series": series, "model": args.model or "default"}
    print(f"peak resident {peak / MIB:.0f} MiB against a plan of {plan / MIB:.0f} MiB: overhead {(peak - plan) / MIB:.0f} MiB")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
