"""The bigram drafter: the chain of most frequent successors in the request's own tokens."""

from __future__ import annotations

import pytest

from specdec import LLM, SamplingParams, SpeculativeConfig
from specdec.drafters.bigram import BigramDrafter
from specdec.errors import ConfigError

PARAMS = SamplingParams(temperature=0.0)


def _propose(context: list[int], k: int, min_count: int = 2) -> list[int]:
    drafter = BigramDrafter(min_count)
    drafter.begin(context, 100)
    return drafter.propose(context, k, PARAMS, None).tokens


def test_follows_the_most_frequent_successor() -> None:
    # 1 -> 2 twice, 1 -> 3 once; 2 -> 4 twice.
    assert _propose([1, 2, 4, 1, 3, 1, 2, 4, 9, 1], 2) == [2, 4]
    assert _propose([1, 2, 4, 1, 3, 1, 2, 4, 9, 1], 1) == [2]


def test_ties_go_to_the_latest_and_rare_successors_are_not_drafted() -> None:
    assert _propose([5, 6, 5, 7, 5], 1, min_count=1) == [7]
    assert _propose([5, 6, 5, 7, 5], 1, min_count=2) == []
    assert _propose([8, 9], 3) == []  # no successor of 9


def test_counts_what_was_committed_and_forks_empty() -> None:
    drafter = BigramDrafter(2)
    drafter.begin([1, 2], 100)
    context = [1, 2, 1, 2, 1]
    drafter.commit(context, 0)
    assert drafter.propose(context, 1, PARAMS, None).tokens == [2]
    fork = drafter.fork()
    fork.begin([1], 100)
    assert fork.propose([1], 1, PARAMS, None).tokens == []


def test_options_are_checked() -> None:
    with pytest.raises(ConfigError, match="bigram_min_count"):
        SpeculativeConfig.from_dict({"method": "bigram", "bigram_min_count": 0})
    assert SpeculativeConfig.from_dict({"method": "bigram"}).num_speculative_tokens == 3


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_tiny_model_output_is_plain_decodings(tiny_any, temperature: float) -> None:
    # Sampled, drafter-invariant: a seed gives the same tokens with the drafter as without it, so
    # the sampled case checks the drafts run through the sampling rule without changing a token.
    params = SamplingParams(temperature=temperature, seed=3, max_tokens=40, ignore_eos=True,
                            drafter_invariant=temperature > 0)
    prompts = ["one two one two one two", "a b c a b c a"]
    plain = LLM(loaded=tiny_any).generate(prompts, params, speculate=False)
    spec = LLM(loaded=tiny_any, speculative_config={"method": "bigram", "num_speculative_tokens": 4,
                                                    "bigram_min_count": 1}).generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert all(len(o.token_ids) == 40 for o in spec)
    # On real weights (test_lossless) the drafter drafts; a random model's output rarely repeats.
