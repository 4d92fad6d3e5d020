"""EAGLE heads: drafting matches what training unrolls, files round-trip (ours and EAGLE-3's
layout), training resumes exactly, and the batched engine feeds each row's head its states."""

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
from specdec.engine.batch import BatchEngine, Sequence
from specdec.errors import ConfigError
from specdec.models import LoadedModel, ModelRunner
from specdec.sampling.penalties import tree_paths
from specdec.training.heads import Progress, TargetView, TrainConfig, evaluate, learning_rate, new_head, train_head

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
    seqs = [Sequence(p, GREEDY, EagleDrafter(head), k=3) for p in prompts]
    engine.add(seqs[0])
    engine.step()
    engine.add(seqs[1])
    engine.add(seqs[2])
    while not all(s.finished for s in seqs):
        engine.step()
    assert [s.result.token_ids for s in seqs] == plain
    assert [s.result.stats.per_position_acceptance for s in seqs] == alone


def test_training_resumes_where_it_stopped(tiny_native: LoadedModel, tmp_path) -> None:
    records = [{"id": f"r{i}", "prompt_ids": torch.randint(0, 400, (12,)).tolist(),
                "answer_ids": torch.randint(0, 400, (20,)).tolist()} for i in range(12)]
    config = TrainConfig(draft_vocab_size=128, batch_sequences=2, max_tokens=32 * 6, checkpoint_every_s=0.0,
                         validation_fraction=0.2, seed=7)
    whole = train_head(tiny_native, records, tmp_path / "whole", config)

    class Killed(Exception):
        pass

    def kill_after_two(progress) -> None:
        if progress.steps == 2:
            raise Killed

    with pytest.raises(Killed):
        train_head(tiny_native, records, tmp_path / "split", config, on_progress=kill_after_two)
    resumed = train_head(tiny_native, records, tmp_path / "split", config, resume=True)
    assert resumed["steps"] == whole["steps"] and resumed["tokens"] == whole["tokens"]
    a = load_file(str(tmp_path / "whole" / "model.safetensors"))
    b = load_file(str(tmp_path / "split" / "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_resume_refuses_other_settings_but_takes_a_larger_budget(tiny_native: LoadedModel, tmp_path) -> None:
    records = [{"id": f"r{i}", "prompt_ids": list(range(3, 30)), "answer_ids": []} for i in range(6)]
    config = TrainConfig(draft_vocab_size=64, batch_sequences=1, max_tokens=30, validation_fraction=0.0)
    first = train_head(tiny_native, records, tmp_path, config)
    with pytest.raises(ConfigError, match="other settings"):
        train_head(tiny_native, records, tmp_path, dataclasses.replace(config, lr=0.5), resume=True)
    # Another machine: bfloat16 autocast there (or not) is its own choice, as is the device.
    longer = train_head(tiny_native, records, tmp_path, dataclasses.replace(config, max_tokens=90, bf16="on"), resume=True)
    assert longer["steps"] > first["steps"] and first["tokens"] < 90 <= longer["tokens"] and longer["bf16"]


def test_learning_rate_warms_up_then_falls_to_its_floor_at_the_token_budget() -> None:
    config = TrainConfig(lr=1e-3, warmup_steps=10, max_tokens=1000, final_lr_fraction=0.1)
    assert learning_rate(config, Progress(steps=0)) == pytest.approx(1e-4)
    assert learning_rate(config, Progress(steps=9)) == pytest.approx(1e-3)
    rates = [learning_rate(config, Progress(steps=50, tokens=t)) for t in range(0, 1001, 100)]
    assert rates[5] == pytest.approx(0.55e-3) and rates[-1] == pytest.approx(1e-4)
    assert all(a > b for a, b in zip(rates, rates[1:]))
    assert learning_rate(config, Progress(steps=50, tokens=5000)) == pytest.approx(1e-4)  # past the budget: the floor
    # A time budget alone gives no end to fall towards: the rate stays.
    assert learning_rate(TrainConfig(lr=1e-3, warmup_steps=10, max_time=60.0), Progress(steps=50, tokens=10**9)) == 1e-3


def test_training_learns(self_distilled, tmp_path) -> None:
    # A short run on the target's own greedy text must lift the head's agreement with the target
    # on that text far above an untrained head's. (A constant rate: 60 steps are too few to
    # spend half of them on a falling one.)
    target, records = self_distilled(24)
    config = TrainConfig(draft_vocab_size=8, batch_sequences=4, max_tokens=30 * 4 * 60, validation_fraction=0.0,
                         lr=3e-3, ttt_steps=2, final_lr_fraction=1.0)
    train_head(target, records, tmp_path, config)
    head = EagleHead.load(tmp_path, target)
    untrained = random_head(target)
    view = TargetView(target, head.config.target_layers, head.draft_ids)
    sequences = [(r["prompt_ids"] + r["answer_ids"], 0) for r in records]
    trained, before = evaluate(head, view, sequences, 2), evaluate(untrained, view, sequences, 2)
    assert trained[0] > before[0] + 0.3 and trained[1] > before[1] + 0.2, (trained, before)


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
    seqs = [Sequence(prompts[0], GREEDY, EagleDrafter(head, tree_width=width, tree_nodes=nodes), k=3),
            Sequence(prompts[1], GREEDY, EagleDrafter(head), k=3)]
    for seq in seqs:
        engine.add(seq)
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
        seqs = [Sequence(p, GREEDY, make(), k=3) for p in prompts]
        for seq in seqs:
            engine.add(seq)
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


def test_view_store_reads_back_what_it_made_and_survives_a_kill(tiny_native: LoadedModel, tmp_path) -> None:
    from specdec.training.heads import ViewStore

    head = random_head(tiny_native, 512)
    layers = head.config.target_layers
    meta = TargetView.meta(tiny_native, layers, head.draft_ids, 16)
    view = TargetView(tiny_native, layers, head.draft_ids, 16, ViewStore(tmp_path, meta))
    first, second = list(range(40, 70)), list(range(80, 95))
    made = view(first)
    assert made.index.shape == (29, 16) and made.features.dtype == torch.bfloat16
    view(second)
    # The rows of a third sequence cut by a kill: in the data files, not yet in the log.
    with (tmp_path / "features.bin").open("ab") as handle:
        handle.write(b"\0" * 1000)
    with (tmp_path / "rows.jsonl").open("a") as handle:
        handle.write('{"key": "cut", "sta')
    reopened = TargetView(tiny_native, layers, head.draft_ids, 16, ViewStore(tmp_path, meta))
    reopened.runner.forward = None  # a stored sequence must not run the target again
    again = reopened(first)
    for name in ("features", "index", "values", "top"):
        assert torch.equal(getattr(again, name), getattr(made, name)), name
    assert torch.equal(reopened(second).top, view(second).top)
    assert (tmp_path / "features.bin").stat().st_size == (29 + 14) * meta["feature_size"] * 2
    # The kept probabilities are the target's: the top tokens' of its softmax over the draft ids.
    probs = torch.softmax(view.runner.score(first)[1:].float(), dim=-1)[:, head.draft_ids]
    torch.testing.assert_close(again.values.float(), probs.topk(16, dim=-1).values, rtol=1e-2, atol=1e-3)
    with pytest.raises(ConfigError, match="draft_vocab, draft_vocab_size"):
        ViewStore(tmp_path, TargetView.meta(tiny_native, layers, head.draft_ids[:100], 16))


def test_a_view_from_a_start_skips_the_prompts_distributions(tiny_any: LoadedModel, tmp_path) -> None:
    from specdec.training.heads import ViewStore

    head = random_head(tiny_any, 256)
    layers = head.config.target_layers
    meta = TargetView.meta(tiny_any, layers, head.draft_ids, 16)
    view = TargetView(tiny_any, layers, head.draft_ids, 16, ViewStore(tmp_path, meta))
    ids, start = list(range(40, 70)), 11
    part = view(ids, start)
    whole = TargetView(tiny_any, layers, head.draft_ids, 16)(ids)
    # The rows it made are the whole view's (to rounding: a float32 LM head over fewer rows; the
    # quantized formats' kernels give the same bits, test_views_from_a_start_are_bitwise_the_whole_ones).
    torch.testing.assert_close(part.values[start:].float(), whole.values[start:].float())
    assert torch.equal(part.features, whole.features)
    assert part.top.shape == whole.top.shape and bool((part.top[:start] == -1).all())
    assert not part.values[:start].any()
    # Stored under its start: it serves that start, never a view counted from earlier rows.
    assert view.stored(ids, start) is not None and view.stored(ids) is None and view.stored(ids, 5) is None
    # A whole view serves every start.
    view(ids)
    assert view.stored(ids, 5) == view.stored(ids) == ViewStore.key(ids)
    with pytest.raises(ValueError, match="past the last row"):
        view(ids, 29)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        view([5])


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


def test_views_from_a_start_are_bitwise_the_whole_ones(default_model: LoadedModel) -> None:
    """On the default model's formats (q4 layers, a q8 LM head: row-invariant kernels), a view
    made from a start is bitwise the whole view's rows from there on: training reads the same."""
    head = random_head(default_model, 1024)
    view = TargetView(default_model, head.config.target_layers, head.draft_ids)
    ids = default_model.tokenizer.encode("The quick brown fox jumps over the lazy dog because it was late for work.")
    whole, part = view(ids), view(ids, 6)
    for name in ("features", "index", "values", "top"):
        assert torch.equal(getattr(part, name)[6:], getattr(whole, name)[6:]), name


def test_loss_counts_answer_positions_only(tiny_native: LoadedModel) -> None:
    from specdec.training.heads import answer_start, batch_losses

    records = [{"id": "x", "prompt_ids": list(range(10, 22)), "answer_ids": list(range(30, 38))},
               {"id": "y", "prompt_ids": list(range(5, 10)), "answer_ids": list(range(60, 64))}]
    sequences = [r["prompt_ids"] + r["answer_ids"] for r in records]
    head = random_head(tiny_native, 256)
    view = TargetView(tiny_native, head.config.target_layers, head.draft_ids)
    samples = [view(ids) for ids in sequences]
    starts = [answer_start(r) for r in records]
    assert starts == [10, 3]  # position 10 predicts token 12, the first answer token
    counted = [n for _, _, n in batch_losses(head, samples, sequences, starts, 3)]
    assert counted == [sum(len(ids) - 1 - s for ids, s in zip(sequences, starts))] * 3
    counted = [n for _, _, n in batch_losses(head, samples, sequences, [0, 0], 3)]
    assert counted == [sum(len(ids) - 1 - j for ids in sequences) for j in range(3)]
    # Padding the shorter sequence changes nothing: alone, each gives the batch's own terms.
    together = batch_losses(head, samples, sequences, [0, 0], 3)
    alone = [batch_losses(head, [s], [ids], [0], 3) for s, ids in zip(samples, sequences)]
    for j in range(3):
        n = [a[j][2] for a in alone]
        torch.testing.assert_close(together[j][0], (alone[0][j][0] * n[0] + alone[1][j][0] * n[1]) / sum(n))
        assert together[j][1] == alone[0][j][1] + alone[1][j][1]


def test_init_starts_from_a_head(tiny_native: LoadedModel, tmp_path) -> None:
    start = random_head(tiny_native, 128, seed=9)
    start.save(tmp_path / "start")
    records = [{"id": f"r{i}", "prompt_ids": list(range(3, 20)), "answer_ids": list(range(40, 50))} for i in range(4)]
    config = TrainConfig(draft_vocab_size=128, batch_sequences=1, max_tokens=20, validation_fraction=0.0, lr=0.0)
    train_head(tiny_native, records, tmp_path / "out", config, init=tmp_path / "start")
    a = load_file(str(tmp_path / "start" / "model.safetensors"))
    b = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert all(torch.equal(a[name], b[name]) for name in a)  # lr 0: the starting weights, saved again
    # The head keeps what trained it before: trained further, it counts every token it has seen.
    history = EagleHead.load(tmp_path / "out", tiny_native).config.training
    assert history["started_from"] == {"from": str(tmp_path / "start")}  # an untrained head: no history
    assert history["total_tokens"] == history["tokens"] > 0
    start.config.training.update({"tokens": 1000, "total_tokens": 5000})
    start.save(tmp_path / "start")
    train_head(tiny_native, records, tmp_path / "again", config, init=tmp_path / "start")
    history = EagleHead.load(tmp_path / "again", tiny_native).config.training
    assert history["started_from"]["total_tokens"] == 5000 and history["total_tokens"] == 5000 + history["tokens"]


def test_a_time_budget_stops_training_on_time(tiny_native: LoadedModel, tmp_path) -> None:
    records = [{"id": f"r{i}", "prompt_ids": list(range(3, 20)), "answer_ids": list(range(40, 60))} for i in range(8)]
    config = TrainConfig(draft_vocab_size=128, batch_sequences=1, max_time=3.0, validation_fraction=0.0)
    report = train_head(tiny_native, records, tmp_path, config)
    assert report["steps"] > 1 and 3 <= report["seconds"] <= 30


def test_records_sharing_an_id_train_over_several_epochs(tiny_native: LoadedModel, tmp_path) -> None:
    # The target's views are keyed by content, not id: two records with one id but different
    # texts must each keep their own view (a shared key fed one record's states to the other).
    records = [{"id": "same", "prompt_ids": list(range(3, 3 + n)), "answer_ids": list(range(50, 60))} for n in (8, 14)]
    config = TrainConfig(draft_vocab_size=64, batch_sequences=2, max_tokens=4 * 42, validation_fraction=0.0)
    assert train_head(tiny_native, records, tmp_path, config)["epochs"] >= 3


def test_fixed_text_trains_and_is_never_held_out(tiny_native: LoadedModel, tmp_path) -> None:
    # With every record in the held-out split by its hash (fraction 1), answers are all held
    # out, but fixed-text records still train; with only text, nothing is held out.
    text = [{"id": f"text:t{i}", "kind": "text", "prompt_ids": [], "answer_ids": list(range(3 + i, 30 + i))}
            for i in range(4)]
    answers = [{"id": f"a{i}", "prompt_ids": [5, 6, 7], "answer_ids": list(range(40 + i, 60 + i))} for i in range(3)]
    config = TrainConfig(draft_vocab_size=64, batch_sequences=1, max_tokens=60, validation_fraction=1.0)
    report = train_head(tiny_native, text + answers, tmp_path / "mixed", config)
    assert report["sequences"] == 4 and report["validation_sequences"] == 3
    assert all(a == a for a in report["validation_agreement"])  # measured: not NaN
    with pytest.raises(ConfigError, match="no training sequences"):
        train_head(tiny_native, answers, tmp_path / "answers", config)


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
def test_views_keep_the_same_distribution_without_the_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    from specdec.training.heads import draft_distribution

    logits = 3 * torch.randn(20, 300, generator=torch.Generator().manual_seed(4))
    draft = torch.randperm(300, generator=torch.Generator().manual_seed(5))[:100]
    fast = draft_distribution(logits, draft, 16)
    monkeypatch.setattr(kernels, "available", lambda: False)
    plain = draft_distribution(logits, draft, 16)
    assert torch.equal(fast[0], plain[0]) and torch.equal(fast[1], plain[1])
    torch.testing.assert_close(fast[2], plain[2], rtol=1e-5, atol=1e-8)


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
