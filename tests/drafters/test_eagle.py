"""EAGLE heads: drafting matches what training unrolls, files round-trip (ours and EAGLE-3's
layout), and the batched engine feeds each row's head its states. Training them:
tests/training/."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdec import LLM, SamplingParams, kernels
from specdec.drafters.base import Drafter
from specdec.drafters.eagle import EagleDrafter, EagleHead, default_target_layers
from specdec.drafters.eagle_unroll import ttt_forward
from specdec.engine import Engine
from specdec.engine.batch import BatchEngine
from specdec.errors import ConfigError
from specdec.models import LoadedModel, ModelRunner
from specdec.sampling.penalties import tree_paths
from specdec.training.heads import TrainConfig, new_head

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def random_head(target: LoadedModel, draft_vocab: int | None = None, seed: int = 0) -> EagleHead:
    """An untrained head over the target's first `draft_vocab` tokens (all by default)."""
    size = draft_vocab or target.backend.vocab_size
    return new_head(target, torch.arange(size), TrainConfig(draft_vocab_size=size, seed=seed)).eval()


def test_default_layers_stay_inside_the_model() -> None:
    assert default_target_layers(30) == (1, 14, 26)
    assert default_target_layers(2) == (1, 0, 0)
    assert all(0 <= i < 1 for i in default_target_layers(1))


def test_drafting_is_what_training_unrolls(tiny_native: LoadedModel) -> None:
    # The drafter runs the head step by step over its KV cache; training runs all positions and
    # depths at once with the training-time-test mask. Fed the same states and tokens, the two
    # must give the same logits at every draft depth, or training teaches the wrong thing.
    head = random_head(tiny_native, 512, seed=3)
    torch.manual_seed(0)
    n_features = len(head.config.target_layers) * head.config.hidden_size
    committed = 9  # positions with the target's states
    features = torch.randn(committed, n_features)
    context = torch.randint(0, 512, (committed + 1,)).tolist()
    seen: list[torch.Tensor] = []
    drafter = EagleDrafter(head, "float32")  # the packed path in float32: the same arithmetic
    logits_of = drafter._logits
    drafter._logits = lambda state: seen.append(logits_of(state)) or seen[-1]  # record each step's logits
    drafter.begin(context[:3], 32)
    drafter.observe_target(features[:5])  # arriving in two pieces, as prefill and a step would
    drafter.observe_target(features[5:])
    proposal = drafter.propose(context, 3, GREEDY, None)

    # Position t reads token t + 1: the context, then the drafted tokens (teacher forcing with the
    # draft's own choices is exactly what drafting does).
    tokens = torch.tensor(context[1:] + proposal.tokens[:2])
    padded = torch.cat([features, torch.randn(2, n_features)])  # states past the context are never read
    unrolled = ttt_forward(head, padded, tokens, 3)
    for depth in range(3):
        expected = unrolled[depth][committed - 1 + depth]
        torch.testing.assert_close(seen[depth][0], expected, rtol=1e-4, atol=1e-4)
        assert int(head.draft_ids[expected.argmax()]) == proposal.tokens[depth]


def test_training_windows_give_the_whole_unroll_at_every_counted_position(tiny_native: LoadedModel) -> None:
    # Training runs each sequence's layer only from begin - (depth - 1) on (earlier positions give
    # depth 0's keys and values alone): from begin on, every depth's states must be the whole
    # unroll's.
    from specdec.drafters.eagle_unroll import ttt_states

    head = random_head(tiny_native, 512, seed=4)
    torch.manual_seed(1)
    features = torch.randn(3, 14, len(head.config.target_layers) * head.config.hidden_size)
    tokens = torch.randint(0, 512, (3, 14))
    _, whole = ttt_states(head, features, tokens, 3)
    begin = torch.tensor([9, 3, 1])
    offset, windowed = ttt_states(head, features, tokens, 3, begin)
    assert offset.tolist() == [7, 1, 0] and windowed[0].shape[1] == 14
    for j in range(3):
        for b in range(3):
            for t in range(max(int(begin[b]), j), 14):
                torch.testing.assert_close(windowed[j][b, t - offset[b]], whole[j][b, t], rtol=1e-4, atol=1e-5)


def test_features_out_of_step_with_the_context_are_refused(tiny_native: LoadedModel) -> None:
    drafter = EagleDrafter(random_head(tiny_native, 64))
    drafter.begin([1, 2, 3], 16)
    drafter.observe_target(torch.zeros(2, 3 * tiny_native.backend.hidden_size))
    with pytest.raises(RuntimeError, match="features for 2 positions"):
        drafter.propose([1, 2, 3, 4], 2, GREEDY, None)


@pytest.mark.parametrize("untied", [False, True])
def test_save_and_load_round_trip(tiny_native: LoadedModel, tmp_path, untied: bool) -> None:
    head = random_head(tiny_native, 300, seed=5)
    if untied:  # EAGLE-3's own layout: the head has its LM head, and the decoder layer is `layers.0`
        head.config = dataclasses.replace(head.config, tied_lm_head=False)
        head.lm_head = torch.nn.Linear(head.config.hidden_size, 300, bias=False)
        del head.lm_head_rows
    head.save(tmp_path)
    if untied:
        state = load_file(str(tmp_path / "model.safetensors"))
        save_file({k.replace("midlayer.", "layers.0."): v for k, v in state.items()}, str(tmp_path / "model.safetensors"))
        config = json.loads((tmp_path / "config.json").read_text())
        del config["specdec"]
        (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = EagleHead.load(tmp_path, tiny_native)
    assert loaded.config.tied_lm_head is not untied
    assert loaded.config.target_layers == head.config.target_layers
    assert torch.equal(loaded.draft_ids, head.draft_ids)
    state = torch.randn(4, head.config.hidden_size)
    # Weights are stored in bfloat16.
    torch.testing.assert_close(loaded.logits(state), head.logits(state), rtol=0.05, atol=0.05)


def test_load_refuses_a_head_for_another_target(tiny_native: LoadedModel, default_model: LoadedModel, tmp_path) -> None:
    random_head(tiny_native, 64).save(tmp_path)
    with pytest.raises(ConfigError, match="hidden size"):
        EagleHead.load(tmp_path, default_model)
    with pytest.raises(ConfigError, match="no EAGLE head in"):
        EagleHead.load(tmp_path / "missing", default_model)


def test_config_names_a_head_directory(tiny_native: LoadedModel, tmp_path) -> None:
    random_head(tiny_native, 256).save(tmp_path)
    llm = LLM(loaded=tiny_native, speculative_config={"method": "eagle", "model": str(tmp_path),
                                                       "num_speculative_tokens": 3})
    prompt = [5, 9, 13, 200, 17]
    assert llm.engine.generate(prompt, GREEDY).token_ids == llm.plain_engine.generate(prompt, GREEDY).token_ids


def test_batched_rows_each_get_their_states(tiny_native: LoadedModel) -> None:
    # Rows of different lengths with their own heads' caches, joining at different steps: each
    # must decode exactly as plain decoding does alone (a row fed another row's states would
    # still be lossless, so the drafts are checked too: the same as a batch of one's).
    head = random_head(tiny_native, 512, seed=1)
    prompts = [[3, 4, 5], [7, 8, 9, 10, 11, 12, 13], [100, 4, 100, 4]]
    plain = [Engine(tiny_native).generate(p, GREEDY).token_ids for p in prompts]
    alone = [Engine(tiny_native, EagleDrafter(head), 3).generate(p, GREEDY).stats.per_position_acceptance
             for p in prompts]
    engine = BatchEngine(tiny_native, max_rows=3, max_model_len=64, max_draft=3)
    seqs = [engine.admit(prompts[0], GREEDY, EagleDrafter(head), 3).sequence]
    engine.step()
    seqs += [engine.admit(p, GREEDY, EagleDrafter(head), 3).sequence for p in prompts[1:]]
    while not all(s.finished for s in seqs):
        engine.step()
    assert [s.result.token_ids for s in seqs] == plain
    assert [s.result.stats.per_position_acceptance for s in seqs] == alone


def test_a_forked_drafter_shares_the_weights(tiny_native: LoadedModel) -> None:
    # The server forks a prototype drafter per request: its head and packed matrices must be
    # the prototype's, not copies, and its cache its own.
    from specdec.server.scheduler import fork_drafter

    prototype = EagleDrafter(random_head(tiny_native, 64))
    forked = fork_drafter(prototype)
    assert forked.head is prototype.head and forked.weights is prototype.weights
    forked.begin([1, 2], 8)
    assert prototype._keys is None and forked._keys is not None


@pytest.mark.parametrize("width,nodes", [(2, 3), (3, 8)])
def test_tree_drafts_are_verified_losslessly(tiny_native: LoadedModel, width: int, nodes: int) -> None:
    # A random head's trees on the native backend, alone and in a batch with a chain row: the
    # output is plain decoding's, and the trees are trees (a node with two children somewhere).
    head = random_head(tiny_native, 512, seed=2)
    prompts = [[3, 4, 5, 6], [7, 8, 9, 10, 11, 12]]
    plain = [Engine(tiny_native).generate(p, GREEDY).token_ids for p in prompts]
    drafter = EagleDrafter(head, tree_width=width, tree_nodes=nodes)
    drafter.begin(prompts[0], 64)
    drafter.observe_target(torch.randn(len(prompts[0]) - 1, 3 * head.config.hidden_size))
    proposal = drafter.propose(prompts[0], 3, GREEDY, None)
    assert len(proposal.tokens) == nodes and proposal.parents.count(-1) == width
    assert Engine(tiny_native, EagleDrafter(head, tree_width=width, tree_nodes=nodes), 3).generate(
        prompts[0], GREEDY).token_ids == plain[0]
    engine = BatchEngine(tiny_native, max_rows=2, max_model_len=64, max_draft=8)
    seqs = [engine.admit(prompts[0], GREEDY, EagleDrafter(head, tree_width=width, tree_nodes=nodes), 3).sequence,
            engine.admit(prompts[1], GREEDY, EagleDrafter(head), 3).sequence]
    while not all(s.finished for s in seqs):
        engine.step()
    assert [s.result.token_ids for s in seqs] == plain


def peaked_head(target: LoadedModel) -> EagleHead:
    """A random head whose draft distributions are peaked: its top probabilities spread over
    (0, 1), so that a confidence floor cuts some drafts and not others."""
    head = random_head(target, 64, seed=3)
    with torch.no_grad():
        head.norm.mul_(24.0)  # the scores' scale
    return head


def test_a_confidence_floor_ends_the_chain_where_its_probability_would_fall_below(tiny_native: LoadedModel,
                                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # The chain the head drafts without a floor, and each token's probability under the head:
    # with a floor between the probabilities of the first j and j + 1 tokens, the draft is the
    # first j tokens; above the first token's, nothing.
    head = peaked_head(tiny_native)
    prompt = [3, 4, 5, 6, 7]
    features = torch.randn(len(prompt) - 1, 3 * head.config.hidden_size, generator=torch.Generator().manual_seed(0))

    def drafted(floor: float | None) -> tuple[list[int], list[float]]:
        drafter = EagleDrafter(head, min_confidence=floor)
        drafter.begin(prompt, 32)
        drafter.observe_target(features)
        seen = []
        scores = drafter._logits
        monkeypatch.setattr(drafter, "_logits", lambda state: seen.append(scores(state)) or seen[-1])
        tokens = drafter.propose(prompt, 4, GREEDY, None).tokens
        return tokens, [float(torch.softmax(logits[0], -1).max()) for logits in seen]

    chain, tops = drafted(None)
    chances = torch.tensor(tops).cumprod(0).tolist()  # the chain's probability after each token
    assert len(chain) == 4 and chances[0] > chances[-1]
    for j in range(1, 4):
        if chances[j] < chances[j - 1]:
            assert drafted((chances[j - 1] + chances[j]) / 2)[0] == chain[:j]
    assert chances[0] < 1 and drafted(min(1.0, chances[0] * 1.01))[0] == []
    assert drafted(chances[-1] * 0.99)[0] == chain


@pytest.mark.parametrize("width", [1, 2])
def test_drafts_under_a_confidence_floor_are_verified_losslessly(tiny_native: LoadedModel, width: int) -> None:
    # Chains and trees cut by the floor, alone and as rows of a batch: plain decoding's tokens,
    # with steps that draft nothing, steps that draft some and steps that draft the most.
    head = peaked_head(tiny_native)
    prompts = [[3, 4, 5, 6], [7, 8, 9, 10, 11, 12]]
    plain = [Engine(tiny_native).generate(p, GREEDY).token_ids for p in prompts]
    sizes = []
    propose = EagleDrafter.propose

    def counted(self, *args):
        proposal = propose(self, *args)
        sizes.append(len(proposal.tokens))
        return proposal

    make = lambda: EagleDrafter(head, tree_width=width, tree_nodes=4 if width > 1 else None, min_confidence=0.3)  # noqa: E731
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(EagleDrafter, "propose", counted)
        assert Engine(tiny_native, make(), 3).generate(prompts[0], GREEDY).token_ids == plain[0]
        engine = BatchEngine(tiny_native, max_rows=2, max_model_len=64, max_draft=8)
        seqs = [engine.admit(p, GREEDY, make(), 3).sequence for p in prompts]
        while not all(s.finished for s in seqs):
            engine.step()
    assert [s.result.token_ids for s in seqs] == plain
    most = 4 if width > 1 else 3
    assert 0 in sizes and most in sizes and any(0 < n < most for n in sizes), sizes


def test_an_oracle_tree_is_accepted_along_its_right_branch(tiny_native: LoadedModel) -> None:
    # A test drafter proposing a tree whose second root child (not the first) is the plain
    # continuation, with the continuation's next tokens under it: every step must accept that
    # branch whole, so each step commits depth + 1 tokens.
    from specdec.drafters import Proposal

    prompt = [3, 4, 5, 6]
    params = SamplingParams(max_tokens=13, temperature=0.0, ignore_eos=True)
    reference = prompt + Engine(tiny_native).generate(prompt, params).token_ids

    class Oracle(Drafter):
        proposal_size = 4  # a tree of 4 tokens, 3 deep

        def begin(self, prompt_ids, max_len):
            pass

        def propose(self, context, k, params, generator):
            right = reference[len(context) : len(context) + 3]
            wrong = (right[0] + 1) % 500
            return Proposal(tokens=[wrong, right[0], right[1], right[2]], parents=(-1, -1, 1, 2))

        def commit(self, context, num_accepted):
            pass

    result = Engine(tiny_native, Oracle(), 3).generate(prompt, params)
    assert result.token_ids == reference[len(prompt):]
    assert result.stats.target_steps == 3  # 1 from the prefill, then 4 tokens a step
    # The target verified every node, the wrong root child included: 5 tokens a step for 4 kept.
    assert result.stats.target_tokens == 3 * 5
    assert result.stats.target_tokens_per_output_token == 15 / 12


def test_forward_gives_logits_for_the_last_tokens_asked(tiny_any: LoadedModel) -> None:
    runner = ModelRunner(tiny_any)
    ids = list(range(30, 50))
    full = runner.forward(runner.new_cache(len(ids)), ids, hidden=True)
    last = runner.forward(runner.new_cache(len(ids)), ids, hidden=True, last_logits=7)
    assert last.logits.shape == (7, full.logits.shape[1]) and last.hidden.shape[0] == 7
    torch.testing.assert_close(last.logits, full.logits[-7:])
    torch.testing.assert_close(last.hidden, full.hidden[-7:])
    for bad in (0, 21):
        with pytest.raises(ValueError, match="last_logits"):
            runner.forward(runner.new_cache(len(ids)), ids, last_logits=bad)
    with pytest.raises(ValueError, match="last_logits"):
        runner.forward(runner.new_cache(len(ids)), ids, last_only=True, last_logits=1)


def test_hybrid_drafts_lookup_up_to_k_and_the_head_up_to_its_own_bound(tiny_native: LoadedModel,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from specdec.drafters.hybrid import HybridDrafter
    from specdec.drafters.ngram import NgramDrafter

    head = random_head(tiny_native, 512, seed=1)
    hybrid = HybridDrafter(EagleDrafter(head), NgramDrafter(2, 6), head_tokens=1)
    context = [5, 6, 7, 8, 9, 10, 11, 12, 13, 5, 6, 7, 8, 9]  # a 5-token match: lookup proposes 4, up to k
    hybrid.begin(context, 64)
    assert hybrid.propose(context, 4, GREEDY, None).tokens == [10, 11, 12, 13] and hybrid.used_lookup == 1

    by_lookup, by_head = [], []
    propose = HybridDrafter.propose

    def logged(self, *args):  # the engine drafts with a fork of `hybrid`
        before = self.used_lookup
        proposal = propose(self, *args)
        (by_lookup if self.used_lookup > before else by_head).append(len(proposal.tokens))
        return proposal

    monkeypatch.setattr(HybridDrafter, "propose", logged)
    prompt = [20, 21, 22, 23]
    params = dataclasses.replace(GREEDY, max_tokens=12)
    out = Engine(tiny_native, hybrid, 4).generate(prompt, params)
    assert out.token_ids == Engine(tiny_native).generate(prompt, params).token_ids
    assert by_head and max(by_head) == 1  # the head: at most hybrid_head_tokens


def test_union_of_two_drafts_is_a_tree_holding_every_path_once() -> None:
    from specdec.drafters import Proposal
    from specdec.drafters.hybrid import union

    lookup = Proposal(tokens=[10, 11, 12])
    # A chain that follows lookup for one token, then leaves it.
    merged = union(lookup, Proposal(tokens=[10, 20]))
    assert merged.tokens == [10, 11, 12, 20] and merged.parents == (-1, 0, 1, 0)
    # A head tree: two roots, the first lookup's.
    tree = Proposal(tokens=[10, 30, 31, 11], parents=(-1, -1, 1, 0))
    merged = union(lookup, tree)
    assert merged.tokens == [10, 11, 12, 30, 31] and merged.parents == (-1, 0, 1, -1, 3)
    paths = {tuple(p) for p in tree_paths(merged.tokens, merged.parents)}
    assert paths == {(), (10,), (10, 11), (10, 11, 12), (30,), (30, 31)}
    # One draft inside the other: still a chain.
    assert union(lookup, Proposal(tokens=[10, 11])) == Proposal(tokens=[10, 11, 12])
    assert union(Proposal(tokens=[]), Proposal(tokens=[7])) == Proposal(tokens=[7])


def test_hybrid_branches_verify_lookup_and_the_head_together(tiny_native: LoadedModel) -> None:
    from specdec.config import SpeculativeConfig
    from specdec.drafters.hybrid import HybridDrafter
    from specdec.drafters.ngram import NgramDrafter

    head = random_head(tiny_native, 512, seed=1)
    config = SpeculativeConfig("hybrid", 4, hybrid_head_tokens=2, hybrid_branches=True)
    assert config.options.proposal_tokens(4) == 6 and "branches" in config.options.label_after_k()
    hybrid = HybridDrafter(EagleDrafter(head), NgramDrafter(2, 6), head_tokens=2, branches_up_to=6)
    context = [5, 6, 7, 8, 9, 10, 11, 12, 13, 5, 6, 7, 8, 9]
    hybrid.begin(context, 64)
    hybrid.observe_target(torch.randn(len(context) - 1, 3 * head.config.hidden_size))
    alone = EagleDrafter(head)
    alone.begin(context, 64)
    alone.observe_target(hybrid.eagle._pending[0])
    own = alone.propose(context, 2, GREEDY, None).tokens
    proposal = hybrid.propose(context, 4, GREEDY, None)
    assert proposal.tokens[:4] == [10, 11, 12, 13] and proposal.probs is None
    paths = {tuple(p) for p in tree_paths(proposal.tokens, proposal.parents or tuple(range(-1, len(proposal.tokens) - 1)))}
    assert tuple(own) in paths and len(proposal.tokens) <= 6
    prompt = [20, 21, 22, 20, 21, 22, 20]
    params = dataclasses.replace(GREEDY, max_tokens=16)
    out = Engine(tiny_native, hybrid, 4).generate(prompt, params)
    assert out.token_ids == Engine(tiny_native).generate(prompt, params).token_ids


@pytest.mark.skipif(not kernels.available(), reason="specdec's kernels are not built on this machine")
@pytest.mark.parametrize("width", [1, 3])
def test_the_one_call_layer_drafts_what_the_pytorch_path_does(tiny_native: LoadedModel, width: int) -> None:
    # The kernels' `head_layer` against the PyTorch operations on the same q8 matrices: every
    # step's draft logits agree to float rounding (the order of sums in the norms and attention),
    # and so do the proposals, over a catch-up of several positions, a chain and a tree.
    head = random_head(tiny_native, 512, seed=6)
    torch.manual_seed(1)
    features = torch.randn(11, len(head.config.target_layers) * head.config.hidden_size)
    context = torch.randint(0, 512, (12,)).tolist()
    runs = []
    for one_call in (True, False):
        drafter = EagleDrafter(head, "q8", tree_width=width, tree_nodes=6 if width > 1 else None)
        assert drafter._one_call is not None
        if not one_call:
            drafter._one_call = None
        seen: list[torch.Tensor] = []
        logits_of = drafter._logits
        drafter._logits = lambda state, f=logits_of, seen=seen: seen.append(f(state)) or seen[-1]
        drafter.begin(context[:2], 32)
        drafter.observe_target(features[:6])
        first = drafter.propose(context[:7], 3, GREEDY, None)
        drafter.observe_target(features[6:])
        second = drafter.propose(context, 3, GREEDY, None)
        runs.append((seen, first, second))
    (fast, *fast_proposals), (plain, *plain_proposals) = runs
    assert len(fast) == len(plain) == 6  # three draft depths in each of two proposals
    for a, b in zip(fast, plain):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert [(p.tokens, p.parents) for p in fast_proposals] == [(p.tokens, p.parents) for p in plain_proposals]
    if width > 1:
        assert fast_proposals[0].parents.count(-1) == width


def test_a_head_packs_in_the_kernels_formats_or_runs_without_them(tiny_native: LoadedModel,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # Drafting packs the head in q8 where the kernels run (the one-call layer), else in PyTorch's
    # int8; a float format always takes the PyTorch path.
    head = random_head(tiny_native, 64)
    assert EagleDrafter(head, "float32")._one_call is None
    if kernels.available():
        assert EagleDrafter(head).weight_format == "q8" and EagleDrafter(head)._one_call is not None
    monkeypatch.setattr(kernels, "available", lambda: False)
    drafter = EagleDrafter(head)
    assert drafter.weight_format == "int8" and drafter._one_call is None
    with pytest.raises(ConfigError, match="unknown weight format"):
        EagleDrafter(head, "q5")
