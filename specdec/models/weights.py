"""Weight sources for the native backend: a GGUF file, a safetensors directory, or a state dict.

A GGUF file names tensors its own way (`blk.0.attn_q.weight`) and, for Llama models, stores the
query and key projections with their rows permuted for llama.cpp's interleaved rotary layout;
:class:`GGUFWeights` maps the names back to Hugging Face's and undoes the permutation (a row
permutation, so quantized rows move whole). Q4_0, Q4_1, Q4_K, Q5_1 and Q5_K matrices come back as
:class:`~specdec.models.qlinear.Int4Groups`, Q8_0, Q5_0, Q6_K, Q3_K, IQ4_NL and IQ4_XS as
:class:`~specdec.models.qlinear.Int8Groups`, exactly as stored (K-quants' group scales as the float32
products GGUF's dequantization computes); every other type is dequantized by the `gguf` package
to float32, the same values transformers loads (F16 matrices then run in float16 again, exactly).
"""

from __future__ import annotations

import re
from collections.abc import Container
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.quants import dequantize
from safetensors import safe_open

from specdec import kernels
from specdec.errors import ModelLoadError
from specdec.models.qlinear import (Int4Groups, Int8Groups, RawWeight, unpack_iq4_nl_blocks, unpack_iq4_xs_blocks,
                                    unpack_q3_k_blocks, unpack_q4_blocks, unpack_q4_k_blocks, unpack_q5_0_blocks,
                                    unpack_q5_1_blocks, unpack_q5_k_blocks, unpack_q6_k_blocks, unpack_q8_blocks)

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
# Gemma 3 norms its sublayers' outputs too: its four norms a layer by their GGUF names.
_GEMMA3_NAMES = {
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}
# Phi-3 stores query/key/value and gate/up fused, in Hugging Face's order, under these names.
_PHI3_NAMES = {"self_attn.qkv_proj.weight": "attn_qkv.weight", "mlp.gate_up_proj.weight": "ffn_up.weight"}
_TOP_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
              "lm_head.weight": "output.weight"}
# The format each GGUF type runs in under `--dtype auto`: its own where a kernel takes it
# (specdec's kernels where they are built, else PyTorch's int4 and int8 ones).
_AUTO_FORMAT = {GGMLQuantizationType.Q4_0: "q4", GGMLQuantizationType.Q4_1: "q4", GGMLQuantizationType.Q4_K: "q4",
                GGMLQuantizationType.Q5_K: "q4", GGMLQuantizationType.Q5_1: "q4",
                GGMLQuantizationType.Q8_0: "q8", GGMLQuantizationType.Q5_0: "q8", GGMLQuantizationType.Q6_K: "q8",
                GGMLQuantizationType.Q3_K: "q8", GGMLQuantizationType.IQ4_NL: "q8", GGMLQuantizationType.IQ4_XS: "q8",
                GGMLQuantizationType.F16: "f16", GGMLQuantizationType.BF16: "bfloat16"}
_FALLBACK_FORMAT = {"q4": "int4", "q8": "int8", "f16": "float32"}


def _runnable(fmt: str) -> str:
    """`fmt`, or PyTorch's nearest where specdec's kernels are not built."""
    return fmt if fmt not in _FALLBACK_FORMAT or kernels.available() else _FALLBACK_FORMAT[fmt]


def _dtype_format(dtype: torch.dtype | None) -> str:
    """What `auto` runs a checkpoint's matrix of this dtype in: bfloat16 and float16 as stored."""
    return {torch.bfloat16: "bfloat16", torch.float16: _runnable("f16")}.get(dtype, "float32")


def _stored(name: str, present: Container[str], tied: bool) -> str:
    """The tensor that holds `name`: a tied LM head is the embedding's table."""
    return "model.embed_tokens.weight" if name == "lm_head.weight" and name not in present and tied else name


# The block types read as groups, exactly as stored (a matrix's raw bytes, out, in -> groups).
_UNPACK = {
    GGMLQuantizationType.Q4_0: lambda raw, out, inp: unpack_q4_blocks(raw, out, inp, with_min=False),
    GGMLQuantizationType.Q4_1: lambda raw, out, inp: unpack_q4_blocks(raw, out, inp, with_min=True),
    GGMLQuantizationType.Q4_K: unpack_q4_k_blocks,
    GGMLQuantizationType.Q5_0: unpack_q5_0_blocks,
    GGMLQuantizationType.Q5_1: unpack_q5_1_blocks,
    GGMLQuantizationType.Q5_K: unpack_q5_k_blocks,
    GGMLQuantizationType.Q6_K: unpack_q6_k_blocks,
    GGMLQuantizationType.Q8_0: unpack_q8_blocks,
    GGMLQuantizationType.Q3_K: unpack_q3_k_blocks,
    GGMLQuantizationType.IQ4_NL: unpack_iq4_nl_blocks,
    GGMLQuantizationType.IQ4_XS: unpack_iq4_xs_blocks,
}


def _unpermute_rows(rows: int, heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's rotary permutation of a [heads * head_dim, in] matrix."""
    half = rows // heads // 2
    return torch.arange(rows).reshape(heads, half, 2).transpose(1, 2).reshape(rows)


class TensorReader(GGUFReader):
    """The `gguf` package's reader, told to step over the contents of metadata arrays instead of
    keeping a view of every element: a view per string of a tokenizer's 49k-262k tokens (and per
    score and type) made the plain reader's parse most of a model's load.
    The tensors and every scalar and string field read exactly as the plain reader reads them; an
    array field keeps its item type and length, not its items (the native backend reads none)."""

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list, list[int], list[GGUFValueType]]:
        if GGUFValueType(raw_type) != GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        item_type, length = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
        item, count, offs = GGUFValueType(int(item_type[0])), int(length[0]), orig_offs + 12
        if item == GGUFValueType.STRING:
            data = self.data
            for _ in range(count):  # each string: a uint64 length, then its bytes
                offs += 8 + int.from_bytes(data[offs : offs + 8].tobytes(), "little")
        elif item in self.gguf_scalar_to_np:
            offs += count * np.dtype(self.gguf_scalar_to_np[item]).itemsize
        else:  # arrays of arrays: the plain reader's walk
            return super()._get_field_parts(orig_offs, raw_type)
        return offs - orig_offs, [item_type, length], [], [GGUFValueType.ARRAY] + ([item] if count else [])


def gguf_logit_size(path: str | Path) -> int:
    """The number of logits a GGUF model gives (its output matrix's rows, or its embedding's when
    tied), from the file's tensor table alone."""
    tensors = {t.name: t for t in TensorReader(str(path)).tensors}
    matrix = tensors.get("output.weight") or tensors.get("token_embd.weight")
    if matrix is None:
        raise ModelLoadError(f"{Path(path).name} has neither output.weight nor token_embd.weight")
    return int(matrix.shape[-1])  # GGUF lists the innermost dimension first


class GGUFWeights:
    """Tensors of a GGUF file by Hugging Face name (a native backend's `WeightSource`)."""

    def __init__(self, path: str | Path, heads: int, kv_heads: int) -> None:
        self.path = Path(path)
        self.reader = TensorReader(str(self.path))
        self.tensors = {t.name: t for t in self.reader.tensors}
        field = self.reader.fields.get("general.architecture")
        self.architecture = bytes(field.parts[field.data[0]]).decode() if field else "?"
        self.heads, self.kv_heads = heads, kv_heads
        # Matrices of a type no kernel takes, dequantized to float32 under `auto`: {type: count}.
        self.widened: dict[str, int] = {}

    def gguf_name(self, name: str) -> str:
        if name in _TOP_NAMES:
            gguf = _TOP_NAMES[name]
            if gguf == "output.weight" and gguf not in self.tensors:
                return "token_embd.weight"  # tied embeddings
            return gguf
        match = _LAYER.match(name)
        names = {**_LAYER_NAMES, **{"gemma3": _GEMMA3_NAMES, "phi3": _PHI3_NAMES}.get(self.architecture, {})}
        if match and match.group(2) in names:
            return f"blk.{match.group(1)}.{names[match.group(2)]}"
        raise KeyError(name)

    def tensor_type(self, name: str) -> GGMLQuantizationType:
        return GGMLQuantizationType(int(self.tensors[self.gguf_name(name)].tensor_type))

    def auto_format(self, name: str) -> str:
        kind = self.tensor_type(name)
        fmt = _AUTO_FORMAT.get(kind, "float32")
        if fmt == "float32" and kind != GGMLQuantizationType.F32:
            self.widened[kind.name] = self.widened.get(kind.name, 0) + 1
        return _runnable(fmt)

    def raw(self, name: str) -> RawWeight:
        """The tensor as stored: int4 groups for Q4_0/Q4_1/Q4_K/Q5_1/Q5_K, int8 groups for
        Q8_0/Q5_0/Q6_K/Q3_K/IQ4_NL/IQ4_XS, else float32."""
        gguf_name = self.gguf_name(name)
        if gguf_name not in self.tensors:
            raise ModelLoadError(f"{self.path.name} has no tensor {gguf_name} ({name})")
        tensor = self.tensors[gguf_name]
        kind = GGMLQuantizationType(int(tensor.tensor_type))
        shape = [int(n) for n in reversed(tensor.shape)]  # GGUF lists the innermost dimension first
        unpack = _UNPACK.get(kind) if len(shape) == 2 else None
        if unpack is not None:
            value: RawWeight = unpack(tensor.data, shape[0], shape[1])
        else:
            value = torch.from_numpy(np.asarray(dequantize(tensor.data, kind), dtype=np.float32).reshape(shape).copy())
        if self.architecture == "llama" and (".attn_q." in gguf_name or ".attn_k." in gguf_name):
            heads = self.heads if ".attn_q." in gguf_name else self.kv_heads
            order = _unpermute_rows(shape[0], heads)
            if isinstance(value, Int4Groups):
                value = Int4Groups(value.q[order], value.d[order], value.m[order])
            elif isinstance(value, Int8Groups):
                value = Int8Groups(value.q[order], value.d[order])
            else:
                value = value[order]
        if self.architecture == "gemma3" and gguf_name.endswith("norm.weight"):
            # llama.cpp stores Gemma's norm weights as 1 + w; Hugging Face's model holds w and
            # multiplies by 1 + w (as transformers' GGUF loader, which subtracts the 1 again).
            value = value - 1
        return value


class SafetensorsWeights:
    """Tensors of a Hugging Face model directory's safetensors files (a `WeightSource`)."""

    def __init__(self, path: str | Path, tie_word_embeddings: bool) -> None:
        self.path = Path(path)
        self.files = sorted(self.path.glob("*.safetensors"))
        if not self.files:
            raise ModelLoadError(f"{self.path} has no .safetensors weights")
        self.where: dict[str, Path] = {}
        for file in self.files:
            with safe_open(file, "pt") as handle:
                for key in handle.keys():
                    self.where[key] = file
        self.tied = tie_word_embeddings
        self.dtypes: dict[str, torch.dtype] = {}

    def raw(self, name: str) -> torch.Tensor:
        name = _stored(name, self.where, self.tied)
        if name not in self.where:
            raise ModelLoadError(f"{self.path} has no tensor {name}")
        with safe_open(self.where[name], "pt") as handle:
            tensor = handle.get_tensor(name)
        self.dtypes[name] = tensor.dtype
        return tensor.float()

    def auto_format(self, name: str) -> str:
        return _dtype_format(self.dtypes.get(_stored(name, self.where, self.tied)))


class StateDictWeights:
    """Tensors of an in-memory transformers model (a `WeightSource`): tests and tools that
    build a model in memory run it natively from the same tensors."""

    def __init__(self, state_dict: dict[str, torch.Tensor], tie_word_embeddings: bool) -> None:
        self.state_dict = state_dict
        self.tied = tie_word_embeddings

    def raw(self, name: str) -> torch.Tensor:
        name = _stored(name, self.state_dict, self.tied)
        if name not in self.state_dict:
            raise ModelLoadError(f"the model has no tensor {name}")
        return self.state_dict[name].detach().float()

    def auto_format(self, name: str) -> str:
        tensor = self.state_dict.get(_stored(name, self.state_dict, self.tied))
        return _dtype_format(None if tensor is None else tensor.dtype)
