"""Medusa: K heads on the target's last hidden state, each guessing one token further ahead.

The target's own LM head turns its normed last state at position t into token t + 1; Medusa
head i turns the same state into token t + 2 + i through one residual block,
x + SiLU(W x + b), and an LM head. So a step's draft costs K small blocks and nothing per
drafted token beyond them, but no head sees the tokens drafted before its own (EAGLE's head
does, and is the stronger drafter).

The LM head: a head trained here shares the target's LM head rows for a draft vocabulary (the
target's most frequent tokens, `d2t` as in EAGLE); Medusa's published heads each have their
own over the whole vocabulary (`medusa_head.{i}.1.weight`), and load as they are.

Files: config.json (`medusa_num_heads`, `hidden_size`, `vocab_size`, `draft_vocab_size`) and
model.safetensors (`medusa_head.{i}.0.linear.weight` / `.bias`, optionally
`medusa_head.{i}.1.weight`, and `d2t`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from specdec.drafters import head_files
from specdec.drafters.base import Drafter, Proposal, best_subtree
from specdec.drafters.head_parts import TrainableHead, check_draft_format, draft_format
from specdec.methods import MedusaTrainOptions, TreeOptions
from specdec.errors import ConfigError
from specdec.models.layer_math import rms_norm
from specdec.models.loader import LoadedModel
from specdec.models.qlinear import PackedLinear
from specdec.sampling.invariant import invariant_tokens
from specdec.sampling.params import SamplingParams
from specdec.sampling.probs import sample

if TYPE_CHECKING:
    from specdec.config import SpeculativeConfig



@dataclass(frozen=True)
class MedusaConfig:
    num_heads: int
    hidden_size: int
    vocab_size: int
    draft_vocab_size: int
    rms_norm_eps: float = 1e-5
    tied_lm_head: bool = True
    target: str = ""
    training: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"medusa_num_heads": self.num_heads, "medusa_num_layers": 1, "hidden_size": self.hidden_size,
                "vocab_size": self.vocab_size, "draft_vocab_size": self.draft_vocab_size,
                "rms_norm_eps": self.rms_norm_eps,
                "specdec": {"tied_lm_head": self.tied_lm_head, "target": self.target, "training": self.training}}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> MedusaConfig:
        try:
            ours = data.get("specdec", {})
            if int(data.get("medusa_num_layers", 1)) != 1:
                raise ValueError("only one residual block per head is supported")
            return cls(num_heads=int(data["medusa_num_heads"]), hidden_size=int(data["hidden_size"]),
                       vocab_size=int(data["vocab_size"]),
                       draft_vocab_size=int(data.get("draft_vocab_size") or data["vocab_size"]),
                       rms_norm_eps=float(data.get("rms_norm_eps", 1e-5)),
                       tied_lm_head=bool(ours.get("tied_lm_head", False)), target=str(ours.get("target", "")),
                       training=dict(ours.get("training", {})))
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"not a Medusa head config: {exc}") from None


class ResBlock(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(TrainableHead):
    """The K heads, shared by every sequence that drafts with them.

    final_norm: the target's final RMSNorm weight [hidden] (the heads read the normed state).
    lm_head_rows: the target's LM head rows for the draft vocabulary when tied.
    """

    def __init__(self, config: MedusaConfig, final_norm: torch.Tensor, d2t: torch.Tensor,
                 lm_head_rows: torch.Tensor | None = None) -> None:
        super().__init__()
        self.config = c = config
        own_lm = not c.tied_lm_head
        self.medusa_head = nn.ModuleList(
            nn.Sequential(ResBlock(c.hidden_size), *([nn.Linear(c.hidden_size, c.vocab_size, bias=False)] if own_lm else []))
            for _ in range(c.num_heads)
        )
        self.register_buffer("d2t", d2t.long())
        self.register_buffer("final_norm", final_norm.float(), persistent=False)
        if c.tied_lm_head:
            if lm_head_rows is None:
                raise ConfigError("tied Medusa heads need the target's LM head rows")
            self.register_buffer("lm_head_rows", lm_head_rows.float(), persistent=False)

    @property
    def draft_ids(self) -> torch.Tensor:
        return torch.arange(len(self.d2t), device=self.d2t.device) + self.d2t

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        """states: [n, hidden], the target's last layer output (before its final norm).
        Returns [heads, n, draft_vocab] (the whole vocabulary for untied heads)."""
        x = rms_norm(states, self.final_norm, self.config.rms_norm_eps)
        out = []
        for head in self.medusa_head:
            y = head[0](x)
            out.append(y @ self.lm_head_rows.t() if self.config.tied_lm_head else head[1](y))
        return torch.stack(out)

    def packed(self, fmt: str) -> PackedMedusa:
        """The matrices packed for drafting in `fmt`, built once and shared by every sequence."""
        cache = self.__dict__.setdefault("_packed", {})
        if fmt not in cache:
            check_draft_format(fmt, "Medusa heads")
            blocks = [head[0].linear for head in self.medusa_head]
            cache[fmt] = PackedMedusa(
                blocks=[PackedLinear.pack(b.weight, fmt) for b in blocks],
                biases=[b.bias.detach().float() for b in blocks],
                lm=[PackedLinear.pack(self.lm_head_rows, fmt)] if self.config.tied_lm_head
                else [PackedLinear.pack(head[1].weight, fmt) for head in self.medusa_head],
            )
        return cache[fmt]

    # --- training (train-draft) ----------------------------------------------------------------

    @classmethod
    def fresh(cls, target: LoadedModel, d2t_ids: torch.Tensor, options: MedusaTrainOptions, *,
              seed: int) -> MedusaHeads:
        """`options.medusa_heads` new heads tied to the target's LM head rows for the vocabulary
        `d2t_ids`, with zero residual blocks: each starts as the target's own next-token guess
        (`seed` is unused)."""
        backend = target.backend
        config = MedusaConfig(options.medusa_heads, backend.hidden_size, backend.vocab_size, len(d2t_ids),
                              float(target.config.rms_norm_eps), target=target.name)
        new = cls(config, backend.final_norm_weight(), d2t_ids - torch.arange(len(d2t_ids)),
                  backend.output_embeddings()[d2t_ids])
        with torch.no_grad():
            for param in new.parameters():
                param.zero_()
        return new

    def view_layers(self, target: LoadedModel) -> tuple[int, ...]:
        return (target.num_layers - 1,)

    def draft_positions(self, options: MedusaTrainOptions) -> int:
        return self.config.num_heads  # the head's own count (a head trained further keeps its count)

    def draft_states(self, features: torch.Tensor, tokens: torch.Tensor, begin: torch.Tensor,
                     options: MedusaTrainOptions):
        """Head i's states at position t predict row t + i (the target's distribution at t + 1 + i),
        scored by that head's LM head. features: [batch, n, hidden]; every position (offsets 0)."""
        c = self.config
        x = rms_norm(features, self.final_norm, c.rms_norm_eps)
        tied = lambda y: y @ self.lm_head_rows.t()  # noqa: E731
        offset = torch.zeros(features.shape[0], dtype=torch.long, device=features.device)
        return offset, [(head[0](x), i, 0, tied if c.tied_lm_head else head[1]) for i, head in enumerate(self.medusa_head)]

    def save(self, directory: str | Path) -> None:
        head_files.save(directory, self.config.to_json(), self.state_dict())

    @classmethod
    def load(cls, directory: str | Path, target: LoadedModel) -> MedusaHeads:
        directory, data, state = head_files.read("Medusa", directory)
        config = MedusaConfig.from_json(data)
        head_files.check_target("Medusa", directory, config.hidden_size, config.vocab_size, target)
        d2t = state.pop("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        backend = target.backend
        rows = backend.output_embeddings()[torch.arange(len(d2t)) + d2t] if config.tied_lm_head else None
        heads = cls(config, backend.final_norm_weight(), d2t, rows)
        missing, unexpected = heads.load_state_dict(state, strict=False)
        head_files.check_state("Medusa", directory, [m for m in missing if m != "d2t"], unexpected)
        return heads.eval()


@dataclass(frozen=True)
class PackedMedusa:
    blocks: list[PackedLinear]
    biases: list[torch.Tensor]
    lm: list[PackedLinear]  # one shared (tied) or one per head

    def nbytes(self) -> int:
        return sum(m.nbytes for m in self.blocks + self.lm) + sum(b.numel() * 4 for b in self.biases)


class MedusaDrafter(Drafter):
    """One sequence's Medusa drafting: the heads applied to the target's last committed state.
    tree_width > 1: a token tree (Medusa's tree of per-depth top tokens), see `_propose_tree`."""

    def __init__(self, heads: MedusaHeads, num_layers: int, weight_format: str | None = None, tree_width: int = 1,
                 tree_nodes: int | None = None) -> None:
        tree = TreeOptions(tree_width, tree_nodes)  # checks both
        self.heads = heads
        # q8 on specdec's kernels (PyTorch's int8 products leave its threads spinning on the
        # cores the next target pass needs), else int8.
        self.weight_format = weight_format or draft_format(heads.config.hidden_size)
        self.target_layers = (num_layers - 1,)
        self.tree_width, self.tree_nodes = tree_width, tree_nodes  # width 1: a chain
        self.proposal_size = tree.proposal_nodes  # the most nodes a tree keeps (0: a chain)
        self.added_memory_bytes = self.weights.nbytes()
        self._state: torch.Tensor | None = None  # [1, hidden]
        self._positions = 0

    @property
    def weights(self) -> PackedMedusa:
        # Looked up on the shared heads, never held: a copied drafter must not copy the weights.
        return self.heads.packed(self.weight_format)

    def begin(self, prompt_ids: list[int], max_len: int) -> None:
        self._state, self._positions = None, 0

    def observe_target(self, features: torch.Tensor) -> None:
        # features: [n, hidden]; only the last committed position's state is read.
        self._state = features[-1:]
        self._positions += features.shape[0]

    @torch.inference_mode()
    def propose(
        self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Proposal:
        if self._state is None or k < 1:
            return Proposal(tokens=[])
        if self._positions != len(context) - 1:
            raise RuntimeError(f"Medusa drafter has states for {self._positions} positions; the context has {len(context)} tokens")
        logits = self._logits(self._state, min(k, self.heads.config.num_heads))  # [k, draft_vocab]
        ids = self.heads.draft_ids
        if self.tree_width > 1:
            return self._propose_tree(logits)
        if params.greedy:
            return Proposal(tokens=ids[logits.argmax(-1)].tolist())
        draft_probs = torch.softmax(logits / params.temperature, dim=-1)
        full = torch.zeros(len(logits), self.heads.config.vocab_size)
        full[:, ids] = draft_probs
        if params.drafter_invariant:  # the target's noise at each position: a deterministic draft
            return Proposal(tokens=invariant_tokens(full, generator.initial_seed(), len(context)))
        indices = sample(draft_probs, generator)
        return Proposal(tokens=ids[indices].tolist(), probs=full)

    def _propose_tree(self, logits: torch.Tensor) -> Proposal:
        """A token tree from one pass of the heads: every node of depth d + 1 has the same
        candidate children, head d's top `tree_width` tokens (no head sees the tokens before its
        own). As EAGLE-2 chooses, the `tree_width` most probable nodes of each depth are
        expanded, a node scored by its path's total log-probability under the heads, and the
        `tree_nodes` best kept. Children are top tokens, deterministic: verified with one-hot
        drafts, in greedy and sampled decoding alike (the heads' own temperature would not
        change which tokens are top)."""
        width, ids = self.tree_width, self.heads.draft_ids
        top = torch.log_softmax(logits, dim=-1).topk(width, dim=-1)  # per depth: [depth, width]
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []
        frontier = [-1]
        for values, indices in zip(top.values.tolist(), top.indices.tolist()):
            level = []
            for node in frontier:
                base = 0.0 if node < 0 else scores[node]
                for value, index in zip(values, indices):
                    tokens.append(int(ids[index]))
                    parents.append(node)
                    scores.append(base + value)
                    level.append(len(tokens) - 1)
            frontier = sorted(level, key=lambda n: -scores[n])[:width]
        return best_subtree(tokens, parents, scores, self.proposal_size)

    def _logits(self, state: torch.Tensor, count: int) -> torch.Tensor:
        """state: [1, hidden] -> [count, draft_vocab], the first `count` heads; the arithmetic of
        :meth:`MedusaHeads.forward` with the packed matrices."""
        c, w = self.heads.config, self.weights
        x = rms_norm(state, self.heads.final_norm, c.rms_norm_eps)
        ys = torch.cat([x + F.silu(w.blocks[i](x).float() + w.biases[i]) for i in range(count)])  # [count, hidden]
        if len(w.lm) == 1:
            return w.lm[0](ys).float()
        return torch.cat([w.lm[i](ys[i : i + 1]).float() for i in range(count)])

    def commit(self, context: list[int], num_accepted: int) -> None:
        pass  # the committed positions' states arrive through observe_target

    def fork(self) -> MedusaDrafter:
        return MedusaDrafter(self.heads, self.target_layers[0] + 1, self.weight_format, self.tree_width,
                             self.tree_nodes)


def load_heads(config: SpeculativeConfig, target: LoadedModel) -> MedusaHeads:
    """The heads a config names (`model`: a directory), else the ones shipped for the target."""
    return MedusaHeads.load(head_files.config_dir("medusa", config, target), target)


def build(config: SpeculativeConfig, target: LoadedModel) -> MedusaDrafter:
    return MedusaDrafter(load_heads(config, target), target.num_layers, tree_width=config.tree_width,
                         tree_nodes=config.tree_nodes)
