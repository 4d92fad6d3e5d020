// The decoder layers of a short pass (a plain step, a verification, a tree) in one call: the same
// kernels, in the same order and on the same values as the native backend's Python loop calls
// them one by one, so the outputs are bitwise that loop's; what goes is the Python and dispatch
// between them (a dozen calls a layer, a third of a plain step on the default model) and the KV
// cache's copies, written here straight from the rotary embedding's output. reference.py composes
// its per-op references the same way.

#include <ATen/ops/add.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include "ops.h"


#include <cstring>
#include <vector>

namespace {

// A matrix's part kinds, as the Python side names them (each part's family: q4 and q8 records of
// 640 bytes are Q5_K's and Q6_K's, which only the kind tells apart).
enum PartKind : int64_t { PART_Q4 = 0, PART_Q8 = 1, PART_F16 = 2, PART_R8 = 3 };

// One matrix of a layer: its parts (one, or several stacked over their outputs, each in its own
// format) and each part's kind and outputs, read from the flat (kind, outputs) list at `spec`.
struct Matrix {
    const std::vector<at::Tensor>& parts;
    const int64_t* spec;
};

// The matrices of a call, in order, each taking its parts' entries off the flat list.
class Matrices {
   public:
    explicit Matrices(const std::vector<int64_t>& parts) : spec_(parts.data()) {}
    Matrix next(const std::vector<at::Tensor>& matrix_parts) {
        TORCH_CHECK(!matrix_parts.empty(), "a matrix has no parts");
        const Matrix m{matrix_parts, spec_};
        spec_ += 2 * matrix_parts.size();
        return m;
    }

   private:
    const int64_t* spec_;
};

at::Tensor part_product(const at::Tensor& x, const at::Tensor& w, int64_t kind, int64_t out_features, int64_t isa,
                        const c10::optional<at::Tensor>& residual) {
    if (kind == PART_F16) return half_matmul(x, w, out_features, isa, residual);
    if (kind == PART_R8) return r8_matmul(x, w, out_features, isa, residual);
    TORCH_CHECK(kind == PART_Q4 || kind == PART_Q8, "a layer's matrix part has an unknown kind ", kind);
    return quantized_matmul(x, w, out_features, isa, kind == PART_Q4, residual);
}

// x times the matrix, plus the residual where given: a stacked matrix's parts side by side, then
// the residual added (the Python loop's `residual + torch.cat(parts)`, the same bits).
at::Tensor product(const at::Tensor& x, const Matrix& m, int64_t isa, const c10::optional<at::Tensor>& residual = c10::nullopt) {
    if (m.parts.size() == 1) return part_product(x, m.parts[0], m.spec[0], m.spec[1], isa, residual);
    std::vector<at::Tensor> outs;
    for (size_t p = 0; p < m.parts.size(); ++p)
        outs.push_back(part_product(x, m.parts[p], m.spec[2 * p], m.spec[2 * p + 1], isa, c10::nullopt));
    const at::Tensor h = at::cat(outs, 1);
    return residual ? at::add(*residual, h) : h;
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

LayerWeights::LayerWeights(std::vector<at::Tensor> attn_norm, LayerParts qkv, std::vector<at::Tensor> qkv_bias,
                           std::vector<at::Tensor> q_norm, std::vector<at::Tensor> k_norm, LayerParts o,
                           std::vector<at::Tensor> mlp_norm, LayerParts gate_up, LayerParts down,
                           std::vector<at::Tensor> post_attn_norm, std::vector<at::Tensor> post_mlp_norm,
                           std::vector<int64_t> parts)
    : attn_norm(std::move(attn_norm)), qkv(std::move(qkv)), qkv_bias(std::move(qkv_bias)), q_norm(std::move(q_norm)),
      k_norm(std::move(k_norm)), o(std::move(o)), mlp_norm(std::move(mlp_norm)), gate_up(std::move(gate_up)),
      down(std::move(down)), post_attn_norm(std::move(post_attn_norm)), post_mlp_norm(std::move(post_mlp_norm)),
      parts(std::move(parts)) {
    const size_t n = layers();
    TORCH_CHECK(this->qkv.size() == n && this->qkv_bias.size() == n && this->q_norm.size() == n &&
                    this->k_norm.size() == n && this->o.size() == n && this->mlp_norm.size() == n &&
                    this->gate_up.size() == n && this->down.size() == n && this->post_attn_norm.size() == n &&
                    this->post_mlp_norm.size() == n,
                "one entry per layer in every list");
    size_t specs = 0;
    for (size_t i = 0; i < n; ++i)
        specs += this->qkv[i].size() + this->o[i].size() + this->gate_up[i].size() + this->down[i].size();
    TORCH_CHECK(this->parts.size() == 2 * specs, "parts: a kind and an output count for every matrix part");
}

// x [rows * new, hidden] float32 through the layers of `w`. Per layer i: attn_norm[i], qkv[i] (its
// parts: one packed matrix, or several stacked over their outputs), qkv_bias[i] (Qwen2's, added to
// the product as the loop's `qkv + bias`; an empty tensor for none), q_norm[i], k_norm[i] (Qwen3's
// and Gemma 3's per-head norms, as `rotary_split` applies them; empty for none), o[i], mlp_norm[i],
// gate_up[i], down[i], post_attn_norm[i] and post_mlp_norm[i] (Gemma 3's norms of the attention's
// and the MLP's outputs before they join the residual stream; empty for none), and its cache
// buffers keys[i], values[i] [R, kv_heads, S, head_dim]; token t = r * new + j writes slot
// write_slots[t] of buffer row write_rows[t], and attends as `attend_cached` does (counts, slots)
// over the first `rows` buffer rows. parts: (kind, outputs) of every matrix part, in the order
// layer, then qkv, o, gate_up, down, then part (kind: PartKind). gelu: GELU(gate) * up (Gemma)
// instead of SiLU. Returns x after the last layer, then x after each layer listed in `keep`
// (positions in the given list).
std::vector<at::Tensor> forward_layers(
    at::Tensor x, const LayerWeights& w, std::vector<at::Tensor> keys, std::vector<at::Tensor> values,
    const at::Tensor& write_rows, const at::Tensor& write_slots, const at::Tensor& cos,
    const at::Tensor& sin, const at::Tensor& counts, const at::Tensor& slots, int64_t rows,
    int64_t heads, int64_t kv_heads, double eps, double scale, int64_t isa, const std::vector<int64_t>& keep,
    bool gelu) {
    const size_t layers = w.layers();
    TORCH_CHECK(keys.size() == layers && values.size() == layers, "one cache buffer per layer");
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
    Matrices matrices(w.parts);
    for (size_t i = 0; i < layers; ++i) {
        const Matrix qkv_m = matrices.next(w.qkv[i]), o_m = matrices.next(w.o[i]), gate_up_m = matrices.next(w.gate_up[i]),
                     down_m = matrices.next(w.down[i]);
        at::Tensor h = product(rms_norm(x, w.attn_norm[i], eps), qkv_m, isa);
        if (w.qkv_bias[i].numel()) h = at::add(h, w.qkv_bias[i]);
        const std::vector<at::Tensor> qkv_rotated = rotary_split(h, cos, sin, rows, heads, kv_heads, w.q_norm[i], w.k_norm[i], eps);
        write_cache(qkv_rotated[1], keys[i], wr.data_ptr<int64_t>(), ws.data_ptr<int64_t>());
        write_cache(qkv_rotated[2], values[i], wr.data_ptr<int64_t>(), ws.data_ptr<int64_t>());
        const at::Tensor attended = attend_cached(qkv_rotated[0], keys[i].narrow(0, 0, rows),
                                                     values[i].narrow(0, 0, rows), counts, slots, scale, isa);
        // Each sublayer's output joins the residual stream in the product's stores, or, normed
        // first (Gemma 3), by one add: the Python loop's `x + norm(...)`.
        if (w.post_attn_norm[i].numel())
            x = at::add(x, rms_norm(product(attended.view({tokens, -1}), o_m, isa), w.post_attn_norm[i], eps));
        else x = product(attended.view({tokens, -1}), o_m, isa, x);
        const at::Tensor g = product(rms_norm(x, w.mlp_norm[i], eps), gate_up_m, isa);
        const at::Tensor act = gelu ? gelu_mul(g) : silu_mul(g);
        if (w.post_mlp_norm[i].numel()) x = at::add(x, rms_norm(product(act, down_m, isa), w.post_mlp_norm[i], eps));
        else x = product(act, down_m, isa, x);
        if (kept[i]) out.push_back(x);
    }
    out[0] = x;
    return out;
}

// A draft head's decoder layer (EAGLE-3's) over n positions of one sequence, in one call: its
// attention reads [rms_norm(embedded, input_norm), rms_norm(features, hidden_norm)] ([n, 2 *
// hidden]), its residual stream is `features` ([n, hidden]); then o, the MLP (SiLU, its input
// normed by mlp_norm) and their residual adds as a decoder layer. Matrices as forward_layers takes
// them (parts: each part's kind and outputs, qkv, o, gate_up, down in order); keys, values [1, kv_heads, S, head_dim]
// float32, position i writing slot write_slots[i] and attending as `attend_cached` does (counts
// [1, n], slots). What the drafter's PyTorch path computes, on the kernels, without the Python
// and the dozens of small operations between them, whose threading also slows the next pass.
at::Tensor head_layer(
    const at::Tensor& embedded, const at::Tensor& features, const at::Tensor& input_norm, const at::Tensor& hidden_norm,
    const at::Tensor& mlp_norm, const std::vector<at::Tensor>& qkv, const std::vector<at::Tensor>& o,
    const std::vector<at::Tensor>& gate_up, const std::vector<at::Tensor>& down, const std::vector<int64_t>& parts,
    at::Tensor keys, at::Tensor values, const at::Tensor& write_slots, const at::Tensor& cos, const at::Tensor& sin,
    const at::Tensor& counts, const at::Tensor& slots, int64_t heads, int64_t kv_heads, double eps, double scale,
    int64_t isa) {
    TORCH_CHECK(features.dim() == 2 && features.scalar_type() == at::kFloat && embedded.sizes() == features.sizes() &&
                    embedded.scalar_type() == at::kFloat,
                "embedded and features must both be [n, hidden] float32");
    TORCH_CHECK(keys.dim() == 4 && keys.size(0) == 1, "a head's cache buffers must be [1, kv_heads, S, head_dim]");
    TORCH_CHECK(parts.size() == 2 * (qkv.size() + o.size() + gate_up.size() + down.size()),
                "parts: a kind and an output count for every matrix part");
    const int64_t n = features.size(0);
    const at::Tensor ws = write_slots.to(at::kLong).contiguous();
    TORCH_CHECK(ws.numel() == n, "one cache write per position");
    const std::vector<int64_t> row_of(n, 0);
    Matrices matrices(parts);
    const Matrix qkv_m = matrices.next(qkv), o_m = matrices.next(o), gate_up_m = matrices.next(gate_up),
                 down_m = matrices.next(down);
    at::Tensor x = features.contiguous();
    const at::Tensor input = at::cat({rms_norm(embedded.contiguous(), input_norm, eps), rms_norm(x, hidden_norm, eps)}, 1);
    const at::Tensor none = at::empty({0}, at::kFloat);  // no per-head query and key norms
    const std::vector<at::Tensor> rotated =
        rotary_split(product(input, qkv_m, isa), cos, sin, 1, heads, kv_heads, none, none, eps);
    write_cache(rotated[1], keys, row_of.data(), ws.data_ptr<int64_t>());
    write_cache(rotated[2], values, row_of.data(), ws.data_ptr<int64_t>());
    const at::Tensor attended = attend_cached(rotated[0], keys, values, counts, slots, scale, isa);
    x = product(attended.view({n, -1}), o_m, isa, x);
    return product(silu_mul(product(rms_norm(x, mlp_norm, eps), gate_up_m, isa)), down_m, isa, x);
}
