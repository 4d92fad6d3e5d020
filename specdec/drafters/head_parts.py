"""What the heads that read the target's hidden states share (EAGLE, MTP, Medusa, hybrid): a
head's matrices packed for specdec's kernels, and the base class of the heads `train-draft`
trains. A head layer's RMS norm and rotary embedding are the target's own
(:mod:`specdec.models.layer_math`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from specdec import kernels
from specdec.models.native import part_specs, part_tensors
from specdec.errors import ConfigError
from specdec.models.qlinear import FORMATS, KERNEL_FORMATS, PackedLinear

if TYPE_CHECKING:
    from specdec.methods import TrainOptions
    from specdec.models.loader import LoadedModel

TREE_SLOTS = 64  # cache slots for a tree's expanded nodes (tree_width x depth at most)


@dataclass(frozen=True)
class PackedHead:
    """The matrices of a head as the drafter multiplies them (:class:`PackedLinear`). `fc` is
    the layer's input projection: EAGLE's fusion of the target's states, an MTP layer's eh_proj."""

    fc: PackedLinear
    qkv: PackedLinear
    o: PackedLinear
    gate_up: PackedLinear
    down: PackedLinear
    lm: PackedLinear

    def nbytes(self) -> int:
        return sum(m.nbytes for m in (self.fc, self.qkv, self.o, self.gate_up, self.down, self.lm))

    def layer_parts(self) -> list | None:
        """The layer's matrices as the kernels' `head_layer` takes them (qkv, o, gate_up, down as
        lists of part tensors, then every part's (kind, outputs)); None where a matrix is in a
        format the kernels do not multiply (float32, bfloat16, int8, int4: the PyTorch path)."""
        matrices = (self.qkv, self.o, self.gate_up, self.down)
        if not all(m.one_call for m in matrices):
            return None
        return [*(part_tensors(m) for m in matrices), part_specs(matrices)]


def check_draft_format(fmt: str, what: str) -> None:
    """Refuse a format a head's matrices cannot be packed in (`what`: the head, for the message)."""
    if fmt not in (*FORMATS, *KERNEL_FORMATS):
        raise ConfigError(f"unknown weight format {fmt!r} for {what}; choose one of: {', '.join((*FORMATS, *KERNEL_FORMATS))}")


def draft_format(*in_features: int) -> str:
    """The format a head's matrices (with these input widths) are packed in for drafting: q8 on
    specdec's kernels (the layer then runs as one call), else PyTorch's int8 (no kernels, or a
    width that is not a whole number of q8's 32-input blocks)."""
    return "q8" if kernels.available() and all(n % 32 == 0 for n in in_features) else "int8"


# One draft position's training entry: its states [batch, m, ...], the shift s (target row t's
# state predicts token t + s), the first window column where it means something, and the
# function that turns states into draft logits.
DraftEntry = tuple[torch.Tensor, int, int, Callable[[torch.Tensor], torch.Tensor]]


class TrainableHead(nn.Module):
    """A head `train-draft` trains (a family in :data:`specdec.methods.HEADS`): what training
    calls of it. A family's head module defines each; the drafter that runs it reads only its
    weights. `options` is always the family's own :class:`~specdec.methods.TrainOptions`
    subclass, the only way a family's training options reach its head."""

    def draft_ids(self) -> torch.Tensor:
        """[draft_vocab] the target token of each draft token."""
        raise NotImplementedError

    @classmethod
    def fresh(cls, target: LoadedModel, d2t_ids: torch.Tensor, options: TrainOptions, *, seed: int) -> TrainableHead:
        """A new head for the target, over the draft vocabulary `d2t_ids`."""
        raise NotImplementedError

    def view_layers(self, target: LoadedModel) -> tuple[int, ...]:
        """The target layers whose outputs the head reads (what a training view keeps)."""
        raise NotImplementedError

    def draft_positions(self, options: TrainOptions) -> int:
        """How many draft positions a step trains (and evaluation measures)."""
        raise NotImplementedError

    def draft_states(self, features: torch.Tensor, tokens: torch.Tensor, begin: torch.Tensor,
                     options: TrainOptions) -> tuple[torch.Tensor, list[DraftEntry]]:
        """Over a batch of views (features [batch, n, ...], tokens [batch, n]) whose positions from
        begin [batch] on are counted: the window offsets [batch] (column c is position offset +
        c) and each draft position's :data:`DraftEntry`."""
        raise NotImplementedError

    def save(self, directory: str | Path) -> None:
        raise NotImplementedError

    @classmethod
    def load(cls, directory: str | Path, target: LoadedModel) -> TrainableHead:
        raise NotImplementedError
