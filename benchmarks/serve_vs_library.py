"""The server against the library at concurrency 1: what serving one request costs on top of
generating it.

Starts `specdec serve` in a subprocess (routes `spec-off`: plain decoding, `spec-on`: ngram with
a fixed k) and loads the same model in this process as `specdec.api.LLM`. Then, prompt by
prompt and mode by mode, it sends one streamed chat request to the server (official `openai`
client) and generates the same chat with the library, alternately, so that both see the same
machine state; only one of them computes at a time. Each pair must give the same text and
token count. It reports tokens/s of each (all output tokens / the summed request times, first
token included) and their ratio. Greedy decoding; Spec-Bench first turns in file order.

It also reads each request a second time with a bare client (`httpx`, the SSE lines parsed with
`json`) that builds none of the `openai` client's objects: the client runs on the same cores as
the server, so the difference between the two server columns is the client's own cost.

`--threads` sets torch's intra-op threads of both: the server's scheduler thread (`serve
--threads`) and this process. Without it both keep torch's default (one per core).

    python benchmarks/serve_vs_library.py --prompts 8 --max-tokens 64 --threads 1   # ~2 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai

import specdec  # noqa: F401  before torch, as the CLI: it sets libgomp's spin before torch loads it
import torch  # noqa: E402

from specdec.api import LLM
from specdec.bench.data import load_records
from specdec.config import SamplingParams
from specdec.server.runtime import wait_healthy

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_load import DEFAULT_DATA, free_port, server_threads  # noqa: E402  (a sibling script)

CONFIG = """
max_model_len = {max_model_len}
max_num_seqs = 1

[routes.spec-on]
speculative = {{ method = "ngram", num_speculative_tokens = {k} }}
load_schedule = false

[routes.spec-off]
"""
MODES = {"off": ("spec-off", False), "ngram": ("spec-on", True)}


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    path = Path(tempfile.mkdtemp(prefix="serve_vs_library_")) / "server.toml"
    path.write_text(CONFIG.format(max_model_len=args.max_model_len, k=args.k))
    port = free_port()
    command = [sys.executable, "-m", "specdec.cli.main", "serve", "--config", str(path), "--port", str(port)]
    if args.threads:
        command += ["--threads", str(args.threads)]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, timeout=300)
    return process, url


def via_server(client: openai.OpenAI, route: str, prompt: str, max_tokens: int) -> tuple[float, int, str]:
    """(seconds, output tokens, text) of one streamed chat request."""
    start = time.perf_counter()
    tokens, text = 0, ""
    stream = client.chat.completions.create(
        model=route, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0,
        stream=True, stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return time.perf_counter() - start, tokens, text


def via_bare_client(http: httpx.Client, url: str, route: str, prompt: str, max_tokens: int) -> tuple[float, int, str]:
    """The same request read as plain SSE lines, each chunk parsed with `json` only."""
    body = {"model": route, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    tokens, text = 0, ""
    with http.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[len("data: "):])
            if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                text += chunk["choices"][0]["delta"]["content"]
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return time.perf_counter() - start, tokens, text


def via_library(llm: LLM, speculate: bool, prompt: str, max_tokens: int) -> tuple[float, int, str]:
    """(seconds, output tokens, text) of the same chat through the library."""
    for engine in (llm.engine, llm.plain_engine):
        engine._last_prefill = None  # no reuse of the previous prompt's cache: the server has none
    start = time.perf_counter()
    result = llm.chat([{"role": "user", "content": prompt}], SamplingParams(max_tokens=max_tokens, temperature=0.0),
                      speculate=speculate)
    return time.perf_counter() - start, len(result.token_ids), result.text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="Spec-Bench JSONL")
    parser.add_argument("--prompts", type=int, default=8, help="the first N first turns")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("-k", type=int, default=4, help="k of the ngram route and of the library's ngram drafter")
    parser.add_argument("--threads", type=int, help="torch intra-op threads of the server and of this process")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    prompts = [record.turns[0] for record in load_records(args.data)][: args.prompts]

    print("starting specdec serve ...", file=sys.stderr)
    process, url = start_server(args)
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
        http = httpx.Client(timeout=600)
        llm = LLM(speculative_config={"method": "ngram", "num_speculative_tokens": args.k})
        via_server(client, "spec-off", prompts[0], 4)  # warm-up, both sides
        via_library(llm, False, prompts[0], 4)
        threads = {"server": server_threads(url), "library": torch.get_num_threads()}
        sides = ("server", "server_bare_client", "library")
        totals = {(side, mode): [0.0, 0] for side in sides for mode in MODES}
        for mode, (route, speculate) in MODES.items():
            for prompt in prompts:
                served = via_server(client, route, prompt, args.max_tokens)
                bare = via_bare_client(http, url, route, prompt, args.max_tokens)
                generated = via_library(llm, speculate, prompt, args.max_tokens)
                if not served[1:] == bare[1:] == generated[1:]:
                    raise SystemExit(f"{mode}: the server and the library differ on {prompt[:60]!r}")
                for side, (seconds, tokens, _) in zip(sides, (served, bare, generated)):
                    totals[side, mode][0] += seconds
                    totals[side, mode][1] += tokens
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)

    rows = []
    for mode in MODES:
        rates = {side: totals[side, mode][1] / totals[side, mode][0] for side in sides}
        rows.append({"mode": mode, "tokens": totals["server", mode][1],
                     "library_tokens_per_s": round(rates["library"], 2), "server_tokens_per_s": round(rates["server"], 2),
                     "ratio": round(rates["server"] / rates["library"], 3),
                     "server_bare_client_tokens_per_s": round(rates["server_bare_client"], 2),
                     "bare_client_ratio": round(rates["server_bare_client"] / rates["library"], 3)})
        print(f"{mode:<6} library {rates['library']:6.1f} tok/s   server {rates['server']:6.1f} tok/s   "
              f"server/library {rates['server'] / rates['library']:.3f}   with a bare client "
              f"{rates['server_bare_client']:6.1f} tok/s ({rates['server_bare_client'] / rates['library']:.3f})")
    if args.json is not None:
        meta = {"data": str(args.data), "prompts": len(prompts), "max_tokens": args.max_tokens, "k": args.k,
                "threads": threads}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"meta": meta, "modes": rows}, indent=2))
        print(f"written to {args.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
