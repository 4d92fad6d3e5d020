"""Fixtures shared by the draft-head tests (EAGLE, Medusa, MTP)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from specdec import SamplingParams
from specdec.drafters.mtp import LAYER_TENSORS
from specdec.engine import Engine
from specdec.models import LoadedModel

SelfDistilled = Callable[[int], tuple[LoadedModel, list[dict[str, Any]]]]


@pytest.fixture(scope="session")
def self_distilled(small_model_factory) -> SelfDistilled:
    """(target, records): a small target with peaked distributions over 8 tokens (so top-1 is well
    defined) and its own greedy answers of `answer_tokens` to 12 random prompts, the text
    `specdec train-draft` trains a head on. A random target follows no pattern a head could
    generalise from, so training on it measures fitting the text, which a broken loss or mask
    would not do."""

    def make(answer_tokens: int) -> tuple[LoadedModel, list[dict[str, Any]]]:
        target = small_model_factory(seed=4, vocab_size=8)
        generator = torch.Generator().manual_seed(0)
        engine = Engine(target)
        params = SamplingParams(max_tokens=answer_tokens, temperature=0.0, ignore_eos=True)
        records = []
        for i in range(12):
            prompt = torch.randint(0, 8, (6,), generator=generator).tolist()
            records.append({"id": f"r{i}", "prompt_ids": prompt, "answer_ids": engine.generate(prompt, params).token_ids})
        return target, records

    return make


def _random_mtp_tensors(target: LoadedModel, seed: int = 0, scale: float = 0.05) -> dict[str, torch.Tensor]:
    """A random MTP layer for `target`, named as in the checkpoint (without the layer prefix)."""
    config, gen = target.config, torch.Generator().manual_seed(seed)
    h, inter = int(config.hidden_size), int(config.intermediate_size)
    heads, kv = int(config.num_attention_heads), int(config.num_key_value_heads)
    head_dim = h // heads
    shapes = {"eh_proj.weight": (h, 2 * h), "self_attn.q_proj.weight": (heads * head_dim, h),
              "self_attn.k_proj.weight": (kv * head_dim, h), "self_attn.v_proj.weight": (kv * head_dim, h),
              "self_attn.o_proj.weight": (h, heads * head_dim), "mlp.gate_proj.weight": (inter, h),
              "mlp.up_proj.weight": (inter, h), "mlp.down_proj.weight": (h, inter)}
    tensors = {name: torch.randn(shape, generator=gen) * scale for name, shape in shapes.items()}
    for norm in ("enorm", "hnorm", "shared_head.norm", "input_layernorm", "post_attention_layernorm"):
        tensors[f"{norm}.weight"] = 1.0 + 0.1 * torch.randn(h, generator=gen)
    assert set(tensors) == set(LAYER_TENSORS)
    return tensors


def _write_checkpoint(target: LoadedModel, directory: Path, tensors: dict[str, torch.Tensor], shards: int = 1,
                     **config_changes) -> Path:
    """A checkpoint directory as a model with an MTP layer ships it: the model's config with
    num_nextn_predict_layers, the layer's tensors under model.layers.{L}. (over `shards` files
    with an index when more than one), beside a tensor of another layer that must be left alone."""
    directory.mkdir(parents=True, exist_ok=True)
    layer = target.num_layers
    config = target.config.to_dict() | {"num_nextn_predict_layers": 1} | config_changes
    (directory / "config.json").write_text(json.dumps(config))
    named = {f"model.layers.{layer}.{name}": t.contiguous() for name, t in tensors.items()}
    named["model.layers.0.input_layernorm.weight"] = torch.ones(int(target.config.hidden_size))
    names = sorted(named)
    if shards == 1:
        save_file(named, str(directory / "model.safetensors"))
        return directory
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {name: named[name] for name in names[i::shards]}
        save_file(part, str(directory / file))
        weight_map |= {name: file for name in part}
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return directory


@pytest.fixture(scope="session")
def mtp_checkpoint() -> Callable[..., tuple[Path, dict[str, torch.Tensor]]]:
    """write(target, directory, tensors=None, shards=1, seed=0, scale=0.05, **config_changes)
    -> (directory, tensors): a checkpoint directory holding an MTP layer for `target` (random
    unless `tensors` are given)."""

    def write(target: LoadedModel, directory: Path, tensors: dict[str, torch.Tensor] | None = None, shards: int = 1,
              seed: int = 0, scale: float = 0.05, **config_changes) -> tuple[Path, dict[str, torch.Tensor]]:
        tensors = tensors if tensors is not None else _random_mtp_tensors(target, seed, scale)
        return _write_checkpoint(target, directory, tensors, shards, **config_changes), tensors

    return write
