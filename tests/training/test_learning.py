"""Training learns: a short run on a small target's own greedy text lifts each family's agreement
with the target on that text far above an untrained head's."""

from __future__ import annotations

import torch

from specdec.drafters.eagle import EagleHead
from specdec.drafters.medusa import MedusaHeads
from specdec.methods import EagleTrainOptions, MedusaTrainOptions
from specdec.training.heads import TargetView, TrainConfig, evaluate, new_head, train_head


def test_an_eagle_head_learns(self_distilled, tmp_path) -> None:
    # A constant rate: 60 steps are too few to spend half of them on a falling one.
    target, records = self_distilled(24)
    config = TrainConfig(head_options=EagleTrainOptions(ttt_steps=2), draft_vocab_size=8, batch_sequences=4,
                         max_tokens=30 * 4 * 60, validation_fraction=0.0, lr=3e-3, final_lr_fraction=1.0)
    train_head(target, records, tmp_path, config)
    head = EagleHead.load(tmp_path, target)
    untrained = new_head(target, torch.arange(8), TrainConfig(draft_vocab_size=8)).eval()
    view = TargetView(target, head.config.target_layers, head.draft_ids)
    sequences = [(r["prompt_ids"] + r["answer_ids"], 0) for r in records]
    trained, before = (evaluate(h, view, sequences, config.head_options) for h in (head, untrained))
    assert trained[0] > before[0] + 0.3 and trained[1] > before[1] + 0.2, (trained, before)


def test_medusa_heads_learn(self_distilled, tmp_path) -> None:
    # Zero blocks at the start: each head guesses the target's next token, not the ones after it.
    target, records = self_distilled(16)
    config = TrainConfig(arch="medusa", head_options=MedusaTrainOptions(medusa_heads=2), draft_vocab_size=8,
                         batch_sequences=4, max_tokens=22 * 4 * 80, validation_fraction=0.0, lr=1e-2)
    report = train_head(target, records, tmp_path, config)
    assert report["arch"] == "medusa" and report["validation_agreement"] is None  # nothing held out
    heads = MedusaHeads.load(tmp_path, target)
    view = TargetView(target, (target.num_layers - 1,), heads.draft_ids)
    sequences = [(r["prompt_ids"] + r["answer_ids"], 0) for r in records]
    untrained = new_head(target, torch.arange(8), config)
    trained, before = (evaluate(h, view, sequences, config.head_options) for h in (heads, untrained))
    assert trained[0] > before[0] + 0.2, (trained, before)
