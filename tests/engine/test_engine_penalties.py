"""Bias and penalties through the engine on a tiny model over 16 tokens, where tokens repeat
within every draft, so a position verified without the drafted tokens before it would show.

Greedy: plain decoding equals a reference that scores the whole context afresh and adjusts the
logits from the definitions (tests.sampling.test_penalties.reference); a drafter that always
agrees, a tree with a wrong sibling and prompt lookup all give the same tokens and logprobs.
Sampling: the first three tokens follow the adjusted target's exact distribution."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from specdec.config import SamplingParams
from specdec.drafters import Drafter, Proposal
from specdec.drafters.draft_model import DraftModelDrafter
from specdec.drafters.ngram import NgramDrafter
from specdec.engine import Engine
from specdec.models import LoadedModel, ModelRunner
from specdec.sampling import logits_to_probs
from tests.engine.test_sampling_distribution import assert_first_tokens_follow
from tests.sampling.test_penalties import reference

VOCAB = 16
PROMPT = [0, 1, 2, 3, 1, 2, 3, 4]
ADJUSTED = SamplingParams(max_tokens=24, ignore_eos=True, frequency_penalty=1.5, presence_penalty=0.5,
                          repetition_penalty=1.3, logit_bias={5: 3.0, 6: -100.0}, logprobs=2)


@pytest.fixture(scope="module")
def target(small_model_factory) -> LoadedModel:
    return small_model_factory(seed=11, vocab_size=VOCAB, logit_scale=6.0)


def reference_greedy(target: LoadedModel, params: SamplingParams) -> list[int]:
    runner, output = ModelRunner(target), []
    for _ in range(params.max_tokens):
        logits = runner.score(PROMPT + output)[-1].tolist()
        adjusted = reference(logits, params, PROMPT, output)
        output.append(max(range(VOCAB), key=lambda t: (adjusted[t], -t)))
    return output


class Oracle(Drafter):
    """Proposes the reference output's next tokens as a chain, or as a tree with a wrong first
    sibling before the right one at every node."""

    def __init__(self, output: list[int], prompt: list[int] = PROMPT, tree: bool = False) -> None:
        self.reference = prompt + output
        self.tree = tree
        self.proposal_size = 8  # tokens a tree may hold (two a level)

    def begin(self, prompt_ids: list[int], max_len: int) -> None:
        pass

    def propose(self, context, k, params, generator) -> Proposal:
        right = self.reference[len(context) : len(context) + k]
        if not self.tree:
            return Proposal(right)
        tokens, parents, parent = [], [], -1
        for token in right:
            tokens += [(token + 1) % VOCAB, token]
            parents += [parent, parent]
            parent = len(tokens) - 1
        return Proposal(tokens, parents=parents)

    def commit(self, context, num_accepted) -> None:
        pass


def test_greedy_with_adjustments_is_the_reference_whatever_drafts(target: LoadedModel) -> None:
    want = reference_greedy(target, ADJUSTED)
    unadjusted = reference_greedy(target, dataclasses.replace(ADJUSTED, frequency_penalty=0, presence_penalty=0,
                                                              repetition_penalty=1, logit_bias={}))
    assert want != unadjusted and 6 not in want
    assert any(want[i] in want[i - 3 : i] for i in range(3, len(want)))  # tokens repeat within a draft's reach
    plain = Engine(target).generate(PROMPT, ADJUSTED)
    assert plain.token_ids == want
    for drafter, k in ((Oracle(want), 4), (Oracle(want, tree=True), 3), (NgramDrafter(1, 3), 4)):
        got = Engine(target, drafter, k).generate(PROMPT, ADJUSTED)
        assert got.token_ids == want
        # hf's float32 rows round a little otherwise in a pass of several tokens: close, not bitwise
        # (the lossless suite checks bitwise on the native formats).
        assert [(t.token, [a for a, _ in t.top]) for t in got.logprobs] == [(t.token, [a for a, _ in t.top]) for t in plain.logprobs]
        torch.testing.assert_close(torch.tensor([t.logprob for t in got.logprobs]),
                                   torch.tensor([t.logprob for t in plain.logprobs]), rtol=0, atol=1e-5)
        if isinstance(drafter, Oracle):
            assert got.stats.acceptance_rate == 1.0  # a tree's: its depth drafted, its right branch kept


SAMPLED = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, frequency_penalty=1.0,
                         presence_penalty=0.5, repetition_penalty=1.5, logit_bias={5: 1.5, 6: -100.0})


def exact_first_three(target: LoadedModel, params: SamplingParams, rows, firsts=range(VOCAB), seconds=range(VOCAB)
                      ) -> torch.Tensor:
    """[VOCAB ** 3]: the probability of each first 3 tokens (t1 in `firsts`, t2 in `seconds`; the
    others get 0) of the target whose logits after PROMPT + t1 t2 are `rows(logits, [t1, t2])`
    ([3, vocab] in, [3, vocab] out: the request's adjustments at each of the 3 positions)."""
    runner = ModelRunner(target)
    joint = torch.zeros(VOCAB, VOCAB, VOCAB, dtype=torch.float64)
    for t1 in firsts:
        for t2 in seconds:
            logits = runner.score(PROMPT + [t1, t2])[len(PROMPT) - 1 :]  # [3, vocab]
            probs = logits_to_probs(rows(logits, [t1, t2]).double(), params).double()
            joint[t1, t2] = probs[0, t1] * probs[1, t2] * probs[2]
    return joint.reshape(-1)


def exact_adjusted_probs(target: LoadedModel, params: SamplingParams) -> torch.Tensor:
    """[VOCAB ** 3]: the adjusted target's probability of each first 3 tokens."""
    return exact_first_three(target, params, lambda logits, prefix: torch.tensor(
        [reference(logits[j].tolist(), params, PROMPT, prefix[:j]) for j in range(3)]))


def draft_model(small_model_factory, seed: int) -> LoadedModel:
    """A peaked draft on the native backend in float32, as a draft model loads by default (and
    at less than half hf's cost a call: thousands of drafts per test)."""
    return small_model_factory(seed=seed, vocab_size=VOCAB, logit_scale=6.0).native("float32")


def engine_with(drafter: str, target: LoadedModel, draft: LoadedModel) -> Engine:
    """Plain decoding, a draft model's sampled chains (k 2), or prompt lookup's (k 2)."""
    return {"plain": lambda: Engine(target), "draft_model": lambda: Engine(target, DraftModelDrafter(draft), 2),
            "ngram": lambda: Engine(target, NgramDrafter(1, 3), 2)}[drafter]()


@pytest.mark.parametrize("drafter", ["plain", "draft_model", "ngram"])
def test_sampling_with_adjustments_follows_the_adjusted_target(target, small_model_factory, drafter: str) -> None:
    engine = engine_with(drafter, target, draft_model(small_model_factory, seed=12))
    assert_first_tokens_follow(engine, PROMPT, SAMPLED, exact_adjusted_probs(target, SAMPLED), VOCAB)
