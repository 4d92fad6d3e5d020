"""A quantized copy of a model to draft with: int8 weights, the rest shared with the original.

Every linear layer (attention, MLP and the LM head) becomes PyTorch's dynamic int8 linear:
weights stored as int8 with one scale per output channel, activations quantized per call.
On the CPU this reads a quarter of the bytes of float32 and runs fbgemm's int8 kernels, so a
step of SmolLM2-135M takes about 0.6 times a float32 step, and its greedy choice agrees with
float32 on over 90% of tokens. Embeddings and norms are not copied: the draft uses the
original's tensors, so the memory it adds is the int8 weights and their scales
(:func:`quantized_bytes`).

PyTorch marks this eager-mode API as deprecated in favour of torchao; it is still the one
whose CPU kernels run fast on the torch we pin, so it is used here and its warnings silenced.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings

import torch
from torch import nn

from specdec.models.linear import ThinLinear
from specdec.models.loader import LoadedModel

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from torch.ao.nn.quantized.dynamic import Linear as DynamicInt8Linear
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic


def quantize_int8(loaded: LoadedModel) -> LoadedModel:
    """A copy of `loaded` whose linear layers are dynamic int8; nothing else is copied."""
    if loaded.device.type != "cpu":
        raise ValueError("int8 dynamic quantization runs on the CPU only")
    # Copy the module tree but not the parameters: every tensor stays shared with the original.
    shared = {id(p): p for p in loaded.model.parameters()}
    shared.update({id(b): b for b in loaded.model.buffers()})
    model = copy.deepcopy(loaded.model, shared)
    for module in model.modules():
        if type(module) is ThinLinear:  # quantize_dynamic swaps exact nn.Linear instances
            module.__class__ = nn.Linear
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantize_dynamic(model, {nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8, inplace=True)
    return dataclasses.replace(loaded, model=model, name=f"{loaded.name} (int8)")


def quantized_bytes(model: nn.Module) -> int:
    """Bytes held by the int8 linear layers of `model`: weights, per-channel scales and
    zero points, and biases (what a quantized draft adds to the memory of its original)."""
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
