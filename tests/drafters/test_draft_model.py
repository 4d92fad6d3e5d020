"""DraftModelDrafter: its proposals are the draft model's own greedy or sampled continuation
of the committed context, whatever was accepted or rejected before (its cache follows the
context), checked against the draft model run from scratch without a cache."""

from __future__ import annotations

import random

import pytest
import torch

from specdec import SpeculativeConfig
from specdec.config import SamplingParams
from specdec.methods import build_drafter
from specdec.drafters.draft_model import DraftModelDrafter, common_prefix_length
from specdec.engine import Engine
from specdec.engine.batch import BatchEngine
from specdec.models import LoadedModel, ModelRunner
from specdec.sampling import logits_to_probs


def reference_greedy(loaded: LoadedModel, context: list[int], k: int) -> list[int]:
    """k greedy tokens after `context`, each from a full forward pass without a cache."""
    tokens = list(context)
    for _ in range(k):
        logits = ModelRunner(loaded).score(tokens)[-1]
        tokens.append(int(logits.argmax()))
    return tokens[len(context) :]


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [([], [], 0), ([1, 2], [1, 2, 3], 2), ([1, 2, 3], [1, 2], 2), ([1, 5, 3], [1, 2, 3], 1), ([4], [5], 0)],
)
def test_common_prefix_length(a: list[int], b: list[int], expected: int) -> None:
    assert common_prefix_length(a, b) == expected


def test_greedy_proposals_follow_the_committed_context(tiny_model: LoadedModel) -> None:
    """Rounds of propose / commit with random acceptance: every proposal must be the draft
    model's greedy continuation of the context as committed, rejected drafts forgotten."""
    rng = random.Random(0)
    drafter = DraftModelDrafter(tiny_model)
    context = [100, 200, 300, 17]
    drafter.begin(context, 128)
    params = SamplingParams()
    for round_ in range(8):
        k = rng.randint(1, 5)
        proposal = drafter.propose(context, k, params, None)
        assert proposal.probs is None
        assert proposal.tokens == reference_greedy(tiny_model, context, k), f"round {round_}"
        accepted = rng.randint(0, k)
        # The target keeps a prefix of the draft and adds a token of its own (not the draft's).
        context = context + proposal.tokens[:accepted] + [rng.randrange(10, 1000)]
        drafter.commit(context, accepted)


@pytest.mark.parametrize("second_max_len", [64, 256])
def test_a_new_request_gets_proposals_for_its_own_context(tiny_model: LoadedModel, second_max_len: int) -> None:
    # Whatever the previous request left in the drafter (a cache of the same size or a smaller
    # one), the next request's proposals follow its own context.
    drafter = DraftModelDrafter(tiny_model)
    drafter.begin([1, 2, 3], 64)
    drafter.propose([1, 2, 3], 4, SamplingParams(), None)
    drafter.commit([1, 2, 3, 99], 0)
    for other in ([1, 2, 50, 60], [1, 2, 3], [7, 8]):  # shares a prefix, is a prefix, shares nothing
        drafter.begin(other, second_max_len)
        assert drafter.propose(other, 3, SamplingParams(), None).tokens == reference_greedy(tiny_model, other, 3)


def test_sampled_proposals_carry_their_distributions(tiny_model: LoadedModel) -> None:
    drafter = DraftModelDrafter(tiny_model)
    context = [5, 6, 7, 8]
    params = SamplingParams(temperature=0.8, top_k=50)
    drafter.begin(context, 64)
    proposal = drafter.propose(context, 3, params, torch.Generator().manual_seed(0))
    assert len(proposal.tokens) == 3
    assert proposal.probs is not None and proposal.probs.shape == (3, tiny_model.vocab_size)
    # Each row is the filtered distribution after the context and the tokens drafted before it.
    logits = ModelRunner(tiny_model).score(context + proposal.tokens[:-1])[-3:]
    torch.testing.assert_close(proposal.probs, logits_to_probs(logits, params), atol=1e-5, rtol=1e-4)
    for row, token in zip(proposal.probs, proposal.tokens):
        assert row[token] > 0
        assert int((row > 0).sum()) <= 50
    # Seeded: the same generator seed gives the same proposal.
    drafter.begin(context, 64)
    again = drafter.propose(context, 3, params, torch.Generator().manual_seed(0))
    assert again.tokens == proposal.tokens


def test_target_drafting_for_itself_shares_weights(default_model: LoadedModel) -> None:
    drafter = build_drafter(SpeculativeConfig(method="draft_model", model="default"), default_model)
    assert isinstance(drafter, DraftModelDrafter)
    assert drafter.runner.backend is default_model.backend


def test_draft_model_from_a_directory_is_loaded(default_model: LoadedModel, tiny_draft_dir) -> None:
    drafter = build_drafter(SpeculativeConfig(method="draft_model", model=str(tiny_draft_dir)), default_model)
    assert drafter.runner.backend is not default_model.backend
    assert drafter.runner.loaded.num_layers == 2


def test_a_resumed_draft_catches_up_on_the_sink_and_recent_window_only(tiny_model: LoadedModel) -> None:
    """After the engine skipped it for several steps, the draft runs on the context's first
    `sink` tokens and its last `resume_window`, not on everything it missed; later proposals
    in the request follow that view as it grows."""
    rng = random.Random(1)
    drafter = DraftModelDrafter(tiny_model, sink=2, resume_window=8)
    context = [rng.randrange(10, 1000) for _ in range(12)]
    drafter.begin(context, 200)
    assert drafter.propose(context, 2, SamplingParams(), None).tokens == reference_greedy(tiny_model, context, 2)
    context = context + [rng.randrange(10, 1000)]
    drafter.commit(context, 0)
    for _ in range(30):  # switched off: steps committed without asking for a draft
        context = context + [rng.randrange(10, 1000)]
        drafter.commit(context, 0)
    drafter.resume()  # the engine says so when it asks again
    proposal = drafter.propose(context, 3, SamplingParams(), None)
    view = context[:2] + context[-8:]
    assert proposal.tokens == reference_greedy(tiny_model, view, 3)
    assert drafter.cached == view + proposal.tokens[:-1]  # nothing else was fed
    # Speculating again, the draft keeps the sink and everything from the window on.
    context = context + proposal.tokens[:1] + [77]
    drafter.commit(context, 1)
    view = context[:2] + context[-10:]
    assert drafter.propose(context, 2, SamplingParams(), None).tokens == reference_greedy(tiny_model, view, 2)
    # The next request, asked for from its start, is seen whole.
    drafter.commit(context + [5], 0)
    other = context[:3] + [rng.randrange(10, 1000) for _ in range(20)]
    drafter.begin(other, 200)
    assert drafter.propose(other, 2, SamplingParams(), None).tokens == reference_greedy(tiny_model, other, 2)


class Scripted:
    """A speculation policy that gives the listed k's, one per step."""

    def __init__(self, ks: list[int]) -> None:
        self.ks = list(ks)

    def next_k(self) -> int:
        return self.ks.pop(0) if self.ks else 2

    def observe(self, *args) -> None:
        pass


@pytest.mark.parametrize(("ks", "resumed"), [([2, 0, 2, 2], False), ([2, 0, 0, 2], True), ([0, 0, 0, 2], True)])
def test_the_engine_says_when_a_draft_resumes(tiny_model: LoadedModel, ks: list[int], resumed: bool) -> None:
    # One step off (a timed plain step, a request's last step) is no pause; two or more are.
    calls: list[int] = []

    class Watched(DraftModelDrafter):
        def resume(self) -> None:
            calls.append(len(ks))
            super().resume()

    engine = BatchEngine(tiny_model, max_rows=1, max_model_len=64, max_draft=2)
    engine.admit(list(range(1000, 1010)), SamplingParams(max_tokens=12, ignore_eos=True), Watched(tiny_model), 2,
                 Scripted(ks))
    for _ in range(len(ks)):
        engine.step()
    assert bool(calls) == resumed


def test_resume_window_must_be_positive(tiny_model: LoadedModel) -> None:
    with pytest.raises(ValueError):
        DraftModelDrafter(tiny_model, resume_window=0)


def test_a_draft_with_a_shorter_context_limits_speculation(tiny_model: LoadedModel) -> None:
    # The draft sees 24 positions, the target 512: a request longer than the draft's context is
    # served (the draft stops proposing when the sequence outgrows it), and stays lossless.
    from tests.conftest import _tiny_llama

    model = _tiny_llama(len(tiny_model.tokenizer), seed=5)
    model.config.max_position_embeddings = 24
    draft = LoadedModel.from_hf(model.eval(), tiny_model.tokenizer, name="short-draft", source="short-draft")
    assert draft.max_positions == 24
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    prompt = list(range(10, 20))
    result = Engine(tiny_model, DraftModelDrafter(draft), 3).generate(prompt, params)
    assert result.token_ids == Engine(tiny_model).generate(prompt, params).token_ids
    stats = result.stats
    # It drafted at every step while the context (11 .. 24 tokens) fit in the draft's 24, then never.
    assert stats.drafted_at[0] == 24 - len(prompt) and stats.undrafted_steps > 0


@pytest.fixture()
def tiny_pair(tmp_path, monkeypatch: pytest.MonkeyPatch):
    """Two tiny GGUF files with one tokenizer, registered as catalog models: `tiny-target`, whose
    known draft is `tiny-draft`, already assembled in a cache of the test's own."""
    from specdec.models import catalog
    from tests.conftest import tiny_tokenizer
    from tests.models.gguf_files import write_tiny_gguf

    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    tokenizer = tiny_tokenizer()
    entries = {}
    for name, seed, draft in (("tiny-target", 0, "tiny-draft"), ("tiny-draft", 1, None)):
        entry = catalog.CatalogModel(name, name.title(), f"{name}.gguf", (), "0", 0, "", "MIT", draft)
        entry.path().parent.mkdir(parents=True, exist_ok=True)
        size = write_tiny_gguf(entry.path(), "qwen2", "Q8_0", tokenizer, seed=seed).stat().st_size
        entries[name] = catalog.CatalogModel(name, name.title(), f"{name}.gguf", (), "0", size, "", "MIT", draft)
        monkeypatch.setitem(catalog.MODELS, name, entries[name])
    return entries


def test_a_target_with_a_known_draft_gets_it(tiny_pair) -> None:
    from specdec import LLM
    from specdec.methods import pinned

    llm = LLM("tiny-target", {"method": "draft_model", "num_speculative_tokens": 3})
    drafter = llm.engine.drafter
    assert isinstance(drafter, DraftModelDrafter)
    assert drafter.runner.loaded.source == str(tiny_pair["tiny-draft"].path())
    assert pinned(llm.speculative_config, llm.target).model == "tiny-draft"
    from specdec.bench.tune import default_methods

    assert {"method": "draft_model"} in default_methods(llm.target)  # tune measures the known draft
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompt = list(range(5, 30))
    result = llm.engine.generate(prompt, greedy)
    assert result.token_ids == llm.plain_engine.generate(prompt, greedy).token_ids
    assert result.stats.drafted_tokens > 0


def test_a_target_without_a_known_draft_is_told_which_pairs_exist(tiny_pair, tiny_model: LoadedModel) -> None:
    from specdec.errors import ConfigError

    config = SpeculativeConfig(method="draft_model")
    with pytest.raises(ConfigError, match=r"needs a draft model: set 'model'.*has no known draft "
                                          r"\(known pairs: .*tiny-target -> tiny-draft"):
        build_drafter(config, tiny_model)


@pytest.mark.parametrize("sampled", [False, True])
def test_a_floor_stops_the_draft_where_its_top_token_is_unlikely(tiny_model: LoadedModel, sampled: bool) -> None:
    """With draft_p_min, a proposal is the draft's continuation up to (not including) the first
    position whose most likely token has a probability under the floor."""
    context = [100, 200, 300, 17]
    params = SamplingParams(temperature=1.0 if sampled else 0.0)
    free = DraftModelDrafter(tiny_model)
    free.begin(context, 128)
    generator = torch.Generator().manual_seed(3) if sampled else None
    proposal = free.propose(context, 6, params, generator)
    tops = []
    for i in range(6):
        logits = ModelRunner(tiny_model).score(context + proposal.tokens[:i])[-1:]
        tops.append(float((logits_to_probs(logits, params) if sampled else torch.softmax(logits, -1)).max()))
    cut = min(range(1, 6), key=lambda i: tops[i])  # the least sure position after the first
    floor = (tops[cut] + min(tops[:cut])) / 2
    assert all(t >= floor for t in tops[:cut]) and tops[cut] < floor
    floored = DraftModelDrafter(tiny_model, p_min=floor)
    floored.begin(context, 128)
    generator = torch.Generator().manual_seed(3) if sampled else None
    got = floored.propose(context, 6, params, generator)
    assert got.tokens == proposal.tokens[:cut]
    if sampled:
        assert got.probs is not None and torch.equal(got.probs, proposal.probs[:cut])
    nothing = DraftModelDrafter(tiny_model, p_min=1.0)
    nothing.begin(context, 128)
    assert nothing.propose(context, 6, params, generator).tokens == []


def test_draft_p_min_is_checked_and_labelled() -> None:
    from specdec.errors import ConfigError

    config = SpeculativeConfig(method="draft_model", model="m.gguf", draft_p_min=0.5)
    assert config.draft_p_min == 0.5 and "p>=0.5" in config.label
    with pytest.raises(ConfigError, match=r"draft_p_min must be a number in \(0, 1\], got 0"):
        SpeculativeConfig(method="draft_model", model="m.gguf", draft_p_min=0)


def test_lookup_in_front_of_the_draft_model(tiny_model: LoadedModel) -> None:
    """With draft_lookup_min, a step whose context ends in a repeated n-gram drafts what followed
    it, without running the draft; other steps are the draft model's own greedy continuation."""
    from specdec.drafters.draft_model import LookupFirst

    config = SpeculativeConfig(method="draft_model", model="target", draft_lookup_min=2, num_speculative_tokens=3)
    drafter = build_drafter(config, tiny_model)
    assert isinstance(drafter, LookupFirst) and drafter.model_runner() is drafter.draft.runner
    assert "lookup>=2" in config.label
    params = SamplingParams()
    repeating = [100, 200, 300, 400, 500, 600, 100, 200, 300, 400]  # a 4-token match proposes up to 3
    drafter.begin(repeating, 128)
    assert drafter.propose(repeating, 3, params, None).tokens == [500, 600, 100]
    assert drafter.used_lookup == 1 and drafter.draft.cached == []  # the draft did not run
    fresh = [100, 200, 300, 17]
    assert drafter.propose(fresh, 3, params, None).tokens == reference_greedy(tiny_model, fresh, 3)
    assert drafter.used_lookup == 1
    fork = drafter.fork()
    assert isinstance(fork, LookupFirst) and fork.draft.runner.loaded is tiny_model and fork.used_lookup == 0
