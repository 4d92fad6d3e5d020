"""Tiny GGUF files with random weights, written with the `gguf` package's writer: a model of
each architecture the native backend runs from GGUF, every matrix in one block format, quantized
blocks written raw (random quants, scales set to keep the activations in range), with the tiny
tokenizer as a byte-level BPE vocabulary. What `test_gguf_conformance.py` loads twice: natively,
and through transformers' own GGUF reader and dequantization."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, TokenType
from transformers import PreTrainedTokenizerFast

# Mistral's GGUF files are `llama` files (llama.cpp converts Mistral to that architecture, and the
# `gguf` package and transformers' reader know no other), so `llama` covers them.
ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3", "phi3")
FORMATS = ("F32", "F16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "Q3_K", "IQ4_NL", "IQ4_XS",
           "Q2_K")
# A mixture as llama.cpp's Q4_K_M writes one: Q6_K for the attention's value, the MLP's down
# projection and the LM head, Q4_K for the rest (so a fused query/key/value mixes the two).
MIXTURES = {"Q4_K_M": ("Q4_K", {"attn_v", "ffn_down", "output"}, "Q6_K")}

# Shapes: K-quants' superblocks are 256 inputs, so every matrix's input is a multiple of 256.
HIDDEN, HEADS, KV_HEADS, INTERMEDIATE, LAYERS = 256, 4, 2, 512, 2


def head_dim(architecture: str) -> int:
    # transformers reads Qwen3's from no key (its config's default, 128); the others' follow
    # hidden / heads or the file's key length.
    return 128 if architecture == "qwen3" else HIDDEN // HEADS
SLIDING_WINDOW = 8  # Gemma 3's sliding layers (layer 0 here; layer 1 is global)

# Bytes per block and where its float16 scales sit (with the value each takes): random quants
# under these scales give weights of roughly 0.02 to 0.1.
_BLOCKS = {
    "Q8_0": (34, 32, {0: 0.002}),
    "Q4_0": (18, 32, {0: 0.01}),
    "Q4_1": (20, 32, {0: 0.01, 2: -0.07}),
    "Q5_0": (22, 32, {0: 0.005}),
    "Q5_1": (24, 32, {0: 0.005, 2: -0.07}),
    "Q4_K": (144, 256, {0: 0.0002, 2: 0.0002}),
    "Q5_K": (176, 256, {0: 0.0001, 2: 0.0001}),
    "Q6_K": (210, 256, {208: 0.00005}),
    "Q3_K": (110, 256, {108: 0.0005}),
    "IQ4_NL": (18, 32, {0: 0.0005}),
    "IQ4_XS": (136, 256, {0: 0.00002}),
    "Q2_K": (84, 256, {80: 0.002, 82: 0.002}),
}


def _matrix(rows: int, cols: int, fmt: str, rng: np.random.Generator) -> tuple[np.ndarray, GGMLQuantizationType]:
    """A [rows, cols] matrix in `fmt`: float values, or raw blocks [rows, bytes per row]."""
    kind = GGMLQuantizationType[fmt]
    if fmt in ("F32", "F16"):
        values = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
        return (values if fmt == "F32" else values.astype(np.float16)), kind
    size, count, scales = _BLOCKS[fmt]
    raw = rng.integers(0, 256, (rows, cols // count, size), dtype=np.uint8)
    for offset, value in scales.items():
        jitter = value * (0.5 + rng.random((rows, cols // count)))
        raw[..., offset : offset + 2] = jitter.astype(np.float16)[..., None].view(np.uint8)
    return raw.reshape(rows, -1), kind


def write_tiny_gguf(path: Path, architecture: str, fmt: str, tokenizer: PreTrainedTokenizerFast, seed: int = 0) -> Path:
    """A random 2-layer `architecture` model with every matrix (embedding and LM head too) in
    `fmt` (a GGUF type, or a mixture of MIXTURES), its norms, biases and metadata as llama.cpp
    writes them."""
    rng = np.random.default_rng(seed)
    vocab = len(tokenizer)
    writer = GGUFWriter(str(path), architecture)
    writer.add_context_length(256)
    writer.add_block_count(LAYERS)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    dim = head_dim(architecture)
    writer.add_rope_dimension_count(dim)
    writer.add_key_length(dim)
    writer.add_value_length(dim)
    writer.add_vocab_size(vocab)
    if architecture == "gemma3":
        writer.add_sliding_window(SLIDING_WINDOW)
    # The tokenizer: byte-level BPE, its tokens in id order, its merges, its special ids.
    tokens = [tokenizer.convert_ids_to_tokens(i) for i in range(vocab)]
    special = set(tokenizer.all_special_ids)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([TokenType.CONTROL if i in special else TokenType.NORMAL for i in range(vocab)])
    writer.add_token_merges(_merges(tokenizer))
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)

    def add(name: str, array: np.ndarray, kind: GGMLQuantizationType | None = None) -> None:
        writer.add_tensor(name, array, raw_dtype=kind)

    def norm(dim: int) -> np.ndarray:
        # Gemma's norms multiply by the stored weight as is (llama.cpp stores 1 + w), as others'.
        return (1.0 + 0.2 * rng.standard_normal(dim)).astype(np.float32)

    def matrix(role: str, rows: int, cols: int) -> tuple[np.ndarray, GGMLQuantizationType]:
        base, roles, other = MIXTURES.get(fmt, (fmt, set(), fmt))
        return _matrix(rows, cols, other if role in roles else base, rng)

    add("token_embd.weight", *matrix("token_embd", vocab, HIDDEN))
    add("output_norm.weight", norm(HIDDEN))
    if architecture != "gemma3":  # Gemma 3 ties its LM head to the embedding
        add("output.weight", *matrix("output", vocab, HIDDEN))
    q, kv = HEADS * dim, KV_HEADS * dim
    for layer in range(LAYERS):
        blk = f"blk.{layer}."
        add(blk + "attn_norm.weight", norm(HIDDEN))
        if architecture == "phi3":  # query, key and value in one matrix; gate and up in another
            add(blk + "attn_qkv.weight", *matrix("attn_qkv", q + 2 * kv, HIDDEN))
            add(blk + "ffn_up.weight", *matrix("ffn_up", 2 * INTERMEDIATE, HIDDEN))
        else:
            add(blk + "attn_q.weight", *matrix("attn_q", q, HIDDEN))
            add(blk + "attn_k.weight", *matrix("attn_k", kv, HIDDEN))
            add(blk + "attn_v.weight", *matrix("attn_v", kv, HIDDEN))
            add(blk + "ffn_gate.weight", *matrix("ffn_gate", INTERMEDIATE, HIDDEN))
            add(blk + "ffn_up.weight", *matrix("ffn_up", INTERMEDIATE, HIDDEN))
        add(blk + "attn_output.weight", *matrix("attn_output", HIDDEN, q))
        add(blk + "ffn_down.weight", *matrix("ffn_down", HIDDEN, INTERMEDIATE))
        add(blk + "ffn_norm.weight", norm(HIDDEN))
        if architecture == "qwen2":
            for part, width in (("q", q), ("k", kv), ("v", kv)):
                add(blk + f"attn_{part}.bias", (0.5 * rng.standard_normal(width)).astype(np.float32))
        if architecture in ("qwen3", "gemma3"):
            add(blk + "attn_q_norm.weight", norm(dim))
            add(blk + "attn_k_norm.weight", norm(dim))
        if architecture == "gemma3":
            add(blk + "post_attention_norm.weight", norm(HIDDEN))
            add(blk + "post_ffw_norm.weight", norm(HIDDEN))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _merges(tokenizer: PreTrainedTokenizerFast) -> list[str]:
    """The BPE merges, "a b" each, as a GGUF file lists them."""
    model = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    return [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]
