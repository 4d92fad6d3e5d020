"""The batched engine against the single-request Engine: per sequence, the same tokens.

Greedy outputs must be token-identical whatever the batch around a sequence does (rows joining
late, other rows drafting more or less, rejections elsewhere). Seeded sampling must give the
same tokens as the single engine with the same seed. With speculation off, a step is one
batched forward pass over [rows, 1]."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import GenerationConfig

from specdec.config import SamplingParams
from specdec.drafters import Drafter, Proposal
from specdec.drafters.ngram import NgramDrafter
from specdec.engine import Engine
from specdec.engine.batch import BatchEngine
from specdec.engine.generation import Generation
from specdec.models import LoadedModel, load_model

PROMPTS = [[1, 5, 9, 5, 9, 5, 9, 200], [1, 700, 800, 900], [1, 42] * 6, [1, 300, 301, 302, 303, 304]]
MAX_TOKENS = 24


class NoisyDrafter(Drafter):
    """Agrees partly: proposes the plain greedy continuation with one token in three wrong."""

    def __init__(self, reference: list[int]) -> None:
        self.reference = reference  # prompt + plain greedy output

    def begin(self, prompt_ids: list[int], max_len: int) -> None:
        pass

    def propose(self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator | None) -> Proposal:
        right = self.reference[len(context) : len(context) + k]
        wrong = len(context) % 3
        return Proposal([7 if i == wrong else t for i, t in enumerate(right)])

    def commit(self, context: list[int], num_accepted: int) -> None:
        pass


Request = tuple[list[int], SamplingParams, Drafter | None, int]  # prompt, params, drafter, k


def _run(engine: BatchEngine, requests: list[Request], join_every: int = 0) -> list[Generation]:
    """Admit the requests (one every `join_every` steps, or all at once) and step to the end;
    their results, in order."""
    results = [Generation(prompt_ids=list(prompt)) for prompt, *_ in requests]
    waiting = list(zip(requests, results))
    steps = 0
    while waiting or engine.running:
        if waiting and (join_every == 0 or steps % join_every == 0):
            batch = waiting if join_every == 0 else waiting[:1]
            for (prompt, params, drafter, k), result in batch:
                if (out := engine.admit(prompt, params, drafter, k, result=result)).finished:
                    engine.remove(out.sequence)
            waiting = waiting[len(batch) :]
        for out in engine.step():
            if out.finished:
                engine.remove(out.sequence)
        steps += 1
    return results


def _plain(model: LoadedModel, prompt: list[int]) -> list[int]:
    return prompt + Engine(model).generate(prompt, SamplingParams(max_tokens=MAX_TOKENS + 8, ignore_eos=True)).token_ids


def _drafter(kind: str, model: LoadedModel, prompt: list[int]):
    if kind == "noisy":
        return NoisyDrafter(_plain(model, prompt))
    return {"none": None, "ngram": NgramDrafter(1, 4)}[kind]


@pytest.mark.parametrize("join_every", [0, 3])
def test_greedy_matches_single_engine_per_sequence(tiny_any: LoadedModel, join_every: int) -> None:
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    kinds = ["none", "ngram", "noisy", "noisy"]
    ks = [0, 4, 3, 6]
    expected = [Engine(tiny_any, _drafter(kind, tiny_any, p), k).generate(p, params).token_ids for p, kind, k in zip(PROMPTS, kinds, ks)]
    engine = BatchEngine(tiny_any, max_rows=4, max_model_len=128)
    results = _run(engine, [(p, params, _drafter(kind, tiny_any, p), k) for p, kind, k in zip(PROMPTS, kinds, ks)],
                   join_every)
    assert [r.token_ids for r in results] == expected
    assert all(r.finish_reason == "length" for r in results)
    noisy = results[2].stats
    assert 0 < noisy.accepted_tokens < noisy.drafted_tokens  # rejections happened in the batch
    assert engine.running == 0 and engine.cache.rows == 0


def test_k_can_change_between_steps(tiny_any: LoadedModel) -> None:
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = Engine(tiny_any).generate(PROMPTS[0], params).token_ids
    engine = BatchEngine(tiny_any, max_rows=2, max_model_len=128)
    seq = engine.admit(PROMPTS[0], params, NoisyDrafter(_plain(tiny_any, PROMPTS[0])), 4).sequence
    step = 0
    while not seq.finished:
        seq.k = [4, 0, 2][step % 3]  # what a load-aware schedule does
        engine.step()
        step += 1
    assert seq.result.token_ids == expected
    stats = seq.result.stats
    assert len(stats.drafted_at) == 4 and stats.drafted_at[1] > stats.drafted_at[2] > 0  # k=2 and k=4 steps


def test_seeded_sampling_matches_single_engine(tiny_any: LoadedModel) -> None:
    expected, requests = [], []
    for i, prompt in enumerate(PROMPTS):
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.95, seed=100 + i, ignore_eos=True)
        expected.append(Engine(tiny_any, NgramDrafter(1, 4), 3).generate(prompt, params).token_ids)
        requests.append((prompt, params, NgramDrafter(1, 4), 3))
    results = _run(BatchEngine(tiny_any, max_rows=4, max_model_len=128), requests)
    assert [r.token_ids for r in results] == expected
    assert len({tuple(r.token_ids) for r in results}) == len(results)


def test_plain_decoding_is_one_batched_pass_per_step(tiny_model: LoadedModel) -> None:
    shapes = []
    hook = tiny_model.model.register_forward_pre_hook(lambda m, a, kw: shapes.append(tuple(kw["input_ids"].shape)), with_kwargs=True)
    try:
        engine = BatchEngine(tiny_model, max_rows=4, max_model_len=128)
        for p in PROMPTS:
            engine.admit(p, SamplingParams(max_tokens=8, ignore_eos=True))
        shapes.clear()  # prefills were one pass each
        engine.step()
    finally:
        hook.remove()
    assert shapes == [(4, 1)]


def test_stop_conditions_match_single_engine(tiny_any: LoadedModel) -> None:
    reference = Engine(tiny_any).generate(PROMPTS[1], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    stop = reference.text[len(reference.text) // 2 : len(reference.text) // 2 + 3]
    assert stop.strip()
    params = SamplingParams(max_tokens=MAX_TOKENS, stop=(stop,), ignore_eos=True)
    expected = Engine(tiny_any, NgramDrafter(1, 4), 4).generate(PROMPTS[1], params)
    (result,) = _run(BatchEngine(tiny_any, max_rows=2, max_model_len=128), [(PROMPTS[1], params, NgramDrafter(1, 4), 4)])
    assert (result.token_ids, result.text, result.finish_reason) == (expected.token_ids, expected.text, "stop")


def test_prompt_over_the_context_is_refused(tiny_any: LoadedModel) -> None:
    engine = BatchEngine(tiny_any, max_rows=1, max_model_len=16)
    with pytest.raises(ValueError, match="at most 15"):
        engine.admit(list(range(1, 17)), SamplingParams())
    assert engine.running == 0


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_draft_model_forks_match_single_engine(tiny_any: LoadedModel, temperature: float) -> None:
    """A stateful drafter (its own KV cache): one fork per sequence, as the server does."""
    from specdec.config import SpeculativeConfig
    from specdec.methods import build_drafter
    from specdec.server.scheduler import fork_drafter

    config = SpeculativeConfig("draft_model", 3, model=tiny_any.source)
    prototype = build_drafter(config, tiny_any)
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=temperature, seed=5 + i, ignore_eos=True) for i in range(3)]
    expected = [Engine(tiny_any, build_drafter(config, tiny_any), 3).generate(p, sp).token_ids
                for p, sp in zip(PROMPTS, params)]
    results = _run(BatchEngine(tiny_any, max_rows=3, max_model_len=128),
                   [(p, sp, fork_drafter(prototype), 3) for p, sp in zip(PROMPTS, params)], join_every=2)
    assert [r.token_ids for r in results] == expected
    assert all(r.stats.accepted_tokens > 0 for r in results)


class OracleDrafter(NoisyDrafter):
    """Always agrees: proposes the plain greedy continuation."""

    def propose(self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator | None) -> Proposal:
        return Proposal(self.reference[len(context) : len(context) + k])


@pytest.mark.parametrize("batched", [False, True])
def test_eos_inside_an_accepted_draft_ends_the_output_there(tiny_any: LoadedModel, batched: bool) -> None:
    # Every other batch test ignores EOS. Here EOS is a token the plain output reaches in the
    # middle of a step (a run of k accepted drafts), so only a check of every committed token,
    # not just the step's last one, stops the output right before it.
    reference = _plain(tiny_any, PROMPTS[1])
    output = reference[len(PROMPTS[1]) :]
    position = next(i for i in range(3, len(output)) if i % 5 not in (0, 4))  # not a step's first or last token
    eos = output[position]
    position = output.index(eos)  # its first occurrence ends the output
    model = dataclasses.replace(tiny_any, generation_config=GenerationConfig(eos_token_id=eos))
    params = SamplingParams(max_tokens=MAX_TOKENS)
    requests: list[Request] = [(PROMPTS[1], params, OracleDrafter(reference), 4)]
    if batched:
        requests.append((PROMPTS[0], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True), NgramDrafter(1, 4), 4))
    first = _run(BatchEngine(model, max_rows=2, max_model_len=128), requests)[0]
    assert first.token_ids == output[:position]
    assert first.finish_reason == "stop"
    assert first.stats.accepted_tokens > 0


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_batched_masks_hold_under_every_attention_implementation(tiny_model_dir, attention: str) -> None:
    # A model handed in with eager attention (which adds masks instead of applying boolean
    # ones) must batch rows of different lengths exactly as each decodes alone.
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation=attention).eval()
    tokenizer = __import__("transformers").AutoTokenizer.from_pretrained(tiny_model_dir)
    loaded = LoadedModel.from_hf(model, tokenizer, name="tiny", source=str(tiny_model_dir))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16], [20, 21, 20, 21, 20]]
    alone = [Engine(loaded).generate(p, params).token_ids for p in prompts]
    engine = BatchEngine(loaded, max_rows=3, max_model_len=64, max_draft=3)
    seqs = [engine.admit(p, params, NgramDrafter(1, 3), 3).sequence for p in prompts]
    while not all(s.finished for s in seqs):
        engine.step()
    assert [s.result.token_ids for s in seqs] == alone


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_llm_generate_batches_its_prompts_as_one_by_one(tiny_model_dir, temperature: float,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # Several prompts share each target pass (rows of the batched step, each with its own fork of
    # the drafter), and each gets what it gets alone: int8 products are row-invariant.
    from specdec import LLM

    target = load_model(str(tiny_model_dir), backend="native", dtype="int8")
    llm = LLM(loaded=target, speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
              prefix_cache_mb=0)
    prompts = ["one two three one two three", "the cat sat on the mat", "a b c d a b c", "red green blue red", "x y z"]
    params = SamplingParams(max_tokens=24, temperature=temperature, seed=5, ignore_eos=True)
    alone = [o.token_ids for o in llm.generate(prompts, params, max_batch=1)]
    rows = []
    forward = target.backend.forward
    monkeypatch.setattr(target.backend, "forward", lambda cache, ids, *a, **kw: rows.append(ids.shape[0]) or forward(cache, ids, *a, **kw))
    together = [o.token_ids for o in llm.generate(prompts, params, max_batch=3)]
    assert together == alone
    assert max(rows) == 3  # three rows at once, the others joining as rows came free


def test_torch_runs_on_one_thread_between_passes_and_on_all_in_them(tiny_native: LoadedModel,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # Where OpenMP's spinning is unbounded (torch imported before specdec), torch's operations
    # between passes (acceptance, a lookup drafter's proposal) run inline, so that no OpenMP worker
    # is left spinning on a core the next pass needs; the passes keep torch's threads.
    import specdec.engine.batch as batch_module
    from specdec import _openmp

    monkeypatch.setattr(_openmp, "spin_bounded", False)

    seen: dict[str, set[int]] = {"pass": set(), "accept": set(), "propose": set()}
    forward, accept, propose = type(tiny_native.backend).forward, batch_module.accept_step, NgramDrafter.propose

    def recorded(name, fn):
        def call(*args, **kwargs):
            seen[name].add(torch.get_num_threads())
            return fn(*args, **kwargs)
        return call

    monkeypatch.setattr(type(tiny_native.backend), "forward", recorded("pass", forward))
    monkeypatch.setattr(batch_module, "accept_step", recorded("accept", accept))
    monkeypatch.setattr(NgramDrafter, "propose", recorded("propose", propose))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        params = SamplingParams(temperature=0.8, seed=3, max_tokens=12)
        Engine(tiny_native, NgramDrafter(1, 3), 3).generate([5, 6, 7, 5, 6, 7, 5], params)
        after = torch.get_num_threads()
        assert seen == {"pass": {2}, "accept": {1}, "propose": {1}} and after == 2
        # A step's logits past INLINE_LOGITS (a big batch): its acceptance keeps torch's threads
        # (the first token's, one row after the prefill, stays inline).
        monkeypatch.setattr(batch_module, "INLINE_LOGITS", 0)
        seen["accept"].clear()
        Engine(tiny_native, NgramDrafter(1, 3), 3).generate([5, 6, 7, 5, 6, 7, 5], params)
        assert seen["accept"] == {1, 2}
    finally:
        torch.set_num_threads(before)
