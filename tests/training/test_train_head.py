"""train_head on the tiny model: a killed run resumes exactly, a resumed one refuses other
settings, budgets stop it, --init starts from a head, the loss counts answer positions only,
and the learning rate follows its schedule."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors.torch import load_file

from specdec.drafters.eagle import EagleHead
from specdec.errors import ConfigError
from specdec.methods import EagleTrainOptions
from specdec.models import LoadedModel
from specdec.training.heads import (Progress, TargetView, TrainConfig, answer_start, batch_losses, learning_rate, new_head,
                                    train_head)


def random_head(target: LoadedModel, draft_vocab: int, seed: int = 0) -> EagleHead:
    """An untrained EAGLE head over the target's first `draft_vocab` tokens."""
    return new_head(target, torch.arange(draft_vocab), TrainConfig(draft_vocab_size=draft_vocab, seed=seed)).eval()


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


def test_loss_counts_answer_positions_only(tiny_native: LoadedModel) -> None:
    records = [{"id": "x", "prompt_ids": list(range(10, 22)), "answer_ids": list(range(30, 38))},
               {"id": "y", "prompt_ids": list(range(5, 10)), "answer_ids": list(range(60, 64))}]
    sequences = [r["prompt_ids"] + r["answer_ids"] for r in records]
    head, depth3 = random_head(tiny_native, 256), EagleTrainOptions(ttt_steps=3)
    view = TargetView(tiny_native, head.config.target_layers, head.draft_ids)
    samples = [view(ids) for ids in sequences]
    starts = [answer_start(r) for r in records]
    assert starts == [10, 3]  # position 10 predicts token 12, the first answer token
    counted = [n for _, _, n in batch_losses(head, samples, sequences, starts, depth3)]
    assert counted == [sum(len(ids) - 1 - s for ids, s in zip(sequences, starts))] * 3
    counted = [n for _, _, n in batch_losses(head, samples, sequences, [0, 0], depth3)]
    assert counted == [sum(len(ids) - 1 - j for ids in sequences) for j in range(3)]
    # Padding the shorter sequence changes nothing: alone, each gives the batch's own terms.
    together = batch_losses(head, samples, sequences, [0, 0], depth3)
    alone = [batch_losses(head, [s], [ids], [0], depth3) for s, ids in zip(samples, sequences)]
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
