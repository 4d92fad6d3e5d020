"""Medusa heads: the packed drafting path matches the module, and files round-trip (ours and
Medusa's own layout with a full LM head per head). Training them: tests/training/."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from specdec import SamplingParams
from specdec.drafters.medusa import MedusaConfig, MedusaDrafter, MedusaHeads
from specdec.engine import Engine
from specdec.errors import ConfigError
from specdec.methods import MedusaTrainOptions
from specdec.models import LoadedModel

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def random_heads(target: LoadedModel, draft_vocab: int, num_heads: int = 3, seed: int = 0) -> MedusaHeads:
    heads = MedusaHeads.fresh(target, torch.arange(draft_vocab), MedusaTrainOptions(medusa_heads=num_heads), seed=0)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in heads.parameters():
            param.normal_(0.0, 0.2, generator=generator)
    return heads.eval()


def test_packed_drafting_matches_the_module(tiny_native: LoadedModel) -> None:
    heads = random_heads(tiny_native, 300)
    drafter = MedusaDrafter(heads, tiny_native.num_layers, "float32")
    state = torch.randn(1, heads.config.hidden_size)
    drafter.begin([1, 2, 3], 16)
    drafter.observe_target(torch.cat([torch.randn(2, heads.config.hidden_size), state]))
    proposal = drafter.propose([1, 2, 3, 4], 3, GREEDY, None)
    expected = heads(state)[:, 0]  # [heads, draft_vocab]
    torch.testing.assert_close(drafter._logits(state, 3), expected, rtol=1e-4, atol=1e-4)
    assert proposal.tokens == heads.draft_ids[expected.argmax(-1)].tolist()
    assert len(drafter.propose([1, 2, 3, 4], 2, GREEDY, None).tokens) == 2


def test_tree_expands_the_best_nodes_by_each_heads_top_tokens(tiny_native: LoadedModel) -> None:
    # Every node of depth d + 1 has head d's top tokens as candidates; the tree_width best nodes
    # of each depth are expanded; the tree_nodes best candidates (path log-probability) are kept.
    heads = random_heads(tiny_native, 300)
    drafter = MedusaDrafter(heads, tiny_native.num_layers, "float32", tree_width=2, tree_nodes=5)
    logits = torch.randn(3, 300, generator=torch.Generator().manual_seed(4)) * 3
    proposal = drafter._propose_tree(logits)
    logp = torch.log_softmax(logits, -1)
    top = [logp[d].topk(2).indices.tolist() for d in range(3)]
    # Brute force: the candidate paths are the expanded nodes' children, depth by depth.
    paths, frontier = {}, [()]
    for d in range(3):
        level = {path + (i,): sum(float(logp[j, t]) for j, t in enumerate(path + (i,)))
                 for path in frontier for i in top[d]}
        paths.update(level)
        frontier = sorted(level, key=lambda p: -level[p])[:2]
    best = sorted(paths, key=lambda p: -paths[p])[:5]
    got = []
    for node, token in enumerate(proposal.tokens):
        parent = proposal.parents[node]
        assert parent < node  # parents before children
        got.append((got[parent] if parent >= 0 else ()) + (int(token),))
    assert sorted(got) == sorted(tuple(int(heads.draft_ids[i]) for i in p) for p in best)
    assert len(set(got)) == len(got)  # siblings distinct


def test_medusa_layout_with_a_head_per_lm(tiny_native: LoadedModel, tmp_path) -> None:
    # Medusa's published layout: medusa_head.{i}.0.linear (the block), medusa_head.{i}.1 (a full
    # LM head of its own), no draft vocabulary.
    hidden, vocab = tiny_native.backend.hidden_size, tiny_native.backend.vocab_size
    generator = torch.Generator().manual_seed(1)
    tensors = {}
    for i in range(2):
        tensors[f"medusa_head.{i}.0.linear.weight"] = torch.randn(hidden, hidden, generator=generator) * 0.1
        tensors[f"medusa_head.{i}.0.linear.bias"] = torch.zeros(hidden)
        tensors[f"medusa_head.{i}.1.weight"] = torch.randn(vocab, hidden, generator=generator) * 0.1
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "medusa_num_layers": 1,
                                                      "hidden_size": hidden, "vocab_size": vocab}))
    heads = MedusaHeads.load(tmp_path, tiny_native)
    assert not heads.config.tied_lm_head and heads.config.draft_vocab_size == vocab
    state = torch.randn(1, hidden)
    normed = state * torch.rsqrt(state.pow(2).mean(-1, keepdim=True) + heads.config.rms_norm_eps) \
        * tiny_native.backend.final_norm_weight()
    block = normed + torch.nn.functional.silu(normed @ tensors["medusa_head.1.0.linear.weight"].t())
    torch.testing.assert_close(heads(state)[1, 0], (block @ tensors["medusa_head.1.1.weight"].t())[0],
                               rtol=1e-4, atol=1e-4)
    prompt = [5, 9, 13, 200, 17]
    spec = Engine(tiny_native, MedusaDrafter(heads, tiny_native.num_layers), 2).generate(prompt, GREEDY)
    assert spec.token_ids == Engine(tiny_native).generate(prompt, GREEDY).token_ids


def test_round_trip_and_refusals(tiny_native: LoadedModel, default_model: LoadedModel, tmp_path) -> None:
    heads = random_heads(tiny_native, 128)
    heads.save(tmp_path)
    loaded = MedusaHeads.load(tmp_path, tiny_native)
    state = torch.randn(2, heads.config.hidden_size)
    torch.testing.assert_close(loaded(state), heads(state), rtol=0.05, atol=0.05)  # stored in bfloat16
    with pytest.raises(ConfigError, match="hidden size"):
        MedusaHeads.load(tmp_path, default_model)
    config = json.loads((tmp_path / "config.json").read_text()) | {"medusa_num_layers": 2}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="one residual block"):
        MedusaHeads.load(tmp_path, tiny_native)
    assert MedusaConfig.from_json({"medusa_num_heads": 4, "hidden_size": 8, "vocab_size": 10}).draft_vocab_size == 10

