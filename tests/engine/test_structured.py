"""Structured outputs through the engine on a tiny model over 16 word tokens, with a grammar that
allows a few tokens at each position (alternating odd and even words), so a position masked after
the wrong tokens would show.

Greedy: plain decoding equals a reference that scores the whole context afresh and masks the
logits with a fresh grammar matcher fed the whole output; a drafter that always agrees, a tree
with a forbidden first sibling, prompt lookup and a draft model all give the same tokens, and a
draft the grammar forbids is cut before verification. Sampling: the first three tokens follow the
masked target's exact distribution, with a draft model's q (whose forbidden drafts are kept and
rejected by the rule), prompt lookup and plain decoding."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import xgrammar

from specdec.config import SamplingParams, StructuredOutput
from specdec.drafters import Proposal
from specdec.drafters.draft_model import DraftModelDrafter
from specdec.drafters.ngram import NgramDrafter
from specdec.engine import Engine
from specdec.errors import ConfigError
from specdec.models import LoadedModel, ModelRunner
from specdec.sampling.grammar import compiler_for
from tests.engine.test_engine_penalties import Oracle, draft_model, engine_with, exact_first_three
from tests.engine.test_sampling_distribution import assert_first_tokens_follow

VOCAB = 16  # t0 .. t15; t15 is EOS
PROMPT = [0, 1, 2, 3, 1, 2, 3, 4]
# Single-digit words only: the grammar reads text, and "t1" is a prefix of "t10".
ALTERNATING = StructuredOutput("regex", "((t3|t5|t7|t9)(t2|t4|t6|t8))+")
GREEDY = SamplingParams(max_tokens=24, structured=ALTERNATING, logprobs=2)


@pytest.fixture(scope="module")
def target(small_model_factory) -> LoadedModel:
    return small_model_factory(seed=11, vocab_size=VOCAB, logit_scale=6.0)


def reference_masks(target: LoadedModel, structured: StructuredOutput, outputs: list[list[int]]) -> torch.Tensor:
    """[len(outputs), vocab] bool: the tokens the grammar allows after each output, each from a
    fresh matcher (no rollback)."""
    compiled = compiler_for(target.tokenizer, VOCAB, target.eos_token_ids).compile(structured)
    masks = torch.zeros(len(outputs), VOCAB, dtype=torch.bool)
    for i, output in enumerate(outputs):
        matcher = xgrammar.GrammarMatcher(compiled)
        assert all(matcher.accept_token(t) for t in output)
        bitmask = xgrammar.allocate_token_bitmask(1, VOCAB)
        matcher.fill_next_token_bitmask(bitmask)
        logits = torch.zeros(1, VOCAB)
        xgrammar.apply_token_bitmask_inplace(logits, bitmask, vocab_size=VOCAB)
        masks[i] = logits[0] == 0
    return masks


def reference_greedy(target: LoadedModel, params: SamplingParams) -> list[int]:
    runner, output = ModelRunner(target), []
    while len(output) < params.max_tokens:
        logits = runner.score(PROMPT + output)[-1]
        allowed = reference_masks(target, params.structured, [output])[0]
        token = int(torch.where(allowed, logits, -torch.inf).argmax())
        if token in target.eos_token_ids:
            break
        output.append(token)
    return output


def test_greedy_constrained_is_the_reference_whatever_drafts(target: LoadedModel) -> None:
    want = reference_greedy(target, GREEDY)
    free = Engine(target).generate(PROMPT, dataclasses.replace(GREEDY, structured=None)).token_ids
    assert len(want) >= 8 and want != free[: len(want)]  # the grammar changes the output
    assert all(t in (3, 5, 7, 9) if i % 2 == 0 else t in (2, 4, 6, 8) for i, t in enumerate(want))
    plain = Engine(target).generate(PROMPT, GREEDY)
    assert plain.token_ids == want
    draft = dataclasses.replace(target, name="draft")  # the target as its own (unmasked) draft model
    # The oracle's tree puts token + 1 before each right token: odd <-> even, a token the grammar
    # forbids there.
    for drafter, k in ((Oracle(want, PROMPT), 4), (Oracle(want, PROMPT, tree=True), 3), (NgramDrafter(1, 3), 4),
                       (DraftModelDrafter(draft), 3)):
        got = Engine(target, drafter, k).generate(PROMPT, GREEDY)
        assert got.token_ids == want and got.finish_reason == plain.finish_reason
        assert [t.token for t in got.logprobs] == want
        # hf's float32 rows round a little otherwise in a pass of several tokens (the lossless
        # suite checks logprobs bitwise on the row-invariant formats).
        torch.testing.assert_close(torch.tensor([t.logprob for t in got.logprobs]),
                                   torch.tensor([t.logprob for t in plain.logprobs]), rtol=1e-5, atol=1e-5)
        if isinstance(drafter, Oracle):
            assert got.stats.acceptance_rate == 1.0


class Forbidden(Oracle):
    """The reference's next token, then a token the grammar forbids after it, then the rest."""

    def propose(self, context, k, params, generator) -> Proposal:
        right = self.reference[len(context) : len(context) + k]
        return Proposal(right[:1] + [right[0]] + right[1:])  # a word repeated: odd after odd


def test_a_forbidden_draft_is_cut_before_verification(target: LoadedModel) -> None:
    want = reference_greedy(target, GREEDY)
    got = Engine(target, Forbidden(want, PROMPT), 4).generate(PROMPT, GREEDY)
    assert got.token_ids == want
    # Each step verifies only the allowed first token: all drafted tokens are accepted.
    assert got.stats.drafted_tokens > 0 and got.stats.acceptance_rate == 1.0


def test_a_bad_spec_is_a_config_error(target: LoadedModel) -> None:
    with pytest.raises(ConfigError, match="regular expression does not compile"):
        Engine(target).generate(PROMPT, SamplingParams(structured=StructuredOutput("regex", "(t1")))
    with pytest.raises(ConfigError, match="ignore_eos cannot go with a structured output"):
        SamplingParams(structured=ALTERNATING, ignore_eos=True)
    with pytest.raises(ConfigError, match="JSON schema is not JSON"):
        StructuredOutput("json", "{nope")


def test_a_spec_without_instance_is_a_config_error(target: LoadedModel) -> None:
    """No first token (refused before prefill), or a dead end after some (the output ends there,
    the same with a drafter, and the request fails as the spec's error, not the engine's)."""
    with pytest.raises(ConfigError, match="regular expression has no instance: no output can follow it"):
        Engine(target).generate(PROMPT, SamplingParams(structured=StructuredOutput("regex", "[^\\s\\S]")))
    dead = SamplingParams(max_tokens=8, structured=StructuredOutput("regex", "t1[^\\s\\S]"))
    for engine in (Engine(target), Engine(target, NgramDrafter(1, 3), 3)):
        with pytest.raises(ConfigError, match="1 tokens\\): no text can complete it"):
            engine.generate(PROMPT, dead)


SAMPLED = SamplingParams(temperature=1.0, max_tokens=4, structured=ALTERNATING)


def exact_masked_probs(target: LoadedModel, params: SamplingParams) -> torch.Tensor:
    """[VOCAB ** 3]: the masked target's probability of each first 3 tokens."""
    def masked(logits: torch.Tensor, prefix: list[int]) -> torch.Tensor:
        masks = reference_masks(target, params.structured, [prefix[:j] for j in range(3)])
        return torch.where(masks, logits, -torch.inf)

    return exact_first_three(target, params, masked, firsts=(3, 5, 7, 9), seconds=(2, 4, 6, 8))


@pytest.mark.parametrize("drafter", ["plain", "draft_model", "ngram"])
def test_sampling_constrained_follows_the_masked_target(target, small_model_factory, drafter: str) -> None:
    # This draft puts much of its mass on forbidden tokens and the rest off the target's: cutting
    # its forbidden drafts instead of rejecting them moves the second token's marginal by ~0.2 TV.
    engine = engine_with(drafter, target, draft_model(small_model_factory, seed=44))
    # After a whole pair the grammar is complete and EOS (the last word) may end the output.
    assert_first_tokens_follow(engine, PROMPT, SAMPLED, exact_masked_probs(target, SAMPLED), VOCAB, end=VOCAB - 1)


def test_schemas_the_grammar_would_not_enforce_are_refused() -> None:
    from specdec.sampling.schema import check_schema

    node = {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}}
    for ref in ("https://example.com/a.json", "file:///etc/passwd", "other.json#/x"):
        with pytest.raises(ConfigError, match="points outside the schema"):
            check_schema({"type": "array", "items": {"$ref": ref}})
    endless = {"$defs": {"n": node | {"required": ["next"]}}, "$ref": "#/$defs/n"}
    with pytest.raises(ConfigError, match="no finite instance"):
        check_schema(endless)
    with pytest.raises(ConfigError, match="no finite instance"):  # a required recursion through a non-empty array
        check_schema({"$defs": {"t": {"type": "array", "minItems": 1, "items": {"$ref": "#/$defs/t"}}}, "$ref": "#/$defs/t"})
    # Recursions that end: optional, a branch with a leaf, an array that may be empty; and a $ref to
    # a missing definition is left to the grammar library's own message.
    for fine in ({"$defs": {"n": node}, "$ref": "#/$defs/n"},
                 {"$defs": {"t": {"anyOf": [{"type": "integer"}, {"type": "array", "items": {"$ref": "#/$defs/t"}}]}},
                  "$ref": "#/$defs/t"},
                 {"$defs": {"t": {"type": "array", "items": {"$ref": "#/$defs/t"}}}, "$ref": "#/$defs/t"},
                 {"$ref": "#/$defs/missing"}, {"type": "object"}, True):
        check_schema(fine)
