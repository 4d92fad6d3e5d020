"""A running stream's largest gap while a long prompt arrives: chunked prefill against whole.

Starts `specdec serve` (default model unless `--model`, one plain route) once per setting of
`prefill_chunk_s` (`--chunks`, seconds; a large value prefills a prompt whole), streams one
request, and 2 s into it sends a prompt of `--prompt-tokens` tokens (training prompts joined). It
reports the stream's largest gap between two chunks while the long prompt was being prefilled, and
the long prompt's time to its first token.

    python benchmarks/prefill_gap.py --prompt-tokens 2000 --chunks 0.25,1000
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from specdec.models.loader import load_vocabulary
from specdec.server.runtime import wait_healthy

TRAIN = Path(__file__).resolve().parents[2] / "shared" / "data" / "train" / "norm" / "train_prompts.jsonl"


def long_prompt(model: str | None, tokens: int) -> str:
    tokenizer = load_vocabulary(model).tokenizer
    parts, size = [], 0
    for line in TRAIN.read_text(encoding="utf-8").split("\n"):
        if not line.strip():
            continue
        text = json.loads(line)["turns"][0]
        parts.append(text)
        size += len(tokenizer(text, add_special_tokens=False)["input_ids"])
        if size >= tokens:
            break
    return "\n\n".join(parts)


def serve(model: str | None, chunk_s: float, max_model_len: int) -> tuple[subprocess.Popen, str]:
    path = Path(tempfile.mkdtemp(prefix="prefill_gap_")) / "server.toml"
    path.write_text(f"max_model_len = {max_model_len}\nmax_num_seqs = 2\nprefill_chunk_s = {chunk_s}\n\n[routes.plain]\n")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "specdec.cli.main", "serve", "--config", str(path), "--port", str(port)]
    if model:
        command += ["--model", model]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, timeout=600)
    return process, url


def run(url: str, prompt: str, stream_tokens: int) -> dict:
    arrivals: list[float] = []
    body = {"model": "plain", "prompt": "Write a long story about a lighthouse keeper.", "max_tokens": stream_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}

    def stream() -> None:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=1200) as reply:
            for line in reply.iter_lines():
                if line.startswith("data: {"):
                    arrivals.append(time.monotonic())

    thread = threading.Thread(target=stream)
    thread.start()
    while len(arrivals) < 3:
        time.sleep(0.01)
    time.sleep(2.0)
    sent = time.monotonic()
    reply = httpx.post(f"{url}/v1/completions", json={"model": "plain", "prompt": prompt, "max_tokens": 1,
                                                     "temperature": 0}, timeout=1200)
    first = time.monotonic()
    reply.raise_for_status()
    thread.join()
    window = [t for t in arrivals if sent <= t <= first + 1.0]
    before = [t for t in arrivals if t < sent][-1:]
    gaps = [b - a for a, b in zip(before + window, window)]
    return {"prompt_tokens": reply.json()["usage"]["prompt_tokens"], "ttft_s": round(first - sent, 3),
            "largest_gap_s": round(max(gaps, default=first - sent), 3), "chunks_in_window": len(window)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--stream-tokens", type=int, default=400)
    parser.add_argument("--chunks", default="0.25,1000", help="prefill_chunk_s settings to compare (comma-separated)")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    prompt = long_prompt(args.model, args.prompt_tokens)
    results = []
    for chunk_s in (float(x) for x in args.chunks.split(",")):
        process, url = serve(args.model, chunk_s, args.max_model_len)
        try:
            result = {"prefill_chunk_s": chunk_s} | run(url, prompt, args.stream_tokens)
        finally:
            process.terminate()
            process.wait(60)
        print(result)
        results.append(result)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"model": args.model or "default", "results": results}, indent=1))


if __name__ == "__main__":
    main()
