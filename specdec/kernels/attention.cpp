// Attention of a few queries per row over the KV cache: a plain step, a chain verification, a
// token tree. Each (row, query, head) is computed alone, in the same order of operations whatever
// else the pass holds: scores q.k * scale over the slots the query sees (a prefix 0..n-1, or a
// tree node's own slot list), a max-subtracted softmax, and the weighted sum of the values. So a
// query's output is bitwise the same in a pass of one token or of many, which is what keeps a
// verification pass identical to plain decoding. One AVX2 + FMA path (every supported CPU has
// it); the exponential is simd.h's polynomial, not the C library's.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

using specdec::exp8;
using specdec::horizontal_sum;  // the softmax's sum

struct Item {
    const float* q;          // [head_dim]
    const float* keys;       // slot s at keys + s * slot_stride
    const float* values;
    int64_t slot_stride;
    const int32_t* slots;    // the slots seen, or null for 0 .. n - 1
    int64_t n;
    float* out;              // [head_dim]
};

__attribute__((target("avx2,fma")))
void attend_one(const Item& it, int64_t head_dim, float scale, std::vector<float>& scores) {
    if (it.n == 0) {  // a padding query that sees nothing: zeros, not NaN
        for (int64_t d = 0; d < head_dim; ++d) it.out[d] = 0.0f;
        return;
    }
    scores.resize(static_cast<size_t>(it.n) + 8);
    const int64_t chunks = head_dim / 8;
    // 1. scores, 8 keys at a time; each key's dot product is the same fixed tree whatever its
    //    place in a block (a tail block repeats its last key and drops the copies)
    float top = -INFINITY;
    for (int64_t j0 = 0; j0 < it.n; j0 += 8) {
        const float* k[8];
        for (int jj = 0; jj < 8; ++jj) {
            const int64_t j = std::min<int64_t>(j0 + jj, it.n - 1);
            k[jj] = it.keys + (it.slots ? it.slots[j] : j) * it.slot_stride;
        }
        __m256 acc[8];
        for (int jj = 0; jj < 8; ++jj) acc[jj] = _mm256_setzero_ps();
        for (int64_t c = 0; c < chunks; ++c) {
            const __m256 qc = _mm256_loadu_ps(it.q + 8 * c);
            for (int jj = 0; jj < 8; ++jj) acc[jj] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k[jj] + 8 * c), acc[jj]);
        }
        const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
        const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]), _mm256_hadd_ps(acc[6], acc[7]));
        const __m256 dots = _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
        alignas(32) float block[8];
        _mm256_store_ps(block, _mm256_mul_ps(dots, _mm256_set1_ps(scale)));
        for (int jj = 0; jj < 8 && j0 + jj < it.n; ++jj) {
            scores[j0 + jj] = block[jj];
            top = block[jj] > top ? block[jj] : top;
        }
    }
    // 2. softmax weights (unnormalized) and their sum, 8 at a time
    __m256 total = _mm256_setzero_ps();
    const __m256 shift = _mm256_set1_ps(top);
    int64_t j = 0;
    for (; j + 8 <= it.n; j += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(&scores[j]), shift));
        _mm256_storeu_ps(&scores[j], e);
        total = _mm256_add_ps(total, e);
    }
    if (j < it.n) {
        alignas(32) float tail[8];
        for (int i = 0; i < 8; ++i) tail[i] = j + i < it.n ? scores[j + i] - top : -INFINITY;
        const __m256 e = exp8(_mm256_load_ps(tail));
        _mm256_store_ps(tail, e);
        for (int i = 0; j + i < it.n; ++i) scores[j + i] = tail[i];
        total = _mm256_add_ps(total, _mm256_blendv_ps(_mm256_setzero_ps(), e,
                                                       _mm256_castsi256_ps(_mm256_cmpgt_epi32(
                                                           _mm256_set1_epi32(static_cast<int>(it.n - j)),
                                                           _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)))));
    }
    const float inverse = 1.0f / horizontal_sum(total);
    // 3. the weighted sum of the values, up to 256 dimensions in registers per pass of 8 chunks
    for (int64_t c0 = 0; c0 < chunks; c0 += 8) {
        const int64_t width = std::min<int64_t>(8, chunks - c0);
        __m256 acc[8];
        for (int c = 0; c < 8; ++c) acc[c] = _mm256_setzero_ps();
        for (int64_t jj = 0; jj < it.n; ++jj) {
            const int64_t slot = it.slots ? it.slots[jj] : jj;
            const float* v = it.values + slot * it.slot_stride + 8 * c0;
            const __m256 w = _mm256_set1_ps(scores[jj]);
            for (int c = 0; c < width; ++c) acc[c] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8 * c), acc[c]);
        }
        const __m256 inv = _mm256_set1_ps(inverse);
        for (int c = 0; c < width; ++c) _mm256_storeu_ps(it.out + 8 * (c0 + c), _mm256_mul_ps(acc[c], inv));
    }
}

}  // namespace

torch::Tensor attend_cached(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
                            const torch::Tensor& counts, const torch::Tensor& slots, double scale) {
    // q [rows, heads, new, head_dim]; keys, values [rows, kv_heads, S, head_dim] (any strides but
    // the last); counts [rows, new] int32; slots [rows, new, L] int32 or empty -> [rows, new, heads * head_dim]
    TORCH_CHECK(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"), "this CPU has no AVX2 and FMA");
    TORCH_CHECK(q.dim() == 4 && q.scalar_type() == torch::kFloat32, "q must be [rows, heads, new, head_dim] float32");
    TORCH_CHECK(keys.dim() == 4 && values.sizes() == keys.sizes() && keys.scalar_type() == torch::kFloat32 &&
                    values.scalar_type() == torch::kFloat32, "keys and values must be one [rows, kv_heads, S, head_dim] float32 shape");
    TORCH_CHECK(keys.stride(3) == 1 && values.stride(3) == 1 && keys.strides() == values.strides(),
                "keys and values must share strides, with contiguous head dimensions");
    const int64_t rows = q.size(0), heads = q.size(1), nq = q.size(2), head_dim = q.size(3);
    const int64_t kv_heads = keys.size(1), span = keys.size(2);
    TORCH_CHECK(keys.size(0) == rows && keys.size(3) == head_dim && heads % kv_heads == 0, "q and keys do not match");
    TORCH_CHECK(head_dim % 8 == 0, "head_dim must be a multiple of 8");
    TORCH_CHECK(counts.scalar_type() == torch::kInt32 && counts.sizes() == torch::IntArrayRef({rows, nq}),
                "counts must be [rows, new] int32");
    const bool listed = slots.numel() > 0;
    TORCH_CHECK(!listed || (slots.scalar_type() == torch::kInt32 && slots.dim() == 3 && slots.size(0) == rows &&
                            slots.size(1) == nq), "slots must be [rows, new, L] int32");
    const torch::Tensor qc = q.contiguous(), cc = counts.contiguous(), sc = listed ? slots.contiguous() : slots;
    const int32_t* count = cc.data_ptr<int32_t>();
    for (int64_t i = 0; i < rows * nq; ++i) {
        TORCH_CHECK(count[i] >= 0 && count[i] <= (listed ? sc.size(2) : span), "a query sees past the cache");
    }
    if (listed) {
        const int32_t* s = sc.data_ptr<int32_t>();
        for (int64_t i = 0; i < sc.numel(); ++i) TORCH_CHECK(s[i] >= 0 && s[i] < span, "a slot index is past the cache");
    }
    auto out = torch::empty({rows, nq, heads * head_dim}, torch::kFloat32);
    const float* qp = qc.data_ptr<float>();
    const float* kp = keys.data_ptr<float>();
    const float* vp = values.data_ptr<float>();
    float* op = out.data_ptr<float>();
    const int64_t group = heads / kv_heads;
    const float fscale = static_cast<float>(scale);
    at::parallel_for(0, rows * nq * heads, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> scores;
        for (int64_t item = begin; item < end; ++item) {
            const int64_t h = item % heads, i = (item / heads) % nq, r = item / (heads * nq);
            const int64_t kvh = h / group;
            const Item it{qp + ((r * heads + h) * nq + i) * head_dim,
                          kp + r * keys.stride(0) + kvh * keys.stride(1),
                          vp + r * values.stride(0) + kvh * values.stride(1),
                          keys.stride(2),
                          listed ? sc.data_ptr<int32_t>() + (r * nq + i) * sc.size(2) : nullptr,
                          count[r * nq + i],
                          op + (r * nq + i) * heads * head_dim + h * head_dim};
            attend_one(it, head_dim, fscale, scores);
        }
    });
    return out;
}
