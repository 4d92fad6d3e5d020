"""EAGLE: a one-layer draft head that reads the target's own hidden states.

The head (EAGLE-3's design) predicts the token after next from what the target already
computed. At position t it takes the target's hidden states at a low, a middle and a high layer
(`target_layers`, fused by `fc`: [3 * hidden] -> [hidden]) and the embedding of token t + 1,
runs one decoder layer whose attention reads both ([2 * hidden] in), and predicts token t + 2
with a draft vocabulary: the target's most frequent tokens (`d2t` maps a draft index to a
target token id). Drafting further, the head feeds its own output state in place of the
target's, one position on, which is what training-time test teaches it to do
(`specdec.training.heads`).

Letters: position t's features are the target's states at t; its token input is token t + 1;
its output state g_t predicts token t + 2.

Per sequence the drafter keeps the head's KV cache. Entries for committed positions are built
from the target's features, which the engine hands over after every pass
(:meth:`EagleDrafter.observe_target`); entries for drafted positions sit past the committed
length and are simply overwritten next step (rollback moves a length).

Files: the EAGLE-3 layout (config.json with `draft_vocab_size` and
`eagle_config.eagle_aux_hidden_state_layer_ids`, one safetensors file with `fc`, `midlayer.*`,
`norm`, `lm_head`, `d2t`, `t2d`), so heads published for a Llama or Qwen target load as they
are. A head trained here may leave out `lm_head`: it then reads the target's own LM head
rows for its draft vocabulary (`tied_lm_head`), and ships without them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from specdec.drafters import eagle_unroll, head_files
from specdec.drafters.base import Drafter, Proposal, best_subtree
from specdec import kernels
from specdec.drafters.head_parts import TREE_SLOTS, PackedHead, TrainableHead, check_draft_format, draft_format
from specdec.errors import ConfigError
from specdec.models.layer_math import rms_norm, rope, rope_inv_freq, rotate
from specdec.models.loader import LoadedModel
from specdec.methods import EagleTrainOptions, TreeOptions
from specdec.models.native import NO_SLOTS, Visible, visible_slots
from specdec.models.qlinear import PackedLinear
from specdec.sampling.invariant import invariant_tokens
from specdec.sampling.params import SamplingParams
from specdec.sampling.probs import sample

if TYPE_CHECKING:
    from specdec.config import SpeculativeConfig

def default_target_layers(num_layers: int) -> tuple[int, ...]:
    """The low, middle and high layers EAGLE-3 reads (outputs of layers 1, L/2 - 1, L - 4: the
    inputs of layers 2, L/2 and L - 3, its convention), kept inside a small model's layers."""
    return tuple(min(max(i, 0), num_layers - 1) for i in (1, num_layers // 2 - 1, num_layers - 4))


@dataclass(frozen=True)
class EagleHeadConfig:
    """Shape of a head and what it was trained for.

    target_layers: the target layers whose outputs it reads (0-based: layer i's output).
    draft_vocab_size: tokens the head can propose; vocab_size: the target's vocabulary.
    tied_lm_head: the head scores its draft vocabulary with the target's LM head rows.
    """

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    target_layers: tuple[int, ...]
    draft_vocab_size: int
    vocab_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tied_lm_head: bool = True
    target: str = ""
    training: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def for_target(cls, target: LoadedModel, draft_vocab_size: int,
                   target_layers: tuple[int, ...] | None = None) -> EagleHeadConfig:
        config, backend = target.config, target.backend
        return cls(
            hidden_size=backend.hidden_size,
            num_heads=int(config.num_attention_heads),
            num_kv_heads=backend.kv_heads,
            head_dim=backend.head_dim,
            intermediate_size=int(config.intermediate_size),
            target_layers=target_layers or default_target_layers(backend.num_layers),
            draft_vocab_size=draft_vocab_size,
            vocab_size=backend.vocab_size,
            rms_norm_eps=float(config.rms_norm_eps),
            rope_theta=float(getattr(config, "rope_theta", 10000.0)),
            target=target.name,
        )

    def to_json(self) -> dict[str, Any]:
        """EAGLE-3's config.json, with specdec's own fields under `specdec`."""
        return {
            "architectures": ["LlamaForCausalLMEagle3"],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": 1,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i + 1 for i in self.target_layers]},
            "specdec": {"tied_lm_head": self.tied_lm_head, "target": self.target, "training": self.training},
        }

    @classmethod
    def from_json(cls, data: dict[str, Any], num_target_layers: int) -> EagleHeadConfig:
        try:
            ours = data.get("specdec", {})
            aux = (data.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
            heads = int(data["num_attention_heads"])
            return cls(
                hidden_size=int(data["hidden_size"]),
                num_heads=heads,
                num_kv_heads=int(data.get("num_key_value_heads") or heads),
                head_dim=int(data.get("head_dim") or data["hidden_size"] // heads),
                intermediate_size=int(data["intermediate_size"]),
                target_layers=tuple(i - 1 for i in aux) if aux else default_target_layers(num_target_layers),
                draft_vocab_size=int(data.get("draft_vocab_size") or data["vocab_size"]),
                vocab_size=int(data["vocab_size"]),
                rms_norm_eps=float(data.get("rms_norm_eps", 1e-5)),
                rope_theta=float(data.get("rope_theta", 10000.0)),
                tied_lm_head=bool(ours.get("tied_lm_head", False)),
                target=str(ours.get("target", "")),
                training=dict(ours.get("training", {})),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"not an EAGLE head config: {exc}") from None


class EagleLayer(nn.Module):
    """The head's decoder layer; attention takes [embedding, features] ([2 * hidden]) in, the
    residual stream is the features. Parameter names follow EAGLE-3's `midlayer`."""

    def __init__(self, c: EagleHeadConfig) -> None:
        super().__init__()
        h, q, kv = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.input_layernorm = nn.Parameter(torch.ones(h))
        self.hidden_norm = nn.Parameter(torch.ones(h))
        self.post_attention_layernorm = nn.Parameter(torch.ones(h))
        self.self_attn = nn.ModuleDict({
            "q_proj": nn.Linear(2 * h, q, bias=False), "k_proj": nn.Linear(2 * h, kv, bias=False),
            "v_proj": nn.Linear(2 * h, kv, bias=False), "o_proj": nn.Linear(q, h, bias=False),
        })
        self.mlp = nn.ModuleDict({
            "gate_proj": nn.Linear(h, c.intermediate_size, bias=False),
            "up_proj": nn.Linear(h, c.intermediate_size, bias=False),
            "down_proj": nn.Linear(c.intermediate_size, h, bias=False),
        })


class EagleHead(TrainableHead):
    """The weights of an EAGLE head, shared by every sequence that drafts with it.

    embed: the target's input embedding [vocab, hidden] (read, not trained, not saved).
    lm_head_rows: the target's LM head rows for the draft vocabulary [draft_vocab, hidden] when
    the head is tied to it; else the head has its own `lm_head`.
    """

    def __init__(self, config: EagleHeadConfig, embed: torch.Tensor, d2t: torch.Tensor,
                 lm_head_rows: torch.Tensor | None = None) -> None:
        super().__init__()
        c = self.config = config
        if d2t.shape != (c.draft_vocab_size,):
            raise ConfigError(f"d2t has shape {tuple(d2t.shape)}; the head's draft vocabulary is {c.draft_vocab_size}")
        self.fc = nn.Linear(len(c.target_layers) * c.hidden_size, c.hidden_size, bias=False)
        self.midlayer = EagleLayer(c)
        self.norm = nn.Parameter(torch.ones(c.hidden_size))
        # d2t holds offsets (EAGLE-3's layout): draft index i is target token i + d2t[i].
        self.register_buffer("d2t", d2t.long())
        t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
        t2d[self.draft_ids] = True
        self.register_buffer("t2d", t2d)
        self.register_buffer("embed", embed.float(), persistent=False)
        if c.tied_lm_head:
            if lm_head_rows is None:
                raise ConfigError("a tied EAGLE head needs the target's LM head rows")
            self.register_buffer("lm_head_rows", lm_head_rows.float(), persistent=False)
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(c.rope_theta, c.head_dim), persistent=False)
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None  # drafting's, see rope_at

    @property
    def draft_ids(self) -> torch.Tensor:
        """[draft_vocab] the target token id of each draft index."""
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    def trained_bytes(self) -> int:
        """Bytes of the head's own weights (what it adds to the target's)."""
        return sum(p.numel() * p.element_size() for p in self.parameters())

    # --- the layer, in pieces: attention differs between drafting and training ---------------

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope(self.inv_freq, positions)

    def rope_at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`rope` of positions [n] looked up in a table that grows by doubling: each entry is
        computed alone, so the same values, without a step's half a dozen operations."""
        needed = int(positions.max()) + 1
        if self._rope_table is None or self._rope_table[0].shape[0] < needed:
            self._rope_table = self.rope(torch.arange(max(4096, 1 << (needed - 1).bit_length())))
        cos, sin = self._rope_table
        return cos[positions], sin[positions]

    def project(self, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, query: bool = True):
        """features: [..., n, hidden] (fused target states or the head's own output); tokens:
        [..., n], the token after each position; positions: [n], or [..., n] per sequence.
        Returns q [..., heads, n, head_dim] (None without `query`) and k, v [..., kv_heads, n,
        head_dim], rotated. Leading dims are a batch."""
        c, layer = self.config, self.midlayer
        lead, n = features.shape[:-2], features.shape[-2]
        x = torch.cat([rms_norm(self.embed[tokens], layer.input_layernorm, c.rms_norm_eps),
                       rms_norm(features, layer.hidden_norm, c.rms_norm_eps)], dim=-1)  # [..., n, 2 * hidden]
        attn = layer.self_attn
        split = lambda t, heads: t.view(*lead, n, heads, c.head_dim).transpose(-2, -3)  # noqa: E731
        k, v = split(attn["k_proj"](x), c.num_kv_heads), split(attn["v_proj"](x), c.num_kv_heads)
        cos, sin = self.rope(positions)
        if positions.dim() > 1:  # [..., n, head_dim] -> [..., 1, n, head_dim], over the heads
            cos, sin = cos.unsqueeze(-3), sin.unsqueeze(-3)
        q = rotate(split(attn["q_proj"](x), c.num_heads), cos, sin) if query else None
        return q, rotate(k, cos, sin), v

    def finish(self, features: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """features: [..., n, hidden] (the residual stream); attended: [..., heads, n, head_dim].
        Returns the head's output state [..., n, hidden] (before the final norm)."""
        c, layer = self.config, self.midlayer
        x = features + layer.self_attn["o_proj"](attended.transpose(-2, -3).flatten(-2))
        mlp = layer.mlp
        y = rms_norm(x, layer.post_attention_layernorm, c.rms_norm_eps)
        return x + mlp["down_proj"](F.silu(mlp["gate_proj"](y)) * mlp["up_proj"](y))

    def logits(self, state: torch.Tensor) -> torch.Tensor:
        """state: [n, hidden] -> [n, draft_vocab]."""
        normed = rms_norm(state, self.norm, self.config.rms_norm_eps)
        return normed @ self.lm_head_rows.t() if self.lm_head is None else self.lm_head(normed)

    def packed(self, fmt: str) -> PackedHead:
        """The head's matrices packed for drafting in `fmt` (query/key/value and gate/up fused),
        built once and shared by every sequence; training must not change the head after."""
        cache = self.__dict__.setdefault("_packed", {})
        if fmt not in cache:
            check_draft_format(fmt, "an EAGLE head")
            attn, mlp = self.midlayer.self_attn, self.midlayer.mlp
            lm = self.lm_head_rows if self.lm_head is None else self.lm_head.weight
            cache[fmt] = PackedHead(
                fc=PackedLinear.pack(self.fc.weight, fmt),
                qkv=PackedLinear.pack([attn[f"{p}_proj"].weight for p in "qkv"], fmt),
                o=PackedLinear.pack(attn["o_proj"].weight, fmt),
                gate_up=PackedLinear.pack([mlp["gate_proj"].weight, mlp["up_proj"].weight], fmt),
                down=PackedLinear.pack(mlp["down_proj"].weight, fmt),
                lm=PackedLinear.pack(lm, fmt),
            )
        return cache[fmt]

    # --- training (train-draft) ----------------------------------------------------------------

    @classmethod
    def fresh(cls, target: LoadedModel, d2t_ids: torch.Tensor, options: EagleTrainOptions, *, seed: int) -> EagleHead:
        """A new head tied to the target's LM head rows for the vocabulary `d2t_ids`: small normal
        weights, the output projections scaled down so that the layer starts near the identity
        on its residual (the options shape training's unroll, not the head)."""
        backend = target.backend
        config = EagleHeadConfig.for_target(target, len(d2t_ids))
        head = cls(config, backend.input_embeddings(), d2t_ids - torch.arange(len(d2t_ids)),
                   backend.output_embeddings()[d2t_ids])
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in head.named_parameters():
                if param.dim() == 2:
                    std = param.shape[1] ** -0.5 * (0.1 if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0)
                    param.normal_(0.0, std, generator=generator)
        return head

    def view_layers(self, target: LoadedModel) -> tuple[int, ...]:
        return self.config.target_layers

    def draft_positions(self, options: EagleTrainOptions) -> int:
        return options.ttt_steps

    def draft_states(self, features: torch.Tensor, tokens: torch.Tensor, begin: torch.Tensor,
                     options: EagleTrainOptions):
        """Training-time test unrolled `options.ttt_steps` draft steps over a batch ([batch, n,
        ...]), from the positions `begin` [batch] on: the window offsets, and per depth j its
        output states, which predict row t (shift 0), meaningful from position j on, scored by
        `logits`."""
        offset, states = eagle_unroll.ttt_states(self, features, tokens, options.ttt_steps, begin)
        return offset, [(state, 0, j, self.logits) for j, state in enumerate(states)]

    # --- files --------------------------------------------------------------------------------

    def save(self, directory: str | Path) -> None:
        head_files.save(directory, self.config.to_json(), {**self.state_dict(), "d2t": self.d2t})

    @classmethod
    def load(cls, directory: str | Path, target: LoadedModel) -> EagleHead:
        """A head from `directory` (EAGLE-3 layout) for this target."""
        directory, data, state = head_files.read("EAGLE", directory)
        config = EagleHeadConfig.from_json(data, target.num_layers)
        head_files.check_target("EAGLE", directory, config.hidden_size, config.vocab_size, target)
        if max(config.target_layers) >= target.num_layers:
            raise ConfigError(f"EAGLE head reads layer {max(config.target_layers)}; {target.name} has {target.num_layers}")
        d2t = state.pop("d2t", None)
        if d2t is None:  # a head over the whole vocabulary
            d2t = torch.zeros(config.draft_vocab_size, dtype=torch.long)
        state.pop("t2d", None)
        state.pop("embed_tokens.weight", None)  # some heads ship the target's embedding: it is the target's
        state = {name.replace("layers.0.", "midlayer."): t for name, t in state.items()}
        backend = target.backend
        head = cls(config, backend.input_embeddings(), d2t,
                   backend.output_embeddings()[torch.arange(config.draft_vocab_size) + d2t.long()]
                   if config.tied_lm_head else None)
        missing, unexpected = head.load_state_dict(state, strict=False)
        head_files.check_state("EAGLE", directory, [m for m in missing if m not in ("d2t", "t2d")], unexpected)
        return head.eval()


class EagleDrafter(Drafter):
    """One sequence's EAGLE drafting: the head's KV cache over the committed positions, built
    from the target's features, plus the drafted positions past them.

    weight_format: what the head's matrices are packed in (None: q8 on specdec's kernels, where
    the layer runs as one call, `head_layer`; else PyTorch's int8). min_confidence: the draft
    stops where its probability under the head (a chain's tokens', a tree node's path's) would
    fall below this (HeadOptions.draft_confidence); None: never."""

    def __init__(self, head: EagleHead, weight_format: str | None = None, tree_width: int = 1,
                 tree_nodes: int | None = None, min_confidence: float | None = None) -> None:
        if tree_width < 1 or (tree_nodes is not None and tree_nodes < 1):
            raise ConfigError("tree_width and tree_nodes must be >= 1")
        if min_confidence is not None and not 0 < min_confidence <= 1:
            raise ConfigError(f"min_confidence must be in (0, 1], got {min_confidence!r}")
        self.head = head
        self.min_confidence = min_confidence
        c = head.config
        self.weight_format = weight_format or draft_format(c.hidden_size, c.num_heads * c.head_dim, c.intermediate_size)
        self.tree_width = tree_width  # 1: a chain
        self.tree_nodes = tree_nodes or 4 * tree_width
        self.proposal_size = TreeOptions(tree_width, tree_nodes).proposal_nodes  # most tokens a proposal holds beyond k
        self.target_layers = head.config.target_layers
        self.added_memory_bytes = self.weights.nbytes()
        self._keys: torch.Tensor | None = None  # [kv_heads, max_len, head_dim]
        self._values: torch.Tensor | None = None
        self._length = 0  # committed positions with entries
        self._pending: list[torch.Tensor] = []  # target features not yet turned into entries
        self._state: torch.Tensor | None = None  # [1, hidden] the last committed position's output
        # The kernels' one-call layer and its weight arguments, where the matrices are in their
        # formats (and the heads' width is whole vectors for the kernels' attention).
        parts = self.weights.layer_parts()
        self._one_call = (kernels.load(), kernels.ISAS[kernels.default_isa()], parts) \
            if parts is not None and c.head_dim % 8 == 0 else None

    @property
    def weights(self) -> PackedHead:
        # Looked up on the shared head, never held: a copied drafter must not copy the weights.
        return self.head.packed(self.weight_format)

    def begin(self, prompt_ids: list[int], max_len: int) -> None:
        c = self.head.config
        # Drafted entries sit past the committed ones: a chain's k, a tree's expanded nodes.
        self._keys = torch.zeros(c.num_kv_heads, max_len + 1 + TREE_SLOTS, c.head_dim)
        self._values = torch.zeros_like(self._keys)
        self._length, self._pending, self._state = 0, [], None

    def observe_target(self, features: torch.Tensor) -> None:
        """features: [n, len(target_layers) * hidden], the target's states at the next n
        committed positions, in order."""
        self._pending.append(features)

    @torch.inference_mode()
    def propose(
        self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Proposal:
        head = self.head
        # 1. Entries for the committed positions whose target features arrived since last step:
        #    position t reads the target's states at t and token t + 1.
        if self._pending:
            features = self._entry_features(torch.cat(self._pending))  # [n, hidden]
            start, n = self._length, features.shape[0]
            if start + n != len(context) - 1:
                raise RuntimeError(f"EAGLE drafter has features for {start + n} positions; the context has {len(context)} tokens")
            tokens = torch.tensor(context[start + 1 : start + n + 1])
            self._state = self._run(features, tokens, start)[-1:]
            self._length, self._pending = start + n, []
        if self._state is None or k < 1:
            return Proposal(tokens=[])
        if self.tree_width > 1:
            return self._propose_tree(k)

        # 2. Up to k tokens, each from the head's output one position on; a drafted position's
        #    entry is written past the committed length and forgotten when the next step
        #    overwrites it. With min_confidence, the chain ends where the probability of the
        #    tokens drafted so far times the head's top probability for the next one falls below
        #    it. When sampling, whether a position is drafted must not depend on the token drawn
        #    there (the drawn tokens would then not follow the head's distribution, which the
        #    acceptance rule divides by): so the top probability, not the drawn token's.
        state, drafted, probs, chance = self._state, [], [], 1.0
        for j in range(k):
            logits = self._logits(state)[0]  # [draft_vocab]
            if params.greedy:
                index = int(logits.argmax())
                token = int(head.d2t[index]) + index
                if self.min_confidence is not None:
                    top = float(torch.softmax(logits, dim=-1)[index])  # (PyTorch's logsumexp of one row is far slower)
                    if chance * top < self.min_confidence:
                        break
                    chance *= top
            else:
                draft_probs = torch.softmax(logits / params.temperature, dim=-1)
                if self.min_confidence is not None and chance * float(draft_probs.max()) < self.min_confidence:
                    break
                full = torch.zeros(head.config.vocab_size)
                full[head.draft_ids] = draft_probs
                if params.drafter_invariant:  # the target's noise at this position: a deterministic draft
                    token = invariant_tokens(full[None], generator.initial_seed(), len(context) + j)[0]
                else:
                    index = int(sample(draft_probs[None], generator)[0])
                    token = int(head.d2t[index]) + index
                    probs.append(full)
                if self.min_confidence is not None:
                    chance *= float(full[token])
            drafted.append(token)
            if j + 1 < k:
                state = self._run(state, torch.tensor([token]), self._length + j)
        return Proposal(tokens=drafted, probs=torch.stack(probs) if probs else None)

    def _propose_tree(self, depth: int) -> Proposal:
        """A token tree (EAGLE-2's dynamic tree): expand the `tree_width` most probable
        candidates of each depth by the head's top `tree_width` tokens, scoring every candidate
        by its path's total log-probability under the head, then keep the `tree_nodes` best
        candidates. Scores fall along a path, so the kept set holds every kept node's parent.
        Children are the head's top tokens, deterministic: verified with one-hot drafts."""
        head, width, length = self.head, self.tree_width, self._length
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []
        slot_of: dict[int, int] = {}  # expanded candidate -> its cache slot
        states: dict[int, torch.Tensor] = {-1: self._state}  # expanded candidate -> its output [1, hidden]
        frontier, base = [-1], 0.0
        floor = -math.inf if self.min_confidence is None else math.log(self.min_confidence)
        for level in range(1, depth + 1):
            if level > 1:
                # Run the head on this depth's frontier, each entry at position length - 1 + depth
                # of the node, seeing the committed entries, its ancestors' and itself.
                slots = torch.arange(len(slot_of), len(slot_of) + len(frontier)) + length
                for node, slot in zip(frontier, slots.tolist()):
                    slot_of[node] = slot
                mask = torch.zeros(len(frontier), int(slots.max()) + 1, dtype=torch.bool)
                mask[:, :length] = True
                for row, node in enumerate(frontier):
                    walk = node
                    while walk >= 0:
                        mask[row, slot_of[walk]] = True
                        walk = parents[walk]
                outputs = self._run_at(torch.cat([states[parents[f]] for f in frontier]),
                                       torch.tensor([tokens[f] for f in frontier]),
                                       torch.full((len(frontier),), length + level - 2), slots,
                                       visible_slots(mask[None, None], 0, len(frontier), long_blocks=True))
                for row, node in enumerate(frontier):
                    states[node] = outputs[row : row + 1]
            logp = torch.log_softmax(self._logits(torch.cat([states[f] for f in frontier])), dim=-1)  # [w, draft_vocab]
            top = logp.topk(width, dim=-1)
            level_nodes = []
            for row, node in enumerate(frontier):
                base = 0.0 if node < 0 else scores[node]
                for value, index in zip(top.values[row].tolist(), top.indices[row].tolist()):
                    tokens.append(int(head.d2t[index]) + index)
                    parents.append(node)
                    scores.append(base + value)
                    level_nodes.append(len(tokens) - 1)
            frontier = sorted(level_nodes, key=lambda n: -scores[n])[:width]
            if scores[frontier[0]] < floor:  # every deeper node would score below the floor too
                break
        # Scores fall along a path, so the nodes at or above the floor hold their parents.
        kept = min(self.tree_nodes, sum(score >= floor for score in scores))
        return best_subtree(tokens, parents, scores, kept) if kept else Proposal(tokens=[])

    def _entry_features(self, target_states: torch.Tensor) -> torch.Tensor:
        """[n, len(target_layers) * hidden] target states -> [n, hidden], the layer's features."""
        return self.weights.fc(target_states).float()

    def _run(self, features: torch.Tensor, tokens: torch.Tensor, start: int) -> torch.Tensor:
        """The layer over positions start .. start + n - 1, writing their entries at those slots;
        each attends to every entry before it. features: [n, hidden]; tokens: [n]. Returns
        [n, hidden]."""
        n = features.shape[0]
        positions = torch.arange(start, start + n)
        prefix = Visible(torch.arange(start + 1, start + n + 1, dtype=torch.int32)[None], None)
        return self._run_at(features, tokens, positions, positions, prefix)

    def _run_at(self, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                visible: Visible) -> torch.Tensor:
        """The layer over n entries at these positions, written at these cache slots, each
        attending to the slots `visible` gives it (counts [1, n]: a prefix of the cache, or the
        listed slots). The same arithmetic as :meth:`EagleHead.project` and
        :meth:`EagleHead.finish`, with the packed matrices."""
        c, layer, w = self.head.config, self.head.midlayer, self.weights
        n = features.shape[0]
        cos, sin = self.head.rope_at(positions)
        if self._one_call is not None:
            ops, isa, parts = self._one_call
            return ops.head_layer(self.head.embed[tokens], features.float(), layer.input_layernorm, layer.hidden_norm,
                                  layer.post_attention_layernorm, *parts, self._keys[None], self._values[None], slots,
                                  cos, sin, visible.counts, NO_SLOTS if visible.slots is None else visible.slots,
                                  c.num_heads, c.num_kv_heads, c.rms_norm_eps, c.head_dim ** -0.5, isa)
        x = torch.cat([rms_norm(self.head.embed[tokens], layer.input_layernorm, c.rms_norm_eps),
                       rms_norm(features, layer.hidden_norm, c.rms_norm_eps)], dim=-1)  # [n, 2 * hidden]
        qkv = w.qkv(x).float().view(n, c.num_heads + 2 * c.num_kv_heads, c.head_dim).transpose(0, 1)
        q, k, v = qkv.split([c.num_heads, c.num_kv_heads, c.num_kv_heads])  # [heads or kv_heads, n, head_dim]
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        self._keys[:, slots] = k
        self._values[:, slots] = v
        span = int(slots.max()) + 1
        keys, values = self._keys[:, :span], self._values[:, :span]
        attended = F.scaled_dot_product_attention(q, keys, values, attn_mask=attention_mask(visible, span),
                                                  enable_gqa=q.shape[0] != keys.shape[0])  # [heads, n, head_dim]
        x = features + w.o(attended.transpose(0, 1).reshape(n, -1)).float()
        gate, up = w.gate_up(rms_norm(x, layer.post_attention_layernorm, c.rms_norm_eps)).float().chunk(2, dim=-1)
        return x + w.down(F.silu(gate) * up).float()

    def _logits(self, state: torch.Tensor) -> torch.Tensor:
        # state: [n, hidden] -> [n, draft_vocab]
        eps = self.head.config.rms_norm_eps
        normed = rms_norm(state, self.head.norm, eps) if self._one_call is None else \
            self._one_call[0].rms_norm(state, self.head.norm, eps)
        return self.weights.lm(normed).float()

    def commit(self, context: list[int], num_accepted: int) -> None:
        pass  # the target's features for the committed positions arrive through observe_target

    def fork(self) -> EagleDrafter:
        return type(self)(self.head, self.weight_format, self.tree_width, self.tree_nodes, self.min_confidence)


def attention_mask(visible: Visible, span: int) -> torch.Tensor | None:
    """The drafter's visible slots as PyTorch attention's mask [n, span] (None: every query sees
    every slot)."""
    counts = visible.counts[0]  # [n]
    if visible.slots is None:
        return None if bool((counts == span).all()) else torch.arange(span)[None] < counts[:, None]
    mask = torch.zeros(len(counts), span, dtype=torch.bool)
    for row, count in enumerate(counts.tolist()):
        mask[row, visible.slots[0, row, :count].long()] = True
    return mask


def load_head(config: SpeculativeConfig, target: LoadedModel) -> EagleHead:
    """The head a config names (`model`: a directory), else the one shipped for the target."""
    return EagleHead.load(head_files.config_dir("eagle", config, target), target)


def build(config: SpeculativeConfig, target: LoadedModel) -> EagleDrafter:
    return EagleDrafter(load_head(config, target), tree_width=config.tree_width, tree_nodes=config.tree_nodes,
                        min_confidence=config.draft_confidence)
