"""Self-consistency: n samples of each math prompt at temperature 0.7 (--temperature), plain decoding against
prompt lookup and suffix drafting, through the library and through the server's `n`.

Prompts: the `math_reasoning` records of the training prompt set (GSM8K's training split;
not a benchmark set), in file order. Each system gets the same prompts, interleaved prompt by
prompt so that all see the same machine state.

- library: `LLM.generate` with the prompt n times (unseeded, so n different samples), one after
  another; the suffix drafter keeps one cache across them, so sample i drafts from samples < i
  (and from earlier prompts' answers).
- server: one chat request with `n` per prompt to a route per system (in-process server, a
  batch of `n` rows, fixed k: no load schedule), the official `openai` client; the n samples
  run together in the batch and the suffix route's samples draft from each other as they go.

Reports tokens/s (output tokens / summed wall time) per system and its ratio to plain decoding
and to prompt lookup, with acceptance; `--json` writes it all.

    python benchmarks/self_consistency.py --prompts 6 --n 8 --json benchmarks/results/self_consistency.json
    python benchmarks/self_consistency.py --only library \
        --compare '{"method": "suffix", "suffix_decoding_use_tree": true}'
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import openai
import torch

from specdec.api import LLM
from specdec.config import SamplingParams, SpeculativeConfig
from specdec.models import load_model
from specdec.server.config import RouteConfig, ServerConfig
from specdec.server.runtime import ServerThread, build_state

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "train" / "norm" / "train_prompts.jsonl"


def systems(k_ngram: int, k_suffix: int, compare: list[str]) -> dict[str, SpeculativeConfig | None]:
    """Plain, prompt lookup and suffix drafting, then each --compare config under its label."""
    configs: dict[str, SpeculativeConfig | None] = {
        "plain": None,
        "ngram": SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": k_ngram}),
        "suffix": SpeculativeConfig.from_dict({"method": "suffix", "num_speculative_tokens": k_suffix})}
    for text in compare:
        config = SpeculativeConfig.from_dict(json.loads(text))
        configs[config.label.replace(" ", "-")] = config
    return configs


def math_prompts(path: Path, count: int, skip: int = 0) -> list[str]:
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").split("\n") if line.strip()]
    return [r["turns"][0] for r in records if r.get("category") == "math_reasoning"][skip : skip + count]


def summary(totals: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    out = {}
    for name, (tokens, seconds, drafted, accepted) in totals.items():
        out[name] = {"tokens": int(tokens), "seconds": round(seconds, 2), "tokens_per_s": round(tokens / seconds, 2),
                     "drafted": int(drafted), "accepted": int(accepted),
                     "acceptance": round(accepted / drafted, 3) if drafted else None}
    for name in out:
        out[name]["vs_plain"] = round(out[name]["tokens_per_s"] / out["plain"]["tokens_per_s"], 3)
        out[name]["vs_ngram"] = round(out[name]["tokens_per_s"] / out["ngram"]["tokens_per_s"], 3)
    return out


def run_library(target, configs, prompts: list[str], n: int, max_tokens: int, temperature: float) -> dict:
    llms = {name: LLM(loaded=target, speculative_config=config) for name, config in configs.items()}
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens)
    totals = {name: [0.0, 0.0, 0.0, 0.0] for name in configs}
    for i, prompt in enumerate(prompts):
        messages = [{"role": "user", "content": prompt}]
        for name, llm in llms.items():
            start = time.perf_counter()
            outputs = llm.generate([messages] * n, params)
            total = totals[name]
            total[1] += time.perf_counter() - start
            total[0] += sum(len(o.token_ids) for o in outputs)
            total[2] += sum(o.stats.drafted_tokens for o in outputs)
            total[3] += sum(o.stats.accepted_tokens for o in outputs)
        print(f"library: prompt {i + 1}/{len(prompts)}", flush=True)
    return summary(totals)


def run_server(target, configs, prompts: list[str], n: int, max_tokens: int, temperature: float) -> dict:
    routes = tuple(RouteConfig(name, config) for name, config in configs.items())
    server = ServerThread(build_state(ServerConfig(routes=routes, max_model_len=512, max_num_seqs=n,
                                                   graceful_shutdown_s=2), loaded=target)).start()
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=600)
        totals = {name: [0.0, 0.0, 0.0, 0.0] for name in configs}
        for i, prompt in enumerate(prompts):
            for name in configs:
                start = time.perf_counter()
                r = client.chat.completions.create(model=name, messages=[{"role": "user", "content": prompt}], n=n,
                                                   max_tokens=max_tokens, temperature=temperature)
                total = totals[name]
                total[1] += time.perf_counter() - start
                total[0] += r.usage.completion_tokens
                stats = (r.model_extra or {}).get("speculation") or {}
                total[2] += stats.get("drafted_tokens", 0)
                total[3] += stats.get("accepted_tokens", 0)
            print(f"server: prompt {i + 1}/{len(prompts)}", flush=True)
        return summary(totals)
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--skip", type=int, default=0,
                        help="start after this many math prompts (to try settings on prompts the report does not use)")
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--k-ngram", type=int, default=4)
    parser.add_argument("--k-suffix", type=int, default=6)
    parser.add_argument("--compare", action="append", default=[],
                        help="another speculative config (JSON) beside plain, ngram and suffix; repeatable")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--only", choices=["library", "server"], default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target = load_model(None)
    configs = systems(args.k_ngram, args.k_suffix, args.compare)
    prompts = math_prompts(args.data, args.prompts, args.skip)
    report: dict = {"prompts": len(prompts), "skip": args.skip, "n": args.n, "max_tokens": args.max_tokens,
                    "temperature": args.temperature,
                    "threads": args.threads, "systems": {k: (c.to_dict() if c else None) for k, c in configs.items()}}
    for mode, run in (("library", run_library), ("server", run_server)):
        if args.only in (None, mode):
            report[mode] = run(target, configs, prompts, args.n, args.max_tokens, args.temperature)
            for name, row in report[mode].items():
                print(f"{mode:8s} {name:16s} {row['tokens_per_s']:7.1f} tok/s  {row['vs_plain']:.2f}x plain  "
                      f"{row['vs_ngram']:.2f}x ngram  acceptance {row['acceptance']}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
