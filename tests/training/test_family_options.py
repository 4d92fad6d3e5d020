"""A head family's training options reach its head and nothing else: the generic TrainConfig
carries a family name and that family's own options object (never one family's fields),
Medusa's head count builds the Medusa head, EAGLE's ttt_steps drive EAGLE's unroll and its
evaluation, another family's options are refused, the CLI's flags map onto the family's
options, and a checkpoint written with the old flat keys still resumes."""

from __future__ import annotations

import dataclasses
import inspect
import json
from pathlib import Path

import pytest
import torch

from specdec import methods
from specdec.drafters.eagle import EagleHead
from specdec.drafters.head_parts import TrainableHead
from specdec.drafters.medusa import MedusaHeads
from specdec.errors import ConfigError
from specdec.methods import EagleTrainOptions, MedusaTrainOptions
from specdec.models import LoadedModel
from specdec.training import run as run_module
from specdec.training.heads import CHECKPOINT_FILE, TrainConfig, new_head, saved_settings, train_head
from specdec.training.run import TrainRun, resumed_config, train_draft

# Text records train; with validation_fraction 1 every answer record is held out, so a run
# measures its held-out agreement per draft position (one number a position).
TEXT = [{"id": f"text:t{i}", "kind": "text", "prompt_ids": [], "answer_ids": list(range(3 + i, 30 + i))} for i in range(3)]
ANSWERS = [{"id": f"a{i}", "prompt_ids": [5, 6, 7], "answer_ids": list(range(40 + i, 60 + i))} for i in range(2)]


def test_the_generic_config_and_head_interface_name_no_family_option() -> None:
    keys = set(methods.train_option_keys())
    assert keys >= {"ttt_steps", "medusa_heads"}
    assert not keys & {f.name for f in dataclasses.fields(TrainConfig)}
    for name in ("fresh", "draft_positions", "draft_states"):
        parameters = set(inspect.signature(getattr(TrainableHead, name)).parameters)
        assert "options" in parameters and not parameters & (keys | {"heads", "depth"}), name
    with pytest.raises(TypeError):
        TrainConfig(medusa_heads=2)  # type: ignore[call-arg]


def test_each_family_gets_its_own_default_options() -> None:
    for name in methods.trainable_heads():
        family = methods.head_family(name)
        assert TrainConfig(arch=name).head_options == family.options()
    assert TrainConfig().head_options == EagleTrainOptions()
    assert TrainConfig(arch="medusa").head_options == MedusaTrainOptions()


def test_a_config_with_another_familys_options_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"MedusaTrainOptions\(medusa_heads=2\) are medusa heads' options; "
                                          r"a eagle head reads EagleTrainOptions \(ttt_steps\)"):
        TrainConfig(arch="eagle", head_options=MedusaTrainOptions(medusa_heads=2))
    with pytest.raises(ConfigError, match="are eagle heads' options; a medusa head reads MedusaTrainOptions"):
        TrainConfig(arch="medusa", head_options=EagleTrainOptions())
    with pytest.raises(ConfigError, match="are no heads' options"):
        TrainConfig(head_options=methods.TrainOptions())
    with pytest.raises(ConfigError, match="unknown head architecture 'hydra'"):
        TrainConfig(arch="hydra")
    with pytest.raises(ConfigError, match="ttt_steps must be an integer >= 1"):
        EagleTrainOptions(ttt_steps=0)
    with pytest.raises(ConfigError, match="medusa_heads must be an integer >= 1"):
        MedusaTrainOptions(medusa_heads=0)


@pytest.mark.parametrize("count", [1, 4])  # not the default (3): a dropped option fails
def test_medusas_head_count_reaches_the_medusa_head(tiny_native: LoadedModel, count: int) -> None:
    options = MedusaTrainOptions(medusa_heads=count)
    heads = new_head(tiny_native, torch.arange(16), TrainConfig(arch="medusa", head_options=options, draft_vocab_size=16))
    assert isinstance(heads, MedusaHeads)
    assert heads.config.num_heads == len(heads.medusa_head) == heads.draft_positions(options) == count
    features = torch.randn(2, 5, tiny_native.backend.hidden_size)
    _, entries = heads.draft_states(features, torch.zeros(2, 5, dtype=torch.long), torch.zeros(2, dtype=torch.long),
                                    options)
    assert [shift for _, shift, _, _ in entries] == list(range(count))


@pytest.mark.parametrize("steps", [1, 4])
def test_eagles_ttt_steps_reach_the_unroll(tiny_native: LoadedModel, steps: int) -> None:
    options = EagleTrainOptions(ttt_steps=steps)
    head = new_head(tiny_native, torch.arange(16), TrainConfig(head_options=options, draft_vocab_size=16))
    assert isinstance(head, EagleHead) and head.draft_positions(options) == steps
    features = torch.randn(2, 9, len(head.config.target_layers) * tiny_native.backend.hidden_size)
    _, entries = head.draft_states(features, torch.zeros(2, 9, dtype=torch.long), torch.zeros(2, dtype=torch.long),
                                   options)
    assert [first for _, _, first, _ in entries] == list(range(steps))  # depth j counts from position j


def test_training_hands_the_head_its_familys_options(tiny_native: LoadedModel, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # EAGLE: every step and the evaluation unroll ttt_steps deep; the report and the head's
    # history name the family's options and no other family's.
    seen: list[object] = []
    unroll = EagleHead.draft_states
    monkeypatch.setattr(EagleHead, "draft_states",
                        lambda self, *args: seen.append(args[-1]) or unroll(self, *args))
    options = EagleTrainOptions(ttt_steps=4)
    config = TrainConfig(head_options=options, draft_vocab_size=64, batch_sequences=1, max_tokens=60,
                         validation_fraction=1.0)
    report = train_head(tiny_native, TEXT + ANSWERS, tmp_path / "eagle", config)
    assert seen and all(o == options for o in seen)
    assert len(report["validation_agreement"]) == 4 and report["ttt_steps"] == 4 and "medusa_heads" not in report
    assert EagleHead.load(tmp_path / "eagle", tiny_native).config.training["ttt_steps"] == 4
    # Medusa: the head count builds the trained head; EAGLE's ttt_steps appear nowhere.
    options = MedusaTrainOptions(medusa_heads=2)
    config = dataclasses.replace(config, arch="medusa", head_options=options)
    report = train_head(tiny_native, TEXT + ANSWERS, tmp_path / "medusa", config)
    assert len(report["validation_agreement"]) == 2 and report["medusa_heads"] == 2 and "ttt_steps" not in report
    assert MedusaHeads.load(tmp_path / "medusa", tiny_native).config.num_heads == 2


def test_the_cli_flags_reach_the_familys_options(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    answers = tmp_path / "answers.jsonl"
    answers.write_text(json.dumps({"id": "a", "prompt_ids": [1, 2], "answer_ids": [3, 4]}) + "\n")
    monkeypatch.setattr(run_module, "train_head", lambda target, records, out, config, **kwargs: {})
    for arch, given, expected in (("eagle", {"ttt_steps": 5}, EagleTrainOptions(ttt_steps=5)),
                                  ("medusa", {"medusa_heads": 5}, MedusaTrainOptions(medusa_heads=5)),
                                  ("medusa", {}, MedusaTrainOptions())):
        run = TrainRun(out_dir=tmp_path / f"{arch}{len(given)}", arch=arch, answers_from=answers, max_tokens=10,
                       head_options=given)
        config, _ = train_draft(None, run)  # type: ignore[arg-type]  # answers given: the target is not asked
        assert config.arch == arch and config.head_options == expected
    # Another family's flag is refused before anything runs, naming the family that reads it.
    for arch, given, owner in (("medusa", {"ttt_steps": 5}, "eagle"), ("eagle", {"medusa_heads": 2}, "medusa")):
        run = TrainRun(out_dir=tmp_path / "refused", arch=arch, answers_from=answers, max_tokens=10, head_options=given)
        with pytest.raises(ConfigError, match=f"{next(iter(given))} is an option of {owner} heads; a {arch} head"):
            run.check()


def test_old_flat_settings_are_read_into_the_familys_options() -> None:
    old = {"arch": "medusa", "medusa_heads": 2, "draft_vocab_size": 8, "ttt_steps": 3, "lr": 0.001}
    assert saved_settings(old) == {"arch": "medusa", "head_options": {"medusa_heads": 2}, "draft_vocab_size": 8,
                                   "lr": 0.001}
    old = {"arch": "eagle", "medusa_heads": 3, "ttt_steps": 2}
    assert saved_settings(old) == {"arch": "eagle", "head_options": {"ttt_steps": 2}}
    new = {"arch": "eagle", "head_options": {"ttt_steps": 2}, "lr": 0.1}
    assert saved_settings(new) == new


def test_a_checkpoint_with_the_old_flat_options_resumes(tiny_native: LoadedModel, tmp_path: Path) -> None:
    config = TrainConfig(arch="medusa", head_options=MedusaTrainOptions(medusa_heads=2), draft_vocab_size=64,
                         batch_sequences=1, max_tokens=30, validation_fraction=0.0)
    first = train_head(tiny_native, TEXT, tmp_path, config)
    # Rewritten as a checkpoint of the old layout: every family's option a field of TrainConfig.
    path = tmp_path / CHECKPOINT_FILE
    saved = torch.load(path, weights_only=False)
    flat = {key: value for key, value in saved["config"].items() if key != "head_options"}
    saved["config"] = {**flat, "medusa_heads": 2, "ttt_steps": 3}
    torch.save(saved, path)
    # `--resume` takes the saved options, whatever this run's flags say ...
    resumed = resumed_config(tmp_path, TrainConfig(arch="medusa", draft_vocab_size=8))
    assert resumed.head_options == MedusaTrainOptions(medusa_heads=2) and resumed.draft_vocab_size == 64
    # ... and training goes on where it stopped, refusing other options.
    with pytest.raises(ConfigError, match="other settings: {'head_options': {'medusa_heads': 2}}"):
        train_head(tiny_native, TEXT, tmp_path, dataclasses.replace(config, head_options=MedusaTrainOptions()),
                   resume=True)
    longer = train_head(tiny_native, TEXT, tmp_path, dataclasses.replace(config, max_tokens=90), resume=True)
    assert longer["steps"] > first["steps"] and longer["medusa_heads"] == 2
