"""The lossless suite (STYLE habit 8): with greedy decoding, every drafter gives exactly the
tokens of plain decoding, whether it always agrees with the target, never agrees, or agrees
partly. The synthetic drafters (always, never, partly, randomly agreeing) run on the tiny model
in every backend and weight format; every registered drafter runs on the real default model on
the default backend, and one per kind of verification pass on its other backends and formats.
Lossless means identical to the same backend's own plain decoding."""

from __future__ import annotations

import json
import math
import random

import jsonschema

import pytest
import torch

from specdec import LLM, SamplingParams, SpeculativeConfig, StructuredOutput
from specdec.api import RequestOutput
from specdec.drafters import Drafter, Proposal
from specdec.engine import Engine, Generation
from specdec.errors import ConfigError
from specdec.models import LoadedModel, load_model
from specdec.models.qlinear import QUANTIZED_FORMATS
from specdec.training.heads import TrainConfig, new_head

MAX_TOKENS = 32
PARAMS = SamplingParams(max_tokens=MAX_TOKENS)
PROMPTS = [
    [{"role": "user", "content": "List the days of the week, one per line, with a short note on each."}],
    [{"role": "user", "content": "Explain in detail how a bicycle works."}],
]


# Every backend and format. bfloat16, int8 and int4 products are row-invariant, so a verification
# pass is bitwise the plain steps it replaces (tests/models/test_native.py); float32 products are
# not (MKL rounds a row otherwise from 4 rows on) and stay identical unless a near-tie of ~1e-6.
VARIANTS = ["hf-float32", "native-float32", "native-bfloat16", "native-int8", "native-auto"]


@pytest.fixture(scope="module", params=VARIANTS)
def target(request: pytest.FixtureRequest, default_model_variants) -> LoadedModel:
    """The default model on one backend and weight format."""
    return default_model_variants(request.param)


@pytest.fixture(scope="module")
def plain_llm(target: LoadedModel) -> LLM:
    return LLM(loaded=target)


def plain_outputs(llm: LLM) -> list[RequestOutput]:
    """Plain greedy decoding of every prompt: the reference every drafter must reproduce."""
    outputs = llm.generate(PROMPTS, PARAMS, speculate=False)
    # The exact step counts below assume the budget, not EOS, ends each output.
    assert [o.finish_reason for o in outputs] == ["length"] * len(PROMPTS)
    return outputs


@pytest.fixture(scope="module")
def plain(plain_llm: LLM) -> list[RequestOutput]:
    return plain_outputs(plain_llm)


def reference_table(plain_llm: LLM, plain: list[RequestOutput]) -> dict[tuple[int, ...], list[int]]:
    """prompt ids -> prompt ids followed by the plain output: what an oracle drafter knows."""
    table = {}
    for prompt, output in zip(PROMPTS, plain):
        ids = plain_llm.encode(prompt)
        table[tuple(ids)] = ids + output.token_ids
    return table


# The tiny model (tests/conftest.py: its own tokenizer, random weights) on every backend and
# weight format: the synthetic drafters' matrix.
TINY_VARIANTS = ["hf-float32", "native-float32", "native-bfloat16", "native-int8", "native-int4"]


@pytest.fixture(scope="module", params=TINY_VARIANTS)
def tiny_target(request: pytest.FixtureRequest, tiny_model_dir) -> LoadedModel:
    backend, dtype = request.param.split("-")
    return load_model(str(tiny_model_dir), backend=backend, dtype=dtype)


@pytest.fixture(scope="module")
def tiny_plain_llm(tiny_target: LoadedModel) -> LLM:
    return LLM(loaded=tiny_target)


@pytest.fixture(scope="module")
def tiny_plain(tiny_plain_llm: LLM) -> list[RequestOutput]:
    return plain_outputs(tiny_plain_llm)


@pytest.fixture(scope="module")
def references(tiny_plain_llm: LLM, tiny_plain: list[RequestOutput]) -> dict[tuple[int, ...], list[int]]:
    return reference_table(tiny_plain_llm, tiny_plain)


# --- test-only drafters -----------------------------------------------------------------------


class OracleDrafter(Drafter):
    """Always agrees: proposes the plain output's next tokens."""

    def __init__(self, references: dict[tuple[int, ...], list[int]], vocab: int | None = None) -> None:
        self.references = references
        self.vocab = vocab  # the target's: a wrong guess is still a token
        self.reference: list[int] = []
        self.commits: list[int] = []

    def begin(self, prompt_ids: list[int], max_len: int) -> None:
        self.reference = self.references[tuple(prompt_ids)]
        self.commits = []

    def right(self, context: list[int], k: int) -> list[int]:
        assert context == self.reference[: len(context)], "the committed context left the plain output"
        return self.reference[len(context) : len(context) + k]

    def propose(
        self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Proposal:
        return Proposal(self.right(context, k))

    def commit(self, context: list[int], num_accepted: int) -> None:
        self.commits.append(num_accepted)


class AdversaryDrafter(OracleDrafter):
    """Never agrees: every proposed token differs from the plain output's."""

    def propose(self, context, k, params, generator) -> Proposal:
        return Proposal([(t + 1) % self.vocab for t in self.right(context, k)])


class PartialDrafter(OracleDrafter):
    """Agrees on the first `agree` positions of every proposal, then disagrees."""

    def __init__(self, references, agree: int, vocab: int) -> None:
        super().__init__(references, vocab)
        self.agree = agree

    def propose(self, context, k, params, generator) -> Proposal:
        right = self.right(context, k)
        return Proposal(right[: self.agree] + [(t + 7) % self.vocab for t in right[self.agree :]])


class RandomMixDrafter(OracleDrafter):
    """Agrees or disagrees at random at each position (seeded)."""

    def __init__(self, references, seed: int, vocab: int) -> None:
        super().__init__(references, vocab)
        self.rng = random.Random(seed)

    def propose(self, context, k, params, generator) -> Proposal:
        return Proposal([t if self.rng.random() < 0.6 else (t + 3) % self.vocab for t in self.right(context, k)])


def run_drafter(target: LoadedModel, plain_llm: LLM, drafter, k: int) -> list[Generation]:
    engine = Engine(target, drafter, k)
    return [engine.generate(plain_llm.encode(prompt), PARAMS) for prompt in PROMPTS]


def assert_same_as_plain(outputs, plain: list[RequestOutput]) -> None:
    for got, want in zip(outputs, plain, strict=True):
        assert got.token_ids == want.token_ids
        assert got.text == want.text
        assert got.finish_reason == want.finish_reason


def adversary_drafted(k: int) -> int:
    """Tokens drafted when every step commits one token: room is min(k, budget - generated - 1)."""
    return sum(min(k, MAX_TOKENS - generated - 1) for generated in range(1, MAX_TOKENS))


# --- the suite --------------------------------------------------------------------------------


def test_plain_stats(tiny_plain: list[RequestOutput]) -> None:
    for output in tiny_plain:
        stats = output.stats
        assert len(output.token_ids) == stats.generated_tokens == MAX_TOKENS
        assert stats.target_forward_passes == MAX_TOKENS  # prefill + one pass per further token
        assert stats.target_steps == MAX_TOKENS - 1
        assert stats.drafted_tokens == stats.accepted_tokens == 0
        assert stats.acceptance_rate == 0.0
        assert stats.mean_accepted_length == 1.0
        assert stats.per_position_acceptance == []


@pytest.mark.parametrize("k", [1, 4])
def test_oracle(tiny_target, tiny_plain_llm, references, tiny_plain, k: int) -> None:
    drafter = OracleDrafter(references)
    outputs = run_drafter(tiny_target, tiny_plain_llm, drafter, k)
    assert_same_as_plain(outputs, tiny_plain)
    steps = math.ceil((MAX_TOKENS - 1) / (k + 1))
    for output in outputs:
        stats = output.stats
        assert stats.acceptance_rate == 1.0
        assert stats.accepted_tokens == stats.drafted_tokens == MAX_TOKENS - 1 - steps
        assert stats.target_steps == steps
        assert stats.mean_accepted_length == pytest.approx((MAX_TOKENS - 1) / steps)
        assert k < stats.mean_accepted_length <= k + 1
        assert stats.per_position_acceptance == [1.0] * k
    # The drafter is told what was accepted: k each step, and at the last step what was left.
    last = (MAX_TOKENS - 1) - (steps - 1) * (k + 1) - 1
    assert drafter.commits == [k] * (steps - 1) + [last]  # of the last request


@pytest.mark.parametrize("k", [1, 3])
def test_adversary(tiny_target, tiny_plain_llm, references, tiny_plain, k: int) -> None:
    outputs = run_drafter(tiny_target, tiny_plain_llm, AdversaryDrafter(references, tiny_target.vocab_size), k)
    assert_same_as_plain(outputs, tiny_plain)
    for output in outputs:
        stats = output.stats
        assert stats.accepted_tokens == 0
        assert stats.acceptance_rate == 0.0
        assert stats.mean_accepted_length == 1.0
        assert stats.target_steps == MAX_TOKENS - 1
        assert stats.drafted_tokens == adversary_drafted(k)
        assert stats.per_position_acceptance == [0.0] * k


def test_partial(tiny_target, tiny_plain_llm, references, tiny_plain) -> None:
    k, agree = 4, 2
    outputs = run_drafter(tiny_target, tiny_plain_llm, PartialDrafter(references, agree, tiny_target.vocab_size), k)
    assert_same_as_plain(outputs, tiny_plain)
    for output in outputs:
        stats = output.stats
        assert 0.0 < stats.acceptance_rate < 1.0
        assert stats.per_position_acceptance == [1.0, 1.0, 0.0, 0.0]
        assert stats.mean_accepted_length == pytest.approx(agree + 1, abs=0.35)


def test_random_mix(tiny_target, tiny_plain_llm, references, tiny_plain) -> None:
    outputs = run_drafter(tiny_target, tiny_plain_llm, RandomMixDrafter(references, 5, tiny_target.vocab_size), 5)
    assert_same_as_plain(outputs, tiny_plain)
    for output in outputs:
        assert 0.0 < output.stats.acceptance_rate < 1.0
        assert output.stats.committed_tokens == output.stats.accepted_tokens + output.stats.target_steps


REAL_DRAFTERS = [
    pytest.param({"method": "ngram", "num_speculative_tokens": 1}, id="ngram-k1"),
    pytest.param({"method": "ngram", "num_speculative_tokens": 3}, id="ngram-k3"),
    pytest.param({"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 1}, id="ngram-k8-n1"),
    pytest.param({"method": "draft_model", "model": "default", "num_speculative_tokens": 2}, id="self-k2"),
    pytest.param({"method": "draft_model", "model": "default", "num_speculative_tokens": 5}, id="self-k5"),
    pytest.param({"method": "draft_model", "model": "TINY", "num_speculative_tokens": 2}, id="tiny-k2"),
    pytest.param({"method": "draft_model", "model": "TINY", "num_speculative_tokens": 5}, id="tiny-k5"),
    pytest.param({"method": "draft_model", "model": "target", "quantization": "int8", "num_speculative_tokens": 3},
                 id="int8-self-k3"),
    pytest.param({"method": "draft_model", "model": "target", "quantization": "int8", "num_speculative_tokens": 4,
                  "draft_p_min": 0.6}, id="int8-self-k4-pmin"),
    pytest.param({"method": "layer_skip", "num_speculative_tokens": 3}, id="layer_skip-k3"),
    pytest.param({"method": "layer_skip", "layers": list(range(0, 30, 3)), "num_speculative_tokens": 4},
                 id="layer_skip-third-k4"),
    pytest.param({"method": "ngram", "num_speculative_tokens": 6, "adaptive": True}, id="ngram-adaptive-k6"),
    pytest.param({"method": "eagle", "model": "RANDOM_EAGLE", "num_speculative_tokens": 4}, id="eagle-random-k4"),
    pytest.param({"method": "eagle", "num_speculative_tokens": 4, "draft_confidence": 0.2}, id="eagle-shipped-k4-floor"),
    pytest.param({"method": "hybrid", "num_speculative_tokens": 4, "hybrid_head_tokens": None, "draft_confidence": 0.2},
                 id="hybrid-shipped-k4-floor"),
    pytest.param({"method": "hybrid", "model": "RANDOM_EAGLE", "num_speculative_tokens": 3}, id="hybrid-random-k3"),
    pytest.param({"method": "hybrid", "model": "RANDOM_EAGLE", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                  "hybrid_head_tokens": 1}, id="hybrid-random-lookup1-head1"),
    pytest.param({"method": "hybrid", "model": "RANDOM_EAGLE", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                  "hybrid_head_tokens": 2, "hybrid_branches": True}, id="hybrid-random-branches"),
    pytest.param({"method": "hybrid", "model": "RANDOM_EAGLE", "num_speculative_tokens": 3, "tree_width": 2,
                  "tree_nodes": 4, "hybrid_head_tokens": None, "hybrid_branches": True}, id="hybrid-random-branches-tree"),
    pytest.param({"method": "eagle", "model": "RANDOM_EAGLE", "num_speculative_tokens": 3, "tree_width": 2,
                  "tree_nodes": 5}, id="eagle-random-tree"),
    pytest.param({"method": "medusa", "model": "RANDOM_MEDUSA", "num_speculative_tokens": 3}, id="medusa-random-k3"),
    pytest.param({"method": "medusa", "model": "RANDOM_MEDUSA", "num_speculative_tokens": 3, "tree_width": 2,
                  "tree_nodes": 6}, id="medusa-random-tree"),
    pytest.param({"method": "mtp", "model": "RANDOM_MTP", "num_speculative_tokens": 2}, id="mtp-random-k2"),
    pytest.param({"method": "suffix", "num_speculative_tokens": 6}, id="suffix-k6"),
    pytest.param({"method": "suffix", "num_speculative_tokens": 8, "suffix_decoding_max_spec_factor": 2.0,
                  "suffix_decoding_min_token_prob": 0.0}, id="suffix-k8-eager"),
    pytest.param({"method": "suffix", "num_speculative_tokens": 6, "suffix_decoding_use_tree": True,
                  "suffix_decoding_max_spec_factor": 2.0, "suffix_decoding_min_token_prob": 0.0}, id="suffix-tree-k6"),
    pytest.param({"method": "draft_model", "model": "target", "quantization": "int8", "num_speculative_tokens": 5,
                  "adaptive": True}, id="int8-self-adaptive-k5"),
    pytest.param({"method": "lookahead", "num_speculative_tokens": 2}, id="lookahead-k2"),
    pytest.param({"method": "lookahead", "num_speculative_tokens": 4, "lookahead_window": 4, "lookahead_ngram": 2,
                  "lookahead_guesses": 3}, id="lookahead-tree-k4"),
    pytest.param({"method": "bigram", "num_speculative_tokens": 3}, id="bigram-k3"),
    pytest.param({"method": "bigram", "num_speculative_tokens": 5, "bigram_min_count": 1}, id="bigram-k5-count1"),
]


def test_every_registered_method_is_checked_here() -> None:
    # A new drafter is lossless on real weights before it lands: it needs a line above.
    from specdec.methods import registered_methods

    assert set(registered_methods()) <= {p.values[0]["method"] for p in REAL_DRAFTERS}


@pytest.fixture(scope="module")
def random_eagle_dir(default_model: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> str:
    """An untrained EAGLE head for the default model (every variant: it reads the target's own
    embedding and LM head rows), over the 4096 lowest token ids."""
    path = tmp_path_factory.mktemp("eagle-random")
    new_head(default_model, torch.arange(4096), TrainConfig(draft_vocab_size=4096, seed=1)).save(path)
    return str(path)


@pytest.fixture(scope="module")
def random_medusa_dir(default_model: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> str:
    """Untrained Medusa heads for the default model with random (not zero) blocks."""
    path = tmp_path_factory.mktemp("medusa-random")
    heads = new_head(default_model, torch.arange(4096), TrainConfig(arch="medusa", draft_vocab_size=4096))
    with torch.no_grad():
        for param in heads.parameters():
            param.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(0))
    heads.save(path)
    return str(path)


@pytest.fixture(scope="module")
def random_mtp_dir(default_model: LoadedModel, mtp_checkpoint, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A random MTP layer for the default model, in a checkpoint directory (DeepSeek-V3 layout)."""
    return str(mtp_checkpoint(default_model, tmp_path_factory.mktemp("mtp-random"))[0])


# On the other backends and formats, one configuration per kind of verification pass: a chain
# (prompt lookup: test_adjusted_logits_and_logprobs_on_backend, with penalties and logprobs), a
# tree (an EAGLE head's), and a draft model's catch-up (the target itself). Every drafter runs on
# the default backend; the synthetic drafters above on every backend.
BACKEND_DRAFTERS = ["eagle-random-tree", "self-k2"]


@pytest.fixture(scope="module")
def default_plain(default_model: LoadedModel) -> list[RequestOutput]:
    """Plain greedy decoding on the default backend (native, the GGUF's own formats)."""
    outputs = LLM(loaded=default_model).generate(PROMPTS, PARAMS, speculate=False)
    assert [o.finish_reason for o in outputs] == ["length"] * len(PROMPTS)
    return outputs


@pytest.fixture
def model_dirs(tiny_draft_dir, random_eagle_dir, random_medusa_dir, random_mtp_dir) -> dict[str, str]:
    """The placeholders of REAL_DRAFTERS' `model` keys -> the directories they stand for."""
    return {"TINY": str(tiny_draft_dir), "RANDOM_EAGLE": random_eagle_dir, "RANDOM_MEDUSA": random_medusa_dir,
            "RANDOM_MTP": random_mtp_dir}


@pytest.mark.parametrize("config", REAL_DRAFTERS)
def test_registered_drafter(default_model, default_plain, model_dirs, config: dict) -> None:
    check_registered(default_model, default_plain, model_dirs, config)


@pytest.mark.parametrize("config", [p for p in REAL_DRAFTERS if p.id in BACKEND_DRAFTERS])
def test_registered_drafter_on_backend(target, default_model, plain, model_dirs, config: dict) -> None:
    if target is default_model:
        pytest.skip("the default backend runs every drafter in test_registered_drafter")
    check_registered(target, plain, model_dirs, config)


def check_registered(target: LoadedModel, plain: list[RequestOutput], model_dirs: dict[str, str],
                     config: dict) -> None:
    """Greedy output identical to the target's plain decoding, with the statistics each kind of
    drafter must show."""
    if config.get("model") in model_dirs:
        config = config | {"model": model_dirs[config["model"]]}
    if config.get("quantization") == "int8" and target.backend.weight_format.startswith(QUANTIZED_FORMATS):
        with pytest.raises(ConfigError, match="would cost as much as the target"):
            LLM(loaded=target, speculative_config=SpeculativeConfig.from_dict(config))
        return
    llm = LLM(loaded=target, speculative_config=SpeculativeConfig.from_dict(config))
    outputs = llm.generate(PROMPTS, PARAMS)
    assert_same_as_plain(outputs, plain)
    k = config["num_speculative_tokens"]
    if config.get("model") == "default":
        # The target drafting for itself agrees at every token where their caches were filled
        # alike: a fresh request alone. In a batch the target's rows, and a draft reusing an earlier
        # request's cached prefix, may round otherwise (seen on an AVX2 machine, at an exact tie of
        # two logits; the output stays the target's).
        alone = [LLM(loaded=target, speculative_config=SpeculativeConfig.from_dict(config)).generate([p], PARAMS)[0]
                 for p in PROMPTS]
        assert_same_as_plain(alone, plain)
        for output in alone:
            assert output.stats.acceptance_rate == 1.0
            assert output.stats.target_steps == math.ceil((MAX_TOKENS - 1) / (k + 1))
    for output in outputs:
        stats = output.stats
        assert stats.committed_tokens == stats.accepted_tokens + stats.target_steps
        assert stats.target_forward_passes == stats.target_steps + 1
        assert len(stats.per_position_acceptance) <= k
        if config.get("model") == "default":
            pass  # full agreement: checked on the lone requests above
        elif config.get("quantization") == "int8" and config.get("adaptive"):
            pass  # adaptive k may switch the draft off before a request drafts much: checked below
        elif config.get("quantization") == "int8":
            # The int8 copy of the target agrees with it most of the time (hf's, whose activations
            # are int8 too, not always).
            assert 0.5 < stats.acceptance_rate <= (1.0 if target.model is None else 0.99)
        elif config.get("tree_width", 1) > 1:
            assert stats.drafted_tokens > 0  # a tree's depth per step
        elif config.get("draft_confidence"):
            pass  # drafts of every length: checked over all requests below
        elif config["method"] in ("eagle", "medusa", "mtp"):
            # A head drafts its k every step but the last few, which the token budget cuts short.
            assert stats.drafted_tokens >= k * (stats.target_steps - k)
        elif config["method"] == "draft_model":
            # A random model hardly ever agrees; at most rarely by chance.
            assert stats.acceptance_rate < 0.2
            assert stats.drafted_tokens > 0
    if config.get("quantization") == "int8" and config.get("adaptive"):
        # Over all requests the int8 copy mostly agrees (a broken copy would be near 0); a single
        # request's handful of drafts before the switch-off is too few to bound.
        drafted = sum(o.stats.drafted_tokens for o in outputs)
        assert sum(o.stats.accepted_tokens for o in outputs) > 0.4 * drafted
    if config.get("draft_confidence"):
        # The floor cut some steps to nothing and some to one token, and let some draft more.
        at = [sum(o.stats.drafted_at[j] for o in outputs if len(o.stats.drafted_at) > j) for j in range(k)]
        assert 0 < at[1] < at[0] < sum(o.stats.target_steps for o in outputs), at
    if config["method"] in ("ngram", "suffix", "lookahead", "bigram") or config.get("adaptive"):
        # The prompts repeat themselves enough for lookup to find something; an adaptive drafter
        # drafts at least until it has judged its first window.
        assert sum(o.stats.drafted_tokens for o in outputs) > 0


# --- bias, penalties and logprobs -------------------------------------------------------------
# The target's logits at each verified position are adjusted from the tokens before it, its
# draft's included, and logprobs come from the verification pass: greedy output identical to
# plain decoding with the same adjustments, and logprobs equal to plain decoding's (bitwise where
# the backend's rows are row-invariant, every format but float32).

ADJUSTING_DRAFTERS = ["ngram-k3", "ngram-k8-n1", "self-k2", "tiny-k5", "eagle-random-tree", "medusa-random-tree",
                      "hybrid-random-k3", "suffix-tree-k6", "lookahead-tree-k4"]


def adjusted_params(plain: list[RequestOutput]) -> SamplingParams:
    """Penalties, and a ban on the plain output's most frequent token: strong enough to change it."""
    ids = plain[0].token_ids
    banned = max(set(ids), key=ids.count)
    return SamplingParams(max_tokens=MAX_TOKENS, frequency_penalty=0.6, presence_penalty=0.3, repetition_penalty=1.15,
                          logit_bias={banned: -100.0, 11: 2.0}, logprobs=3)


@pytest.fixture(scope="module")
def adjusted_plain(default_model: LoadedModel, default_plain: list[RequestOutput]) -> list[RequestOutput]:
    outputs = LLM(loaded=default_model).generate(PROMPTS, adjusted_params(default_plain), speculate=False)
    for got, unadjusted in zip(outputs, default_plain):
        assert got.token_ids != unadjusted.token_ids  # the adjustments change what is generated
        assert len(got.logprobs) == len(got.token_ids)
    return outputs


def assert_same_logprobs(outputs: list[RequestOutput], plain: list[RequestOutput], exact: bool) -> None:
    for got, want in zip(outputs, plain, strict=True):
        assert [item.token for item in got.logprobs] == got.token_ids
        if exact:
            assert got.logprobs == want.logprobs
        else:
            torch.testing.assert_close(torch.tensor([item.logprob for item in got.logprobs]),
                                       torch.tensor([item.logprob for item in want.logprobs]), rtol=0, atol=1e-3)


def test_oracle_with_adjusted_logits(default_model, default_plain, adjusted_plain) -> None:
    # Every draft is the adjusted plain output: all of it is accepted only if each position inside
    # a draft is verified after the drafted tokens before it.
    params = adjusted_params(default_plain)
    llm = LLM(loaded=default_model)
    references = {tuple(llm.encode(p)): llm.encode(p) + o.token_ids for p, o in zip(PROMPTS, adjusted_plain)}
    engine = Engine(default_model, OracleDrafter(references), 4)
    for prompt, want in zip(PROMPTS, adjusted_plain):
        got = engine.generate(llm.encode(prompt), params)
        assert got.token_ids == want.token_ids and got.logprobs == want.logprobs
        assert got.stats.acceptance_rate == 1.0


@pytest.mark.parametrize("config", [p for p in REAL_DRAFTERS if p.id in ADJUSTING_DRAFTERS])
def test_adjusted_logits_and_logprobs(default_model, default_plain, adjusted_plain, model_dirs, config: dict) -> None:
    if config.get("model") in model_dirs:
        config = config | {"model": model_dirs[config["model"]]}
    llm = LLM(loaded=default_model, speculative_config=SpeculativeConfig.from_dict(config))
    outputs = llm.generate(PROMPTS, adjusted_params(default_plain))
    assert_same_as_plain(outputs, adjusted_plain)
    assert_same_logprobs(outputs, adjusted_plain, exact=True)
    assert sum(o.stats.drafted_tokens for o in outputs) > 0
    if config.get("model") == "default":
        # The target drafting for itself with the same adjustments agrees everywhere (its draft
        # distribution is adjusted as the target's is).
        assert all(o.stats.acceptance_rate == 1.0 for o in outputs)


def test_adjusted_logits_and_logprobs_on_backend(target, plain_llm, plain) -> None:
    params = adjusted_params(plain)
    want = plain_llm.generate(PROMPTS, params, speculate=False)
    got = LLM(loaded=target, speculative_config={"method": "ngram", "num_speculative_tokens": 3}).generate(PROMPTS, params)
    assert_same_as_plain(got, want)
    assert_same_logprobs(got, want, exact=target.backend.weight_format != "float32")
    assert sum(o.stats.drafted_tokens for o in got) > 0  # chains were verified
    for output in got:
        assert output.stats.committed_tokens == output.stats.accepted_tokens + output.stats.target_steps


# --- structured outputs -----------------------------------------------------------------------
# Every verified position is masked by the grammar after the tokens before it: greedy output
# identical to plain constrained decoding, and each finished output a document of the schema.

STRUCTURED_DRAFTERS = ["ngram-k3", "self-k2", "eagle-random-tree", "suffix-tree-k6", "lookahead-tree-k4"]
SCHEMA = {"type": "object", "properties": {"topic": {"type": "string", "maxLength": 40},
                                           "points": {"type": "array", "items": {"type": "string", "maxLength": 30},
                                                      "maxItems": 3}},
          "required": ["topic", "points"], "additionalProperties": False}
STRUCTURED = SamplingParams(max_tokens=64, structured=StructuredOutput.json_schema(SCHEMA))


@pytest.fixture(scope="module")
def structured_plain(default_model: LoadedModel) -> list[RequestOutput]:
    outputs = LLM(loaded=default_model).generate(PROMPTS, STRUCTURED, speculate=False)
    for output in outputs:
        assert output.finish_reason == "stop"
        jsonschema.validate(json.loads(output.text), SCHEMA)
    return outputs


@pytest.mark.parametrize("config", [p for p in REAL_DRAFTERS if p.id in STRUCTURED_DRAFTERS])
def test_structured_output(default_model, structured_plain, model_dirs, config: dict) -> None:
    if config.get("model") in model_dirs:
        config = config | {"model": model_dirs[config["model"]]}
    outputs = LLM(loaded=default_model, speculative_config=SpeculativeConfig.from_dict(config)).generate(PROMPTS, STRUCTURED)
    assert_same_as_plain(outputs, structured_plain)
    assert sum(o.stats.drafted_tokens for o in outputs) > 0
