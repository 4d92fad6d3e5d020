"""Suffix drafting: the longest suffix, the most frequent continuation, the route's cache of
earlier outputs (shared by forks, never across caches), its limits, and thread safety."""

from __future__ import annotations

import threading

import pytest

from specdec import LLM, SamplingParams
from specdec.config import SpeculativeConfig
from specdec.drafters.suffix import BYTES_PER_TOKEN, SuffixCache, SuffixDrafter
from specdec.errors import ConfigError
from specdec.models import LoadedModel

GREEDY = SamplingParams(temperature=0.0)


def drafter(cache: SuffixCache | None = None, **options) -> SuffixDrafter:
    return SuffixDrafter(cache or SuffixCache(100, 2**20), **options)


def run(d: SuffixDrafter, prompt: list[int], output: list[int]) -> None:
    """A request: its prompt, then its output committed token by token."""
    d.begin(prompt, 1000)
    context = list(prompt)
    for token in output:
        context.append(token)
        d.commit(context, 0)


def test_the_longest_suffix_and_what_followed_it() -> None:
    d = drafter()
    # "1 2 3" occurred followed by 4; "2 3" also occurred followed by 9, but the longer match wins.
    context = [2, 3, 9, 7, 1, 2, 3, 4, 5, 6, 8, 1, 2, 3]
    d.begin(context, 100)
    assert d.propose(context, 8, GREEDY, None).tokens == [4, 5, 6]  # a 3-token match: at most 3 tokens
    assert d.propose(context, 2, GREEDY, None).tokens == [4, 5]  # at most k
    assert drafter(spec_factor=0.5).propose(context, 8, GREEDY, None).tokens[:1] == [4]
    fresh = drafter()
    fresh.begin([1, 2, 3], 100)
    assert fresh.propose([1, 2, 3], 4, GREEDY, None).tokens == []  # nothing occurred before


def test_the_most_frequent_continuation_while_it_is_probable_enough() -> None:
    cache = SuffixCache(100, 2**20)
    for output in ([5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 9, 9]):
        run(drafter(cache), [1], output)
    # After "5 6": 7 twice, 9 once (p = 2/3), then 8 every time (p stays 2/3).
    d = drafter(cache, min_prob=0.5)
    d.begin([40, 5, 6], 100)
    assert d.propose([40, 5, 6], 2, GREEDY, None).tokens == [7, 8]
    strict = drafter(cache, min_prob=0.7)
    strict.begin([40, 5, 6], 100)
    assert strict.propose([40, 5, 6], 2, GREEDY, None).tokens == []


def test_a_tree_holds_the_most_probable_continuations_best_first() -> None:
    cache = SuffixCache(100, 2**20)
    for output in ([5, 6, 7, 8], [5, 6, 7, 9], [5, 6, 3, 4]):
        run(drafter(cache), [1], output)

    def propose(source: SuffixCache, k: int, **options):
        d = drafter(source, spec_factor=2.0, **options)
        d.begin([40, 5, 6], 100)
        return d.propose([40, 5, 6], k, GREEDY, None)

    # After "5 6": 7 (p = 2/3), 3 (1/3); after "5 6 7": 8 and 9 (1/3 each); after "5 6 3": 4 (1/3).
    proposal = propose(cache, 4, min_prob=0.3, tree=True)
    assert proposal.tokens == [7, 3, 8, 9] and proposal.parents == (-1, -1, 0, 0)  # at most k nodes
    assert propose(cache, 2, min_prob=0.3, tree=True).tokens == [7, 3]
    assert propose(cache, 4, min_prob=0.5, tree=True).tokens == [7]
    # The chain takes the most frequent token at each step: 7, then 8 (the first of a tie).
    chain = propose(cache, 4, min_prob=0.3)
    assert chain.tokens == [7, 8] and chain.parents is None
    # A tree that is one path goes out as a chain.
    single = SuffixCache(100, 2**20)
    run(drafter(single), [1], [5, 6, 7, 8])
    assert propose(single, 4, tree=True).parents is None


def test_outputs_are_shared_by_forks_and_not_across_caches() -> None:
    route_a, route_b = drafter(), drafter()
    run(route_a, [1, 2], [10, 11, 12, 13, 14])
    other = route_a.fork()  # another request of route a
    other.begin([50, 10, 11], 100)
    assert other.propose([50, 10, 11], 3, GREEDY, None).tokens == [12, 13]
    stranger = route_b.fork()  # route b has its own cache: route a's text must not leak into it
    stranger.begin([50, 10, 11], 100)
    assert stranger.propose([50, 10, 11], 3, GREEDY, None).tokens == []
    # Only the output is cached, never the prompt: a prompt may hold one tenant's secrets.
    stranger_a = route_a.fork()
    stranger_a.begin([60, 1], 100)
    assert stranger_a.propose([60, 1], 3, GREEDY, None).tokens == []


def test_requests_still_running_draft_from_each_other() -> None:
    cache = SuffixCache(100, 2**20)
    first, second = drafter(cache), drafter(cache)
    first.begin([1], 100)
    second.begin([1], 100)
    first.commit([1, 20, 21, 22, 23], 0)  # first is ahead; second has just written 20 21
    assert second.propose([1, 20, 21], 3, GREEDY, None).tokens == [22, 23]


def test_the_cache_forgets_the_least_recently_written_requests() -> None:
    by_count = SuffixCache(2, 2**20)
    for base in (100, 200, 300):
        run(drafter(by_count), [1], [base, base + 1, base + 2])
    assert by_count.requests == 2
    probe = drafter(by_count)
    probe.begin([9, 100], 10)
    assert probe.propose([9, 100], 2, GREEDY, None).tokens == []  # the oldest request is gone
    probe.begin([9, 300], 10)
    assert probe.propose([9, 300], 2, GREEDY, None).tokens == [301]

    by_bytes = SuffixCache(100, 10 * BYTES_PER_TOKEN)
    for base in (100, 200, 300):
        run(drafter(by_bytes), [1], [base, base + 1, base + 2, base + 3])
    assert by_bytes.nbytes <= 10 * BYTES_PER_TOKEN and by_bytes.requests == 2

    none = SuffixCache(0, 2**20)  # no cross-request cache: the request's own text only
    run(drafter(none), [1], [5, 6, 7])
    assert none.requests == 0


def test_the_index_stays_right_through_many_evictions() -> None:
    cache = SuffixCache(3, 2**20)
    for base in range(0, 3000, 10):
        run(drafter(cache), [1], [base, base + 1, base + 2, base + 3])
    probe = drafter(cache)
    probe.begin([7, 2990], 10)
    assert probe.propose([7, 2990], 3, GREEDY, None).tokens == [2991]
    probe.begin([7, 2000], 10)
    assert probe.propose([7, 2000], 3, GREEDY, None).tokens == []
    assert cache._index.dead < 5000  # dead entries were compacted away


def test_concurrent_requests_share_the_cache_safely() -> None:
    cache = SuffixCache(50, 2**20)
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        try:
            for r in range(30):
                d = drafter(cache)
                prompt = [seed, r]
                d.begin(prompt, 1000)
                context = list(prompt)
                for i in range(40):
                    context.append((seed * 7 + i) % 13)
                    d.commit(context, 0)
                    d.propose(context, 4, GREEDY, None)
        except BaseException as exc:  # noqa: BLE001  reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert cache.requests <= 50


def test_config_options_are_checked() -> None:
    config = SpeculativeConfig.from_dict({"method": "suffix"})
    assert config.num_speculative_tokens == 6 and config.suffix_decoding_max_tree_depth == 24
    assert config.label == "suffix k=6"
    assert SpeculativeConfig.from_dict({"method": "suffix", "suffix_decoding_max_cached_requests": 0}).label == "suffix no cache k=6"
    assert SpeculativeConfig.from_dict({"method": "suffix", "suffix_decoding_use_tree": True}).label == "suffix tree k=6"
    for bad in ({"suffix_decoding_max_tree_depth": 0}, {"suffix_decoding_min_token_prob": 1.5},
                {"suffix_decoding_max_spec_factor": 0}, {"suffix_decoding_max_cached_requests": -1},
                {"suffix_decoding_max_cache_mib": float("inf")}, {"suffix_decoding_use_tree": 1}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            SpeculativeConfig.from_dict({"method": "suffix"} | bad)


def test_repeated_requests_draft_from_earlier_outputs(tiny_native: LoadedModel) -> None:
    # The library keeps one drafter: a request repeated draws on the first one's output, and
    # greedy output stays the plain output.
    llm = LLM(loaded=tiny_native, speculative_config={"method": "suffix", "num_speculative_tokens": 4})
    prompt = [{"role": "user", "content": "Tell me a story about a cat."}]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = llm.generate(prompt, params, speculate=False)[0].token_ids
    first, second = (llm.generate([prompt], params)[0] for _ in range(2))  # one after the other
    assert first.token_ids == second.token_ids == plain
    assert second.stats.accepted_tokens > first.stats.accepted_tokens
    # Not every proposal: the tiny model's text repeats itself, so a few follow another branch
    # of the same output.
    assert second.stats.acceptance_rate > 0.8
