"""Prefix caching (specdec.models.prefix_cache): blocks keyed by their whole prefix, least recently
used leaves evicted first within the budget, and reuse that is exact: the keys and values a later
prompt gets are bitwise what a fresh prefill of the same tokens computes, whatever drafter
committed them, and outputs are the same with the cache and without it."""

from __future__ import annotations

import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.engine import Engine
from specdec.engine.batch import BatchEngine
from specdec.config import SpeculativeConfig
from specdec.methods import build_drafter
from specdec.models import LoadedModel, load_model
from specdec.models.prefix_cache import PrefixCache
from specdec.models.runner import ModelRunner
from specdec.training.heads import TrainConfig, new_head

# --- the block logic, on a fake cache whose slot n holds the value n ------------------------------


class Slots:
    """keys_values() of a cache whose every entry at slot n is n (1 layer, 1 head, head_dim 1)."""

    def keys_values(self, start: int, end: int, row: int = 0) -> torch.Tensor:
        slots = torch.arange(start, end, dtype=torch.float32)
        return torch.stack((slots, slots))[None, :, None, :, None]  # [1, 2, 1, n, 1]


BLOCK_BYTES = 2 * 4 * 4  # a block of 4 slots: keys and values, float32


def test_a_prompt_reuses_the_longest_run_of_whole_blocks_and_keeps_one_token() -> None:
    cache = PrefixCache(10 * BLOCK_BYTES, block=4)
    assert cache.store(list(range(10)), Slots()) == 2  # 10 tokens: 2 whole blocks
    hit = cache.match(list(range(10)))
    assert hit.tokens == 8 and torch.equal(hit.kv()[0, 0, 0, :, 0], torch.arange(8.0))
    # One token is always left to prefill: its logits give the first output token.
    assert cache.match(list(range(8))).tokens == 4
    assert cache.match([0, 1, 2, 3, 99, 5, 6, 7, 8]).tokens == 4  # the second block differs
    assert cache.match([9, 0, 1, 2, 3, 4, 5, 6, 7]).tokens == 0
    # A block is keyed by its whole prefix: the same four tokens after other ones are no hit.
    assert cache.store([7, 7, 7, 7, 4, 5, 6, 7, 0], Slots()) == 2
    assert cache.match([9, 9, 9, 9, 4, 5, 6, 7, 0]).tokens == 0
    assert cache.stats.hit_tokens == 8 + 4 + 4 and cache.stats.lookup_tokens == 10 + 8 + 9 + 9 + 9


def test_storing_again_copies_only_what_is_new() -> None:
    cache = PrefixCache(10 * BLOCK_BYTES, block=4)
    cache.store(list(range(8)), Slots())
    assert cache.store(list(range(8)), Slots()) == 0
    assert cache.store(list(range(13)), Slots()) == 1
    assert len(cache) == 3 and cache.nbytes == 3 * BLOCK_BYTES


def test_eviction_takes_the_least_recently_used_leaves_first() -> None:
    cache = PrefixCache(4 * BLOCK_BYTES, block=4)
    a = [1] * 4 + [2] * 4 + [3] * 4  # blocks a1 a2 a3
    b = [1] * 4 + [5] * 4  # shares a1
    cache.store(a, Slots())
    cache.store(b, Slots())
    assert len(cache) == 4
    cache.match(a + [0])  # a is used last: b's own block is the oldest
    cache.store([8] * 8, Slots())  # two more blocks: two must go
    assert cache.nbytes <= cache.budget_bytes and cache.stats.evicted_blocks == 2
    # b's leaf went first, then a's deepest; the shared first block, used by both, stays.
    assert cache.match(b + [0]).tokens == 4
    assert cache.match(a + [0]).tokens == 8
    assert cache.match([8] * 9).tokens == 8


def test_a_prompt_that_needs_states_reuses_only_blocks_that_hold_them() -> None:
    cache = PrefixCache(10 * BLOCK_BYTES + 1000, block=4)
    states = {3: torch.arange(8.0)[:, None]}  # [tokens, hidden]
    cache.store(list(range(8)), Slots(), states=states)
    cache.store(list(range(13)), Slots())  # the third block without states
    assert cache.match(list(range(13))).tokens == 12
    hit = cache.match(list(range(13)), layers=(3,))
    assert hit.tokens == 8 and torch.equal(hit.states((3,))[3], states[3])
    assert cache.match(list(range(13)), layers=(4,)).tokens == 0


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="block"):
        PrefixCache(100, block=0)
    with pytest.raises(ValueError, match="budget"):
        PrefixCache(-1)


# --- exactness on a model --------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_exact(tiny_model_dir) -> LoadedModel:
    """The tiny model where reuse is exact: int8 products (row-invariant), the kernels' per-query
    attention."""
    loaded = load_model(str(tiny_model_dir), backend="native", dtype="int8")
    if not loaded.backend.exact_blocks:
        pytest.skip("specdec's kernels are not built here: no backend reuses keys exactly")
    return loaded


def test_no_cache_where_reuse_would_not_be_exact(tiny_model: LoadedModel, tiny_native: LoadedModel) -> None:
    # hf (a prompt attends in one masked pass) and float32 products (MKL rounds by row count).
    assert PrefixCache.for_backend(tiny_model.backend, 1 << 30) is None
    assert PrefixCache.for_backend(tiny_native.backend, 1 << 30) is None
    assert LLM(loaded=tiny_model).prefix_cache is None


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(5, 200, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


SPECULATION = [None, {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
               {"method": "lookahead", "num_speculative_tokens": 4, "lookahead_window": 4, "lookahead_ngram": 2,
                "lookahead_guesses": 3},
               {"method": "suffix", "num_speculative_tokens": 6, "suffix_decoding_use_tree": True,
                "suffix_decoding_max_spec_factor": 2.0, "suffix_decoding_min_token_prob": 0.0}]


@pytest.mark.parametrize("spec", SPECULATION, ids=["plain", "ngram", "lookahead-tree", "suffix-tree"])
def test_stored_keys_are_bitwise_a_fresh_prefill(tiny_exact: LoadedModel, spec: dict | None) -> None:
    # Committed by plain steps, chain verifications or token trees (whose kept branch is moved),
    # in a batch of three rows: every stored block is what one prefill of the tokens computes.
    prefix = PrefixCache(1 << 30)
    engine = BatchEngine(tiny_exact, max_rows=3, max_model_len=200, max_draft=16, prefix_cache=prefix)
    config = SpeculativeConfig.from_dict(spec) if spec else None
    seqs = [engine.admit(_prompt(40 + 7 * i, i), SamplingParams(max_tokens=60, ignore_eos=True),
                         build_drafter(config, tiny_exact) if config else None,
                         config.num_speculative_tokens if config else 0).sequence
            for i in range(3)]
    while not all(s.finished for s in seqs):
        engine.step()
    for seq in seqs:
        committed = seq.context[: int(engine.cache.lengths[seq.row])]
        engine.remove(seq)
        hit = prefix.match(committed + [0])
        assert hit.tokens == len(committed) // prefix.block * prefix.block > len(seq.prompt_ids)
        runner = ModelRunner(tiny_exact)
        fresh = runner.new_cache(len(committed))
        runner.forward(fresh, committed, last_only=True)
        assert torch.equal(hit.kv(), fresh.keys_values(0, hit.tokens))


@pytest.mark.parametrize("spec", SPECULATION[:3], ids=["plain", "ngram", "lookahead-tree"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_outputs_are_the_same_with_the_cache_and_without(tiny_exact: LoadedModel, spec: dict | None,
                                                        temperature: float) -> None:
    # A conversation: each turn resends the earlier ones and their answers.
    config = SpeculativeConfig.from_dict(spec) if spec else None
    cached = Engine.from_config(tiny_exact, config, prefix_cache=PrefixCache(64 << 20))
    uncached = Engine.from_config(tiny_exact, config)
    params = SamplingParams(max_tokens=30, temperature=temperature, seed=7, ignore_eos=True)
    prompt, held = _prompt(50, 1), 0
    for turn in range(3):
        a = cached.generate(prompt, params)
        b = uncached.generate(prompt, params)
        assert a.token_ids == b.token_ids
        assert b.stats.cached_tokens == 0
        # The earlier turn's committed tokens, in whole blocks: its last token was never fed.
        assert a.stats.cached_tokens == held // 16 * 16
        held = len(prompt) + len(a.token_ids) - 1
        prompt = prompt + a.token_ids + _prompt(9, 10 + turn)


def test_prompt_logprobs_compute_every_position(tiny_exact: LoadedModel) -> None:
    engine = Engine(tiny_exact, prefix_cache=PrefixCache(64 << 20))
    prompt = _prompt(40, 3)
    engine.generate(prompt, SamplingParams(max_tokens=4))
    asked = SamplingParams(max_tokens=4, logprobs=0, prompt_logprobs=True)
    out = engine.generate(prompt + [7], asked)
    assert out.stats.cached_tokens == 0 and len(out.prompt_logprobs) == len(prompt) + 1
    fresh = Engine(tiny_exact).generate(prompt + [7], asked)
    assert [p.logprob if p else None for p in out.prompt_logprobs] == \
        [p.logprob if p else None for p in fresh.prompt_logprobs]


def test_a_sequence_joining_a_batch_reuses_a_running_ones_prompt(tiny_exact: LoadedModel) -> None:
    # A shared system prompt: the second request, admitted while the first runs, prefills only its tail.
    prefix = PrefixCache(1 << 30)
    engine = BatchEngine(tiny_exact, max_rows=2, max_model_len=200, prefix_cache=prefix)
    system = _prompt(64, 4)
    first = engine.admit(system + _prompt(5, 5), SamplingParams(max_tokens=20)).sequence
    engine.step()
    second = engine.admit(system + _prompt(7, 6), SamplingParams(max_tokens=20)).sequence
    assert first.result.stats.cached_tokens == 0 and second.result.stats.cached_tokens == 64
    while not (first.finished and second.finished):
        engine.step()
    alone = Engine(tiny_exact).generate(second.prompt_ids, SamplingParams(max_tokens=20))
    assert second.result.token_ids == alone.token_ids


def test_llm_refuses_a_bad_budget(tiny_exact: LoadedModel) -> None:
    with pytest.raises(Exception, match="prefix_cache_mb"):
        LLM(loaded=tiny_exact, prefix_cache_mb=-1)


@pytest.mark.real
def test_a_head_reading_the_targets_states_reuses_blocks_that_hold_them(default_model: LoadedModel,
                                                                        tmp_path) -> None:
    # An EAGLE head needs the target's states at every prompt position: a prompt's blocks are
    # stored with them, a finished answer's without, so a later turn reuses the earlier prompts.
    new_head(default_model, torch.arange(4096), TrainConfig(draft_vocab_size=4096, seed=1)).save(tmp_path)
    spec = {"method": "eagle", "model": str(tmp_path), "num_speculative_tokens": 3, "tree_width": 2, "tree_nodes": 5}
    cached, uncached = (LLM(loaded=default_model, speculative_config=spec, prefix_cache_mb=mb) for mb in (64, 0))
    messages = [{"role": "user", "content": "Explain how a bicycle works, with its gears and brakes. " * 4}]
    params = SamplingParams(max_tokens=24)
    prompts = []
    for turn in range(3):
        a, b = cached.chat(messages, params), uncached.chat(messages, params)
        assert a.token_ids == b.token_ids
        prompts.append(a.stats.prompt_tokens)
        # The earlier turn's prompt in whole blocks (its answer's blocks hold no states).
        assert a.stats.cached_tokens == (0 if turn == 0 else prompts[-2] // 16 * 16)
        messages = messages + [{"role": "assistant", "content": a.text}, {"role": "user", "content": "Go on."}]


@pytest.mark.parametrize("prefix", [False, True], ids=["no-prefix-cache", "prefix-cache"])
def test_a_prompt_sent_twice_in_a_row_reports_its_reuse(tiny_exact: LoadedModel, prefix: bool) -> None:
    # The second request reuses the first one's prefill whole (whichever cache holds it).
    engine = Engine(tiny_exact, prefix_cache=PrefixCache(64 << 20) if prefix else None)
    prompt = _prompt(40, 11)
    params = SamplingParams(max_tokens=6, temperature=0.0)
    first, second = engine.generate(prompt, params), engine.generate(prompt, params)
    assert first.stats.cached_tokens == 0 and second.stats.cached_tokens == len(prompt)
    assert second.token_ids == first.token_ids
