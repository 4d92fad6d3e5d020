// The decoder layers of a short pass (a plain step, a verification, a tree) in one call: the same
// kernels, in the same order and on the same values as the native backend's Python loop calls
// them one by one, so the outputs are bitwise that loop's; what goes is the Python and dispatch
// between them (a dozen calls a layer, a third of a plain step on the default model) and the KV
// cache's copies, written here straight from the rotary embedding's output.

#include <ATen/ops/add.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include "ops.h"


#include <cstring>
#include <vector>

namespace {

at::Tensor product(const at::Tensor& x, const at::Tensor& packed, int64_t out_features, int64_t isa,
                      const c10::optional<at::Tensor>& residual = c10::nullopt) {
    if (packed.dim() == 2 && packed.scalar_type() == at::kHalf) return half_matmul(x, packed, out_features, isa, residual);
    TORCH_CHECK(packed.dim() == 3, "a layer's matrices must be packed q4 or q8, or float16");
    const int64_t record = packed.size(2);
    TORCH_CHECK(record == Q4_RECORD || record == Q4F_RECORD || record == Q8_RECORD || record == Q6_RECORD,
                "a layer's matrices must be packed q4 or q8 (the one-call forward takes no Q5_K records)");
    return quantized_matmul(x, packed, out_features, isa, record == Q4_RECORD || record == Q4F_RECORD, residual);
}

// n floats to float16 bits, rounded to nearest even (F16C's conversion, as torch's .half()).
__attribute__((target("avx2,f16c")))
void to_half(const float* src, at::Half* dst, int64_t n) {
    int64_t e = 0;
    for (; e + 8 <= n; e += 8)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + e),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    for (; e < n; ++e) dst[e] = at::Half(src[e]);
}

// k or v [rows, kv_heads, new, head_dim] into buf [R, kv_heads, S, head_dim] at (row, slot) per
// token; a float16 buffer takes each element rounded to nearest even, as torch's .half() does.
void write_cache(const at::Tensor& states, at::Tensor& buf, const int64_t* row_of, const int64_t* slot_of) {
    const int64_t rows = states.size(0), kv_heads = states.size(1), nq = states.size(2), head_dim = states.size(3);
    TORCH_CHECK(buf.size(1) == kv_heads && buf.size(3) == head_dim && buf.stride(3) == 1, "a cache buffer does not match");
    const bool half = buf.scalar_type() == at::kHalf;
    TORCH_CHECK(half || buf.scalar_type() == at::kFloat, "a cache buffer must be float32 or float16");
    const float* src = states.data_ptr<float>();
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t i = 0; i < nq; ++i) {
            const int64_t t = r * nq + i, row = row_of[t], slot = slot_of[t];
            TORCH_CHECK(row >= 0 && row < buf.size(0) && slot >= 0 && slot < buf.size(2), "a cache write is out of range");
            for (int64_t h = 0; h < kv_heads; ++h) {
                const int64_t offset = row * buf.stride(0) + h * buf.stride(1) + slot * buf.stride(2);
                const float* from = src + ((r * kv_heads + h) * nq + i) * head_dim;
                if (half) to_half(from, buf.data_ptr<at::Half>() + offset, head_dim);
                else std::memcpy(buf.data_ptr<float>() + offset, from, sizeof(float) * head_dim);
            }
        }
}

}  // namespace

// x [rows * new, hidden] float32 through the given layers. Per layer i: attn_norm[i], qkv[i] (packed),
// qkv_bias[i] (Qwen2's, added to the product as the loop's `qkv + bias`; an empty tensor for none),
// q_norm[i], k_norm[i] (Qwen3's and Gemma 3's per-head norms, as `rotary_split` applies them; empty
// for none), o[i], mlp_norm[i], gate_up[i], down[i], post_attn_norm[i] and post_mlp_norm[i] (Gemma
// 3's norms of the attention's and the MLP's outputs before they join the residual stream; empty
// for none), and its cache buffers keys[i], values[i] [R, kv_heads, S, head_dim]; token
// t = r * new + j writes slot write_slots[t] of buffer row write_rows[t], and attends as
// `attend_cached` does (counts, slots) over the first `rows` buffer rows. widths: the outputs of
// qkv, o, gate_up and down. gelu: GELU(gate) * up (Gemma) instead of SiLU. Returns x after the
// last layer, then x after each layer listed in `keep` (positions in the given list).
std::vector<at::Tensor> forward_layers(
    at::Tensor x, const std::vector<at::Tensor>& attn_norm, const std::vector<at::Tensor>& qkv,
    const std::vector<at::Tensor>& qkv_bias, const std::vector<at::Tensor>& q_norm, const std::vector<at::Tensor>& k_norm,
    const std::vector<at::Tensor>& o, const std::vector<at::Tensor>& mlp_norm,
    const std::vector<at::Tensor>& gate_up, const std::vector<at::Tensor>& down,
    const std::vector<at::Tensor>& post_attn_norm, const std::vector<at::Tensor>& post_mlp_norm,
    std::vector<int64_t> widths, std::vector<at::Tensor> keys, std::vector<at::Tensor> values,
    const at::Tensor& write_rows, const at::Tensor& write_slots, const at::Tensor& cos,
    const at::Tensor& sin, const at::Tensor& counts, const at::Tensor& slots, int64_t rows,
    int64_t heads, int64_t kv_heads, double eps, double scale, int64_t isa, const std::vector<int64_t>& keep,
    bool gelu) {
    const size_t layers = attn_norm.size();
    TORCH_CHECK(qkv.size() == layers && qkv_bias.size() == layers && q_norm.size() == layers && k_norm.size() == layers &&
                o.size() == layers && mlp_norm.size() == layers && gate_up.size() == layers &&
                    down.size() == layers && post_attn_norm.size() == layers && post_mlp_norm.size() == layers &&
                    keys.size() == layers && values.size() == layers,
                "one entry per layer in every list");
    TORCH_CHECK(widths.size() == 4, "widths: qkv, o, gate_up, down");
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(0) % rows == 0, "x must be [rows * new, hidden] float32");
    const int64_t tokens = x.size(0);
    const at::Tensor wr = write_rows.to(at::kLong).contiguous(), ws = write_slots.to(at::kLong).contiguous();
    TORCH_CHECK(wr.numel() == tokens && ws.numel() == tokens, "one cache write per token");
    std::vector<bool> kept(layers, false);
    for (int64_t i : keep) {
        TORCH_CHECK(i >= 0 && static_cast<size_t>(i) < layers, "keep names a layer not run");
        kept[i] = true;
    }
    std::vector<at::Tensor> out{at::Tensor()};
    for (size_t i = 0; i < layers; ++i) {
        at::Tensor h = product(rms_norm(x, attn_norm[i], eps), qkv[i], widths[0], isa);
        if (qkv_bias[i].numel()) h = at::add(h, qkv_bias[i]);
        const std::vector<at::Tensor> qkv_rotated = rotary_split(h, cos, sin, rows, heads, kv_heads, q_norm[i], k_norm[i], eps);
        write_cache(qkv_rotated[1], keys[i], wr.data_ptr<int64_t>(), ws.data_ptr<int64_t>());
        write_cache(qkv_rotated[2], values[i], wr.data_ptr<int64_t>(), ws.data_ptr<int64_t>());
        const at::Tensor attended = attend_cached(qkv_rotated[0], keys[i].narrow(0, 0, rows),
                                                     values[i].narrow(0, 0, rows), counts, slots, scale, isa);
        // Each sublayer's output joins the residual stream in the product's stores, or, normed
        // first (Gemma 3), by one add: the Python loop's `x + norm(...)`.
        if (post_attn_norm[i].numel())
            x = at::add(x, rms_norm(product(attended.view({tokens, -1}), o[i], widths[1], isa), post_attn_norm[i], eps));
        else x = product(attended.view({tokens, -1}), o[i], widths[1], isa, x);
        const at::Tensor g = product(rms_norm(x, mlp_norm[i], eps), gate_up[i], widths[2], isa);
        const at::Tensor act = gelu ? gelu_mul(g) : silu_mul(g);
        if (post_mlp_norm[i].numel()) x = at::add(x, rms_norm(product(act, down[i], widths[3], isa), post_mlp_norm[i], eps));
        else x = product(act, down[i], widths[3], isa, x);
        if (kept[i]) out.push_back(x);
    }
    out[0] = x;
    return out;
}
