"""Training draft heads (EAGLE, Medusa) on the target's own view of text.

For each training sequence the target runs one prefill pass (the same backend and weights the
head will draft for) and gives, at every position t, its hidden states at the head's
`target_layers` and its next-token distribution. The head learns, at position t, from the
target's states at t and token t + 1, to match the target's distribution at t + 1 (the token
after next), restricted to the draft vocabulary: soft cross-entropy, as EAGLE-3 does.

Training-time test: drafting k tokens, the head reads its own output state in place of the
target's from the second token on, attending to its own earlier drafted entries. Training
unrolls `ttt_steps` such depths: at depth j, position t reads the depth j - 1 output at t - 1,
and attends to the depth-0 entries up to t - j plus one entry of each depth 1 .. j (the ones a
draft of j + 1 tokens would have written). Depth j's loss is weighted 0.8^j.

Medusa's heads read only the target's last state at t; head i learns the target's distribution
at t + 1 + i (token t + 2 + i). Their residual blocks start at zero, so each head starts as the
target's own next-token guess.

Budgets (`max_tokens`, `max_time`, both counted over the whole run, resumes included) bound a
run; a checkpoint is written every `checkpoint_every_s` seconds and at the end, and `resume`
continues from it with the same data order and optimizer state, with the same budget (exactly
the run an uninterrupted one would have been) or a larger one (training longer). The validation split (a fixed hash of each record's id) is never
trained on; its top-1 agreement with the target per draft depth is the measured result.
"""

from __future__ import annotations

import json
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specdec import drafters
from specdec.errors import ConfigError
from specdec.models.loader import LoadedModel
from specdec.models.runner import ModelRunner
from specdec.training.corpus import split_of

CHECKPOINT_FILE = "checkpoint.pt"
REPORT_FILE = "report.json"
DEPTH_WEIGHT = 0.8
# A resumed run may change its budget (to train longer); every other setting must be the same.
BUDGET_FIELDS = ("max_tokens", "max_time", "checkpoint_every_s")


LOSS_ON = ("answers", "all")


@dataclass(frozen=True)
class TrainConfig:
    arch: str = drafters.DEFAULT_HEAD
    medusa_heads: int = 3
    draft_vocab_size: int = 8192
    ttt_steps: int = 3
    lr: float = 1e-3
    warmup_steps: int = 20
    batch_sequences: int = 8
    max_seq_len: int = 512
    max_tokens: int | None = None
    max_time: float | None = None
    seed: int = 0
    checkpoint_every_s: float = 120.0
    validation_fraction: float = 0.03
    max_validation_sequences: int = 64
    loss_on: str = "answers"  # "answers": positions predicting answer tokens; "all": every position
    cache_top: int = 64  # keep each sequence's target view for later epochs (0: recompute it)


def draft_vocabulary(sequences: list[list[int]], size: int, vocab_size: int) -> tuple[torch.Tensor, float]:
    """The `size` most frequent tokens of the sequences, ascending by id, and the fraction of
    all their tokens those cover. Tokens never seen fill the rest by id."""
    counts = Counter(token for seq in sequences for token in seq)
    common = [token for token, _ in counts.most_common(size)]
    if len(common) < size:
        seen = set(common)
        common += [t for t in range(vocab_size) if t not in seen][: size - len(common)]
    total = sum(counts.values()) or 1
    covered = sum(counts[t] for t in common) / total
    return torch.tensor(sorted(common), dtype=torch.long), covered


@dataclass(frozen=True)
class TargetSample:
    """What the target says about one sequence, row t for position t:
    features [n, F] (its states at t), probs [n, draft_vocab] (its distribution of token t + 2
    over the draft vocabulary) and top [n] (its most likely token t + 2, a target id)."""

    features: torch.Tensor
    probs: torch.Tensor
    top: torch.Tensor


class TargetView:
    """The target's view of sequences, one prefill pass each.

    cache_top > 0 keeps what a sequence's pass gave for the next epochs, compressed: the states
    in bfloat16 and the `cache_top` most likely draft tokens' probabilities (the rest of the
    distribution, a small tail on the target's own text, counts as 0). Later epochs then skip
    the target's pass, which is most of a training step's cost.
    """

    def __init__(self, target: LoadedModel, layers: tuple[int, ...], draft_ids: torch.Tensor, cache_top: int = 0) -> None:
        self.runner = ModelRunner(target)
        self.layers = layers
        self.draft_ids = draft_ids
        self.cache_top = cache_top
        self._cache: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def __call__(self, ids: list[int], key: str | None = None) -> TargetSample:
        """The sample for `ids`; with a key (and cache_top > 0), the compressed one, the same on
        every epoch (and in a resumed run, which starts with an empty cache)."""
        if key is not None and key in self._cache:
            features, index, values, top = self._cache[key]
            probs = torch.zeros(len(top), len(self.draft_ids)).scatter_(1, index.long(), values.float())
            return TargetSample(features.float(), probs, top.long())
        with torch.inference_mode():
            out = self.runner.forward(self.runner.new_cache(len(ids)), ids, hidden_layers=self.layers)
            features = torch.cat([out.layer_states[i] for i in self.layers], dim=-1)[:-1]  # positions 0 .. len - 2
            logits = out.logits[1:]  # positions 1 .. len - 1: the distribution of the token after next
            probs = torch.softmax(logits, dim=-1)[:, self.draft_ids]
            top = logits.argmax(-1)
        if key is not None and self.cache_top > 0:
            values, index = probs.topk(min(self.cache_top, probs.shape[-1]), dim=-1)
            self._cache[key] = (features.to(torch.bfloat16), index.to(torch.int16 if len(self.draft_ids) < 2**15 else torch.int32),
                                values.to(torch.bfloat16), top.to(torch.int32))
            return self(ids, key)
        return TargetSample(features.clone(), probs.clone(), top.clone())


def answer_start(record: dict) -> int:
    """The first position whose prediction (token t + 2) is an answer token: training and
    evaluation count these, what drafting will face (the prompt is context only)."""
    return max(0, len(record["prompt_ids"]) - 2) if record.get("answer_ids") else 0


def sequence_losses(head: nn.Module, sample: TargetSample, ids: list[int], depth: int, start: int = 0):
    """Per draft position (EAGLE: depth; Medusa: head) (loss, correct count, positions counted)
    for one sequence, counting positions from `start`."""
    n = len(ids) - 1
    pairs = []
    for logits, shift, first in head.draft_logits(sample.features, torch.tensor(ids[1:]), depth):
        low, high = max(first, start), n - shift
        pairs.append((logits[low:high], slice(low + shift, max(low, high) + shift)))
    results = []
    for logits, rows in pairs:
        if logits.shape[0] == 0:
            results.append((logits.sum() * 0.0, 0, 0))
            continue
        loss = -(sample.probs[rows] * F.log_softmax(logits, dim=-1)).sum(-1).mean()
        correct = (head.draft_ids[logits.argmax(-1)] == sample.top[rows]).sum()
        results.append((loss, int(correct), logits.shape[0]))
    return results


def new_head(target: LoadedModel, d2t_ids: torch.Tensor, config: TrainConfig) -> nn.Module:
    """A fresh head of `config.arch` reading the target's LM head rows for the vocabulary `d2t_ids`."""
    return drafters.head_class(config.arch).fresh(target, d2t_ids, heads=config.medusa_heads, seed=config.seed)


@dataclass
class Progress:
    tokens: int = 0
    steps: int = 0
    cursor: int = 0
    epoch: int = 0
    elapsed_s: float = 0.0
    loss: float = float("nan")
    agreement: float = float("nan")


def train_head(
    target: LoadedModel,
    records: list[dict],
    out: Path,
    config: TrainConfig,
    *,
    resume: bool = False,
    init: Path | None = None,
    on_progress: Callable[[Progress], None] = lambda p: None,
) -> dict[str, Any]:
    """Train (or resume training) a head of `config.arch` on `records` ({"id", "prompt_ids",
    "answer_ids"}), write it to `out` and return the report (also written as report.json).
    init: a head directory to start from (its weights and draft vocabulary) instead of fresh
    weights; a resumed run ignores it (its checkpoint holds the weights)."""
    family = drafters.head_class(config.arch)  # ConfigError for an unknown one
    if config.loss_on not in LOSS_ON:
        raise ConfigError(f"loss_on must be one of {', '.join(LOSS_ON)}, got {config.loss_on!r}")
    out.mkdir(parents=True, exist_ok=True)
    checkpoint_path = out / CHECKPOINT_FILE
    # Fixed-text records only train: the held-out split measures what drafting faces, answers.
    held_out = lambda r: r.get("kind") != "text" and split_of(r["id"], config.validation_fraction) == "validation"  # noqa: E731
    train_ids = [r for r in records if not held_out(r)]
    validation = [r for r in records if held_out(r)]
    if not train_ids:
        raise ConfigError("no training sequences (every record fell in the validation split)")
    sequence = lambda r: (r["prompt_ids"] + r.get("answer_ids", []))[: config.max_seq_len]  # noqa: E731
    order = list(range(len(train_ids)))
    random.Random(config.seed).shuffle(order)
    torch.manual_seed(config.seed)

    progress = Progress()
    if resume and checkpoint_path.is_file():
        saved = torch.load(checkpoint_path, weights_only=False)
        ours = asdict(config)
        differ = {k: v for k, v in saved["config"].items() if k not in BUDGET_FIELDS and ours.get(k) != v}
        if differ:
            raise ConfigError(f"{checkpoint_path} was written with other settings: {differ}")
        d2t_ids = saved["d2t_ids"]
        head = new_head(target, d2t_ids, config)
        head.load_state_dict(saved["head"])
        progress = Progress(**saved["progress"])
        coverage = saved["coverage"]
    elif init is not None:
        start_from = family.load(init, target)
        d2t_ids = start_from.draft_ids
        if len(d2t_ids) != config.draft_vocab_size:
            raise ConfigError(f"--init head has a draft vocabulary of {len(d2t_ids)}; this run asks for {config.draft_vocab_size}")
        counts = Counter(token for r in train_ids for token in sequence(r))
        kept = set(d2t_ids.tolist())
        coverage = sum(c for t, c in counts.items() if t in kept) / max(1, sum(counts.values()))
        head = new_head(target, d2t_ids, config)
        head.load_state_dict(start_from.state_dict())
        saved = None
    else:
        d2t_ids, coverage = draft_vocabulary([sequence(r) for r in train_ids], config.draft_vocab_size,
                                             target.backend.vocab_size)
        head = new_head(target, d2t_ids, config)
        saved = None
    head.train()
    optimizer = torch.optim.AdamW(head.parameters(), lr=config.lr, weight_decay=0.0)
    if saved is not None:
        optimizer.load_state_dict(saved["optimizer"])
    view = TargetView(target, head.view_layers(target), head.draft_ids, config.cache_top)

    def checkpoint() -> None:
        state = {"config": asdict(config), "d2t_ids": d2t_ids, "coverage": coverage, "head": head.state_dict(),
                 "optimizer": optimizer.state_dict(), "progress": asdict(progress)}
        partial = checkpoint_path.with_suffix(".tmp")
        torch.save(state, partial)
        partial.replace(checkpoint_path)  # a kill mid-write leaves the previous checkpoint whole

    start = time.monotonic() - progress.elapsed_s
    last_checkpoint = time.monotonic()
    positions = head.draft_positions(config.ttt_steps)
    weights = [DEPTH_WEIGHT ** j for j in range(positions)]

    def out_of_budget() -> bool:
        progress.elapsed_s = time.monotonic() - start
        return ((config.max_tokens is not None and progress.tokens >= config.max_tokens)
                or (config.max_time is not None and progress.elapsed_s >= config.max_time))

    while not out_of_budget():
        # One optimizer step over `batch_sequences` sequences, in the seeded order, epoch after epoch.
        optimizer.zero_grad(set_to_none=True)
        total_loss, correct, counted = 0.0, 0, 0
        for _ in range(config.batch_sequences):
            if progress.cursor >= len(order):
                progress.cursor, progress.epoch = 0, progress.epoch + 1
            index = order[progress.cursor]
            record = train_ids[index]
            ids = sequence(record)
            progress.cursor += 1
            if len(ids) < positions + 2:
                continue
            first = answer_start(record) if config.loss_on == "answers" else 0
            # Keyed by the record's place in the training list: ids may repeat.
            results = sequence_losses(head, view(ids, str(index)), ids, config.ttt_steps, min(first, len(ids) - 2))
            loss = sum(w * r[0] for w, r in zip(weights, results)) / config.batch_sequences
            loss.backward()
            total_loss += float(loss.detach())
            correct, counted = correct + results[0][1], counted + results[0][2]
            progress.tokens += len(ids)
        for group in optimizer.param_groups:
            group["lr"] = config.lr * min(1.0, (progress.steps + 1) / config.warmup_steps)
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        optimizer.step()
        progress.steps += 1
        progress.loss = total_loss
        progress.agreement = correct / max(counted, 1)
        on_progress(progress)
        if time.monotonic() - last_checkpoint >= config.checkpoint_every_s:
            checkpoint()
            last_checkpoint = time.monotonic()

    checkpoint()
    head.eval()
    # None where nothing is held out (fixed text only, or too few answers): nothing to measure on.
    agreement = evaluate(head, view, [(sequence(r), answer_start(r)) for r in validation[: config.max_validation_sequences]],
                         config.ttt_steps) if validation else None
    head.config.training.update({
        "sequences": len(train_ids), "tokens": progress.tokens, "steps": progress.steps,
        "epochs": round(progress.epoch + progress.cursor / len(order), 3), "seconds": round(progress.elapsed_s),
        "arch": config.arch, "ttt_steps": config.ttt_steps, "draft_vocab_coverage": round(coverage, 4), "seed": config.seed,
        "validation_agreement": agreement,
    })
    head.save(out)
    report = {"target": target.name, "weight_format": target.backend.weight_format, **head.config.training,
              "validation_sequences": min(len(validation), config.max_validation_sequences),
              "head_bytes": (out / "model.safetensors").stat().st_size}
    (out / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return report


@torch.no_grad()
def evaluate(head: nn.Module, view: TargetView, sequences: list[tuple[list[int], int]],
             depth: int) -> list[float]:
    """Top-1 agreement with the target per draft position (EAGLE: the (j + 1)-th drafted token,
    the earlier ones right; Medusa: head j), over (sequence, first position counted) pairs: the
    answer positions of held-out records."""
    positions = head.draft_positions(depth)
    correct, counted = [0] * positions, [0] * positions
    for ids, start in sequences:
        if len(ids) < positions + 2:
            continue
        for j, (_, c, n) in enumerate(sequence_losses(head, view(ids), ids, depth, min(start, len(ids) - 2))):
            correct[j] += c
            counted[j] += n
    return [round(c / n, 4) if n else float("nan") for c, n in zip(correct, counted)]
