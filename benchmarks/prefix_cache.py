"""A chat's second turn with the prefix cache and without it: time to first token, answers, hits.

Each conversation's first turn is a long Spec-Bench summarization prompt (`--min-tokens` to
`--max-tokens-prompt` tokens, ~1,200 by default; the first `--conversations` records in file
order); its second turn resends the first with the answer and a short follow-up. Two `specdec
serve` processes run the same config side by side, one with `--no-prefix-cache`, and every turn
goes to both, the order alternating per conversation, streamed through the official `openai`
client: time to first token is to the first content chunk. Greedy, so the answers must match.
For each route (`spec`: ngram k = 4; `plain`) a fresh pair of servers runs the same traffic, so
that the hit rates with speculation on and off can be compared; they read `/metrics`.

    python benchmarks/prefix_cache.py --json benchmarks/results/prefix_cache.json   # ~4 minutes
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import openai

from specdec.bench.data import load_records
from specdec.models.backend import cpu_model
from specdec.models.loader import load_model
from specdec.server.runtime import wait_healthy

from serve_load import free_port  # the sibling script's (run as a script, its folder is on the path)

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "norm" / "spec_bench.jsonl"
FOLLOW_UP = "Now give three key facts from the text as a short list."
CONFIG = """
max_model_len = 2048
max_num_seqs = 2

[routes.spec]
speculative = { method = "ngram", num_speculative_tokens = 4 }
load_schedule = false

[routes.plain]
"""


def start(config: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "specdec.cli.main", "serve", "--config", str(config),
                                "--port", str(port), *extra], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, timeout=300)
    return process, url


def turn(url: str, route: str, messages: list[dict], max_tokens: int) -> tuple[float, str]:
    """(time to the first content chunk, the answer), streamed."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    start = time.perf_counter()
    first, parts = None, []
    for chunk in client.chat.completions.create(model=route, messages=messages, max_tokens=max_tokens, temperature=0,
                                                stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            first = first if first is not None else time.perf_counter() - start
            parts.append(chunk.choices[0].delta.content)
    return first if first is not None else time.perf_counter() - start, "".join(parts)


def metric(url: str, name: str, route: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        for line in response.read().decode().splitlines():
            if line.startswith(f'{name}{{route="{route}"}}'):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def run_route(route: str, config: Path, prompts: list[str], max_tokens: int) -> dict:
    servers = {"cache": start(config), "no_cache": start(config, "--no-prefix-cache")}
    try:
        rows = []
        for i, prompt in enumerate(prompts):
            order = ["cache", "no_cache"] if i % 2 == 0 else ["no_cache", "cache"]
            row: dict = {}
            for name in order:
                url = servers[name][1]
                messages = [{"role": "user", "content": prompt}]
                ttft1, answer = turn(url, route, messages, max_tokens)
                messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": FOLLOW_UP}]
                ttft2, answer2 = turn(url, route, messages, max_tokens)
                row[name] = {"ttft_turn1_s": ttft1, "ttft_turn2_s": ttft2, "answers": [answer, answer2]}
            row["same_answers"] = row["cache"].pop("answers") == row["no_cache"].pop("answers")
            rows.append(row)
            print(f"{route} {i}: turn 2 ttft {row['cache']['ttft_turn2_s']:.3f} s cached vs "
                  f"{row['no_cache']['ttft_turn2_s']:.3f} s", flush=True)
        url = servers["cache"][1]
        prompt_tokens = metric(url, "specdec_prompt_tokens_total", route)
        hits = metric(url, "specdec_prefix_cache_hit_tokens_total", route)
        with urllib.request.urlopen(f"{url}/health", timeout=10) as response:
            health = json.load(response)
    finally:
        for process, _ in servers.values():
            process.terminate()
            process.wait(timeout=60)
    median = {name: {key: statistics.median(r[name][key] for r in rows) for key in ("ttft_turn1_s", "ttft_turn2_s")}
              for name in ("cache", "no_cache")}
    return {"conversations": rows, "median": median,
            "turn2_ttft_ratio": median["cache"]["ttft_turn2_s"] / median["no_cache"]["ttft_turn2_s"],
            "all_answers_same": all(r["same_answers"] for r in rows), "prompt_tokens": prompt_tokens,
            "hit_tokens": hits, "hit_rate": hits / prompt_tokens if prompt_tokens else 0.0,
            "kernel_path": health.get("kernel_path")}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--conversations", type=int, default=6)
    parser.add_argument("--min-tokens", type=int, default=1000, help="Shortest first turn, in tokens.")
    parser.add_argument("--max-tokens-prompt", type=int, default=1500, help="Longest first turn, in tokens.")
    parser.add_argument("--max-tokens", type=int, default=48, help="Output tokens per turn.")
    parser.add_argument("--json", type=Path, help="Write the results here.")
    args = parser.parse_args(argv)

    tokenizer = load_model().tokenizer  # the served default model's
    prompts = []
    for record in load_records(args.data):
        if record.category == "summarization" and args.min_tokens <= len(tokenizer(record.turns[0])["input_ids"]) <= args.max_tokens_prompt:
            prompts.append(record.turns[0])
        if len(prompts) == args.conversations:
            break
    config = Path(tempfile.mkdtemp(prefix="prefix_cache_")) / "server.toml"
    config.write_text(CONFIG)
    results = {"cpu": cpu_model(), "conversations": len(prompts), "follow_up": FOLLOW_UP, "max_tokens": args.max_tokens,
               "routes": {route: run_route(route, config, prompts, args.max_tokens) for route in ("spec", "plain")}}
    for route, r in results["routes"].items():
        print(f"{route}: turn-2 TTFT median {r['median']['cache']['ttft_turn2_s']:.3f} s with the prefix cache, "
              f"{r['median']['no_cache']['ttft_turn2_s']:.3f} s without ({r['turn2_ttft_ratio']:.2f}x); "
              f"answers identical: {r['all_answers_same']}; hit rate {r['hit_rate']:.3f} ({r['kernel_path']})")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
