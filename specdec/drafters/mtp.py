"""MTP: the multi-token-prediction module a checkpoint ships (DeepSeek-V3's layout).

A model trained with multi-token prediction keeps, after its last decoder layer, a module
that predicts one token further: at position t it takes the target's final (normed) state h_t
and the embedding of token t + 1, normalises each (`hnorm`, `enorm`), projects their
concatenation back to the hidden size (`eh_proj`: [2 * hidden] -> [hidden]), runs one decoder
layer of the model's own kind, and scores token t + 2 with `shared_head` (a norm and an LM
head, the target's when the checkpoint leaves it out). Drafting further feeds the module its
own output state in place of h, as vLLM does, so it is an EAGLE-like drafter that came with the
model instead of being trained after it: the drafting machinery is :class:`EagleDrafter`'s
(per-sequence KV cache, target states handed over after every pass, chains and trees).

Files: the checkpoint's config.json (`num_hidden_layers` L, `num_nextn_predict_layers` >= 1,
the layer's shapes) and safetensors holding `model.layers.{L}.*`: `enorm`, `hnorm`, `eh_proj`,
`shared_head.norm`, optionally `shared_head.head` and `embed_tokens`, and the decoder layer
(`input_layernorm`, `self_attn.{q,k,v,o}_proj`, `post_attention_layernorm`,
`mlp.{gate,up,down}_proj`). The first MTP layer drafts every position. Layers with multi-head
latent attention or experts (DeepSeek-V3's own) are refused: specdec's targets run neither.
As vLLM does, the embedding at position 0 is zeroed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from specdec.drafters.eagle import EagleDrafter, attention_mask
from specdec.drafters.head_parts import PackedHead, check_draft_format
from specdec.errors import ConfigError
from specdec.models.layer_math import rms_norm, rope, rope_inv_freq, rotate
from specdec.models.loader import LoadedModel
from specdec.models.native import Visible
from specdec.models.qlinear import PackedLinear

if TYPE_CHECKING:
    from specdec.config import SpeculativeConfig

LAYER_TENSORS = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                 "input_layernorm.weight", "post_attention_layernorm.weight",
                 *(f"self_attn.{p}_proj.weight" for p in "qkvo"),
                 *(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")))
OPTIONAL_TENSORS = ("shared_head.head.weight", "embed_tokens.weight")


@dataclass(frozen=True)
class MtpConfig:
    """The module's shapes, read from the checkpoint's config.json; `layer` is its index (L)."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    layer: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0

    # What EagleDrafter reads: the target layer whose state it takes, a full draft vocabulary.
    @property
    def target_layers(self) -> tuple[int, ...]:
        return (self.layer - 1,)

    @property
    def draft_vocab_size(self) -> int:
        return self.vocab_size

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> MtpConfig:
        if int(data.get("num_nextn_predict_layers") or 0) < 1:
            raise ConfigError("the checkpoint has no MTP module: its config.json sets no num_nextn_predict_layers")
        if data.get("kv_lora_rank") or data.get("q_lora_rank"):
            raise ConfigError("the checkpoint's MTP layer uses multi-head latent attention, which specdec does not run")
        try:
            heads = int(data["num_attention_heads"])
            return cls(
                hidden_size=int(data["hidden_size"]),
                num_heads=heads,
                num_kv_heads=int(data.get("num_key_value_heads") or heads),
                head_dim=int(data.get("head_dim") or data["hidden_size"] // heads),
                intermediate_size=int(data["intermediate_size"]),
                vocab_size=int(data["vocab_size"]),
                layer=int(data["num_hidden_layers"]),
                rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)),
                rope_theta=float(data.get("rope_theta", 10000.0)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"not a model config with an MTP module: {exc}") from None

    def to_json(self) -> dict[str, Any]:
        return {"hidden_size": self.hidden_size, "num_attention_heads": self.num_heads,
                "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim,
                "intermediate_size": self.intermediate_size, "vocab_size": self.vocab_size,
                "num_hidden_layers": self.layer, "num_nextn_predict_layers": 1,
                "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta}


class MtpHead:
    """The module's weights, shared by every sequence. `tensors` holds the layer's tensors
    named without the `model.layers.{L}.` prefix; the embedding and the LM head default to
    the target's own."""

    def __init__(self, config: MtpConfig, tensors: dict[str, torch.Tensor], target: LoadedModel) -> None:
        self.config = c = config
        missing = [name for name in LAYER_TENSORS if name not in tensors]
        unexpected = sorted(set(tensors) - set(LAYER_TENSORS) - set(OPTIONAL_TENSORS))
        if missing or unexpected:
            experts = any(".experts." in name for name in unexpected)
            raise ConfigError("the MTP layer is a mixture of experts, which specdec does not run" if experts else
                              f"the MTP layer does not have the expected tensors: missing {missing}, unexpected {unexpected}")
        self.w = {name: t.float() for name, t in tensors.items()}
        backend = target.backend
        embed, lm_rows = self.w.pop("embed_tokens.weight", None), self.w.pop("shared_head.head.weight", None)
        self.embed = embed if embed is not None else backend.input_embeddings().float()  # [vocab, hidden]
        self.lm_rows = lm_rows if lm_rows is not None else backend.output_embeddings().float()
        self.target_norm = backend.final_norm_weight().float()  # h_t is the target's normed final state
        self.d2t = torch.zeros(c.vocab_size, dtype=torch.long)  # EAGLE's draft-vocabulary offsets: the full vocabulary
        self._packed: dict[str, PackedHead] = {}
        self.inv_freq = rope_inv_freq(c.rope_theta, c.head_dim)
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        shapes = {"eh_proj.weight": (c.hidden_size, 2 * c.hidden_size), "self_attn.q_proj.weight": (q, c.hidden_size),
                  "self_attn.k_proj.weight": (kv, c.hidden_size), "self_attn.v_proj.weight": (kv, c.hidden_size),
                  "self_attn.o_proj.weight": (c.hidden_size, q),
                  "mlp.gate_proj.weight": (c.intermediate_size, c.hidden_size),
                  "mlp.up_proj.weight": (c.intermediate_size, c.hidden_size),
                  "mlp.down_proj.weight": (c.hidden_size, c.intermediate_size)}
        for name, shape in shapes.items():
            if tuple(self.w[name].shape) != shape:
                raise ConfigError(f"MTP tensor {name} has shape {tuple(self.w[name].shape)}, the config says {shape}")

    @property
    def draft_ids(self) -> torch.Tensor:
        return torch.arange(self.config.vocab_size)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope(self.inv_freq, positions)

    def packed(self, fmt: str) -> PackedHead:
        """The matrices packed for drafting in `fmt`, built once and shared."""
        cache = self._packed
        if fmt not in cache:
            check_draft_format(fmt, "an MTP module")
            w = self.w
            cache[fmt] = PackedHead(
                fc=PackedLinear.pack(w["eh_proj.weight"], fmt),
                qkv=PackedLinear.pack([w[f"self_attn.{p}_proj.weight"] for p in "qkv"], fmt),
                o=PackedLinear.pack(w["self_attn.o_proj.weight"], fmt),
                gate_up=PackedLinear.pack([w["mlp.gate_proj.weight"], w["mlp.up_proj.weight"]], fmt),
                down=PackedLinear.pack(w["mlp.down_proj.weight"], fmt),
                lm=PackedLinear.pack(self.lm_rows, fmt),
            )
        return cache[fmt]

    def save(self, directory: str | Path) -> None:
        """Write the module as a checkpoint would hold it (config.json and mtp.safetensors)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "config.json").write_text(json.dumps(self.config.to_json(), indent=2) + "\n", encoding="utf-8")
        prefix = f"model.layers.{self.config.layer}."
        save_file({prefix + name: t.contiguous() for name, t in
                   {**self.w, "shared_head.head.weight": self.lm_rows}.items()}, str(directory / "mtp.safetensors"))


def _layer_tensors(directory: Path, layer: int) -> dict[str, torch.Tensor]:
    """The tensors named `model.layers.{layer}.*` in a checkpoint directory, reading only the
    files the index names for them (a large checkpoint is many files)."""
    prefix = f"model.layers.{layer}."
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
        files = sorted({directory / f for name, f in weight_map.items() if name.startswith(prefix)})
    else:
        files = sorted(directory.glob("*.safetensors"))
    tensors = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if name.startswith(prefix):
                    tensors[name[len(prefix):]] = f.get_tensor(name)
    if not tensors:
        raise ConfigError(f"no MTP layer in {directory}: no tensor is named {prefix}*")
    return tensors


def load_mtp(directory: str | Path, target: LoadedModel) -> MtpHead:
    """The first MTP layer of the checkpoint at `directory`, for this target."""
    directory = Path(directory).expanduser()
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise ConfigError(f"no MTP module in {directory}: it needs the checkpoint's config.json and safetensors")
    config = MtpConfig.from_json(json.loads(config_path.read_text(encoding="utf-8")))
    backend = target.backend
    if (config.hidden_size, config.vocab_size, config.layer) != (backend.hidden_size, backend.vocab_size, target.num_layers):
        raise ConfigError(
            f"the MTP module at {directory} is for a model with hidden size {config.hidden_size}, vocabulary "
            f"{config.vocab_size} and {config.layer} layers; {target.name} has {backend.hidden_size}, "
            f"{backend.vocab_size} and {target.num_layers}"
        )
    return MtpHead(config, _layer_tensors(directory, config.layer), target)


class MtpDrafter(EagleDrafter):
    """One sequence's drafting with an MTP module (EagleDrafter's machinery, MTP's arithmetic)."""

    def _entry_features(self, target_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(target_states, self.head.target_norm, self.head.config.rms_norm_eps)

    def _run_at(self, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                visible: Visible) -> torch.Tensor:
        c, w, packed = self.head.config, self.head.w, self.weights
        n, eps = features.shape[0], c.rms_norm_eps
        embedded = self.head.embed[tokens] * (positions != 0)[:, None]  # vLLM zeroes position 0's
        x = packed.fc(torch.cat([rms_norm(embedded, w["enorm.weight"], eps),
                                 rms_norm(features, w["hnorm.weight"], eps)], dim=-1)).float()  # [n, hidden]
        h = rms_norm(x, w["input_layernorm.weight"], eps)
        qkv = packed.qkv(h).float().view(n, c.num_heads + 2 * c.num_kv_heads, c.head_dim).transpose(0, 1)
        q, k, v = qkv.split([c.num_heads, c.num_kv_heads, c.num_kv_heads])
        cos, sin = self.head.rope(positions)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        self._keys[:, slots] = k
        self._values[:, slots] = v
        span = int(slots.max()) + 1
        attended = F.scaled_dot_product_attention(q, self._keys[:, :span], self._values[:, :span],
                                                  attn_mask=attention_mask(visible, span),
                                                  enable_gqa=c.num_heads != c.num_kv_heads)  # [heads, n, head_dim]
        x = x + packed.o(attended.transpose(0, 1).reshape(n, -1)).float()
        gate, up = packed.gate_up(rms_norm(x, w["post_attention_layernorm.weight"], eps)).float().chunk(2, dim=-1)
        return x + packed.down(F.silu(gate) * up).float()

    def _logits(self, state: torch.Tensor) -> torch.Tensor:
        return self.weights.lm(rms_norm(state, self.head.w["shared_head.norm.weight"], self.head.config.rms_norm_eps)).float()


def mtp_dir(config: SpeculativeConfig, target: LoadedModel) -> Path:
    """The checkpoint a config names (`model`), else the target's own when it is a directory."""
    if config.model:
        return Path(config.model).expanduser()
    source = Path(target.source)
    if source.is_dir() and (source / "config.json").is_file():
        return source
    raise ConfigError(f"{target.name} was not loaded from a checkpoint directory (a GGUF file keeps no MTP layers): "
                      "set 'model' to the directory of a checkpoint whose config has num_nextn_predict_layers")


def build(config: SpeculativeConfig, target: LoadedModel) -> MtpDrafter:
    return MtpDrafter(load_mtp(mtp_dir(config, target), target), tree_width=config.tree_width,
                      tree_nodes=config.tree_nodes)
