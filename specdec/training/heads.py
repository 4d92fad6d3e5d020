"""Training draft heads (EAGLE, Medusa) on the target's own view of text.

For each training sequence the target runs one prefill pass (the same backend and weights the
head will draft for) and gives, at every position t, its hidden states at the head's
`target_layers` and its next-token distribution. The head learns, at position t, from the
target's states at t and token t + 1, to match the target's distribution at t + 1 (the token
after next), restricted to the draft vocabulary: soft cross-entropy, as EAGLE-3 does.

Training-time test: drafting k tokens, the head reads its own output state in place of the
target's from the second token on, attending to its own earlier drafted entries. Training
unrolls EAGLE's option `ttt_steps` such depths: at depth j, position t reads the depth j - 1
output at t - 1, and attends to the depth-0 entries up to t - j plus one entry of each depth
1 .. j (the ones a draft of j + 1 tokens would have written). Depth j's loss is weighted 0.8^j.

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

import hashlib
import json
import math
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from specdec import kernels
from specdec import methods as registry
from specdec.errors import ConfigError
from specdec.models.backend import cpu_multiplies_bfloat16
from specdec.models.loader import LoadedModel
from specdec.models.runner import ModelRunner
from specdec.training.corpus import split_of

CHECKPOINT_FILE = "checkpoint.pt"
REPORT_FILE = "report.json"
LOG_FILE = "log.jsonl"
VIEWS_DIR = "views"
DEPTH_WEIGHT = 0.8
# A resumed run may change its budget (to train longer) and the machine it runs on; every other
# setting must be the same.
BUDGET_FIELDS = ("max_tokens", "max_time", "checkpoint_every_s")
MACHINE_FIELDS = ("device", "bf16")
LOSS_ON = ("answers", "all")
BF16 = ("auto", "on", "off")


@dataclass(frozen=True)
class TrainConfig:
    """A training run's settings. `arch` names the head family (:data:`specdec.methods.HEADS`)
    and `head_options` are that family's own options (its :class:`~specdec.methods.TrainOptions`
    subclass; None: its defaults), which reach only its head; options of another family are
    refused. The rest is every family's."""

    arch: str = registry.DEFAULT_HEAD
    head_options: registry.TrainOptions | None = None
    draft_vocab_size: int = 8192
    lr: float = 1e-3
    warmup_steps: int = 20
    final_lr_fraction: float = 0.1  # with a token budget, the rate falls along a cosine to this fraction of lr
    batch_sequences: int = 16  # at most this many sequences a step ...
    batch_tokens: int = 4096  # ... and this many tokens, padding included
    max_seq_len: int = 512
    max_tokens: int | None = None
    max_time: float | None = None
    seed: int = 0
    checkpoint_every_s: float = 120.0
    validate_every_s: float = 900.0  # held-out agreement in the run's log, at a checkpoint this often
    validation_fraction: float = 0.03
    max_validation_sequences: int = 64
    loss_on: str = "answers"  # "answers": positions predicting answer tokens; "all": every position
    view_top: int = 64  # the target's most likely draft tokens kept per position
    bf16: str = "auto"  # the step in bfloat16 autocast: "auto" (a GPU, or a CPU that multiplies bfloat16), "on", "off"
    device: str = "cpu"  # where the head trains ("cuda": a GPU); the target runs where it was loaded

    def __post_init__(self) -> None:
        family = registry.head_family(self.arch)  # ConfigError for an unknown one
        if self.head_options is None:
            object.__setattr__(self, "head_options", family.options())
        elif not isinstance(self.head_options, family.options):
            owners = [h.name for h in registry.HEADS.values() if isinstance(self.head_options, h.options)]
            own = f"{family.options.__name__} ({', '.join(family.keys()) or 'none'})"
            raise ConfigError(f"head_options {self.head_options!r} are {' or '.join(owners) or 'no'} heads' options; "
                              f"a {self.arch} head reads {own}")
        if self.loss_on not in LOSS_ON:
            raise ConfigError(f"loss_on must be one of {', '.join(LOSS_ON)}, got {self.loss_on!r}")
        if self.bf16 not in BF16:
            raise ConfigError(f"bf16 must be one of {', '.join(BF16)}, got {self.bf16!r}")


def saved_settings(saved: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's settings (`asdict` of its TrainConfig) as today's TrainConfig lays them out.
    A checkpoint written when the family options were fields of TrainConfig (`ttt_steps`,
    `medusa_heads`, every family's) has its family's moved into `head_options`, the others dropped."""
    settings = dict(saved)
    flat = {key: settings.pop(key) for key in registry.train_option_keys() if key in settings}
    if "head_options" not in settings:
        own = registry.head_family(settings.get("arch", registry.DEFAULT_HEAD)).keys()
        settings["head_options"] = {key: value for key, value in flat.items() if key in own}
    return settings


def learning_rate(config: TrainConfig, progress: Progress) -> float:
    """The step's rate: a linear warmup over `warmup_steps`, then, where the run has a token
    budget, a cosine from lr down to `final_lr_fraction` of it at the budget's end (a run that
    resumes with a larger budget stretches the rest of the curve); without one, lr throughout."""
    rate = config.lr * min(1.0, (progress.steps + 1) / config.warmup_steps)
    if config.max_tokens:
        done = min(1.0, progress.tokens / config.max_tokens)
        floor = config.final_lr_fraction
        rate *= floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * done))
    return rate


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
    """What the target says about one sequence of n + 1 tokens, row t for position t < n:
    features [n, F] (its states at t, bfloat16), index and values [n, top] (its `top` most likely
    tokens t + 2 as draft indices, and their probabilities; the small tail beyond them counts as
    0) and top [n] (its most likely token t + 2, a target id)."""

    features: torch.Tensor
    index: torch.Tensor
    values: torch.Tensor
    top: torch.Tensor


class ViewStore:
    """Target views on disk, appended as they are made, so that later epochs, resumed runs and
    other machines read them instead of running the target again.

    One directory: `meta.json` (what the views are of: a store made for another target, layers or
    draft vocabulary is refused), four flat files of rows (features as bfloat16, top indices as
    int16/int32, their probabilities as bfloat16, the top token as int32) and `rows.jsonl`,
    one line per sequence written after its rows: a killed run loses at most the sequence it was
    writing. A sequence is keyed by a hash of its token ids.
    """

    def __init__(self, directory: Path, meta: dict[str, Any]) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        meta_path = directory / "meta.json"
        if meta_path.is_file():
            found = json.loads(meta_path.read_text(encoding="utf-8"))
            if found != meta:
                differ = sorted(k for k in meta.keys() | found.keys() if meta.get(k) != found.get(k))
                raise ConfigError(f"{directory} holds target views made with other settings ({', '.join(differ)}); "
                                  f"remove it or train in another directory")
        else:
            meta_path.write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
        width, top = meta["feature_size"], meta["top"]
        index_dtype = np.int16 if meta["draft_vocab_size"] < 2**15 else np.int32
        # name -> (numpy dtype, values per row)
        self.columns = {"features": (np.int16, width), "index": (index_dtype, top), "values": (np.int16, top),
                        "top": (np.int32, 1)}
        self.rows: dict[str, tuple[int, int]] = {}
        self.length = 0
        rows_path = directory / "rows.jsonl"
        if rows_path.is_file():
            lines = rows_path.read_text(encoding="utf-8").split("\n")
            for line in lines:
                try:
                    entry = json.loads(line)
                except json.JSONDecodeError:
                    break  # a line cut by a kill, and whatever was written after it
                self.rows[entry["key"]] = (entry["start"], entry["rows"])
                self.length = entry["start"] + entry["rows"]
            rows_path.write_text("".join(json.dumps({"key": k, "start": a, "rows": n}) + "\n"
                                         for k, (a, n) in self.rows.items()), encoding="utf-8")
        for name, (dtype, per_row) in self.columns.items():
            path = directory / f"{name}.bin"
            with path.open("ab") as handle:  # rows past the last whole sequence: a kill's leftovers
                handle.truncate(self.length * per_row * np.dtype(dtype).itemsize)

    @staticmethod
    def key(ids: list[int]) -> str:
        return hashlib.sha1(np.asarray(ids, dtype=np.int64).tobytes()).hexdigest()[:24]

    def __contains__(self, key: str) -> bool:
        return key in self.rows

    def nbytes(self) -> int:
        return sum((self.directory / f"{name}.bin").stat().st_size for name in self.columns)

    def put(self, key: str, sample: TargetSample) -> None:
        n = sample.top.shape[0]
        arrays = {"features": sample.features.view(torch.int16), "index": sample.index, "values": sample.values.view(torch.int16),
                  "top": sample.top}
        for name, (dtype, _) in self.columns.items():
            with (self.directory / f"{name}.bin").open("ab") as handle:
                handle.write(arrays[name].contiguous().numpy().astype(dtype, copy=False).tobytes())
        with (self.directory / "rows.jsonl").open("a", encoding="utf-8") as handle:
            handle.write(json.dumps({"key": key, "start": self.length, "rows": n}) + "\n")
        self.rows[key] = (self.length, n)
        self.length += n

    def get(self, key: str) -> TargetSample:
        start, n = self.rows[key]
        out = {}
        for name, (dtype, per_row) in self.columns.items():
            size = np.dtype(dtype).itemsize
            raw = np.fromfile(self.directory / f"{name}.bin", dtype=dtype, count=n * per_row, offset=start * per_row * size)
            out[name] = torch.from_numpy(raw).view(n, per_row)
        return TargetSample(out["features"].view(torch.bfloat16), out["index"].long(), out["values"].view(torch.bfloat16),
                            out["top"][:, 0].long())


def draft_distribution(logits: torch.Tensor, draft_ids: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What a view keeps of the target's distributions (logits [positions, vocab]): the most
    likely token of the vocabulary, and the k most likely draft tokens (positions in `draft_ids`,
    best first) with their probabilities under the softmax over the whole vocabulary. specdec's
    kernel where it runs (one pass a row for each, where PyTorch's softmax, gather and top-k each
    go over the whole matrix), else the same in PyTorch."""
    if logits.device.type == "cpu" and kernels.available():
        return kernels.draft_distribution(logits.contiguous(), draft_ids.cpu(), k)
    chosen, index = logits[:, draft_ids.to(logits.device)].topk(k, dim=-1)
    return logits.argmax(-1), index, torch.exp(chosen - torch.logsumexp(logits, dim=-1, keepdim=True))


class TargetView:
    """The target's view of sequences: one prefill pass each, kept in `store` when there is one.

    A sample is always the compressed one (states in bfloat16, the `top` most likely draft
    tokens' probabilities), whether just made or read back, so that a resumed run trains on
    exactly what an uninterrupted one did.
    """

    def __init__(self, target: LoadedModel, layers: tuple[int, ...], draft_ids: torch.Tensor, top: int = 64,
                 store: ViewStore | None = None) -> None:
        self.runner = ModelRunner(target)
        self.layers = layers
        self.draft_ids = draft_ids.cpu()
        self.top = min(top, len(draft_ids))
        self.store = store

    @staticmethod
    def meta(target: LoadedModel, layers: tuple[int, ...], draft_ids: torch.Tensor, top: int) -> dict[str, Any]:
        """What a store of these views must agree on."""
        return {"target": target.name, "weight_format": target.backend.weight_format, "layers": list(layers),
                "feature_size": len(layers) * target.backend.hidden_size, "draft_vocab_size": len(draft_ids),
                "draft_vocab": hashlib.sha1(draft_ids.cpu().numpy().astype(np.int64).tobytes()).hexdigest()[:16],
                "top": min(top, len(draft_ids))}

    def stored(self, ids: list[int], start: int = 0) -> str | None:
        """The store's key of a view of `ids` that serves rows from `start` on, if it holds one:
        a whole view serves any start; one made from a start serves that start only."""
        if self.store is None:
            return None
        whole = ViewStore.key(ids)
        if whole in self.store:
            return whole
        partial = f"{whole}@{start}"
        return partial if start and partial in self.store else None

    def __call__(self, ids: list[int], start: int = 0) -> TargetSample:
        """The view of `ids`. With `start`, the target's distributions are made for rows start ..
        only (the rows a loss counted from there reads; the LM head and the distributions skip
        the prompt), the rows before it filled with zeros and a top token of -1; the features
        are every row's."""
        if len(ids) < 2:
            raise ValueError("a view needs at least 2 tokens (its rows predict the token after next)")
        if not 0 <= start <= len(ids) - 2:
            raise ValueError(f"start {start} is past the last row of a {len(ids)}-token view")
        key = self.stored(ids, start)
        if key is not None:
            return self.store.get(key)
        rows = len(ids) - 1
        with torch.inference_mode():
            out = self.runner.forward(self.runner.new_cache(len(ids)), ids, hidden_layers=self.layers,
                                      last_logits=rows - start)
            features = torch.cat([out.layer_states[i] for i in self.layers], dim=-1)[:-1]  # positions 0 .. len - 2
            # positions start + 1 .. len - 1: the distribution of the token after next for rows start ..
            logits = out.logits[-(rows - start):].float()
            top, index, values = draft_distribution(logits, self.draft_ids, self.top)
            if start:
                top = torch.cat([top.new_full((start,), -1), top])
                index = torch.cat([index.new_zeros(start, index.shape[1]), index])
                values = torch.cat([values.new_zeros(start, values.shape[1]), values])
            sample = TargetSample(features.to(torch.bfloat16).cpu(), index.cpu(), values.to(torch.bfloat16).cpu(),
                                  top.cpu())
        if self.store is not None:
            self.store.put(ViewStore.key(ids) + (f"@{start}" if start else ""), sample)
        return sample


def answer_start(record: dict) -> int:
    """The first position whose prediction (token t + 2) is an answer token: training and
    evaluation count these, what drafting will face (the prompt is context only)."""
    return max(0, len(record["prompt_ids"]) - 2) if record.get("answer_ids") else 0


def counted_from(record: dict, ids: list[int], answers: bool) -> int:
    """The first row of `ids` (the record's sequence) a loss counts: its answer's (`answer_start`)
    where only answers count, else 0; never past the sequence's last row."""
    return max(0, min(answer_start(record) if answers else 0, len(ids) - 2))


def batch_losses(head: nn.Module, samples: list[TargetSample], sequences: list[list[int]], starts: list[int],
                 options: registry.TrainOptions) -> list[tuple[torch.Tensor, int, int]]:
    """Per draft position (EAGLE: depth; Medusa: head) (mean loss, correct count, positions
    counted) over a batch of sequences, counting sequence b's positions from starts[b]; `options`
    are the head family's own (:class:`~specdec.methods.TrainOptions`).

    The sequences run as one padded batch (a shorter one padded at its end: no position reads a
    later one), and the draft vocabulary's logits are made only at the positions counted: the
    soft cross-entropy against the target's top probabilities, from the log-sum-exp and the
    logits at those top tokens."""
    lengths = torch.tensor([len(ids) - 1 for ids in sequences])
    count, width = len(sequences), int(lengths.max())
    features = torch.zeros(count, width, samples[0].features.shape[-1])
    tokens = torch.zeros(count, width, dtype=torch.long)
    index = torch.zeros(count, width, samples[0].index.shape[-1], dtype=torch.long)
    values = torch.zeros(count, width, samples[0].values.shape[-1])
    top = torch.full((count, width), -1, dtype=torch.long)
    for b, (sample, ids) in enumerate(zip(samples, sequences)):
        n = len(ids) - 1
        features[b, :n], tokens[b, :n] = sample.features, torch.tensor(ids[1:])
        index[b, :n], values[b, :n], top[b, :n] = sample.index, sample.values, sample.top
    device = head.draft_ids.device
    features, tokens, index, values, top = (x.to(device) for x in (features, tokens, index, values, top))
    lengths, begin = lengths.to(device), torch.tensor(starts, device=device)
    t = torch.arange(width, device=device)[None]
    results = []
    offset, entries = head.draft_states(features, tokens, begin, options)
    for states, shift, first, score in entries:
        rows, cols = ((t >= begin.clamp(min=first)[:, None]) & (t < (lengths - shift)[:, None])).nonzero(as_tuple=True)
        if len(rows) == 0:
            results.append((states.sum() * 0.0, 0, 0))
            continue
        logits = score(states[rows, cols - offset[rows]]).float()  # [counted, draft_vocab]
        p, at = values[rows, cols + shift], index[rows, cols + shift]
        loss = (p.sum(-1) * logits.logsumexp(-1) - (p * logits.gather(1, at)).sum(-1)).mean()
        correct = (head.draft_ids[logits.argmax(-1)] == top[rows, cols + shift]).sum()
        results.append((loss, int(correct), len(rows)))
    return results


def training_device(name: str) -> torch.device:
    """The device a head trains on; ConfigError for one this machine does not have."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"--device {name}: train on cpu or cuda") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {name}: no CUDA GPU here (torch.cuda.is_available() is False); train on cpu")
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"--device {name}: train on cpu or cuda")
    return device


def epoch_batches(lengths: list[int], epoch: int, seed: int, max_sequences: int, max_tokens: int) -> list[list[int]]:
    """The batches of one epoch, the same for a seed and epoch on every run: indices shuffled,
    sorted by length within windows of a few batches (little padding), cut into batches of at
    most `max_sequences` sequences and `max_tokens` padded tokens, and the batches shuffled."""
    rng = random.Random(seed * 1_000_003 + epoch)
    order = list(range(len(lengths)))
    rng.shuffle(order)
    window = max_sequences * 16
    batches: list[list[int]] = []
    for begin in range(0, len(order), window):
        part = sorted(order[begin : begin + window], key=lambda i: lengths[i])
        batch: list[int] = []
        for i in part:
            if batch and (len(batch) == max_sequences or (len(batch) + 1) * lengths[i] > max_tokens):
                batches.append(batch)
                batch = []
            batch.append(i)
        batches.append(batch)
    rng.shuffle(batches)
    return batches


def compact_optimizer(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state with Adam's moments in bfloat16, a third of the checkpoint instead of
    two thirds. The live moments are rounded the same way first, so that the run goes on from
    exactly what a resumed one loads (loading casts them back to float32)."""
    for state in optimizer.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            if key in state:
                state[key].copy_(state[key].to(torch.bfloat16))
    saved = optimizer.state_dict()
    saved["state"] = {i: {k: v.to(torch.bfloat16) if k in ("exp_avg", "exp_avg_sq") else v for k, v in entry.items()}
                      for i, entry in saved["state"].items()}
    return saved


def new_head(target: LoadedModel, d2t_ids: torch.Tensor, config: TrainConfig) -> nn.Module:
    """A fresh head of `config.arch` reading the target's LM head rows for the vocabulary
    `d2t_ids`, built with the family's own options."""
    return registry.head_class(config.arch).fresh(target, d2t_ids, config.head_options, seed=config.seed)


@dataclass
class Progress:
    tokens: int = 0
    steps: int = 0
    cursor: int = 0  # the next batch of the epoch
    epoch: int = 0
    elapsed_s: float = 0.0
    loss: float = float("nan")
    agreement: float = float("nan")
    view_tokens: int = 0  # tokens the target's views were made for (this run and earlier ones)
    view_s: float = 0.0
    step_s: float = 0.0
    phase: str = "views"  # "views", then "train"


@dataclass
class Run:
    """What the steps of :func:`train_head` share: the settings and output directory, the head and
    its optimizer, the draft vocabulary (and the fraction of the training tokens it covers), what
    trained the starting head (--init), the target's views, the progress, and when the whole run
    began (resumes included: the budget's clock)."""

    config: TrainConfig
    out: Path
    device: torch.device
    head: nn.Module
    optimizer: torch.optim.Optimizer
    d2t_ids: torch.Tensor
    coverage: float
    prior: dict[str, Any]
    view: TargetView
    autocast: bool
    progress: Progress
    began: float

    def out_of_budget(self) -> bool:
        config, progress = self.config, self.progress
        progress.elapsed_s = time.monotonic() - self.began
        return ((config.max_tokens is not None and progress.tokens >= config.max_tokens)
                or (config.max_time is not None and progress.elapsed_s >= config.max_time))

    def checkpoint(self) -> None:
        """The run's state to out/checkpoint.pt, through a temporary file: a kill mid-write leaves
        the previous checkpoint whole."""
        state = {"config": asdict(self.config), "d2t_ids": self.d2t_ids, "coverage": self.coverage,
                 "head": self.head.state_dict(), "optimizer": compact_optimizer(self.optimizer),
                 "progress": asdict(self.progress), "started_from": self.prior}
        path = self.out / CHECKPOINT_FILE
        partial = path.with_suffix(".tmp")
        torch.save(state, partial)
        partial.replace(path)


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
    weights; a resumed run ignores it (its checkpoint holds the weights).

    First the target's view of every sequence is made (or found) in `out/views`, then the head
    trains on batches of them; `out/log.jsonl` gets a line at every checkpoint (tokens, loss,
    training agreement, tokens/s) with the held-out agreement per draft position every
    `validate_every_s`."""
    device = training_device(config.device)
    out.mkdir(parents=True, exist_ok=True)
    train, validation = split_records(records, config)
    sequences = [training_sequence(r, config) for r in train]
    held_out = [(training_sequence(r, config), answer_start(r)) for r in validation]
    torch.manual_seed(config.seed)
    run = start_run(target, sequences, out, config, device, resume=resume, init=init)

    # 1. The target's views, made once (the budget's clock runs: they are most of a first epoch),
    #    each with the target's distributions from the first row its loss counts.
    starts = [counted_from(r, ids, config.loss_on == "answers") for r, ids in zip(train, sequences)]
    held_rows = [(ids, counted_from(r, ids, True)) for r, (ids, _) in zip(validation, held_out)]
    make_views(run, [*zip(sequences, starts), *held_rows], on_progress)
    # 2. Steps over batches of views, in the seeded order, epoch after epoch.
    batches = train_steps(run, sequences, starts, held_out, on_progress)
    # 3. The head with its history, and the report.
    return finish(run, target, sequences, held_out, batches)


def split_records(records: list[dict], config: TrainConfig) -> tuple[list[dict], list[dict]]:
    """The records trained on and the held-out ones (at most `max_validation_sequences`), split
    by a hash of each id. Fixed-text records only train: the held-out split measures what
    drafting faces, answers. ConfigError where nothing is left to train on."""
    held = lambda r: r.get("kind") != "text" and split_of(r["id"], config.validation_fraction) == "validation"  # noqa: E731
    train = [r for r in records if not held(r)]
    validation = [r for r in records if held(r)][: config.max_validation_sequences]
    if not train:
        raise ConfigError("no training sequences (every record fell in the validation split)")
    return train, validation


def training_sequence(record: dict, config: TrainConfig) -> list[int]:
    """A record's tokens as training reads them: prompt then answer, cut to `max_seq_len`."""
    return (record["prompt_ids"] + record.get("answer_ids", []))[: config.max_seq_len]


def start_run(target: LoadedModel, sequences: list[list[int]], out: Path, config: TrainConfig, device: torch.device, *,
              resume: bool, init: Path | None) -> Run:
    """The run at its start: resumed from out/checkpoint.pt where `resume` finds one (its settings
    must be this run's but for BUDGET_FIELDS and MACHINE_FIELDS), else a new optimizer over a head
    from `init` or a fresh one (its draft vocabulary the most frequent tokens of `sequences`); the
    target's views kept in out/views."""
    checkpoint_path = out / CHECKPOINT_FILE
    saved = torch.load(checkpoint_path, weights_only=False, map_location="cpu") \
        if resume and checkpoint_path.is_file() else None
    if saved is not None:
        check_resumable(saved["config"], config, checkpoint_path)
        d2t_ids, coverage, prior = saved["d2t_ids"], saved["coverage"], saved.get("started_from") or {}
        head = new_head(target, d2t_ids, config)
        head.load_state_dict(saved["head"])
        progress = Progress(**saved["progress"])
    elif init is not None:
        head, d2t_ids, coverage, prior = initial_head(target, sequences, init, config)
        progress = Progress()
    else:
        d2t_ids, coverage = draft_vocabulary(sequences, config.draft_vocab_size, target.backend.vocab_size)
        head, prior, progress = new_head(target, d2t_ids, config), {}, Progress()
    head.to(device).train()
    optimizer = torch.optim.AdamW(head.parameters(), lr=config.lr, weight_decay=0.0)
    if saved is not None:
        optimizer.load_state_dict(saved["optimizer"])
    layers = head.view_layers(target)
    store = ViewStore(out / VIEWS_DIR, TargetView.meta(target, layers, head.draft_ids, config.view_top))
    view = TargetView(target, layers, head.draft_ids, config.view_top, store)
    autocast = config.bf16 == "on" or (config.bf16 == "auto" and (
        torch.cuda.is_bf16_supported() if device.type == "cuda" else device.type == "cpu" and cpu_multiplies_bfloat16()))
    return Run(config, out, device, head, optimizer, d2t_ids, coverage, prior, view, autocast, progress,
               began=time.monotonic() - progress.elapsed_s)


def check_resumable(saved: dict[str, Any], config: TrainConfig, path: Path) -> None:
    """ConfigError unless a checkpoint's settings (`saved`, in any layout :func:`saved_settings`
    reads) are this run's, its budget and machine aside."""
    ours = asdict(config)
    differ = {k: v for k, v in saved_settings(saved).items()
              if k not in BUDGET_FIELDS + MACHINE_FIELDS and ours.get(k) != v}
    if differ:
        raise ConfigError(f"{path} was written with other settings: {differ}")


def initial_head(target: LoadedModel, sequences: list[list[int]], init: Path,
                 config: TrainConfig) -> tuple[nn.Module, torch.Tensor, float, dict[str, Any]]:
    """A head with the weights and draft vocabulary of the head in `init`, that vocabulary, the
    fraction of the training tokens it covers, and what trained that head (none for a published
    one), kept with this one's history."""
    start_from = registry.head_class(config.arch).load(init, target)
    prior = {"from": str(init), **start_from.config.training}
    d2t_ids = start_from.draft_ids
    if len(d2t_ids) != config.draft_vocab_size:
        raise ConfigError(f"--init head has a draft vocabulary of {len(d2t_ids)}; this run asks for {config.draft_vocab_size}")
    counts = Counter(token for ids in sequences for token in ids)
    kept = set(d2t_ids.tolist())
    coverage = sum(c for t, c in counts.items() if t in kept) / max(1, sum(counts.values()))
    head = new_head(target, d2t_ids, config)
    head.load_state_dict(start_from.state_dict())
    return head, d2t_ids, coverage, prior


def make_views(run: Run, rows: list[tuple[list[int], int]], on_progress: Callable[[Progress], None]) -> None:
    """The target's view of each (sequence, first row counted) that the store lacks, while the
    budget lasts."""
    progress = run.progress
    for ids, first in rows:
        if run.out_of_budget():
            break
        if len(ids) >= 2 and run.view.stored(ids, first) is None:
            began = time.monotonic()
            run.view(ids, first)
            progress.view_s += time.monotonic() - began
            progress.view_tokens += len(ids)
            on_progress(progress)


def train_steps(run: Run, sequences: list[list[int]], starts: list[int], held_out: list[tuple[list[int], int]],
                on_progress: Callable[[Progress], None]) -> int:
    """Steps over batches of the sequences (each counted from its start) until the budget is
    spent, in the seeded order of :func:`epoch_batches`, from where the progress left off; every
    `checkpoint_every_s` a checkpoint and a log line, with the held-out agreement every
    `validate_every_s`. Returns the number of batches of the last epoch."""
    config, progress = run.config, run.progress
    positions = run.head.draft_positions(config.head_options)
    lengths = [len(ids) for ids in sequences]
    usable = [i for i, n in enumerate(lengths) if n >= positions + 2]
    if not usable:
        raise ConfigError(f"no training sequence is long enough ({positions + 2} tokens) for {positions} draft positions")
    progress.phase = "train"
    batches = epoch_batches([lengths[i] for i in usable], progress.epoch, config.seed, config.batch_sequences,
                            config.batch_tokens)
    last_checkpoint = last_validation = time.monotonic()
    while not run.out_of_budget():
        if progress.cursor >= len(batches):
            progress.cursor, progress.epoch = 0, progress.epoch + 1
            batches = epoch_batches([lengths[i] for i in usable], progress.epoch, config.seed, config.batch_sequences,
                                    config.batch_tokens)
        chosen = [usable[i] for i in batches[progress.cursor]]
        progress.cursor += 1
        train_step(run, [sequences[i] for i in chosen], [starts[i] for i in chosen])
        on_progress(progress)
        if time.monotonic() - last_checkpoint >= config.checkpoint_every_s:
            run.checkpoint()
            held = None
            if held_out and time.monotonic() - last_validation >= config.validate_every_s:
                held = evaluate(run.head, run.view, held_out, config.head_options, run.autocast)
                run.head.train()
                last_validation = time.monotonic()
            log_line(run.out, progress, held)
            last_checkpoint = time.monotonic()
    return len(batches)


def train_step(run: Run, ids: list[list[int]], firsts: list[int]) -> None:
    """One optimizer step on a batch of sequences (sequence b counted from firsts[b]): draft
    position j's loss weighted DEPTH_WEIGHT^j, the step's learning rate, gradients clipped to norm 1."""
    config, progress, head = run.config, run.progress, run.head
    began = time.monotonic()
    run.optimizer.zero_grad(set_to_none=True)
    with torch.autocast(run.device.type, dtype=torch.bfloat16, enabled=run.autocast):
        results = batch_losses(head, [run.view(s, f) for s, f in zip(ids, firsts)], ids, firsts, config.head_options)
        loss = sum(DEPTH_WEIGHT ** j * r[0] for j, r in enumerate(results))
    loss.backward()
    for group in run.optimizer.param_groups:
        group["lr"] = learning_rate(config, progress)
    torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
    run.optimizer.step()
    progress.steps += 1
    progress.tokens += sum(len(s) for s in ids)
    progress.loss = float(loss.detach())
    progress.agreement = results[0][1] / max(results[0][2], 1)
    progress.step_s += time.monotonic() - began


def finish(run: Run, target: LoadedModel, sequences: list[list[int]], held_out: list[tuple[list[int], int]],
           batches: int) -> dict[str, Any]:
    """The last checkpoint and log line, the head saved to `out` with its training history
    (`config.training`: what trained it, and the head it started from), and the run's report,
    also written to out/report.json. `batches`: the number of the last epoch's."""
    config, progress, head, out = run.config, run.progress, run.head, run.out
    run.checkpoint()
    head.eval()
    # None where nothing is held out (fixed text only, or too few answers): nothing to measure on.
    agreement = evaluate(head, run.view, held_out, config.head_options, run.autocast) if held_out else None
    log_line(out, progress, agreement)
    head.config.training.update({
        "sequences": len(sequences), "tokens": progress.tokens, "steps": progress.steps,
        "distinct_tokens": sum(len(ids) for ids in sequences),
        "epochs": round(progress.epoch + progress.cursor / batches, 3), "seconds": round(progress.elapsed_s), "arch": config.arch, **config.head_options.to_dict(),
        "draft_vocab_coverage": round(run.coverage, 4), "seed": config.seed, "validation_agreement": agreement,
    })
    if run.prior:  # a head trained further (--init): its whole history, and every token it has trained on
        head.config.training.update({
            "started_from": run.prior,
            "total_tokens": progress.tokens + int(run.prior.get("total_tokens") or run.prior.get("tokens") or 0)})
    head.cpu().save(out)
    report = {"target": target.name, "weight_format": target.backend.weight_format, **head.config.training,
              "validation_sequences": len(held_out), "head_bytes": (out / "model.safetensors").stat().st_size,
              "bf16": run.autocast,
              "view_tokens_per_s": round(progress.view_tokens / progress.view_s) if progress.view_s else None,
              "train_tokens_per_s": round(progress.tokens / progress.step_s) if progress.step_s else None,
              "views_bytes": run.view.store.nbytes(), "checkpoint_bytes": (out / CHECKPOINT_FILE).stat().st_size}
    (out / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return report


def log_line(out: Path, progress: Progress, validation: list[float] | None) -> None:
    """One line of the run's log: where it is, and the held-out agreement when measured."""
    line = {"tokens": progress.tokens, "steps": progress.steps, "epoch": progress.epoch,
            "elapsed_s": round(progress.elapsed_s, 1), "loss": round(progress.loss, 4),
            "train_agreement": round(progress.agreement, 4),
            "train_tokens_per_s": round(progress.tokens / progress.step_s, 1) if progress.step_s else None}
    if validation is not None:
        line["validation_agreement"] = validation
    with (out / LOG_FILE).open("a", encoding="utf-8") as handle:
        handle.write(json.dumps(line) + "\n")


@torch.no_grad()
def evaluate(head: nn.Module, view: TargetView, sequences: list[tuple[list[int], int]],
             options: registry.TrainOptions, autocast: bool = False, batch: int = 8) -> list[float]:
    """Top-1 agreement with the target per draft position (EAGLE: the (j + 1)-th drafted token,
    the earlier ones right; Medusa: head j), over (sequence, first position counted) pairs: the
    answer positions of held-out records. `options`: the head family's own, as in training."""
    positions = head.draft_positions(options)
    correct, counted = [0] * positions, [0] * positions
    usable = [(ids, max(0, min(start, len(ids) - 2))) for ids, start in sequences if len(ids) >= positions + 2]
    for begin in range(0, len(usable), batch):
        part = usable[begin : begin + batch]
        with torch.autocast(head.draft_ids.device.type, dtype=torch.bfloat16, enabled=autocast):
            results = batch_losses(head, [view(ids, start) for ids, start in part], [ids for ids, _ in part],
                                   [start for _, start in part], options)
        for j, (_, c, n) in enumerate(results):
            correct[j] += c
            counted[j] += n
    return [round(c / n, 4) if n else float("nan") for c, n in zip(correct, counted)]
