"""Lookahead decoding: the n-gram pool, the trie of guesses, the Jacobi window's diagonals, and
greedy identity on the default model (the lossless, sampling-distribution and invariant suites
cover it too)."""

from __future__ import annotations

import pytest

from specdec import LLM, SamplingParams, SpeculativeConfig
from specdec.config import SamplingParams as Params
from specdec.drafters.base import Verified
from specdec.drafters.lookahead import LookaheadDrafter, NgramPool, merge_chains
from specdec.errors import ConfigError

GREEDY = Params()


def test_pool_keeps_the_most_recent_per_first_token() -> None:
    pool = NgramPool(3, size=2)
    for gram in [(1, 2, 3), (1, 4, 5), (1, 2, 3), (1, 6, 7), (9, 9, 9)]:
        pool.add(gram)
    assert pool.guesses(1, 5) == [(6, 7), (2, 3)]  # newest first; (4, 5) fell out
    assert pool.guesses(1, 1) == [(6, 7)]
    assert pool.guesses(2, 3) == []
    assert len(pool) == 3


def test_merge_chains_shares_prefixes_in_order() -> None:
    tokens, parents = merge_chains([[5, 6, 7], [5, 8], [9], [5, 6, 7]])
    assert tokens == [5, 6, 7, 8, 9]
    assert parents == [-1, 0, 1, 0, -1]
    assert merge_chains([]) == ([], [])


def test_window_proposes_its_guesses_and_learns_diagonals() -> None:
    # N = 2: after a pass fed (root r, window w1, w2) with top tokens (z1, z2, z3), the target put
    # z1 after r, z2 after w1, z3 after w2: bigrams (r, z1), (w1, z2), (w2, z3).
    drafter = LookaheadDrafter(window=2, n=2, guesses=2, pool_size=4)
    prompt = [10, 11, 12, 13]
    drafter.begin(prompt, 64)
    first = drafter.propose(prompt, 4, GREEDY, None)
    window = first.tokens[-2:]
    assert first.parents is None and len(first.tokens) == 2  # an empty pool: the window alone, a chain
    drafter.observe_verified(Verified(first.tokens, [-1, 0], top=[20, 21, 22]))
    assert drafter.pool.guesses(13, 3) == [(20,)]
    assert drafter.pool.guesses(window[0], 3)[0] == (21,)
    assert drafter.pool.guesses(window[1], 3)[0] == (22,)
    # Commit one token (20): the next window starts at the positions the pass predicted.
    context = prompt + [20]
    drafter.commit(context, 0)
    second = drafter.propose(context, 4, GREEDY, None)
    assert second.tokens[-2:] == [21, 22]  # the Jacobi iterate: this pass's tops, shifted
    assert drafter.pool.guesses(20, 1) == []  # no n-gram starts at the new root yet


def test_trigrams_come_from_two_passes() -> None:
    # N = 3: the token fed in the older pass, what that pass put after it, what the newer pass put
    # after that (it was fed it).
    drafter = LookaheadDrafter(window=2, n=3, guesses=1, pool_size=4)
    prompt = [1, 2, 3]
    drafter.begin(prompt, 64)
    p1 = drafter.propose(prompt, 4, GREEDY, None)
    drafter.observe_verified(Verified(p1.tokens, [-1, 0], top=[7, 8, 9]))  # positions 3, 4, 5
    assert len(drafter.pool) == 0  # one pass is not a trigram yet
    context = prompt + [7]  # nothing accepted: the target's token after the root is committed
    drafter.commit(context, 0)
    p2 = drafter.propose(context, 4, GREEDY, None)  # window [8, 9] at positions 4, 5
    assert p2.tokens[-2:] == [8, 9]
    drafter.observe_verified(Verified(p2.tokens, list(p2.parents or [-1, 0]), top=[8, 5, 6]))  # tops at positions 4, 5, 6
    # (3 fed in pass 1, 7 out at 3, 8 out of pass 2 at 4): the root's n-gram; (p1.window[0], 8, 5);
    # (p1.window[1], 9, 6).
    assert (7, 8) in drafter.pool.guesses(3, 4)
    assert (8, 5) in drafter.pool.guesses(p1.tokens[0], 4)


def test_output_ngrams_enter_the_pool_but_the_prompts_do_not() -> None:
    drafter = LookaheadDrafter(window=0, n=2, guesses=2, pool_size=4)
    prompt = [1, 2, 1, 2]
    drafter.begin(prompt, 64)
    assert drafter.propose(prompt, 4, GREEDY, None).tokens == []  # no window, empty pool
    context = prompt + [3, 4]
    drafter.commit(context, 1)
    assert drafter.pool.guesses(2, 2) == [(3,)] and drafter.pool.guesses(3, 2) == [(4,)]
    assert drafter.pool.guesses(1, 2) == []


def test_options_are_validated() -> None:
    config = SpeculativeConfig(method="lookahead", lookahead_window=3, lookahead_ngram=2, lookahead_guesses=2)
    assert config.label == "lookahead W3 N2 G2 k=2"
    with pytest.raises(ConfigError, match="lookahead_ngram must be an integer >= 2, got 1"):
        SpeculativeConfig(method="lookahead", lookahead_ngram=1)
    with pytest.raises(ConfigError, match="lookahead_guesses must be an integer >= 0"):
        SpeculativeConfig(method="lookahead", lookahead_guesses=-1)


@pytest.mark.real
@pytest.mark.parametrize("options", [
    {"num_speculative_tokens": 2},
    {"num_speculative_tokens": 3, "lookahead_window": 3, "lookahead_ngram": 2, "lookahead_guesses": 3},
    {"num_speculative_tokens": 4, "lookahead_window": 0, "lookahead_ngram": 4, "lookahead_guesses": 2},
])
def test_greedy_identity_on_the_default_model(default_model, options: dict) -> None:
    prompts = [[{"role": "user", "content": "List the days of the week, one per line, with a short note on each."}],
               [{"role": "user", "content": "Write a short poem about the sea."}]]
    params = SamplingParams(max_tokens=64)
    plain = LLM(loaded=default_model).generate(prompts, params)
    llm = LLM(loaded=default_model, speculative_config=SpeculativeConfig(method="lookahead", **options))
    outputs = llm.generate(prompts, params)
    for out, ref in zip(outputs, plain):
        assert out.token_ids == ref.token_ids
    assert sum(o.stats.drafted_tokens for o in outputs) > 0
    # The list repeats its pattern: something must be accepted.
    assert outputs[0].stats.accepted_tokens > 0
