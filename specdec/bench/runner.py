"""Side-by-side benchmark: every prompt once without speculation and once with it, interleaved
in one process, with optional peers (transformers' own generate) on the same prompts.

speedup = speculative tokens/s / plain tokens/s, which is plain time / speculative time when
the outputs are identical (greedy). Tokens/s counts generated tokens over wall time, prefill
included; decode_tokens_per_s leaves the prompt out (the tokens after the first over the time
after it, as llama.cpp's programs report their decoding), for comparing with peers that time
themselves.

What the speed costs, per system: target_tokens_per_output_token (tokens the target processed
after prefill, drafts included, per committed token: 1.0 for plain decoding and for peers, which
decode plainly) and cpu_s_per_output_token (the process's CPU time over each generation call, all
threads, prefill included, per generated token).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from specdec.api import LLM, Message
from specdec.models.prompts import Infill, Prompt
from specdec.bench.data import Record
from specdec.config import SamplingParams
from specdec.engine.stats import RequestStats
from specdec.models.loader import LoadedModel


@dataclass
class RunResult:
    token_ids: list[int]
    text: str
    seconds: float
    stats: RequestStats | None = None
    cpu_s: float = 0.0  # process CPU time of the call (run_conversation measures it)
    plain: bool = True  # without stats: whether the system decoded plainly (one target token per token)
    decode: tuple[int, float] | None = None  # (tokens, seconds) decoded after the prompt and the first token


Runner = Callable[[Prompt], RunResult]  # a chat, or an infill


@dataclass(frozen=True)
class System:
    """Something that generates: `baseline` names the system its speedup and identity are
    measured against (its own plain decoding); None for a baseline."""

    name: str
    run: Runner
    baseline: str | None = None


@dataclass
class Tally:
    prompts: int = 0
    identical: int = 0
    tokens: int = 0
    seconds: float = 0.0
    speculation: RequestStats = field(default_factory=RequestStats)  # summed over specdec runs
    timed_turns: int = 0  # runs that said when their first token came (specdec's)
    target_tokens: int = 0  # tokens the target processed after prefill ...
    committed_tokens: int = 0  # ... and the tokens those steps committed
    cpu_s: float = 0.0
    decode_tokens: int = 0  # decoding without the prompt: what each system reports of it
    decode_seconds: float = 0.0
    unknown_target_tokens: bool = False  # a peer that speculates without saying how much it verified

    def add(self, results: list[RunResult], identical: bool | None) -> None:
        self.prompts += 1
        self.identical += bool(identical)
        for r in results:
            self.tokens += len(r.token_ids)
            self.seconds += r.seconds
            self.cpu_s += r.cpu_s
            if r.decode is not None:
                self.decode_tokens += r.decode[0]
                self.decode_seconds += r.decode[1]
            if r.stats is not None:
                self.speculation.merge(r.stats)
                self.timed_turns += 1
                self.target_tokens += r.stats.target_tokens
                self.committed_tokens += r.stats.committed_tokens
            elif r.plain:  # a peer decoding plainly: one token processed per token
                self.target_tokens += len(r.token_ids)
                self.committed_tokens += len(r.token_ids)
            else:
                self.unknown_target_tokens = True

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def summary(self, baseline: Tally | None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "prompts": self.prompts,
            "tokens": self.tokens,
            "seconds": round(self.seconds, 3),
            "tokens_per_s": round(self.tokens_per_s, 2),
            "target_tokens_per_output_token": (round(self.target_tokens / self.committed_tokens, 4)
                                               if self.committed_tokens and not self.unknown_target_tokens else None),
            "cpu_s_per_output_token": round(self.cpu_s / self.tokens, 6) if self.tokens else None,
            "decode_tokens_per_s": round(self.decode_tokens / self.decode_seconds, 2) if self.decode_seconds else None,
        }
        if baseline is not None:
            out["identical"] = self.identical
            out["speedup"] = round(self.tokens_per_s / baseline.tokens_per_s, 3) if baseline.tokens_per_s else 0.0
            out["tokens_per_s_baseline"] = round(baseline.tokens_per_s, 2)
        stats = self.speculation
        if self.timed_turns:  # mean time to first token a turn: the prefill and the first token
            out["ttft_s"] = round(stats.prefill_time_s / self.timed_turns, 4)
        if stats.drafted_tokens and stats.draft_time_s:
            # What one drafted token costs: absolute, and in the plain system's time per output token.
            per_token = stats.draft_time_s / stats.drafted_tokens
            out["draft_s_per_drafted_token"] = round(per_token, 6)
            if baseline is not None and baseline.tokens and baseline.seconds:
                out["drafted_token_cost"] = round(per_token / (baseline.seconds / baseline.tokens), 4)
        if stats.target_steps:
            out["acceptance_rate"] = round(stats.acceptance_rate, 4)
            out["mean_accepted_length"] = round(stats.mean_accepted_length, 4)
            out["per_position_acceptance"] = [round(x, 4) for x in stats.per_position_acceptance]
        return out


def specdec_runner(llm: LLM, params: SamplingParams, speculate: bool) -> Runner:
    def run(prompt: Prompt) -> RunResult:
        out = llm.generate([prompt], params, speculate=speculate)[0]
        stats = out.stats
        decode = (len(out.token_ids) - 1, stats.wall_time_s - stats.prefill_time_s) if len(out.token_ids) > 1 else None
        return RunResult(out.token_ids, out.text, stats.wall_time_s, stats, decode=decode)

    return run


def transformers_runner(loaded: LoadedModel, encode: Callable[[Prompt], list[int]], params: SamplingParams,
                        ends: Callable[[Prompt], tuple[int, ...]] = lambda prompt: (), **generate_kwargs: Any) -> Runner:
    """transformers' `generate` on a stock model (no specdec kernels), greedy, same stop rule:
    EOS (and `ends(prompt)`, an infill's) ends the output and is not counted."""
    model, tokenizer = loaded.model, loaded.tokenizer

    @torch.inference_mode()
    def run(prompt: Prompt) -> RunResult:
        stops = loaded.eos_token_ids | set(ends(prompt))
        eos = sorted(stops)
        ids = torch.tensor([encode(prompt)], device=loaded.device)
        start = time.perf_counter()
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=params.max_tokens,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos[0],
            **generate_kwargs,
        )
        seconds = time.perf_counter() - start
        new = out[0, ids.shape[1] :].tolist()
        for i, token in enumerate(new):
            if token in stops:
                new = new[:i]
                break
        return RunResult(new, tokenizer.decode(new, skip_special_tokens=True), seconds)

    return run


def run_conversation(system: System, record: Record) -> list[RunResult]:
    """Each user turn in order; the system's own answer to turn n is in the context of turn n + 1.
    A fill-in-the-middle record is one infill."""
    messages: list[Message] = []
    results = []
    if record.suffix is not None:
        cpu_start = time.process_time()
        result = system.run(Infill(record.turns[0], record.suffix))
        result.cpu_s = time.process_time() - cpu_start
        return [result]
    for turn in record.turns:
        messages.append({"role": "user", "content": turn})
        cpu_start = time.process_time()
        result = system.run(list(messages))
        result.cpu_s = time.process_time() - cpu_start
        results.append(result)
        messages.append({"role": "assistant", "content": result.text})
    return results


def run_bench(
    systems: list[System],
    records: list[Record],
    on_prompt: Callable[[Record], None] | None = None,
    warmup: list[Message] | None = None,
) -> dict[str, Any]:
    """Run every record through every system, rotating which goes first, and tally the results."""
    names = [s.name for s in systems]
    if warmup is not None:
        for system in systems:  # the first generation of a process pays one-off allocation costs
            system.run(warmup)
    overall = {name: Tally() for name in names}
    by_category: dict[str, dict[str, Tally]] = defaultdict(lambda: {name: Tally() for name in names})
    by_turn: dict[int, dict[str, Tally]] = defaultdict(lambda: {name: Tally() for name in names})  # 1-based
    prompts = []
    for index, record in enumerate(records):
        order = systems[index % len(systems) :] + systems[: index % len(systems)]
        results = {system.name: run_conversation(system, record) for system in order}
        entry: dict[str, Any] = {"id": record.id, "category": record.category, "turns": len(record.turns), "systems": {}}
        for system in systems:
            own = results[system.name]
            identical = None
            if system.baseline is not None:
                base = results[system.baseline]
                identical = all(a.token_ids == b.token_ids for a, b in zip(own, base))
            for tally in (overall[system.name], by_category[record.category][system.name]):
                tally.add(own, identical)
            for turn, result in enumerate(own):
                same = None if system.baseline is None else result.token_ids == results[system.baseline][turn].token_ids
                by_turn[turn + 1][system.name].add([result], same)
            single = Tally()
            single.add(own, identical)
            entry["systems"][system.name] = single.summary(_single(results[system.baseline]) if system.baseline else None)
        prompts.append(entry)
        if on_prompt is not None:
            on_prompt(record)

    def summarise(tallies: dict[str, Tally]) -> dict[str, Any]:
        return {s.name: tallies[s.name].summary(tallies[s.baseline] if s.baseline else None) for s in systems}

    return {
        "systems": {s.name: {"baseline": s.baseline} for s in systems},
        "overall_by_system": summarise(overall),
        "categories_by_system": {cat: summarise(t) for cat, t in by_category.items()},
        "turns_by_system": {str(turn): summarise(t) for turn, t in sorted(by_turn.items())},
        "prompts": prompts,
    }


def _single(results: list[RunResult]) -> Tally:
    tally = Tally()
    tally.add(results, None)
    return tally
