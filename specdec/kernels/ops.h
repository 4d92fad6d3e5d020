// The kernels' functions as the other sources call them (each defined in the file named).
#pragma once

// ATen's tensor alone, not <torch/extension.h> (pybind11 and the whole C++ API): the
// sources that include only this compile in a fraction of the time; bindings.cpp has the rest.
#include <ATen/core/Tensor.h>

#include "cpu.h"

#include <string>
#include <vector>

// Bytes per (unit of 16 output columns, block of 32 inputs) of the packed weights (quant.cpp).
constexpr int Q4_RECORD = 256 + 64;  // nibbles, then 16 float16 d and 16 float16 m
constexpr int Q4F_RECORD = 256 + 128;  // nibbles, then 16 float32 d and 16 float32 m (Q4_K's scales)
constexpr int Q5_RECORD = 512 + 128;   // q4's form with a byte a weight (0..31), 16 float32 d and m (Q5_K)
constexpr int Q8_RECORD = 512 + 32;  // int8, then 16 float16 d
constexpr int Q6_RECORD = 512 + 128;  // int8, then 16 float32 d of inputs 0..15 and 16 of 16..31 (Q6_K)

// A product's residual ([rows, out] float32, added in its stores) as a contiguous pointer, kept
// alive in `holder`; null where there is none.
inline const float* residual_rows(const c10::optional<at::Tensor>& residual, int64_t rows, int64_t out_features,
                                  at::Tensor& holder) {
    if (!residual) return nullptr;
    TORCH_CHECK(residual->scalar_type() == at::kFloat && residual->numel() == rows * out_features,
                "the residual must be [rows, out] float32");
    holder = residual->contiguous();
    return holder.data_ptr<float>();
}

// quant.cpp: x [rows, in] float32 times packed q4 (Q4_0/Q4_1/Q4_K) or q8 (Q8_0/Q5_0/Q6_K) weights, plus the
// residual where given -> [rows, out] float32; isa: a kernel path (cpu.h's Isa), as for every op below.
at::Tensor quantized_matmul(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                               int64_t isa, bool q4, const c10::optional<at::Tensor>& residual);

// rotated.cpp: x [rows, in] float32 times r8 weights ([units, in * 16 + 64] uint8: int8 a weight,
// a float32 scale a column, stored rotated) after the same rotation of x, plus the residual where
// given -> [rows, out] float32; and that rotation alone (x R, for tests).
at::Tensor r8_matmul(const at::Tensor& x, const at::Tensor& packed, int64_t out_features, int64_t isa,
                     const c10::optional<at::Tensor>& residual);
at::Tensor rotate_rows(const at::Tensor& x, int64_t isa);

// half.cpp: x [rows, in] float32 times float16 weights [out, in] (+ residual) -> [rows, out] float32.
at::Tensor half_matmul(const at::Tensor& x, const at::Tensor& w, int64_t out_features, int64_t isa,
                       const c10::optional<at::Tensor>& residual);

// attention.cpp
at::Tensor attend_cached(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                            const at::Tensor& counts, const at::Tensor& slots, double scale, int64_t isa);

// layer_ops.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
std::vector<at::Tensor> rotary_split(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                                        int64_t rows, int64_t heads, int64_t kv_heads, const at::Tensor& q_norm,
                                        const at::Tensor& k_norm, double eps);
at::Tensor silu_mul(const at::Tensor& h);
at::Tensor gelu_mul(const at::Tensor& h);
at::Tensor embed_rows(const at::Tensor& packed, const at::Tensor& ids, bool q8);
// distribution.cpp: x [rows, n] float32 -> [rows] int64, the first maximum's index (a NaN's, where
// the row holds one), as torch.argmax.
at::Tensor argmax_rows(const at::Tensor& x);
// logits [positions, vocab] float32, draft_ids [draft] int64 -> the first
// most likely token [positions], and the k most likely draft tokens' positions in draft_ids
// [positions, k] (best first; ties to the earlier position) and probabilities under the softmax
// over the whole vocabulary [positions, k] float32.
std::vector<at::Tensor> draft_distribution(const at::Tensor& logits, const at::Tensor& draft_ids, int64_t k);
// forward.cpp. A matrix per layer, as its parts (one, or several stacked over their outputs).
using LayerParts = std::vector<std::vector<at::Tensor>>;
// The weights of a run of decoder layers, as `forward_layers` reads them (see there), checked and
// gathered once: the backend keeps one per set of layers, so that a pass does not convert every
// layer's tensors from Python lists again (pybind11 converts a list element by element).
struct LayerWeights {
    LayerWeights(std::vector<at::Tensor> attn_norm, LayerParts qkv, std::vector<at::Tensor> qkv_bias,
                 std::vector<at::Tensor> q_norm, std::vector<at::Tensor> k_norm, LayerParts o,
                 std::vector<at::Tensor> mlp_norm, LayerParts gate_up, LayerParts down,
                 std::vector<at::Tensor> post_attn_norm, std::vector<at::Tensor> post_mlp_norm, std::vector<int64_t> parts);
    size_t layers() const { return attn_norm.size(); }

    std::vector<at::Tensor> attn_norm;
    LayerParts qkv;
    std::vector<at::Tensor> qkv_bias, q_norm, k_norm;
    LayerParts o;
    std::vector<at::Tensor> mlp_norm;
    LayerParts gate_up, down;
    std::vector<at::Tensor> post_attn_norm, post_mlp_norm;
    std::vector<int64_t> parts;
};
std::vector<at::Tensor> forward_layers(
    at::Tensor x, const LayerWeights& weights, std::vector<at::Tensor> keys, std::vector<at::Tensor> values,
    const at::Tensor& write_rows, const at::Tensor& write_slots, const at::Tensor& cos,
    const at::Tensor& sin, const at::Tensor& counts, const at::Tensor& slots, int64_t rows,
    int64_t heads, int64_t kv_heads, double eps, double scale, int64_t isa, const std::vector<int64_t>& keep,
    bool gelu);
// forward.cpp: a draft head's decoder layer (EAGLE-3's) in one call.
at::Tensor head_layer(
    const at::Tensor& embedded, const at::Tensor& features, const at::Tensor& input_norm, const at::Tensor& hidden_norm,
    const at::Tensor& mlp_norm, const std::vector<at::Tensor>& qkv, const std::vector<at::Tensor>& o,
    const std::vector<at::Tensor>& gate_up, const std::vector<at::Tensor>& down, const std::vector<int64_t>& parts,
    at::Tensor keys, at::Tensor values, const at::Tensor& write_slots, const at::Tensor& cos, const at::Tensor& sin,
    const at::Tensor& counts, const at::Tensor& slots, int64_t heads, int64_t kv_heads, double eps, double scale,
    int64_t isa);
