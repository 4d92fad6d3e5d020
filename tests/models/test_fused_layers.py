"""The native backend's fused layers (`forward_layers`: every layer of a short pass in one kernel
call) against its Python loop over the same kernels: the same bits in every output, every kept
layer state and every cache slot written, for a prompt, plain steps, a chain, a token tree, a
subset of layers and a batch of rows at different lengths."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, MistralConfig, MistralForCausalLM, Phi3Config,
                          Phi3ForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

from specdec import kernels
from specdec.errors import ModelLoadError
from specdec.models import LoadedModel, load_model
from specdec.models.loader import resolve_backend
from specdec.models.batch_cache import BatchCache
from specdec.models.cache import PreallocatedCache
from specdec.kernels import packing
from specdec.models.qlinear import Int4Groups, Int8Groups, PackedLinear, StackedLinear
from specdec.models.runner import ModelRunner
from tests.conftest import tiny_tokenizer

pytestmark = pytest.mark.skipif(not kernels.available(), reason="specdec's kernels are not built here")


def _tiny_other(kind: str, path) -> LoadedModel:
    """A random 2-layer Qwen2 (its query/key/value bias nonzero), Qwen3 (its query and key norms
    away from 1), Mistral (a sliding window of 8), Phi-3 (fused query/key/value and gate/up, a
    window of 8) or Gemma 3 (a sliding layer with a window of 8 and a global one, each with its own
    rotary base, a query scale other than its head_dim's, all six norms away from 1) with the tiny
    tokenizer, on the hf backend."""
    tokenizer = tiny_tokenizer()
    torch.manual_seed(7)
    shape = dict(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=128, max_position_embeddings=512,
                 eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False)
    if kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**shape))
    elif kind == "mistral":
        model = MistralForCausalLM(MistralConfig(**shape, sliding_window=8))
    elif kind == "phi3":
        model = Phi3ForCausalLM(Phi3Config(**shape, sliding_window=8, pad_token_id=tokenizer.pad_token_id))
    elif kind == "gemma3":
        model = Gemma3ForCausalLM(Gemma3TextConfig(**shape, head_dim=16, sliding_window=8, query_pre_attn_scalar=24,
                                                   layer_types=["sliding_attention", "full_attention"]))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**shape, head_dim=16))
    with torch.no_grad():
        if kind == "gemma3":  # Gemma's norms multiply by 1 + w, initialised at w = 0
            for name, weight in model.named_parameters():
                if "norm" in name:
                    weight.uniform_(-0.5, 0.5)
        for layer in model.model.layers:
            attn = layer.self_attn
            if kind in ("mistral", "phi3", "gemma3"):
                continue
            if kind == "qwen2":
                for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
                    proj.bias.normal_(0.0, 0.5)
            else:
                attn.q_norm.weight.uniform_(0.5, 1.5)
                attn.k_norm.weight.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return load_model(str(path), backend="hf")


@pytest.fixture(scope="module", params=["qwen2", "qwen3", "mistral", "phi3", "gemma3"])
def tiny_other(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return _tiny_other(request.param, tmp_path_factory.mktemp(f"tiny-{request.param}"))


@pytest.fixture(scope="module", params=["q4", "q8", "f16", "q8-kv32", "qwen2-q8", "qwen3-q8", "mistral-q8", "phi3-q8",
                                        "gemma3-q8"])
def quantized(request: pytest.FixtureRequest, tiny_model: LoadedModel, tmp_path_factory) -> LoadedModel:
    # Llama, Qwen2 (its bias added in the fused call), Qwen3 (its norms in rotary_split),
    # Mistral (its window in the slots each query sees: the passes below cover 40 positions) and
    # Gemma 3 (post-norms, GeGLU, a sliding and a global layer: two calls a pass, one per run of
    # layers with one window and rotary table); the KV cache in float16 (the default on the
    # kernels), and once in float32; float16 matrices (f16) as well as blocks.
    if request.param == "q8-kv32":
        loaded = tiny_model.native("q8", kv_dtype="float32")
    elif "-" in request.param:
        kind = request.param.split("-")[0]
        loaded = _tiny_other(kind, tmp_path_factory.mktemp(f"fused-{kind}")).native("q8")
    else:
        loaded = tiny_model.native(request.param)
    assert all(loaded.backend._one_call())
    return loaded


def test_qwen_mistral_phi3_and_gemma3_on_the_native_backend_are_the_hf_model(tiny_other: LoadedModel) -> None:
    # float32 weights, the kernels' norms and rotation (Qwen3's and Gemma 3's per-head norms in
    # rotary_split, Gemma's GeGLU), Mistral's and Gemma's windows over 30 positions: a prompt,
    # then plain steps past the window.
    native = tiny_other.native("float32")
    tokens = torch.randint(3, tiny_other.vocab_size, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    want = ModelRunner(tiny_other).score(tokens)
    torch.testing.assert_close(ModelRunner(native).score(tokens), want, rtol=1e-4, atol=1e-4)
    runner = ModelRunner(native)
    cache = runner.new_cache(len(tokens))
    stepped = [runner.forward(cache, tokens[:6]).logits]
    stepped += [runner.forward(cache, [t]).logits for t in tokens[6:]]
    torch.testing.assert_close(torch.cat(stepped), want, rtol=1e-4, atol=1e-4)


def _single_passes(loaded: LoadedModel, fuse: bool, layers: list[int] | None = None) -> list[torch.Tensor]:
    """A prompt, a plain step, a chain of 4, then a tree of 3 nodes (two siblings under one),
    on one cache; the logits and kept states of each pass, and the cache's keys and values."""
    backend = loaded.backend
    backend.fuse_layers = fuse
    cache = PreallocatedCache(backend.num_layers, 64, held=layers)
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(3, loaded.vocab_size, (40,), generator=generator)
    seen: list[torch.Tensor] = []
    at = 0

    def run(ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        out = backend.forward(cache, ids[None], positions[None], mask, layers=layers, hidden_layers=(0, 1))
        seen.append(out.logits)
        seen.extend(out.layer_states[i] for i in sorted(out.layer_states))

    with torch.inference_mode():
        for block in (10, 1, 4):  # prompt, plain step, chain
            run(tokens[at : at + block], torch.arange(at, at + block))
            at += block
        # A tree: node 0 follows the cache, nodes 1 and 2 are its children (siblings).
        mask = torch.zeros(1, 1, 3, at + 3, dtype=torch.bool)
        mask[..., :at] = True
        mask[0, 0, 0, at] = mask[0, 0, 1, at] = mask[0, 0, 2, at] = True
        mask[0, 0, 1, at + 1] = mask[0, 0, 2, at + 2] = True
        run(tokens[at : at + 3], torch.tensor([at, at + 1, at + 1]), mask)
        for index in layers or range(backend.num_layers):
            seen += [cache.layers[index].keys, cache.layers[index].values]
    backend.fuse_layers = True
    return seen


@pytest.mark.parametrize("layers", [None, [0]], ids=["every layer", "a subset"])
def test_fused_layers_are_the_loop_bit_for_bit(quantized: LoadedModel, layers: list[int] | None) -> None:
    fused, loop = _single_passes(quantized, True, layers), _single_passes(quantized, False, layers)
    assert len(fused) == len(loop) > 8
    for got, want in zip(fused, loop):
        assert got.shape == want.shape and torch.equal(got, want)


def test_fused_layers_write_a_batch_of_rows_at_their_own_lengths(quantized: LoadedModel) -> None:
    backend = quantized.backend
    results = {}
    for fuse in (True, False):
        backend.fuse_layers = fuse
        cache = BatchCache.for_backend(backend, max_rows=3, capacity=64)
        runner = ModelRunner(quantized)
        for prompt in ([5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19]):
            single = runner.new_cache(64)
            runner.forward(single, prompt)
            cache.insert_row(single)
        logits = []
        with torch.inference_mode():
            for tokens, keep in (([[20, 21, 22], [30, 31, 32], [40, 41, 42]], [1, 3, 2]), ([[23], [33], [43]], [1, 1, 1])):
                positions, mask = cache.step_inputs(len(tokens[0]))
                logits.append(backend.forward(cache, torch.tensor(tokens), positions, mask).logits)
                cache.commit(len(tokens[0]), torch.tensor(keep))
        results[fuse] = logits + [cache.layers[i].key_buf[:3, :, :12] for i in range(backend.num_layers)]
    backend.fuse_layers = True
    for got, want in zip(results[True], results[False]):
        assert torch.equal(got, want)


def test_formats_without_the_kernels_run_the_loop(tiny_model: LoadedModel) -> None:
    # float32 matrices are not the fused call's: the loop runs, and answers as before.
    backend = tiny_model.native("float32").backend
    assert not any(backend._one_call())


def _counting(backend, calls: list[int]):
    """The backend's kernels, with each forward_layers call's layer count noted in `calls`."""
    ops = backend._ops

    class Counting:
        def __getattr__(self, name):
            if name == "forward_layers":
                return lambda *args: calls.append(len(args[1])) or ops.forward_layers(*args)
            return getattr(ops, name)

    return Counting()


def _calls_and_loop(quantized: LoadedModel, layers: list) -> tuple[list[int], list[torch.Tensor], list[torch.Tensor]]:
    """The passes of `_single_passes` with these layers, through the one-call forward (and the
    layers' count of each call) and through the loop."""
    mixed = copy.copy(quantized.backend)
    mixed.layers = layers
    calls: list[int] = []
    mixed._ops = _counting(quantized.backend, calls)
    plain = copy.copy(mixed)
    plain._ops = quantized.backend._ops
    plain.fuse_layers = False
    with_calls = _single_passes(dataclasses.replace(quantized, backend=mixed), True)
    return calls, with_calls, _single_passes(dataclasses.replace(quantized, backend=plain), False)


def test_layers_the_call_cannot_take_run_the_loop_between_calls(quantized: LoadedModel) -> None:
    # A layer with a float matrix takes the loop; the layers around it still take the call, and
    # the pass's bits are those of the loop throughout.
    backend = quantized.backend
    layer = backend.layers[0]
    widened = dataclasses.replace(layer, o=PackedLinear.pack(layer.o.dequantized(), "float32"))
    mixed = copy.copy(backend)
    mixed.layers = [widened, *backend.layers[1:]]
    assert mixed._one_call() == [False] + [True] * (backend.num_layers - 1)
    calls, with_calls, loop = _calls_and_loop(quantized, mixed.layers)
    assert calls and all(n == backend.num_layers - 1 for n in calls)
    for got, want in zip(with_calls, loop):
        assert torch.equal(got, want)


def test_stacked_and_five_bit_matrices_run_in_the_call(quantized: LoadedModel) -> None:
    # A Q4_K_M file's query/key/value (Q4_K beside Q6_K) and a Q5_K_M file's matrices (Q5_K's q4
    # records of 640 bytes, which only their kind tells from Q6_K's q8 records of the same size)
    # run in the one-call forward: every layer in it, the bits of the loop.
    backend = quantized.backend
    generator = torch.Generator().manual_seed(5)

    def five_bit(out_features: int, in_features: int) -> PackedLinear:
        scale = (torch.rand(out_features, in_features // 32, generator=generator) / 200).half().float()
        q = torch.randint(0, 32, (out_features, in_features), generator=generator)
        return PackedLinear.pack(Int4Groups(q, scale, -16 * scale), "q4")

    def six_bit(out_features: int, in_features: int) -> PackedLinear:
        scale = torch.rand(out_features, in_features // 16, generator=generator) / 300  # float32, per 16
        return PackedLinear.pack(Int8Groups(torch.randint(-32, 32, (out_features, in_features), generator=generator),
                                            scale), "q8")

    hidden, queries = backend.hidden_size, backend.heads * backend.head_dim
    rest = 2 * backend.kv_heads * backend.head_dim
    layer = backend.layers[0]
    mixed = dataclasses.replace(
        layer, qkv=StackedLinear([five_bit(queries, hidden), six_bit(rest, hidden)]),
        down=five_bit(layer.down.out_features, layer.down.in_features))
    assert mixed.qkv.parts[0].tensors["weight"].shape[-1] == packing.Q5_RECORD == packing.Q6_RECORD
    mixed_backend = copy.copy(backend)
    mixed_backend.layers = [mixed, *backend.layers[1:]]
    assert all(mixed_backend._one_call())
    calls, with_calls, loop = _calls_and_loop(quantized, mixed_backend.layers)
    assert calls and calls == _calls_and_loop(quantized, backend.layers)[0]  # as many layers a call as before
    for got, want in zip(with_calls, loop):
        assert torch.equal(got, want)


def test_phi3_with_long_context_rope_runs_on_hf(tmp_path) -> None:
    loaded = _tiny_other("phi3", tmp_path)
    config = copy.deepcopy(loaded.config)
    config.rope_parameters = dict(config.rope_parameters, rope_type="longrope")
    with pytest.raises(ModelLoadError, match="long-context"):
        dataclasses.replace(loaded, config=config).native("float32")
    assert resolve_backend("auto", loaded.config, "cpu") == "native"


def test_the_kv_cache_is_float16_on_the_kernels_and_float32_elsewhere(tiny_model: LoadedModel,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    q8, f32 = tiny_model.native("q8").backend, tiny_model.native("float32").backend
    assert q8.kv_dtype == torch.float16 and f32.kv_dtype == torch.float32
    assert q8.kv_bytes_per_token() * 2 == f32.kv_bytes_per_token()
    assert tiny_model.native("q8", kv_dtype="float32").backend.kv_dtype == torch.float32
    monkeypatch.setenv("SPECDEC_KV_DTYPE", "float32")
    assert tiny_model.native("q8").backend.kv_dtype == torch.float32
    assert tiny_model.native("q8", kv_dtype="float16").backend.kv_dtype == torch.float16  # the argument wins
    monkeypatch.setenv("SPECDEC_KV_DTYPE", "bfloat16")
    with pytest.raises(ModelLoadError, match="unknown KV cache format 'bfloat16'"):
        tiny_model.native("q8")


def test_a_float16_cache_holds_the_float32_caches_keys_rounded_to_nearest(tiny_model: LoadedModel) -> None:
    # Layer 0's keys and values come before any attention: the float16 cache holds exactly the
    # float32 cache's, rounded as torch's .half() rounds (to nearest, ties to even), fused or not.
    runs = {}
    for kv in ("float16", "float32"):
        for fuse in (True, False):
            backend = tiny_model.native("q8", kv_dtype=kv).backend
            backend.fuse_layers = fuse
            cache = PreallocatedCache(backend.num_layers, 32)
            tokens = torch.randint(3, tiny_model.vocab_size, (1, 12), generator=torch.Generator().manual_seed(4))
            with torch.inference_mode():
                backend.forward(cache, tokens, torch.arange(12)[None])
            runs[kv, fuse] = cache.layers[0].keys, cache.layers[0].values
    for fuse in (True, False):
        assert runs["float16", fuse][0].dtype == torch.float16
        assert torch.equal(runs["float16", fuse][0], runs["float32", fuse][0].half())
        assert torch.equal(runs["float16", fuse][1], runs["float32", fuse][1].half())
