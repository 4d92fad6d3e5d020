"""A quantized copy of a model to draft with: int8 weights, the rest shared with the original.

Every linear layer (attention, MLP and the LM head) gets an int8 copy of its weight, one scale
per output channel, run by PyTorch's dynamic int8 kernels (fbgemm). On the CPU a draft step of
SmolLM2-135M then takes about 0.6 times a float32 step. Embeddings and norms are not copied:
the draft uses the original's tensors, so the memory it adds is the int8 weights and their
scales (:func:`quantized_bytes`).

Two details keep its agreement with the original high:

- The kernels quantize their input with one scale for the whole block of rows, so a long
  block loses precision: teacher-forced over a 60-token block, SmolLM2's int8 greedy choice
  matched float32 on 37% of tokens, against 87% fed one token at a time. Each row (token) is
  therefore quantized on its own.
- Blocks longer than `full_precision_rows` (the prompt, in practice) run the original float32
  weights: the draft's cache of the prompt is then the target's own, and only drafting runs
  in int8. Any deterministic draft keeps decoding lossless; this one is just a better guess.

PyTorch marks this eager-mode API as deprecated in favour of torchao; it is still the one
whose CPU kernels run fast on the torch we pin, so it is used here and its warnings silenced.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings

import torch
from torch import nn

from specdec.errors import ConfigError
from specdec.models.hf_backend import HFBackend
from specdec.models.linear import thin_linear
from specdec.models.loader import LoadedModel
from specdec.models.native import NativeBackend
from specdec.models.qlinear import QUANTIZED_FORMATS

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from torch.ao.nn.quantized.dynamic import Linear as DynamicInt8Linear
    from torch.ao.quantization import per_channel_dynamic_qconfig

FULL_PRECISION_ROWS = 8


class Int8DraftLinear(nn.Module):
    """A linear layer that runs an int8 copy of `linear`'s weight on up to
    `full_precision_rows` rows, one row at a time, and the (shared) float weight on more."""

    def __init__(self, linear: nn.Linear, full_precision_rows: int = FULL_PRECISION_ROWS) -> None:
        super().__init__()
        self.weight = linear.weight  # shared with the original, not copied
        self.bias = linear.bias
        self.full_precision_rows = full_precision_rows
        source = nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None)
        source.weight, source.bias = linear.weight, linear.bias
        source.qconfig = per_channel_dynamic_qconfig
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.int8 = DynamicInt8Linear.from_float(source)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in_features] -> [..., out_features]
        rows = x.numel() // x.shape[-1]
        if rows > self.full_precision_rows:
            return thin_linear(x, self.weight, self.bias)
        flat = x.reshape(rows, x.shape[-1])
        if rows == 1:
            out = self.int8(flat)  # [1, out]
        else:
            out = torch.cat([self.int8(row) for row in flat.split(1)])  # [rows, out]
        return out.reshape(*x.shape[:-1], out.shape[-1])


def quantize_int8(loaded: LoadedModel, full_precision_rows: int = FULL_PRECISION_ROWS) -> LoadedModel:
    """A copy of `loaded` whose linear layers run int8; nothing else is copied.

    hf: :class:`Int8DraftLinear` layers. native: the backend's matrices repacked as int8
    (:meth:`NativeBackend.requantized`), which only pays for a target in float32 or bfloat16.
    """
    backend = loaded.backend
    if isinstance(backend, NativeBackend):
        if any(fmt in backend.weight_format for fmt in QUANTIZED_FORMATS):
            raise ConfigError(
                f"the target already runs {backend.weight_format} weights: an int8 copy of it would cost as much as "
                "the target; load the target with --dtype float32 or bfloat16, or draft with layer_skip"
            )
        return dataclasses.replace(loaded, backend=backend.requantized("int8"), name=f"{loaded.name} (int8)")
    if loaded.device.type != "cpu":
        raise ValueError("int8 dynamic quantization runs on the CPU only")
    # Copy the module tree but not the parameters: every tensor stays shared with the original.
    shared = {id(p): p for p in loaded.model.parameters()}
    shared[id(backend)] = backend
    shared.update({id(b): b for b in loaded.model.buffers()})
    model = copy.deepcopy(loaded.model, shared)
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear):
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, Int8DraftLinear(module, full_precision_rows))
    return dataclasses.replace(loaded, backend=HFBackend(model), name=f"{loaded.name} (int8)")


def quantized_bytes(loaded: LoadedModel) -> int:
    """Bytes held by the int8 linear layers of a quantized copy: weights, per-channel scales
    (and zero points, and biases on hf): what a quantized draft adds to the memory of its original."""
    if isinstance(loaded.backend, NativeBackend):
        return loaded.backend.matrix_bytes()
    model = loaded.model
    total = 0
    for module in model.modules():
        if isinstance(module, DynamicInt8Linear):
            weight, bias = module._weight_bias()
            total += weight.numel() * weight.element_size()
            if weight.qscheme() in (torch.per_channel_affine, torch.per_channel_symmetric):
                total += weight.q_per_channel_scales().numel() * 8 + weight.q_per_channel_zero_points().numel() * 8
            if bias is not None:
                total += bias.numel() * bias.element_size()
    return total
