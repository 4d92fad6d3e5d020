// The small per-layer operations of decoding, fused so that a layer is a handful of calls:
// RMSNorm, the rotary embedding with the query/key/value split, and SiLU(gate) * up. Each row
// (token) is computed alone in a fixed order, so a row's bits never depend on the rest of the pass.
// reference.py has each one's arithmetic in PyTorch, bit for bit.

#include "pool.h"
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <immintrin.h>

#include "ops.h"
#include "simd.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using specdec::exp8;
using specdec::horizontal_sum;

// x [rows, dim] -> x * (1 / sqrt(mean(x^2) + eps)) * weight, the sum of squares in 8 lanes then
// folded in a fixed order.
__attribute__((target("avx2,fma")))
void rms_norm_range(const float* x, const float* w, float* out, int64_t begin, int64_t end, int64_t dim, float eps) {
    for (int64_t r = begin; r < end; ++r) {
        const float* xr = x + r * dim;
        float* o = out + r * dim;
        __m256 acc = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 8 <= dim; i += 8) {
            const __m256 v = _mm256_loadu_ps(xr + i);
            acc = _mm256_add_ps(acc, _mm256_mul_ps(v, v));
        }
        float ss = horizontal_sum(acc);
        for (; i < dim; ++i) ss += xr[i] * xr[i];
        const float inverse = 1.0f / std::sqrt(ss / static_cast<float>(dim) + eps);
        const __m256 inv = _mm256_set1_ps(inverse);
        for (i = 0; i + 8 <= dim; i += 8)
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + i), inv), _mm256_loadu_ps(w + i)));
        for (; i < dim; ++i) o[i] = (xr[i] * inverse) * w[i];
    }
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
    TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "float32 only");
    const int64_t dim = x.size(-1);
    TORCH_CHECK(weight.dim() == 1 && weight.size(0) == dim, "weight must be [dim]");
    specdec::require_avx2();
    const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
    auto out = at::empty_like(xc);
    const float *xp = xc.data_ptr<float>(), *wp = wc.data_ptr<float>();
    float* op = out.data_ptr<float>();
    const float e = static_cast<float>(eps);
    specdec::parallel_chunks(xc.numel() / dim, 16, [&](int64_t begin, int64_t end) {
        rms_norm_range(xp, wp, op, begin, end, dim, e);
    });
    return out;
}

std::vector<at::Tensor> rotary_split(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                                        int64_t rows, int64_t heads, int64_t kv_heads, const at::Tensor& q_norm,
                                        const at::Tensor& k_norm, double eps) {
    // qkv [rows * new, (heads + 2 kv_heads) * head_dim]; cos, sin [rows * new, head_dim] (halves
    // repeated) -> q [rows, heads, new, head_dim] and k [rows, kv_heads, new, head_dim] rotated
    // (x cos - x_other sin on the first half, x cos + x_other sin on the second: the same float
    // operations as rotating by concatenation), v [rows, kv_heads, new, head_dim] copied. With
    // q_norm and k_norm [head_dim] (Qwen3's; empty tensors for none), each query and key head is
    // RMS-normed first, as `rms_norm` norms a row.
    TORCH_CHECK(qkv.dim() == 2 && qkv.scalar_type() == at::kFloat, "qkv must be [tokens, width] float32");
    const int64_t tokens = qkv.size(0), width = qkv.size(1), all = heads + 2 * kv_heads;
    TORCH_CHECK(width % all == 0 && tokens % rows == 0, "qkv does not split into heads and rows");
    const int64_t head_dim = width / all, half = head_dim / 2, nq = tokens / rows;
    TORCH_CHECK(cos.sizes() == at::IntArrayRef({tokens, head_dim}) && sin.sizes() == cos.sizes(),
                "cos and sin must be [tokens, head_dim]");
    const bool normed = q_norm.numel() > 0;
    TORCH_CHECK(!normed || (q_norm.numel() == head_dim && k_norm.numel() == head_dim && q_norm.scalar_type() == at::kFloat
                            && k_norm.scalar_type() == at::kFloat), "q_norm and k_norm must both be [head_dim] float32");
    if (normed) specdec::require_avx2();
    const at::Tensor x = qkv.contiguous(), c = cos.contiguous(), s = sin.contiguous();
    const at::Tensor qn = normed ? q_norm.contiguous() : q_norm, kn = normed ? k_norm.contiguous() : k_norm;
    const float e = static_cast<float>(eps);
    auto q = at::empty({rows, heads, nq, head_dim}, at::kFloat);
    auto k = at::empty({rows, kv_heads, nq, head_dim}, at::kFloat);
    auto v = at::empty({rows, kv_heads, nq, head_dim}, at::kFloat);
    const float *xp = x.data_ptr<float>(), *cp = c.data_ptr<float>(), *sp = s.data_ptr<float>();
    float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
    specdec::parallel_chunks(tokens, 16, [&](int64_t begin, int64_t end) {
        std::vector<float> normed_head(normed ? head_dim : 0);
        for (int64_t t = begin; t < end; ++t) {
            const int64_t r = t / nq, i = t % nq;
            const float *ct = cp + t * head_dim, *st = sp + t * head_dim;
            for (int64_t h = 0; h < all; ++h) {
                const float* src = xp + t * width + h * head_dim;
                if (normed && h < heads + kv_heads) {
                    rms_norm_range(src, (h < heads ? qn : kn).data_ptr<float>(), normed_head.data(), 0, 1, head_dim, e);
                    src = normed_head.data();
                }
                float* dst;
                if (h < heads) dst = qp + ((r * heads + h) * nq + i) * head_dim;
                else if (h < heads + kv_heads) dst = kp + ((r * kv_heads + h - heads) * nq + i) * head_dim;
                else {
                    std::memcpy(vp + ((r * kv_heads + h - heads - kv_heads) * nq + i) * head_dim, src,
                                sizeof(float) * head_dim);
                    continue;
                }
                for (int64_t d = 0; d < half; ++d) dst[d] = src[d] * ct[d] + (-src[d + half]) * st[d];
                for (int64_t d = half; d < head_dim; ++d) dst[d] = src[d] * ct[d] + src[d - half] * st[d];
            }
        }
    });
    return {q, k, v};
}

namespace {

// SiLU, g / (1 + exp(-g)).
struct Silu {
    __attribute__((target("avx2,fma"))) __m256 operator()(__m256 g) const {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
        return _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
    }
};

// GELU's tanh approximation, 0.5 g (1 + tanh(u)) with u = sqrt(2 / pi) (g + 0.044715 g^3), written
// as g / (1 + exp(-2u)) (the same function; no cancellation near 0).
struct Gelu {
    __attribute__((target("avx2,fma"))) __m256 operator()(__m256 g) const {
        const __m256 g3 = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
        const __m256 inner = _mm256_add_ps(g, _mm256_mul_ps(_mm256_set1_ps(0.044715f), g3));
        const __m256 e = exp8(_mm256_mul_ps(_mm256_set1_ps(-1.5957691216057308f), inner));  // -2 sqrt(2 / pi)
        return _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
    }
};

// Rows begin .. end of h [rows, 2 * inter] (gate, then up) -> Act(gate) * up.
template <class Act>
__attribute__((target("avx2,fma")))
void gated_range(const float* h, float* out, int64_t begin, int64_t end, int64_t inter) {
    for (int64_t r = begin; r < end; ++r) {
        const float* gate = h + r * 2 * inter;
        const float* up = gate + inter;
        float* o = out + r * inter;
        for (int64_t i = 0; i < inter; i += 8)
            _mm256_storeu_ps(o + i, _mm256_mul_ps(Act{}(_mm256_loadu_ps(gate + i)), _mm256_loadu_ps(up + i)));
    }
}

// h [rows, 2 * inter] (gate, then up) -> act(gate) * up [rows, inter], rows split between threads
// 16 at a time, as the norms: fewer rows cost less than moving them between cores.
template <class Act>
at::Tensor gated(const at::Tensor& h) {
    TORCH_CHECK(h.dim() == 2 && h.scalar_type() == at::kFloat && h.size(1) % 2 == 0, "h must be [rows, 2 * inter] float32");
    TORCH_CHECK(h.size(1) % 16 == 0, "inter must be a multiple of 8");
    specdec::require_avx2();
    const at::Tensor hc = h.contiguous();
    auto out = at::empty({h.size(0), h.size(1) / 2}, at::kFloat);
    const float* hp = hc.data_ptr<float>();
    float* op = out.data_ptr<float>();
    const int64_t inter = h.size(1) / 2;
    specdec::parallel_chunks(h.size(0), 16, [&](int64_t begin, int64_t end) { gated_range<Act>(hp, op, begin, end, inter); });
    return out;
}

}  // namespace

at::Tensor silu_mul(const at::Tensor& h) { return gated<Silu>(h); }

at::Tensor gelu_mul(const at::Tensor& h) { return gated<Gelu>(h); }

at::Tensor embed_rows(const at::Tensor& packed, const at::Tensor& ids, bool q8) {
    // packed: [units, blocks, record] uint8 (packing.pack_q8 or pack_q4: per block, the 16 rows'
    // quants interleaved, then their scales, and for q4 their mins, float16 or, in q4's 384-byte
    // records and q8's 640-byte ones (a scale per 16 inputs), float32); ids [n] int64 ->
    // [n, blocks * 32] float32, each value d * q (q8) or d * q + m (q4) in float32, two roundings
    // as GGUF's own dequantization (the build contracts no multiply-add). No parallel region: a
    // step looks up a few rows.
    constexpr int64_t unit = 16, block = 32;
    TORCH_CHECK(packed.dim() == 3, "packed must be [units, blocks, record]");
    const bool f32 = !q8 && packed.size(2) == Q4F_RECORD;
    const bool q5 = !q8 && packed.size(2) == Q5_RECORD;
    const bool q6 = q8 && packed.size(2) == Q6_RECORD;
    const int64_t record = q8 ? (q6 ? Q6_RECORD : Q8_RECORD) : q5 ? Q5_RECORD : f32 ? Q4F_RECORD : Q4_RECORD;
    TORCH_CHECK(packed.scalar_type() == at::kByte && packed.size(2) == record && packed.is_contiguous(),
                "packed must be a contiguous [units, blocks, ", record, "] uint8 tensor");
    TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong, "ids must be [n] int64");
    const int64_t units = packed.size(0), blocks = packed.size(1), n = ids.size(0);
    const at::Tensor idc = ids.contiguous();
    const int64_t* idp = idc.data_ptr<int64_t>();
    const uint8_t* base = packed.data_ptr<uint8_t>();
    auto out = at::empty({n, blocks * block}, at::kFloat);
    float* op = out.data_ptr<float>();
    for (int64_t r = 0; r < n; ++r) {
        const int64_t id = idp[r];
        TORCH_CHECK(id >= 0 && id < units * unit, "row ", id, " is outside the matrix's ", units * unit);
        const int64_t u = id / unit, c = id % unit;
        for (int64_t b = 0; b < blocks; ++b) {
            const uint8_t* rec = base + (u * blocks + b) * record;
            float* o = op + r * blocks * block + b * block;
            if (q8) {
                // quants: [j (8), column (16), i (4)] int8; value j * 4 + i of the block
                const float d = q6 ? 0.0f : static_cast<float>(reinterpret_cast<const at::Half*>(rec + 512)[c]);
                for (int j = 0; j < 8; ++j) {
                    // q6: inputs 0..15 (j < 4) and 16..31 each have their own float32 scale
                    const float dj = q6 ? reinterpret_cast<const float*>(rec + (j < 4 ? 512 : 576))[c] : d;
                    for (int i = 0; i < 4; ++i) {
                        o[j * 4 + i] = dj * static_cast<float>(static_cast<int8_t>(rec[(j * unit + c) * 4 + i]));
                    }
                }
            } else if (q5) {
                // q8's layout, unsigned values 0..31, then float32 d and m
                const float d = reinterpret_cast<const float*>(rec + 512)[c];
                const float m = reinterpret_cast<const float*>(rec + 576)[c];
                for (int j = 0; j < 8; ++j)
                    for (int i = 0; i < 4; ++i) o[j * 4 + i] = d * static_cast<float>(rec[(j * unit + c) * 4 + i]) + m;
            } else {
                // bytes: [p (4), column (16), i (4)], low nibble value p * 4 + i, high nibble 16 + p * 4 + i
                const float d = f32 ? reinterpret_cast<const float*>(rec + 256)[c]
                                    : static_cast<float>(reinterpret_cast<const at::Half*>(rec + 256)[c]);
                const float m = f32 ? reinterpret_cast<const float*>(rec + 320)[c]
                                    : static_cast<float>(reinterpret_cast<const at::Half*>(rec + 288)[c]);
                for (int p = 0; p < 4; ++p) {
                    for (int i = 0; i < 4; ++i) {
                        const uint8_t byte = rec[(p * unit + c) * 4 + i];
                        const float low = d * static_cast<float>(byte & 0x0F);
                        const float high = d * static_cast<float>(byte >> 4);
                        o[p * 4 + i] = low + m;
                        o[16 + p * 4 + i] = high + m;
                    }
                }
            }
        }
    }
    return out;
}
