"""The native backend: a decoder (Llama, Mistral, Qwen2/3, Gemma 3, Phi-3, SmolLM) written for decoding.

In the spirit of gpt-fast's `model.py`: the query, key and value projections are one matrix, so
are the MLP's gate and up projections; rotary tables are computed once (growing with the positions
used) and indexed per step; the mask is built once per step and shared by every layer (Gemma 3:
once per kind of layer, sliding or global); the KV cache is preallocated
(the same cache objects as the `hf` backend). Weights are :class:`~specdec.models.qlinear.PackedLinear`
in one of four formats, so a step costs about the bytes of its weights instead of float32's.

The residual stream, norms, rotary embedding and attention run in float32 whatever the weight
format; only the matrix products run in the format's kernel (int4, int8 and bfloat16 take bfloat16
activations; q4 and q8, specdec's own kernels, take float32 and quantize it per block of 32).
The embedding table stays in the file's blocks (the tied LM head's table, where they are one matrix):
a lookup dequantizes the rows it reads, bitwise the float32 rows (`qlinear.Embedding`).

Weights come from a GGUF file (:mod:`specdec.models.weights`: Q4_0/Q4_1/Q4_K, Q8_0/Q5_0/Q6_K
blocks kept exactly, other types dequantized) or from a Hugging Face directory's safetensors.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from transformers import PretrainedConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from specdec import kernels
from specdec.errors import ModelLoadError
from specdec.models.backend import ForwardOutput, causal_mask, kv_bytes_per_token, logits_kept
from specdec.models import huge_pages
from specdec.models.batch_cache import BatchCache, BatchCacheLayer
from specdec.models.cache import PreallocatedLayer
from specdec.models.layer_math import rms_norm, rope, rope_inv_freq, rotate
from specdec.models.qlinear import FORMATS, KERNEL_FORMATS, Embedding, PackedLinear, RawWeight, StackedLinear

log = logging.getLogger(__name__)

NATIVE_MODEL_TYPES = frozenset({"llama", "mistral", "phi3", "qwen2", "qwen3", "gemma3_text"})
GEMMA3 = "gemma3_text"


class WeightSource(Protocol):
    """Tensors by Hugging Face name (e.g. "model.layers.0.self_attn.q_proj.weight")."""

    def raw(self, name: str) -> RawWeight:
        """The tensor as stored: int4 or int8 groups, or float32."""

    def auto_format(self, name: str) -> str:
        """The format the tensor runs in under `auto`: its own, where a kernel takes it."""


@dataclass
class NativeLayer:
    attn_norm: torch.Tensor  # [hidden]
    qkv: PackedLinear | StackedLinear  # [(heads + 2 * kv_heads) * head_dim, hidden]
    qkv_bias: torch.Tensor | None  # Qwen2
    o: PackedLinear  # [hidden, heads * head_dim]
    q_norm: torch.Tensor | None  # Qwen3: RMSNorm over head_dim
    k_norm: torch.Tensor | None
    mlp_norm: torch.Tensor  # [hidden]
    gate_up: PackedLinear | StackedLinear  # [2 * intermediate, hidden]
    down: PackedLinear  # [hidden, intermediate]
    # Gemma 3: the attention's and the MLP's outputs normed before they join the residual stream.
    post_attn_norm: torch.Tensor | None = None
    post_mlp_norm: torch.Tensor | None = None


# Without specdec's kernels, blocks of at most this many tokens per row (a plain step, a
# verification) attend per query; a longer block (a prompt) attends in one masked pass, which is
# faster and rounds differently. With them, every block attends per query in one call a layer,
# so a prompt's positions are bitwise what decoding them one by one would give.
PER_QUERY_MAX = 32
NO_SLOTS = torch.empty(0, dtype=torch.int32)  # every query sees a prefix
# The KV cache's formats (see NativeBackend._choose_kv_dtype), and the variable that picks one for `auto`.
KV_DTYPES = {"float16": torch.float16, "float32": torch.float32}
ENV_KV_DTYPE = "SPECDEC_KV_DTYPE"

_NONE = torch.empty(0)  # a layer without Qwen2's bias or Qwen3's query and key norms, to the kernels
_PART_KINDS = {"q4": 0, "q8": 1, "f16": 2, "r8": 3}  # forward.cpp's PartKind of each kernel format


@dataclass
class Visible:
    """Per row and query of a short block, the cache slots it attends to.

    counts: [rows, new] int32, how many; slots: None where every query sees a prefix (slots
    0 .. n - 1: a plain step, a chain verification, a batch without holes), else [rows, new, L]
    int32 whose first n entries are the slots (a token tree's node sees its row's prefix and its
    ancestors)."""

    counts: torch.Tensor
    slots: torch.Tensor | None

    def per_query(self) -> list[list[int | torch.Tensor]]:
        """For PyTorch's attention: an int n for a prefix, else the slot indices."""
        counts = self.counts.tolist()
        if self.slots is None:
            return counts
        return [[self.slots[r, i, :n].long() for i, n in enumerate(row)] for r, row in enumerate(counts)]


def visible_slots(mask: torch.Tensor | None, cached: int, new: int, long_blocks: bool = False) -> Visible | None:
    """The slots each query of a block sees (see :class:`Visible`); None for a long block
    (prefill) unless `long_blocks`."""
    if new > PER_QUERY_MAX and not long_blocks:
        return None
    if mask is None:  # one row: the new tokens follow everything cached
        return Visible(torch.arange(cached + 1, cached + new + 1, dtype=torch.int32)[None], None)
    counts = mask.sum(dim=-1)[:, 0]  # [rows, new]
    slots = torch.arange(mask.shape[-1], device=mask.device)
    prefix = (mask[:, 0] == (slots < counts[..., None])).all(dim=-1)  # [rows, new]
    if bool(prefix.all()):
        return Visible(counts.to(torch.int32), None)
    # A tree: the visible slots in order, padded (a prefix query lists its prefix the same way).
    listed = torch.sort(torch.where(mask[:, 0], slots, mask.shape[-1]), dim=-1).values[..., : int(counts.max())]
    return Visible(counts.to(torch.int32), listed.clamp(max=mask.shape[-1] - 1).to(torch.int32).contiguous())


def part_tensors(matrix: PackedLinear | StackedLinear) -> list[torch.Tensor]:
    """A matrix as the kernels' one-call functions take it: its parts' packed tensors."""
    return [part.tensors["weight"] for part in matrix.parts]


def part_specs(matrices: Sequence[PackedLinear | StackedLinear]) -> list[int]:
    """Every part's (kind, outputs) of these matrices, in order, flat: what the one-call functions
    read beside the tensors (the kind tells Q5_K's q4 records from Q6_K's q8 ones, both 640 bytes)."""
    return [value for m in matrices for part in m.parts for value in (_PART_KINDS[part.fmt], part.out_features)]


class NativeBackend:
    """A Llama-family model for decoding; see the module docstring.

    weight_format: the format of every matrix (`float32`, `bfloat16`, `int8`, `int4`, or a kernel
    format, `q4` or `q8`, quantized from float where the source is not in blocks), or `auto`:
    each in the format it is stored in where a kernel takes it (GGUF Q4_0/Q4_1 as q4 and Q8_0 as
    q8 on specdec's kernels; int4 and int8 on PyTorch's where those are not built), else float32.
    """

    name = "native"

    def __init__(self, config: PretrainedConfig, weights: WeightSource, weight_format: str = "auto",
                 device: torch.device | str = "cpu", kv_dtype: str = "auto") -> None:
        if weight_format not in ("auto", *FORMATS, *KERNEL_FORMATS):
            raise ModelLoadError(f"unknown weight format {weight_format!r}; choose one of: auto, {', '.join(FORMATS)}")
        model_type = getattr(config, "model_type", "?")
        if model_type not in NATIVE_MODEL_TYPES:
            raise ModelLoadError(
                f"the native backend runs {', '.join(sorted(NATIVE_MODEL_TYPES))} models; this is a {model_type!r} "
                "model: use --backend hf"
            )
        if model_type == GEMMA3 and (getattr(config, "attn_logit_softcapping", None)
                                     or getattr(config, "final_logit_softcapping", None)):
            raise ModelLoadError("the native backend runs Gemma 3 without logit soft-capping; this model caps its "
                                 "logits: use --backend hf")
        if torch.device(device).type != "cpu":
            raise ModelLoadError("the native backend's packed kernels run on the CPU; use --backend hf on other devices")
        rope_config = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
        if model_type == "phi3" and (rope_config.get("rope_type", "default") != "default"
                                     or rope_config.get("partial_rotary_factor", 1.0) != 1.0):
            raise ModelLoadError(f"the native backend runs Phi-3 with its default rotary embedding; this one's is "
                                 f"{rope_config.get('rope_type')!r} (long-context scaling): use --backend hf")
        self.config = config
        self.model_type = model_type
        self.device = torch.device(device)
        self.num_layers = int(config.num_hidden_layers)
        self.hidden_size = int(config.hidden_size)
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(getattr(config, "num_key_value_heads", None) or self.heads)
        self.head_dim = int(getattr(config, "head_dim", None) or self.hidden_size // self.heads)
        self.vocab_size = int(config.vocab_size)
        self.eps = float(config.rms_norm_eps)
        self.gemma = model_type == GEMMA3
        # Gemma scales the query by query_pre_attn_scalar ** -0.5 (its head_dim's for the 270M).
        self.attn_scale = float(getattr(config, "query_pre_attn_scalar", None) or self.head_dim) ** -0.5 \
            if self.gemma else self.head_dim ** -0.5
        # Gemma multiplies the embedding by sqrt(hidden), rounded to float32 as its module does.
        self.embed_scale = torch.tensor(self.hidden_size ** 0.5, dtype=torch.float32) if self.gemma else None
        # Each layer's sliding window (a query sees the keys of the last `window` positions only;
        # None: all) and rotary table: one of each for Mistral and Phi-3, Gemma 3's per layer type.
        layer_types = list(getattr(config, "layer_types", None) or ["full_attention"] * self.num_layers) \
            if self.gemma else ["full_attention"] * self.num_layers
        window = getattr(config, "sliding_window", None) if model_type in ("mistral", "phi3", GEMMA3) else None
        self.windows = [int(window) if window and (not self.gemma or kind == "sliding_attention") else None
                        for kind in layer_types]
        self.rope_kinds = layer_types
        self._rotary = {kind: self._inverse_frequencies(config, kind) for kind in set(layer_types)}
        self._tables: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.kv_dtype = torch.float32
        # specdec's fused layer operations where the kernels are built (see `_norm`).
        self.fused = kernels.available()
        if weight_format == "r8" and not self.fused:
            raise ModelLoadError("--dtype r8 runs on specdec's kernels, which are not built here: "
                                 f"{kernels.missing_reason('auto')}; --dtype auto or int8 run without them")
        self._ops = kernels.load() if self.fused else None
        # The kernels' path (products, attention), read once as the products bind theirs.
        self._isa = kernels.ISAS[kernels.default_isa()] if self.fused else None
        # A short pass runs every layer in one kernel call where it can (see `_fused_layers`);
        # off, the Python loop calls the same kernels one by one (the same bits).
        self.fuse_layers = True
        self._fusable_for: tuple[object, list[bool]] = (None, [])
        self._fused_weights: dict[tuple[int, ...], object] = {}  # the kernels' LayerWeights, per set of layers
        self._weights, self._format = weights, weight_format
        self.file_types: set[str] = set()  # a GGUF file's matrix types (Q4_K, Q6_K...), else empty

        self.layers = [self._load_layer(i) for i in range(self.num_layers)]
        self.norm = self._norm_weight("model.norm.weight")
        self.lm_head = self._linear("lm_head.weight")
        # Kept as the file stores it (the tied LM head's table where they are one): a lookup
        # dequantizes its rows, so the weights in memory stay about the file's size.
        self.embed = Embedding.of(self._weights.raw("model.embed_tokens.weight"), self.lm_head)
        decoder = sorted(self._formats())
        self.weight_format = "+".join(decoder)
        if self.lm_head.fmt != self.weight_format:
            self.weight_format += f" (LM head {self.lm_head.fmt})"
        self.kernel_path = self._products_path()
        self.kv_dtype = self._choose_kv_dtype(kv_dtype)
        self.huge_page_bytes = huge_pages.place(self._matrix_tensors())
        widened = getattr(self._weights, "widened", None)
        if widened:  # a GGUF file's types that no kernel takes yet (Q5_1, Q2_K, IQ*...): said once
            log.warning("%d matrices run in float32 (4 bytes a weight), dequantized from %s: specdec's kernels "
                        "do not take that type yet", sum(widened.values()),
                        ", ".join(f"{kind} ({n})" for kind, n in sorted(widened.items())))
        del self._weights

    def _inverse_frequencies(self, config: PretrainedConfig, kind: str) -> tuple[torch.Tensor, float]:
        """A rotary table's inverse frequencies and scaling: Hugging Face's for this model (Gemma 3:
        per layer type, each with its own base)."""
        if not self.gemma:
            rotary = LlamaRotaryEmbedding(config)
            return rotary.inv_freq.float(), float(rotary.attention_scaling)
        params = (getattr(config, "rope_parameters", None) or {}).get(kind) or {}
        rope_type = params.get("rope_type", "default")
        if rope_type not in ("default", "linear"):
            raise ModelLoadError(f"the native backend runs Gemma 3 with default or linear rotary scaling; this one's "
                                 f"{kind} layers use {rope_type!r}: use --backend hf")
        dim = self.head_dim
        inv_freq = rope_inv_freq(float(params["rope_theta"]), dim)
        if rope_type == "linear":
            inv_freq = inv_freq / float(params["factor"])
        return inv_freq, 1.0

    def _rotary_table(self, kind: str, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [rows * new, head_dim] of these positions in the `kind` layers' table, which
        grows (doubling) as positions need: each entry is computed alone, so a table's size never
        changes its values (a full table of Gemma 3's 32k positions would take 134 MB)."""
        needed = int(positions.max()) + 1
        table = self._tables.get(kind)
        if table is None or table[0].shape[0] < needed:
            size = max(4096, 1 << (needed - 1).bit_length())
            inv_freq, scaling = self._rotary[kind]
            cos, sin = rope(inv_freq, torch.arange(size))  # [size, head_dim]
            table = self._tables[kind] = (cos * scaling, sin * scaling)
        flat = positions.reshape(-1)
        return table[0][flat], table[1][flat]

    def _tensor(self, name: str) -> torch.Tensor:
        raw = self._weights.raw(name)
        return raw if isinstance(raw, torch.Tensor) else raw.dequantize()

    def _norm_weight(self, name: str) -> torch.Tensor:
        """A norm's weight as it multiplies: Gemma's norms multiply by 1 + w (in float32)."""
        weight = self._tensor(name).float()
        return 1.0 + weight if self.gemma else weight

    def _linear(self, *names: str) -> PackedLinear | StackedLinear:
        """One matrix, or several fused over their outputs, in the backend's format (under `auto`,
        the file's: parts whose formats differ, as a Q4_K_M file's Q4_K query and key beside its
        Q6_K value, are stacked, each in its own)."""
        if hasattr(self._weights, "tensor_type"):  # a GGUF file: the types its matrices come in
            self.file_types.update(self._weights.tensor_type(name).name for name in names)
        raws = [self._weights.raw(name) for name in names]
        if self._format != "auto":
            return PackedLinear.pack(raws, self._format)
        formats = [self._weights.auto_format(name) for name in names]
        if len(set(formats)) > 1:
            return StackedLinear([PackedLinear.pack(raw, fmt) for raw, fmt in zip(raws, formats)])
        return PackedLinear.pack(raws, formats[0])

    def _load_layer(self, i: int) -> NativeLayer:
        prefix = f"model.layers.{i}."
        attn, mlp = prefix + "self_attn.", prefix + "mlp."
        qwen2, qwen3, phi3 = (self.model_type == kind for kind in ("qwen2", "qwen3", "phi3"))
        gemma = self.gemma
        return NativeLayer(
            attn_norm=self._norm_weight(prefix + "input_layernorm.weight"),
            # Phi-3 stores them fused already: query/key/value and gate/up, in this order.
            qkv=self._linear(*([attn + "qkv_proj.weight"] if phi3 else (attn + f"{p}_proj.weight" for p in "qkv"))),
            qkv_bias=torch.cat([self._tensor(attn + f"{p}_proj.bias") for p in "qkv"]) if qwen2 else None,
            o=self._linear(attn + "o_proj.weight"),
            q_norm=self._norm_weight(attn + "q_norm.weight") if qwen3 or gemma else None,
            k_norm=self._norm_weight(attn + "k_norm.weight") if qwen3 or gemma else None,
            mlp_norm=self._norm_weight(prefix + ("pre_feedforward_layernorm.weight" if gemma else
                                                 "post_attention_layernorm.weight")),
            gate_up=self._linear(*([mlp + "gate_up_proj.weight"] if phi3 else (mlp + "gate_proj.weight", mlp + "up_proj.weight"))),
            down=self._linear(mlp + "down_proj.weight"),
            post_attn_norm=self._norm_weight(prefix + "post_attention_layernorm.weight") if gemma else None,
            post_mlp_norm=self._norm_weight(prefix + "post_feedforward_layernorm.weight") if gemma else None,
        )

    def requantized(self, fmt: str) -> NativeBackend:
        """A copy whose matrices run in `fmt`, quantized from this backend's own; the embedding,
        norms and rotary tables are shared, not copied (the quantized self-draft)."""
        copy = object.__new__(NativeBackend)
        copy.__dict__.update(self.__dict__)
        repack = lambda linear: PackedLinear.pack(linear.dequantized(), fmt)  # noqa: E731
        copy.layers = [
            NativeLayer(layer.attn_norm, repack(layer.qkv), layer.qkv_bias, repack(layer.o), layer.q_norm,
                        layer.k_norm, layer.mlp_norm, repack(layer.gate_up), repack(layer.down),
                        layer.post_attn_norm, layer.post_mlp_norm)
            for layer in self.layers
        ]
        copy.lm_head = repack(self.lm_head)
        copy.weight_format = fmt
        copy.kernel_path = copy._products_path()
        copy.huge_page_bytes = huge_pages.place(copy._matrix_tensors())
        return copy

    def _choose_kv_dtype(self, wanted: str) -> torch.dtype:
        """The KV cache's format: `auto` ($SPECDEC_KV_DTYPE, else float16 where the kernels run
        the products and attention, as llama.cpp keeps its cache, else float32), `float16` or
        `float32`. float16 halves what attention reads (at 16 rows of 300 tokens, more than the
        weights a step) and what a cached token holds; a position's keys and values are rounded
        once, when written, and every pass reads the same rounded values, so passes stay
        bitwise alike."""
        if wanted == "auto":
            wanted = os.environ.get(ENV_KV_DTYPE, "auto")
        if wanted not in ("auto", *KV_DTYPES):
            raise ModelLoadError(f"unknown KV cache format {wanted!r} (from kv_dtype or ${ENV_KV_DTYPE}); choose one "
                                 f"of: auto, {', '.join(KV_DTYPES)}")
        if wanted == "float16" and not self.fused:
            raise ModelLoadError("a float16 KV cache needs specdec's kernels (their attention reads it), which are "
                                 f"not built here: {kernels.missing_reason('auto')}")
        if wanted == "auto":
            wanted = "float16" if self.kernel_path != "pytorch" else "float32"
        return KV_DTYPES[wanted]

    def _decoder_matrices(self) -> list[PackedLinear | StackedLinear]:
        """Every layer's query/key/value, output, gate/up and down matrices, in order."""
        return [m for layer in self.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down)]

    def _matrix_tensors(self) -> list[torch.Tensor]:
        """The tensors of every matrix a pass streams whole (the layers' and the LM head's; the
        embedding's rows are read a few at a time), for :func:`huge_pages.place`."""
        return [t for m in (*self._decoder_matrices(), self.lm_head) for part in m.parts for t in part.tensors.values()]

    def _formats(self) -> set[str]:
        """The decoder's matrices' formats (a stacked matrix's parts' each)."""
        return {fmt for lin in self._decoder_matrices() for fmt in lin.formats}

    def _products_path(self) -> str:
        """The kernels' path where any matrix runs on them (q4, q8), else `pytorch`."""
        on_kernels = (self._formats() | self.lm_head.formats) & set(KERNEL_FORMATS)
        return kernels.default_isa() if self.fused and on_kernels else "pytorch"

    @property
    def exact_blocks(self) -> bool:
        """Whether a position's keys and values are bitwise the same whatever pass computes them
        (a prompt's prefill, a part of it after a cached prefix, a step among other rows): every
        block attends per query (the kernels) and every decoder product is row-invariant (not
        float32's MKL product). What makes a prefix cache exact."""
        return self.fused and "float32" not in self._formats()

    def matrix_bytes(self) -> int:
        """Bytes of the packed matrices alone (what a requantized copy adds)."""
        return self.lm_head.nbytes + sum(m.nbytes for m in self._decoder_matrices())

    # --- the protocol ------------------------------------------------------------------------

    def weight_bytes(self) -> int:
        norms = self.norm.numel() + sum(norm.numel() for layer in self.layers for norm in (
            layer.attn_norm, layer.mlp_norm, layer.post_attn_norm, layer.post_mlp_norm, layer.q_norm, layer.k_norm)
            if norm is not None)
        return self.matrix_bytes() + self.embed.nbytes + 4 * norms

    def kv_bytes_per_token(self, layers: Sequence[int] | None = None) -> int:
        return kv_bytes_per_token(self, layers)

    def input_embeddings(self) -> torch.Tensor:
        return self.embed.full()

    def output_embeddings(self) -> torch.Tensor:
        return self.lm_head.dequantized()[: self.vocab_size]

    def final_norm_weight(self) -> torch.Tensor:
        return self.norm

    @torch.inference_mode()
    def forward(
        self,
        cache,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor | None = None,
        *,
        layers: Sequence[int] | None = None,
        last_only: bool = False,
        hidden: bool = False,
        hidden_layers: Sequence[int] = (),
        last_logits: int | None = None,
    ) -> ForwardOutput:
        rows, new = input_ids.shape
        keep = logits_kept(new, last_only, last_logits)
        cached = cache.layers[(layers or [0])[0]].get_seq_length()  # before this pass writes
        ids = list(range(self.num_layers) if layers is None else layers)
        # Per sliding window among these layers (Gemma 3 has two kinds), what each query sees.
        prefix = cache.prefix_counts(mask) if isinstance(cache, BatchCache) else None
        views = {window: self._view(mask, cached, new, positions, window, prefix)
                 for window in {self.windows[i] for i in ids}}
        x = self.embed(input_ids).view(rows * new, -1)  # [rows * new, hidden] float32
        if self.embed_scale is not None:
            x = x * self.embed_scale
        tables = {kind: self._rotary_table(kind, positions) for kind in {self.rope_kinds[i] for i in ids}}
        states: dict[int, torch.Tensor] = {}
        # Runs of layers sharing a window, a rotary table and whether the one-call forward takes
        # them (Gemma 3's sliding and global layers alternate; a Q4_K_M file's stacked projections
        # sit in some layers): a run in one call where it can, else through the loop (the same bits).
        for run in self._runs(ids):
            mask, visible = views[self.windows[run[0]]]
            cos, sin = tables[self.rope_kinds[run[0]]]
            out = None
            if visible is not None and self.fuse_layers and self._one_call()[run[0]]:
                out = self._fused_layers(cache, run, x, rows, cos, sin, visible, hidden_layers)
            if out is not None:
                x, kept = out
                states.update(kept)
                continue
            for index in run:
                layer = self.layers[index]
                attended = self._attention(layer, cache.layers[index], self._norm(x, layer.attn_norm), rows, cos, sin,
                                           mask, visible)  # [rows * new, heads * head_dim]
                if layer.post_attn_norm is None:
                    x = layer.o(attended, residual=x)
                    x = layer.down(self._silu_mul(layer.gate_up(self._norm(x, layer.mlp_norm))), residual=x)
                else:  # Gemma 3: each sublayer's output normed, then added
                    x = x + self._norm(layer.o(attended).float(), layer.post_attn_norm)
                    h = self._gelu_mul(layer.gate_up(self._norm(x, layer.mlp_norm)))
                    x = x + self._norm(layer.down(h).float(), layer.post_mlp_norm)
                if index in hidden_layers:
                    states[index] = x.view(rows, new, -1)
        x = x.view(rows, new, -1)[:, new - keep :]
        normed = self._norm(x, self.norm)  # [rows, keep, hidden]
        logits = self.lm_head(normed.view(-1, self.hidden_size)).float().view(rows, -1, self.vocab_size)
        return ForwardOutput(logits=logits, hidden=normed if hidden else None, layer_states=states or None)

    def _runs(self, ids: list[int]) -> list[list[int]]:
        """`ids` cut into runs of consecutive layers with the same window, rotary table and
        one-call eligibility."""
        one_call = self._one_call()  # (re)computed with the layers, and the runs with it
        if tuple(ids) not in self._run_cuts:
            key = lambda index: (self.windows[index], self.rope_kinds[index], one_call[index])  # noqa: E731
            runs: list[list[int]] = []
            for index in ids:
                if runs and key(index) == key(runs[-1][0]):
                    runs[-1].append(index)
                else:
                    runs.append([index])
            self._run_cuts[tuple(ids)] = runs
        return self._run_cuts[tuple(ids)]

    def _view(self, mask: torch.Tensor | None, cached: int, new: int, positions: torch.Tensor,
              window: int | None, prefix: torch.Tensor | None = None) -> tuple[torch.Tensor | None, Visible | None]:
        """What the pass's queries see in layers with this sliding window: per query slots for the
        kernels' attention (and PyTorch's per query), else a mask (a long block without kernels).
        prefix: each query's count where the mask is known to show every query a prefix (the
        batch cache's, `BatchCache.prefix_counts`): what `visible_slots` would count from it."""
        if window is not None and cached + new > window:
            mask, prefix = self._windowed(mask, cached, new, positions, window), None
        if prefix is not None and (new <= PER_QUERY_MAX or self.fused):
            return None, Visible(prefix, None)
        visible = visible_slots(mask, cached, new, long_blocks=self.fused)
        if visible is not None:
            return None, visible
        if mask is None:  # a long block (prefill) of one row: causal over the cache, built once
            mask = causal_mask(cached, new, positions.device)
        return mask, None

    @staticmethod
    def _windowed(mask: torch.Tensor | None, cached: int, new: int, positions: torch.Tensor, window: int) -> torch.Tensor:
        """The pass's mask [rows, 1, new, span] with a sliding window applied: query at position
        p sees slot s only where s > p - window (as transformers' Mistral and Gemma 3). A slot's
        index is its position for every cached token; a tree's nodes sit past the row's length,
        within any window, so their slot indices stand in for their positions."""
        if mask is None:
            mask = causal_mask(cached, new, positions.device)  # [1, 1, new, cached + new]
        slots = torch.arange(mask.shape[-1], device=mask.device)
        inside = slots[None, None, :] > positions[:, :, None] - window  # [rows, new, span]
        return mask & inside[:, None]

    def _one_call(self) -> list[bool]:
        """Per layer, whether the one-call forward takes it: the kernels built and its matrices all
        in formats `forward_layers` reads (specdec's kernel formats, stacked or not; no float ones)."""
        if self._fusable_for[0] is not self.layers:  # checked once per set of layers
            able = [self.fused and all(lin.one_call for lin in (layer.qkv, layer.o, layer.gate_up, layer.down))
                    for layer in self.layers]
            self._fusable_for = (self.layers, able)
            self._fused_weights = {}
            self._run_cuts: dict[tuple[int, ...], list[list[int]]] = {}
        return self._fusable_for[1]

    def _layer_weights(self, ids: list[int]):
        """`forward_layers`' weights for these layers (the kernels' `LayerWeights`), gathered once
        per set of layers."""
        key = tuple(ids)
        if key not in self._fused_weights:
            layers = [self.layers[i] for i in ids]
            # Each matrix as its parts' tensors, and every part's (kind, outputs) in the order
            # layer, matrix, part.
            specs = part_specs([lin for layer in layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)])
            parts = {name: [part_tensors(getattr(layer, name)) for layer in layers]
                     for name in ("qkv", "o", "gate_up", "down")}
            self._fused_weights[key] = self._ops.LayerWeights(
                [layer.attn_norm for layer in layers], parts["qkv"],
                [layer.qkv_bias if layer.qkv_bias is not None else _NONE for layer in layers],
                [layer.q_norm if layer.q_norm is not None else _NONE for layer in layers],
                [layer.k_norm if layer.k_norm is not None else _NONE for layer in layers],
                parts["o"], [layer.mlp_norm for layer in layers], parts["gate_up"], parts["down"],
                [layer.post_attn_norm if layer.post_attn_norm is not None else _NONE for layer in layers],
                [layer.post_mlp_norm if layer.post_mlp_norm is not None else _NONE for layer in layers],
                specs)
        return self._fused_weights[key]

    def _fused_layers(self, cache, ids: list[int], x: torch.Tensor, rows: int, cos: torch.Tensor, sin: torch.Tensor,
                      visible: Visible, hidden_layers: Sequence[int]) -> tuple[torch.Tensor, dict[int, torch.Tensor]] | None:
        """A run of layers of a short pass in one call of the kernels (`forward_layers`: the same
        kernels on the same values as the loop, so the same bits, without its Python and the
        cache's copies; Qwen2's query/key/value bias, Qwen3's and Gemma 3's query and key norms,
        Gemma's post-norms and GeGLU too); None where the cache is one it cannot write, and the loop
        runs instead. The caller sends only layers `_one_call` takes."""
        new = x.shape[0] // rows
        held = [cache.layers[i] for i in ids]
        if all(isinstance(layer, BatchCacheLayer) for layer in held):
            owner = held[0].owner
            if rows != owner.rows:
                raise ValueError(f"forward over {rows} rows but the cache has {owner.rows} active")
            row_index, slot_index = owner.write_index(new)
            keys, values = [layer.key_buf for layer in held], [layer.value_buf for layer in held]
            write_rows, write_slots = row_index.reshape(-1), slot_index.reshape(-1)
            advance = None
        elif all(isinstance(layer, PreallocatedLayer) for layer in held):
            claims = [layer.claim(rows, new, self.kv_heads, self.head_dim, self.kv_dtype) for layer in held]
            if any(claim is None for claim in claims) or len({claim[2] for claim in claims}) != 1:
                return None
            keys, values = [claim[0] for claim in claims], [claim[1] for claim in claims]
            start = claims[0][2]
            write_rows = torch.arange(rows).repeat_interleave(new)
            write_slots = torch.arange(start, start + new).repeat(rows)
            advance = held
        else:
            return None
        kept = [n for n, i in enumerate(ids) if i in hidden_layers]
        outs = self._ops.forward_layers(
            x, self._layer_weights(ids), keys, values, write_rows, write_slots, cos, sin, visible.counts,
            NO_SLOTS if visible.slots is None else visible.slots, rows, self.heads, self.kv_heads, self.eps,
            self.attn_scale, self._isa, kept, self.gemma)
        for layer in advance or ():
            layer.advance(new)
        states = {ids[n]: state.view(rows, new, -1) for n, state in zip(kept, outs[1:])}
        return outs[0], states

    # With the kernels built, RMSNorm, the rotary embedding, SiLU * up and attention over the cache
    # run fused (specdec.kernels: a few calls a layer); otherwise as PyTorch operations.

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self._ops.rms_norm(x, weight, self.eps) if self.fused else rms_norm(x, weight, self.eps)

    def _silu_mul(self, h: torch.Tensor) -> torch.Tensor:
        # h: [tokens, 2 * inter] (gate, then up) -> [tokens, inter]
        if self.fused:
            return self._ops.silu_mul(h.float())
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up

    def _gelu_mul(self, h: torch.Tensor) -> torch.Tensor:
        # h: [tokens, 2 * inter] (gate, then up) -> GELU(gate, tanh approximation) * up [tokens, inter]
        if self.fused:
            return self._ops.gelu_mul(h.float())
        gate, up = h.float().chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def _attention(self, layer: NativeLayer, cache_layer, x: torch.Tensor, rows: int, cos: torch.Tensor,
                   sin: torch.Tensor, mask: torch.Tensor | None, visible: Visible | None) -> torch.Tensor:
        # x: [rows * new, hidden] float32 (normed) -> [rows * new, heads * head_dim] float32
        new = x.shape[0] // rows
        qkv = layer.qkv(x).float()  # [rows * new, (heads + 2 kv_heads) * head_dim]
        if layer.qkv_bias is not None:
            qkv = qkv + layer.qkv_bias
        if self.fused:  # Qwen3's query and key norms too, each head normed as the kernels' rms_norm does
            q_norm, k_norm = (_NONE, _NONE) if layer.q_norm is None else (layer.q_norm, layer.k_norm)
            q, k, v = self._ops.rotary_split(qkv, cos, sin, rows, self.heads, self.kv_heads, q_norm, k_norm,
                                             self.eps)  # [rows, h, new, head_dim]
        else:
            qkv = qkv.view(rows, new, self.heads + 2 * self.kv_heads, self.head_dim).transpose(1, 2)
            q, k, v = qkv.split([self.heads, self.kv_heads, self.kv_heads], dim=1)  # [rows, h, new, head_dim]
            if layer.q_norm is not None:
                q, k = rms_norm(q, layer.q_norm, self.eps), rms_norm(k, layer.k_norm, self.eps)
            cos4, sin4 = cos.view(rows, 1, new, -1), sin.view(rows, 1, new, -1)  # [rows, 1, new, head_dim]
            q, k = rotate(q, cos4, sin4), rotate(k, cos4, sin4)
        keys, values = cache_layer.update(k.to(self.kv_dtype), v.to(self.kv_dtype))  # [rows, kv_heads, cached + new, head_dim]
        if visible is not None and self.fused:
            # Each query of each row attends alone over its row's visible slots, exactly as a
            # one-token step of that sequence alone would (specdec's kernel: one call a layer).
            slots = NO_SLOTS if visible.slots is None else visible.slots
            return self._ops.attend_cached(q, keys, values, visible.counts, slots, self.attn_scale,
                                          self._isa).view(rows * new, -1)
        gqa = self.heads != self.kv_heads
        sdpa_scale = self.attn_scale if self.gemma else None  # None: PyTorch's own 1 / sqrt(head_dim)
        if visible is not None:
            # The same with PyTorch's attention, a call per query: its activations are bitwise
            # those of plain decoding, whatever else is in the pass. A tree node's slots (its
            # row's prefix, its ancestors, itself) are gathered in order: the same keys in the
            # same order as the plain step at its position would read.
            out = torch.cat([
                torch.cat([
                    F.scaled_dot_product_attention(
                        q[r : r + 1, :, i : i + 1],
                        keys[r : r + 1, :, :seen] if isinstance(seen, int) else keys[r : r + 1, :, seen],
                        values[r : r + 1, :, :seen] if isinstance(seen, int) else values[r : r + 1, :, seen],
                        enable_gqa=gqa, scale=sdpa_scale)
                    for i, seen in enumerate(row)
                ], dim=2)
                for r, row in enumerate(visible.per_query())
            ])
        else:
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=gqa, scale=sdpa_scale)
        return out.transpose(1, 2).reshape(rows * new, self.heads * self.head_dim)

