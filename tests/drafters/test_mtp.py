"""MTP modules (DeepSeek-V3 layout): drafting matches a reference built from transformers' own
Llama layer, the checkpoint layout loads (sharded or not), and what specdec cannot run is refused.
No real MTP checkpoint can be had here: the modules are random, on the tests' small models."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from specdec import LLM, SamplingParams
from specdec.drafters.mtp import MtpDrafter, load_mtp
from specdec.engine import Engine
from specdec.errors import ConfigError
from specdec.models import LoadedModel
from specdec.models.runner import ModelRunner


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def test_drafts_match_a_transformers_reference(small_model_factory, mtp_checkpoint, tmp_path: Path) -> None:
    # The reference: transformers' Llama model for the target's normed final states, its
    # LlamaDecoderLayer for the MTP block, run over every position from scratch at each draft
    # depth, with each drafted position fed the module's own previous output. The drafter's
    # sampled distributions (the whole distribution, not only its argmax) must match it. The
    # target's norms are made uneven, or a missed final norm would go unseen (hnorm follows).
    small = small_model_factory(seed=9, vocab_size=16, layers=2)
    model = copy.deepcopy(small.model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.5 * torch.randn(param.shape, generator=torch.Generator().manual_seed(3)))
    target = LoadedModel.from_hf(model, small.tokenizer, name="small-uneven-norms", source="small-uneven-norms")
    directory, tensors = mtp_checkpoint(target, tmp_path, seed=1, scale=0.2)
    head = load_mtp(directory, target)
    cfg = target.model.config
    eps = float(cfg.rms_norm_eps)
    block = LlamaDecoderLayer(cfg, layer_idx=0).eval()
    block.load_state_dict({name: t for name, t in tensors.items() if name.split(".")[0] in
                           ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")})
    rotary = LlamaRotaryEmbedding(cfg)
    embed = target.model.get_input_embeddings().weight.detach()
    lm = target.model.get_output_embeddings().weight.detach()

    context = torch.randint(0, 16, (10,), generator=torch.Generator().manual_seed(2)).tolist()
    n = len(context)
    with torch.no_grad():
        normed = target.model(torch.tensor([context]), output_hidden_states=True).hidden_states[-1][0]  # [n, hidden]
    runner = ModelRunner(target)
    states = runner.forward(runner.new_cache(n), context, hidden_layers=(target.num_layers - 1,)).layer_states
    drafter = MtpDrafter(head, "float32")
    drafter.begin(context, 64)
    drafter.observe_target(states[target.num_layers - 1][: n - 1])  # positions 0 .. n - 2 know their next token
    params = SamplingParams(temperature=0.8)
    proposal = drafter.propose(context, 3, params, torch.Generator().manual_seed(0))

    # Position t reads token t + 1 (zeroed at t = 0) and h_t: the target's for t <= n - 2, then
    # the module's own output at t - 1.
    hidden, tokens = list(normed[: n - 1]), context[1:]
    with torch.no_grad():
        for depth in range(3):
            count = len(hidden)
            e = embed[torch.tensor(tokens[:count])].clone()
            e[0] = 0
            x = torch.cat([_rms(e, tensors["enorm.weight"], eps), _rms(torch.stack(hidden), tensors["hnorm.weight"], eps)], -1)
            x = (x @ tensors["eh_proj.weight"].T)[None]  # [1, count, hidden]
            positions = torch.arange(count)[None]
            mask = torch.full((count, count), float("-inf")).triu(1)[None, None]
            out = block(x, attention_mask=mask, position_ids=positions, position_embeddings=rotary(x, positions))
            out = (out[0] if isinstance(out, tuple) else out)[0]  # [count, hidden]
            logits = _rms(out[-1], tensors["shared_head.norm.weight"], eps) @ lm.T
            expected = torch.softmax(logits / params.temperature, -1)
            torch.testing.assert_close(proposal.probs[depth], expected, rtol=1e-4, atol=1e-5)
            hidden.append(out[-1])
            tokens.append(proposal.tokens[depth])


@pytest.mark.parametrize("shards", [1, 3])
def test_speculation_with_the_module_is_lossless(tiny_native: LoadedModel, mtp_checkpoint, tmp_path: Path,
                                                 shards: int) -> None:
    directory, _ = mtp_checkpoint(tiny_native, tmp_path / "ckpt", shards=shards)
    prompt = [5, 17, 300, 5, 17, 300, 5, 17]
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = Engine(tiny_native).generate(prompt, greedy).token_ids
    for config in ({"method": "mtp", "model": str(directory)},
                   {"method": "mtp", "model": str(directory), "num_speculative_tokens": 3, "tree_width": 2}):
        llm = LLM(loaded=tiny_native, speculative_config=config)
        out = llm.engine.generate(prompt, greedy)
        assert out.token_ids == plain
        assert out.stats.drafted_tokens > 0
    assert LLM(loaded=tiny_native, speculative_config={"method": "mtp", "model": str(directory)}).speculative_config \
        .num_speculative_tokens == 1  # one MTP layer: one token further by default


def test_what_cannot_run_is_refused(tiny_native: LoadedModel, default_model: LoadedModel, mtp_checkpoint,
                                    tmp_path: Path) -> None:
    _, tensors = mtp_checkpoint(tiny_native, tmp_path / "ok")

    def write_checkpoint(target: LoadedModel, directory: Path, tensors: dict, **changes) -> Path:
        return mtp_checkpoint(target, directory, tensors, **changes)[0]

    def refused(directory: Path, target: LoadedModel, match: str) -> None:
        with pytest.raises(ConfigError, match=match):
            LLM(loaded=target, speculative_config={"method": "mtp", "model": str(directory)})

    refused(write_checkpoint(tiny_native, tmp_path / "none", tensors, num_nextn_predict_layers=0), tiny_native,
            "no MTP module")
    refused(write_checkpoint(tiny_native, tmp_path / "mla", tensors, kv_lora_rank=512), tiny_native,
            "multi-head latent attention")
    experts = dict(tensors) | {"mlp.experts.0.gate_proj.weight": torch.zeros(4, 4)}
    refused(write_checkpoint(tiny_native, tmp_path / "moe", experts), tiny_native, "mixture of experts")
    missing = {name: t for name, t in tensors.items() if name != "eh_proj.weight"}
    refused(write_checkpoint(tiny_native, tmp_path / "missing", missing), tiny_native, r"missing \['eh_proj.weight'\]")
    refused(write_checkpoint(tiny_native, tmp_path / "ok", tensors), default_model, "is for a model with hidden size")
    refused(tmp_path / "empty", tiny_native, "no MTP module in")
    with pytest.raises(ConfigError, match="a GGUF file keeps no MTP layers"):
        LLM(loaded=default_model, speculative_config={"method": "mtp"})


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_drafter_invariant_sampling_gives_the_plain_tokens(tiny_native: LoadedModel, mtp_checkpoint, tmp_path: Path,
                                                          temperature: float) -> None:
    directory, _ = mtp_checkpoint(tiny_native, tmp_path, scale=0.3)
    llm = LLM(loaded=tiny_native, speculative_config={"method": "mtp", "model": str(directory),
                                                     "num_speculative_tokens": 2, "drafter_invariant": True})
    drafted = 0
    for seed, prompt in enumerate(([5, 17, 300, 5, 17], [9, 9, 9, 40], [100, 200, 300])):
        params = llm.request_params(SamplingParams(max_tokens=20, temperature=temperature, seed=seed, ignore_eos=True))
        spec = llm.engine.generate(prompt, params)
        assert spec.token_ids == llm.plain_engine.generate(prompt, params).token_ids
        drafted += spec.stats.drafted_tokens
    assert drafted > 0
