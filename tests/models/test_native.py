"""The native backend against the hf backend (the reference), and its weight formats against
float references, with a tolerance stated per format."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.quants import dequantize, quantize

from specdec import LLM, SamplingParams, kernels
from specdec.errors import ModelLoadError
from specdec.kernels import packing
from specdec.models import LoadedModel, ModelRunner
from specdec.models.cache import PreallocatedCache
from specdec.models.loader import default_model_path, load_model
from specdec.models.qlinear import (Embedding, Int4Groups, Int8Groups, PackedLinear, StackedLinear, unpack_q4_blocks,
                                    unpack_q8_blocks)
from specdec.models.weights import GGUFWeights, TensorReader

PROMPTS = [
    [{"role": "user", "content": "Explain in detail how a bicycle works."}],
    [{"role": "user", "content": "Write a Python function that checks whether a number is prime."}],
    [{"role": "user", "content": "List the planets of the solar system in order."}],
]
# Relative error of a matrix product against float32 x @ W.T, per format (random weights).
FORMAT_TOLERANCE = {"float32": 1e-6, "bfloat16": 1e-2, "int8": 2e-2, "int4": 0.12, "q4": 0.12, "q8": 2e-2, "r8": 3e-2}


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


@pytest.mark.parametrize("kind", [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1])
def test_q4_blocks_unpack_to_gguf_values(kind: GGMLQuantizationType) -> None:
    weights = np.random.default_rng(0).standard_normal((48, 64)).astype(np.float32)
    raw = quantize(weights, kind)  # [48, blocks * block bytes]
    groups = unpack_q4_blocks(raw, 48, 64, with_min=kind == GGMLQuantizationType.Q4_1)
    assert torch.equal(groups.dequantize(), torch.from_numpy(dequantize(raw, kind)))


def test_int4_repack_of_q4_groups_is_exact_but_for_bfloat16_scales() -> None:
    # The kernel keeps d and m + 8d in bfloat16: the only rounding between the file and the product.
    raw = quantize(np.random.default_rng(1).standard_normal((64, 96)).astype(np.float32), GGMLQuantizationType.Q4_1)
    groups = unpack_q4_blocks(raw, 64, 96, with_min=True)
    packed = PackedLinear.pack(groups, "int4")
    rounded = Int4Groups(groups.q, groups.d.bfloat16().float(), (groups.m + 8 * groups.d).bfloat16().float() - 8 * groups.d.bfloat16().float())
    x = torch.randn(3, 96).bfloat16()
    want = x.float() @ rounded.dequantize().t()
    assert relative_error(packed(x), want) < 5e-3  # the kernel's bfloat16 output
    assert relative_error(packed.dequantized(), groups.dequantize()) < 5e-3


@pytest.mark.parametrize("fmt", list(FORMAT_TOLERANCE))
def test_formats_compute_the_product(fmt: str) -> None:
    torch.manual_seed(0)
    weight = torch.randn(80, 64)
    x = torch.randn(5, 64)
    linear = PackedLinear.pack(weight, fmt)
    assert relative_error(linear(x), x @ weight.t()) < FORMAT_TOLERANCE[fmt]
    assert linear(x).shape == (5, 80)  # 80 rows: int4 pads the kernel's outputs to 16s and slices


@pytest.mark.parametrize("fmt", ["q4", "q8"])
def test_kernel_formats_keep_gguf_blocks_exactly(fmt: str) -> None:
    # q4 and q8 run the file's blocks as stored: the matrix they compute with is GGUF's own
    # dequantization, bit for bit (the only rounding is of the activations).
    kind = GGMLQuantizationType.Q4_1 if fmt == "q4" else GGMLQuantizationType.Q8_0
    raw = quantize(np.random.default_rng(2).standard_normal((48, 96)).astype(np.float32), kind)
    groups = unpack_q4_blocks(raw, 48, 96, with_min=True) if fmt == "q4" else unpack_q8_blocks(raw, 48, 96)
    assert torch.equal(groups.dequantize(), torch.from_numpy(dequantize(raw, kind)))
    linear = PackedLinear.pack(groups, fmt)
    assert torch.equal(linear.dequantized(), groups.dequantize())
    x = torch.randn(3, 96)
    assert relative_error(linear(x), x @ groups.dequantize().t()) < 1e-2


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("fmt", ["bfloat16", "int8", "int4", "q4", "q8", "f16", "r8"])
def test_products_are_row_invariant(fmt: str, threads: int) -> None:
    # What makes a verification pass bitwise a plain step: a row's product does not depend on
    # how many rows are multiplied with it. 576 x 1536 is the default model's down projection,
    # where oneDNN's bfloat16 product of 1 to 3 rows rounds some rows otherwise than of 4 or more,
    # and on AMX CPUs of 33 or more otherwise than of 32 (66 rows: two parts and a padded one).
    torch.manual_seed(1)
    linear = PackedLinear.pack(torch.randn(576, 1536), fmt)
    x = torch.randn(66, 1536)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        alone = torch.cat([linear(x[i : i + 1]) for i in range(66)])
        for rows in range(2, 67):
            assert torch.equal(linear(x[:rows]), alone[:rows]), rows
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(not kernels.available(), reason="specdec's kernels are not built on this machine")
def test_a_float16_checkpoint_runs_in_float16(tiny_model_dir: Path, tmp_path: Path) -> None:
    # Its matrices stay 2 bytes a weight on the float16 kernel and its embedding is a float16 table,
    # the values exactly the checkpoint's; speculation on it is greedy-identical to plain decoding.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float16).save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(tmp_path)
    half = load_model(str(tmp_path), backend="native")
    exact = load_model(str(tmp_path), backend="native", dtype="float32")
    backend = half.backend
    assert backend._formats() == {"f16"} and backend.lm_head.fmt == "f16" and backend.kernel_path != "pytorch"
    assert backend.embed.table.dtype == torch.float16 or backend.embed.shared
    for packed, plain in zip(backend.layers, exact.backend.layers):
        assert torch.equal(packed.gate_up.dequantized(), plain.gate_up.dequantized())
    assert 2 * backend.matrix_bytes() == exact.backend.matrix_bytes()
    prompt = list(range(5, 30))
    got, want = ModelRunner(half).score(prompt), ModelRunner(exact).score(prompt)
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)  # float32 sums in another order
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    plain = LLM(loaded=half).plain_engine.generate(prompt, greedy).token_ids
    spec = LLM(loaded=half, speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    assert spec.engine.generate(prompt, greedy).token_ids == plain


def test_float32_products_are_not_row_invariant() -> None:
    # The float32 product is close, not bitwise: MKL's sgemm rounds a row otherwise from some
    # row counts (from 4 on the AVX2 and AVX-512 machines here, 9 to 15 on the AMX ones).
    # docs/backends.md says so; if a PyTorch upgrade makes it row-invariant, this fails and those docs
    # and the lossless suite's notes can say more.
    torch.manual_seed(1)
    linear = PackedLinear.pack(torch.randn(576, 1536), "float32")
    x = torch.randn(16, 1536)
    alone = torch.cat([linear(x[i : i + 1]) for i in range(16)])
    assert torch.equal(linear(x[:3]), alone[:3])
    assert any(not torch.equal(linear(x[:rows]), alone[:rows]) for rows in range(4, 17))
    torch.testing.assert_close(linear(x), alone, rtol=1e-5, atol=1e-4)  # entries of size ~40


def test_gguf_weights_match_transformers_dequantization(default_model_hf: LoadedModel) -> None:
    config = default_model_hf.config
    weights = GGUFWeights(default_model_path(), config.num_attention_heads, config.num_key_value_heads)
    state = default_model_hf.model.state_dict()
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                 "model.layers.7.mlp.down_proj.weight", "model.embed_tokens.weight", "model.norm.weight"):
        raw = weights.raw(name)
        value = raw if isinstance(raw, torch.Tensor) else raw.dequantize()
        assert torch.equal(value, state[name]), name  # the un-permuted query/key rows included
    assert weights.auto_format("model.layers.0.mlp.up_proj.weight") == "q4"
    assert weights.auto_format("lm_head.weight") == "q8"  # tied: the Q8_0 embedding


def test_native_float32_is_the_hf_model(default_model_hf: LoadedModel, default_model_native_f32: LoadedModel) -> None:
    tokens = default_model_hf.tokenizer("The capital of France is Paris, and the capital of Italy is")["input_ids"]
    layers = (0, 14, 29)
    outs = []
    for loaded in (default_model_hf, default_model_native_f32):
        cache = PreallocatedCache(loaded.num_layers, 64)
        positions = torch.arange(len(tokens))[None]
        outs.append(loaded.backend.forward(cache, torch.tensor([tokens]), positions, hidden_layers=layers))
    hf, native = outs
    # The same float32 arithmetic but for the order of sums (native attends per query) and, with
    # specdec's kernels, their exponential (a polynomial, relative error ~2e-7) in attention and SiLU.
    for layer in layers:
        torch.testing.assert_close(native.layer_states[layer], hf.layer_states[layer], rtol=1e-4, atol=2e-4)
    torch.testing.assert_close(native.logits, hf.logits, rtol=1e-4, atol=1e-3)
    # Greedy outputs of both backends on real prompts: float32 gives the same tokens.
    params = SamplingParams(max_tokens=24)
    for prompt in PROMPTS:
        assert (LLM(loaded=default_model_native_f32).chat(prompt, params).token_ids
                == LLM(loaded=default_model_hf).chat(prompt, params).token_ids)


@pytest.mark.parametrize("variant, tolerance", [("native-bfloat16", 0.05), ("native-int8", 0.08), ("native-auto", 0.08)])
def test_quantized_formats_stay_close_to_float32(default_model_variants, variant: str, tolerance: float) -> None:
    # Relative error of the logits over a real sentence against hf float32 (the GGUF's own values
    # dequantized): bfloat16 activations everywhere, plus int8 weights per channel; auto keeps the
    # file's Q4_1 and Q8_0 blocks and rounds the activations to int8 per block of 32 instead.
    reference = default_model_variants("hf-float32")
    loaded = default_model_variants(variant)
    tokens = reference.tokenizer("Speculative decoding verifies several guessed tokens in one pass.")["input_ids"]
    want = ModelRunner(reference).score(tokens)
    got = ModelRunner(loaded).score(tokens)
    assert relative_error(got, want) < tolerance
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.8


def test_native_weights_are_smaller(default_model: LoadedModel, default_model_native_f32: LoadedModel) -> None:
    assert default_model.backend.weight_format == "q4 (LM head q8)"
    # Q4_1 blocks (5 bits a weight with two float16s per 32) and a Q8_0 head, against float32.
    assert default_model.backend.matrix_bytes() < 0.2 * default_model_native_f32.backend.matrix_bytes()
    assert default_model.describe() == "native q4 (LM head q8)"


@pytest.mark.real  # the default model's GGUF file
def test_tensor_reader_reads_what_the_gguf_reader_reads() -> None:
    # The fast reader steps over metadata arrays (the tokenizer's): every tensor and every other
    # field must read exactly as the gguf package's own reader reads them.
    path = str(default_model_path())
    fast, plain = TensorReader(path), GGUFReader(path)
    assert (fast.data_offset, fast.alignment) == (plain.data_offset, plain.alignment)
    assert [t.name for t in fast.tensors] == [t.name for t in plain.tensors]
    for a, b in zip(fast.tensors, plain.tensors):
        assert (int(a.tensor_type), list(a.shape), a.data_offset, a.n_bytes) == (int(b.tensor_type), list(b.shape), b.data_offset, b.n_bytes)
        assert np.array_equal(a.data, b.data), a.name
    assert list(fast.fields) == list(plain.fields)
    arrays = 0
    for name, field in fast.fields.items():
        other = plain.fields[name]
        assert field.types == other.types, name
        if field.types[0] == GGUFValueType.ARRAY:  # its item type and length, not its items
            arrays += 1
            assert int(field.parts[-1][0]) == len(other.data), name
        else:
            assert [bytes(p) for p in field.parts] == [bytes(p) for p in other.parts] and field.data == other.data, name
    assert arrays >= 3  # the tokenizer's tokens, types and merges at least


def test_int8_groups_of_32_and_16_stack_as_groups_of_16_with_the_same_values() -> None:
    q8 = Int8Groups(*packing.quantize_q8(torch.randn(16, 64)))
    q6 = Int8Groups(torch.randint(-32, 32, (8, 64)), torch.rand(8, 4) / 100)
    both = Int8Groups.cat([q8, q6])
    assert both.group == 16 and torch.equal(both.dequantize(), torch.cat([q8.dequantize(), q6.dequantize()]))


def test_a_stacked_matrix_is_its_parts_side_by_side() -> None:
    # A Q4_K_M file's fused query/key/value: Q4_K groups (q4) beside Q6_K ones (q8), each packed
    # in its own format; the product is bitwise each part's, for any number of rows.
    q4 = PackedLinear.pack(Int4Groups(torch.randint(0, 16, (48, 64)), torch.rand(48, 2) / 50, -torch.rand(48, 2) / 50), "q4")
    q8 = PackedLinear.pack(Int8Groups(torch.randint(-32, 32, (16, 64)), torch.rand(16, 4) / 100), "q8")
    stacked = StackedLinear([q4, q8])
    assert stacked.formats == {"q4", "q8"} and stacked.out_features == 64 and stacked.nbytes == q4.nbytes + q8.nbytes
    assert torch.equal(stacked.dequantized(), torch.cat([q4.dequantized(), q8.dequantized()]))
    x, residual = torch.randn(5, 64), torch.randn(5, 64)
    want = torch.cat([q4(x), q8(x)], dim=1)
    assert torch.equal(stacked(x), want) and torch.equal(stacked(x, residual=residual), residual + want)
    assert all(torch.equal(stacked(x[i : i + 1]), want[i : i + 1]) for i in range(5))


@pytest.mark.parametrize("kind", ["q8", "q4_0", "q4_1", "q4_k", "q5_k", "q6_k", "float16", "float32"])
def test_the_embedding_keeps_the_files_blocks_and_looks_up_their_exact_rows(kind: str) -> None:
    # Rows gathered from the packed blocks and dequantized (specdec's kernel `embed_rows`, or
    # PyTorch's indexing) are bitwise the float32 table's, and a table that is the tied LM head's
    # is held once. K-quants' scales (products float16 cannot hold) in their float32 records.
    torch.manual_seed(3)
    weight = torch.randn(40, 96)
    small = lambda *shape: (torch.rand(*shape) / 500).half().float()  # noqa: E731 (float16 values)
    if kind == "q8":
        raw = Int8Groups(*packing.quantize_q8(weight))
    elif kind in ("q4_k", "q5_k"):
        raw = Int4Groups(torch.randint(0, 16 if kind == "q4_k" else 32, (40, 96)),
                         small(40, 3) * torch.randint(0, 64, (40, 3)), -small(40, 3) * torch.randint(0, 64, (40, 3)))
    elif kind == "q6_k":
        raw = Int8Groups(torch.randint(-32, 32, (40, 96)), small(40, 6) * torch.randint(-128, 128, (40, 6)))
    elif kind == "float32":
        raw = weight
    elif kind == "float16":  # float32 values that float16 holds exactly (an F16 file's): kept in float16
        raw = weight.half().float()
    else:
        q, d, m = packing.quantize_q4(weight)
        raw = Int4Groups(q, d, -8 * d if kind == "q4_0" else m)
    table = raw if isinstance(raw, torch.Tensor) else raw.dequantize()
    ids = torch.tensor([[0, 7, 39], [16, 16, 1]])
    own = Embedding.of(raw, PackedLinear.pack(torch.randn(40, 96), "float32"))
    assert torch.equal(own(ids), table[ids]) and torch.equal(own.full(), table)
    own._ops = None  # PyTorch's gather, where specdec's kernels are not built: the same bits
    assert torch.equal(own(ids), table[ids])
    assert own.nbytes == {"float32": table.numel() * 4, "float16": table.numel() * 2}.get(kind, own.table.nbytes)
    assert not own.shared
    if kind in ("q4_k", "q5_k", "q6_k"):
        records = {"q4_k": packing.Q4F_RECORD, "q5_k": packing.Q5_RECORD, "q6_k": packing.Q6_RECORD}
        assert own.table.tensors["weight"].shape[-1] == records[kind]
    if kind != "float32":
        lm_head = PackedLinear.pack(raw, {"q8": "q8", "q6_k": "q8", "float16": "f16"}.get(kind, "q4"))
        tied = Embedding.of(raw, lm_head)
        assert tied.table is lm_head and tied.nbytes == 0 and torch.equal(tied(ids), table[ids])


@pytest.mark.real
def test_the_default_models_weights_are_about_its_files_size(default_model: LoadedModel) -> None:
    size = Path(default_model_path()).stat().st_size
    assert default_model.backend.embed.shared  # SmolLM2's embedding is its LM head's table
    assert default_model.backend.weight_bytes() <= 1.3 * size


@pytest.mark.skipif(not kernels.available(), reason="specdec's kernels are not built on this machine")
def test_r8_runs_the_model_with_exact_passes_and_lossless_speculation(tiny_model_dir: Path) -> None:
    # --dtype r8: every matrix rotated int8 (the tiny model's widths divide by 64), its LM head
    # too, the embedding kept apart as the file stores it. A prompt's prefill is bitwise its
    # tokens decoded one by one, and speculation gives plain decoding's tokens.
    loaded = load_model(str(tiny_model_dir), backend="native", dtype="r8")
    assert loaded.backend.weight_format == "r8"
    reference_model = load_model(str(tiny_model_dir), backend="native", dtype="float32")
    runner = ModelRunner(loaded)
    tokens = [5, 9, 13, 7, 22, 31, 4, 8, 17, 3]
    together = runner.forward(runner.new_cache(16), tokens).logits
    cache = runner.new_cache(16)
    one_by_one = torch.cat([runner.forward(cache, [t]).logits for t in tokens])
    assert torch.equal(together, one_by_one)
    want = ModelRunner(reference_model).score(tokens)
    assert relative_error(together, want) < 0.05
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    prompt = "one two three one two three one two"
    plain = LLM(loaded=loaded).generate(prompt, params, speculate=False)[0]
    for config in ({"method": "ngram", "num_speculative_tokens": 4}, {"method": "suffix"}):
        assert LLM(loaded=loaded, speculative_config=config).generate(prompt, params)[0].token_ids == plain.token_ids


def test_r8_without_the_kernels_is_refused_with_the_reason(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "available", lambda: False)
    with pytest.raises(ModelLoadError, match="--dtype r8 runs on specdec's kernels"):
        load_model(str(tiny_model_dir), backend="native", dtype="r8")
