// Attention of a few queries per row over the KV cache: a plain step, a chain verification, a
// token tree. Each (row, query, head) is computed alone, in the same order of operations whatever
// else the pass holds: scores q.k * scale over the slots the query sees (a prefix 0..n-1, or a
// tree node's own slot list), a max-subtracted softmax, and the weighted sum of the values. So a
// query's output is bitwise the same in a pass of one token or of many, which is what keeps a
// verification pass identical to plain decoding. The heads that share a key/value head are computed
// together (each key and value loaded once for them), each with its own unchanged arithmetic. An
// AVX2 + FMA path (every supported CPU has it) and an AVX-512 one, chosen as the products' path is;
// the exponential is simd.h's polynomial, not the C library's. Keys and values are float32 or
// float16 (the cache's format; each element widened exactly on load, then the same arithmetic).
// reference.py's attend_cached is the same arithmetic in PyTorch, for either width of the scores.

#include "pool.h"
#include <ATen/ops/empty.h>
#include <immintrin.h>

#include "ops.h"
#include "simd.h"

#include <algorithm>
#include <type_traits>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

using specdec::exp8;
using specdec::horizontal_sum;  // the softmax's sum

// 8 or 16 keys' or values' elements as float32: a float32 cache's as they are, a float16 cache's
// (uint16_t bits) widened exactly.
__attribute__((target("avx2,fma,f16c"))) inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
__attribute__((target("avx2,fma,f16c"))) inline __m256 load8(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
__attribute__((target("avx512f,avx2,fma,f16c"))) inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
__attribute__((target("avx512f,avx2,fma,f16c"))) inline __m512 load16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Scores -> exp(score - highest) in place, 8 at a time from `j` (the elements before it done, their
// exponentials summed into `total`), and 1 / their sum (summed in 8 lanes in order, then folded in
// a fixed order): the softmax's weights, normalized at the end.
__attribute__((target("avx2,fma")))
float softmax_from(float* sc, int64_t n, float highest, int64_t j, __m256 total) {
    const __m256 shift = _mm256_set1_ps(highest);
    for (; j + 8 <= n; j += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + j), shift));
        _mm256_storeu_ps(sc + j, e);
        total = _mm256_add_ps(total, e);
    }
    if (j < n) {
        alignas(32) float tail[8];
        for (int i = 0; i < 8; ++i) tail[i] = j + i < n ? sc[j + i] - highest : -INFINITY;
        const __m256 e = exp8(_mm256_load_ps(tail));
        _mm256_store_ps(tail, e);
        for (int i = 0; j + i < n; ++i) sc[j + i] = tail[i];
        total = _mm256_add_ps(total, _mm256_blendv_ps(_mm256_setzero_ps(), e,
                                                       _mm256_castsi256_ps(_mm256_cmpgt_epi32(
                                                           _mm256_set1_epi32(static_cast<int>(n - j)),
                                                           _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)))));
    }
    return 1.0f / horizontal_sum(total);
}

__attribute__((target("avx2,fma")))
float softmax_weights(float* sc, int64_t n, float highest) {
    return softmax_from(sc, n, highest, 0, _mm256_setzero_ps());
}

// The same, 16 exponentials at a time (exp16: exp8's operations per lane) and each 16 summed as
// their two 8s in turn: the same bits as softmax_weights.
__attribute__((target("avx512f,avx512dq,avx2,fma")))
float softmax_weights16(float* sc, int64_t n, float highest) {
    __m256 total = _mm256_setzero_ps();
    const __m512 shift = _mm512_set1_ps(highest);
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
        const __m512 e = specdec::exp16(_mm512_sub_ps(_mm512_loadu_ps(sc + j), shift));
        _mm512_storeu_ps(sc + j, e);
        total = _mm256_add_ps(total, _mm512_castps512_ps256(e));
        total = _mm256_add_ps(total, _mm512_extractf32x8_ps(e, 1));
    }
    return softmax_from(sc, n, highest, j, total);
}

// The element type of a cache (float, or uint16_t for float16) as a value, to choose a template.
template <typename T>
struct Element {
    using type = T;
};

// One query of one row, for HG query heads that share a key/value head (grouped-query attention):
// each key and value is loaded once for all HG heads. Every head's arithmetic is the same
// sequence of operations as it would be alone, so the bits do not depend on the grouping.
template <int HG, typename T>
struct Heads {
    const float* q[HG];      // [head_dim] each
    float* out[HG];          // [head_dim] each
    const T* keys;           // slot s at keys + s * slot_stride (T: float, or uint16_t for float16)
    const T* values;
    int64_t slot_stride;
    const int32_t* slots;    // the slots seen, or null for 0 .. n - 1
    int64_t n;               // slots seen, at least 1 (the caller gives a query that sees none zeros)
    int64_t head_dim;
    // The keys the thread reads next, after these (the next query's: its slots, or null for a
    // prefix, and how many; null and 0 for none), where prefetching runs on into them.
    const T* next_keys;
    const int32_t* next_slots;
    int64_t next_n;
    // Whether to prefetch at all: not for a row's later queries in a pass of one row, whose
    // slots its first query has just brought into the caches (there it only cost time).
    bool fetch_ahead;

    int64_t slot(int64_t j) const { return slots ? slots[j] : j; }

    // Asked for while the scores of the slots j0 .. j0 + 15 are computed: the cache lines of the
    // values of these 16 slots and of the keys of the next 16, running on into the next query's
    // keys. A query reads one key/value head's slots, short streams (a few KB each) that the
    // hardware prefetcher picks up late, and stalls most at each one's start, which many rows of
    // short contexts make the common case (benchmarks/attention_ab.py measures it). Prefetches
    // only: the arithmetic, and so the bits, are untouched.
    void prefetch(int64_t j0) const {
        if (!fetch_ahead) return;
        const int64_t bytes = head_dim * static_cast<int64_t>(sizeof(T)), end = std::min<int64_t>(j0 + PREFETCH_SLOTS, n);
        if (!slots && slot_stride == head_dim) {  // a prefix: two ranges of lines
            lines(values + j0 * slot_stride, (end - j0) * bytes);
            const int64_t ahead = std::min<int64_t>(j0 + 2 * PREFETCH_SLOTS, n) - (j0 + PREFETCH_SLOTS);
            if (ahead > 0) lines(keys + (j0 + PREFETCH_SLOTS) * slot_stride, ahead * bytes);
        } else {
            for (int64_t j = j0; j < end; ++j) lines(values + slot(j) * slot_stride, bytes);
            for (int64_t j = j0 + PREFETCH_SLOTS; j < std::min<int64_t>(j0 + 2 * PREFETCH_SLOTS, n); ++j)
                lines(keys + slot(j) * slot_stride, bytes);
        }
        // the part of the window j0 + 16 .. j0 + 31 past n: the next query's first keys
        const int64_t last = std::min<int64_t>(j0 + 2 * PREFETCH_SLOTS - n, next_n);
        for (int64_t j = std::max<int64_t>(j0 + PREFETCH_SLOTS - n, 0); j < last; ++j)
            lines(next_keys + (next_slots ? next_slots[j] : j) * slot_stride, bytes);
    }

   private:
    static constexpr int64_t PREFETCH_SLOTS = 16;
    // (as asm: GCC deletes a loop of prefetch builtins whose count it does not know, as having no effect)
    static void lines(const T* at, int64_t bytes) {
        const char* p = reinterpret_cast<const char*>(at);
        for (int64_t b = 0; b < bytes; b += 64) asm volatile("prefetcht0 %0" : : "m"(p[b]));
    }
};

template <int HG, typename T>
__attribute__((target("avx2,fma,f16c")))
void attend_heads(const Heads<HG, T>& it, float scale, std::vector<float>& buffer) {
    const int64_t stride = it.n + 8;  // room for a tail block's copies
    buffer.resize(static_cast<size_t>(HG * stride));
    float* scores[HG];
    for (int h = 0; h < HG; ++h) scores[h] = buffer.data() + h * stride;
    const int64_t chunks = it.head_dim / 8;

    // 1. scores, 4 keys at a time: each key's dot product is 8-wide FMAs over the chunks in order,
    //    then the fixed tree ((0+1)+(2+3)) + ((4+5)+(6+7)) of its lanes, whatever its place in a
    //    block (a tail block repeats its last key; the copies land past n and are never read).
    __m128 top[HG];
    for (int h = 0; h < HG; ++h) top[h] = _mm_set1_ps(-INFINITY);
    for (int64_t j0 = 0; j0 < it.n; j0 += 4) {
        if (j0 % 16 == 0) it.prefetch(j0);
        const T* k[4];
        for (int jj = 0; jj < 4; ++jj) k[jj] = it.keys + it.slot(std::min<int64_t>(j0 + jj, it.n - 1)) * it.slot_stride;
        __m256 acc[HG][4];
        for (int h = 0; h < HG; ++h)
            for (int jj = 0; jj < 4; ++jj) acc[h][jj] = _mm256_setzero_ps();
        for (int64_t c = 0; c < chunks; ++c) {
            for (int jj = 0; jj < 4; ++jj) {
                const __m256 kc = load8(k[jj] + 8 * c);
                for (int h = 0; h < HG; ++h) acc[h][jj] = _mm256_fmadd_ps(_mm256_loadu_ps(it.q[h] + 8 * c), kc, acc[h][jj]);
            }
        }
        for (int h = 0; h < HG; ++h) {
            const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(acc[h][0], acc[h][1]), _mm256_hadd_ps(acc[h][2], acc[h][3]));
            const __m128 dots = _mm_mul_ps(_mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1)),
                                           _mm_set1_ps(scale));
            _mm_storeu_ps(scores[h] + j0, dots);
            top[h] = _mm_max_ps(top[h], dots);  // a copy's score equals its key's: the maximum holds
        }
    }

    // 2. per head, softmax weights (unnormalized) and their sum
    float inverse[HG];
    for (int h = 0; h < HG; ++h) {
        __m128 m = _mm_max_ps(top[h], _mm_movehl_ps(top[h], top[h]));
        m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
        inverse[h] = softmax_weights(scores[h], it.n, _mm_cvtss_f32(m));
    }

    // 3. the weighted sums of the values, 2 chunks (16 dimensions) at a time: the HG x 2
    //    accumulators, two value vectors and a weight fit the 16 AVX2 registers (4 chunks spill);
    //    every element sums over the slots in order, whatever the chunking
    for (int64_t c0 = 0; c0 < chunks; c0 += 2) {
        const int width = static_cast<int>(std::min<int64_t>(2, chunks - c0));
        __m256 acc[HG][2];
        for (int h = 0; h < HG; ++h) acc[h][0] = acc[h][1] = _mm256_setzero_ps();
        if (width == 2) {
            for (int64_t j = 0; j < it.n; ++j) {
                const T* v = it.values + it.slot(j) * it.slot_stride + 8 * c0;
                const __m256 v0 = load8(v), v1 = load8(v + 8);
                for (int h = 0; h < HG; ++h) {
                    const __m256 w = _mm256_broadcast_ss(scores[h] + j);
                    acc[h][0] = _mm256_fmadd_ps(w, v0, acc[h][0]);
                    acc[h][1] = _mm256_fmadd_ps(w, v1, acc[h][1]);
                }
            }
        } else {
            for (int64_t j = 0; j < it.n; ++j) {
                const __m256 v0 = load8(it.values + it.slot(j) * it.slot_stride + 8 * c0);
                for (int h = 0; h < HG; ++h) acc[h][0] = _mm256_fmadd_ps(_mm256_broadcast_ss(scores[h] + j), v0, acc[h][0]);
            }
        }
        for (int h = 0; h < HG; ++h) {
            const __m256 inv = _mm256_set1_ps(inverse[h]);
            for (int c = 0; c < width; ++c) _mm256_storeu_ps(it.out[h] + 8 * (c0 + c), _mm256_mul_ps(acc[h][c], inv));
        }
    }
}

// The AVX-512 path: the same three steps, 16 lanes wide, for head_dim = 16 CH (the query's CH
// vectors stay in registers). A key's score is 16-lane FMAs over the chunks in order, then a fixed
// tree over its own lanes (pairs within each 128-bit block, then the blocks), run for 16 keys at
// once; so a score never depends on the keys beside it, but its bits differ from the AVX2 path's
// (8 lanes, another tree). The softmax is the shared code's (16 exponentials at a time, the same
// bits), and the weighted sum of the values is the AVX2 path's arithmetic per element (the same
// FMAs in the same order), 16 wide.

// v[0..15] -> one vector whose lane j is the sum of v[j]'s lanes, in a fixed order. In two parts:
// keys 0..7 and 8..15 give two vectors each (halves), then the four are folded (fold). A key's
// lanes meet only their own, so the halves can be made apart, for several heads at once.

// v[0..7] -> u[0..1]: per 128-bit block, keys 4i .. 4i + 3, each its block's four lanes summed.
__attribute__((target("avx512f")))
inline void lane_sums_half(const __m512* v, __m512* u) {
    __m512 t[4];
    for (int i = 0; i < 4; ++i)  // per 128-bit block: (a0 + a2, b0 + b2, a1 + a3, b1 + b3)
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 2; ++i)
        u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
}

// u[0..3] -> the 16 keys' sums: the four blocks of each key, (b0 + b1) + (b2 + b3), keys in order.
__attribute__((target("avx512f")))
inline __m512 lane_sums_fold(const __m512* u) {
    const __m512 y01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                     _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 y23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                     _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(y01, y23, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(y01, y23, _MM_SHUFFLE(3, 1, 3, 1)));
}

__attribute__((target("avx512f")))
inline __m512 lane_sums(const __m512* v) {
    __m512 u[4];
    lane_sums_half(v, u);
    lane_sums_half(v + 8, u + 2);
    return lane_sums_fold(u);
}

// Step 1 for head_dim 64 and several heads: each key is loaded (and widened) once for all of
// them, 8 keys at a time (HG x 8 accumulators and the key's 4 vectors fit the 32 registers; the
// queries are read from memory). Every score is the one-head loop's arithmetic, bit for bit.
template <int HG, typename T>
__attribute__((target("avx512f,avx2,fma,f16c")))
void scores_shared(const Heads<HG, T>& it, float scale, float* buffer, int64_t stride, __m512* top) {
    const __m512 factor = _mm512_set1_ps(scale);
    for (int64_t j0 = 0; j0 < it.n; j0 += 16) {
        it.prefetch(j0);
        alignas(64) __m512 u[HG][4];
        for (int half = 0; half < 2; ++half) {
            __m512 a[HG][8];
            for (int jj = 0; jj < 8; ++jj) {
                const T* k = it.keys + it.slot(std::min<int64_t>(j0 + 8 * half + jj, it.n - 1)) * it.slot_stride;
                __m512 kc[4];
                for (int c = 0; c < 4; ++c) kc[c] = load16(k + 16 * c);
                for (int h = 0; h < HG; ++h) {
                    __m512 x = _mm512_fmadd_ps(_mm512_loadu_ps(it.q[h]), kc[0], _mm512_setzero_ps());
                    for (int c = 1; c < 4; ++c) x = _mm512_fmadd_ps(_mm512_loadu_ps(it.q[h] + 16 * c), kc[c], x);
                    a[h][jj] = x;
                }
            }
            for (int h = 0; h < HG; ++h) lane_sums_half(a[h], u[h] + 2 * half);
        }
        for (int h = 0; h < HG; ++h) {
            const __m512 dots = _mm512_mul_ps(lane_sums_fold(u[h]), factor);
            _mm512_storeu_ps(buffer + h * stride + j0, dots);
            top[h] = _mm512_max_ps(top[h], dots);  // a copy's score equals its key's: the maximum holds
        }
    }
}

// Step 3 of the AVX-512 path: the weighted sums of the values, 64 dimensions at a time (HG x 4
// accumulators), every element summed over the slots in order; weights at buffer + h * stride.
template <int HG, int CH, typename T>
__attribute__((target("avx512f,avx2,fma,f16c")))
void weighted_values(const Heads<HG, T>& it, const float* buffer, int64_t stride, const float* inverse) {
    for (int c0 = 0; c0 < CH; c0 += 4) {
        __m512 acc[HG][4];
        for (int h = 0; h < HG; ++h)
            for (int c = 0; c < 4; ++c) acc[h][c] = _mm512_setzero_ps();
        for (int64_t j = 0; j < it.n; ++j) {
            const T* v = it.values + it.slot(j) * it.slot_stride + 16 * c0;
            __m512 vc[4];
            for (int c = 0; c < 4; ++c) vc[c] = load16(v + 16 * c);
            for (int h = 0; h < HG; ++h) {
                const __m512 w = _mm512_set1_ps(buffer[h * stride + j]);
                for (int c = 0; c < 4; ++c) acc[h][c] = _mm512_fmadd_ps(w, vc[c], acc[h][c]);
            }
        }
        for (int h = 0; h < HG; ++h) {
            const __m512 inv = _mm512_set1_ps(inverse[h]);
            for (int c = 0; c < 4; ++c) _mm512_storeu_ps(it.out[h] + 16 * (c0 + c), _mm512_mul_ps(acc[h][c], inv));
        }
    }
}

template <int HG, int CH, typename T>
__attribute__((target("avx512f,avx2,fma,f16c")))
void attend_heads_avx512(const Heads<HG, T>& it, float scale, std::vector<float>& buffer) {
    const int64_t stride = it.n + 16;  // room for a tail block's copies
    buffer.resize(static_cast<size_t>(HG * stride));

    // 1. scores, 16 keys at a time (a tail block repeats its last key; the copies land past n)
    float inverse[HG];
    if constexpr (CH == 4 && HG > 1) {
        __m512 top[HG];
        for (int h = 0; h < HG; ++h) top[h] = _mm512_set1_ps(-INFINITY);
        scores_shared<HG, T>(it, scale, buffer.data(), stride, top);
        for (int h = 0; h < HG; ++h)  // 2. softmax weights (unnormalized) and their sum
            inverse[h] = softmax_weights16(buffer.data() + h * stride, it.n, _mm512_reduce_max_ps(top[h]));
    } else for (int h = 0; h < HG; ++h) {
        float* sc = buffer.data() + h * stride;
        __m512 q[CH];
        for (int c = 0; c < CH; ++c) q[c] = _mm512_loadu_ps(it.q[h] + 16 * c);
        __m512 top = _mm512_set1_ps(-INFINITY);
        for (int64_t j0 = 0; j0 < it.n; j0 += 16) {
            if (h == 0) it.prefetch(j0);
            __m512 acc[16];
            for (int jj = 0; jj < 16; ++jj) {
                const T* k = it.keys + it.slot(std::min<int64_t>(j0 + jj, it.n - 1)) * it.slot_stride;
                __m512 a = _mm512_fmadd_ps(q[0], load16(k), _mm512_setzero_ps());
                for (int c = 1; c < CH; ++c) a = _mm512_fmadd_ps(q[c], load16(k + 16 * c), a);
                acc[jj] = a;
            }
            const __m512 dots = _mm512_mul_ps(lane_sums(acc), _mm512_set1_ps(scale));
            _mm512_storeu_ps(sc + j0, dots);
            top = _mm512_max_ps(top, dots);  // a copy's score equals its key's: the maximum holds
        }
        // 2. softmax weights (unnormalized) and their sum: the shared code's bits, 16 at a time
        inverse[h] = softmax_weights16(sc, it.n, _mm512_reduce_max_ps(top));
    }

    weighted_values<HG, CH, T>(it, buffer.data(), stride, inverse);
}

// Prefill and other passes of many queries over a row's prefix, head_dim 64: the row's keys are
// laid out once per call, 16 slots at a time as 64 vectors (vector d of block b: dimension d of
// slots 16 b .. 16 b + 15), so that a query's 16 scores come from vertical arithmetic alone. Lane
// l of the other paths' 16-lane dot product is fma(q[48 + l], k[48 + l], .. fma(q[l], k[l], 0)),
// and their fixed tree over the lanes is, per key, ((s0 + s1) + (s2 + s3)) with s_b = (x[4b] +
// x[4b + 2]) + (x[4b + 1] + x[4b + 3]): the same FMAs and adds here, each with its key in a lane,
// give every score bit for bit, without the tree's 45 shuffles per 16 keys and head.
constexpr int KEY_BLOCK = 16, KEY_DIM = 64;
constexpr int64_t TRANSPOSE_MIN_QUERIES = 16;  // queries a call needs to pay for the transposition

template <typename T>
__attribute__((target("avx512f,avx2,fma,f16c")))
void transpose_keys(const T* keys, int64_t slot_stride, int64_t n, float* out) {
    alignas(64) float tmp[KEY_BLOCK][KEY_DIM];
    for (int64_t j0 = 0; j0 < n; j0 += KEY_BLOCK) {
        for (int s = 0; s < KEY_BLOCK; ++s) {
            if (j0 + s < n) {
                for (int c = 0; c < KEY_DIM / 16; ++c)
                    _mm512_store_ps(tmp[s] + 16 * c, load16(keys + (j0 + s) * slot_stride + 16 * c));
            } else {
                for (int c = 0; c < KEY_DIM / 16; ++c) _mm512_store_ps(tmp[s] + 16 * c, _mm512_setzero_ps());
            }
        }
        float* o = out + j0 * KEY_DIM;
        const __m512i slots = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                                 _mm512_set1_epi32(KEY_DIM));
        for (int d = 0; d < KEY_DIM; ++d) _mm512_storeu_ps(o + d * KEY_BLOCK, _mm512_i32gather_ps(slots, &tmp[0][d], 4));
    }
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma,f16c")
template <int HG>
void scores_transposed(const float* const* q, const float* kt, int64_t n, float scale, float* buffer, int64_t stride,
                       __m512* top) {
    using specdec::repeat;
    const __m512 factor = _mm512_set1_ps(scale);
    for (int64_t j0 = 0; j0 < n; j0 += KEY_BLOCK) {
        const float* block = kt + j0 * KEY_DIM;
        __m512 half[HG][2], quarter[HG];  // (s0 + s1), (s2 + s3); s_b while it is summed
        repeat<4>([&](auto b) {
            repeat<2>([&](auto odd) {  // lanes 4b + odd and 4b + 2 + odd, summed
                __m512 pair[HG][2];
                repeat<2>([&](auto i) {
                    constexpr int l = 4 * b + odd + 2 * i;
                    __m512 kd[4];
                    repeat<4>([&](auto c) {
                        kd[c] = _mm512_loadu_ps(block + (16 * c + l) * KEY_BLOCK);
                        asm("" : "+v"(kd[c]));  // in a register, loaded once for the HG heads (not folded into each FMA)
                    });
                    repeat<HG>([&](auto h) {
                        __m512 x = _mm512_fmadd_ps(_mm512_set1_ps(q[h][l]), kd[0], _mm512_setzero_ps());
                        repeat<3>([&](auto c) { x = _mm512_fmadd_ps(_mm512_set1_ps(q[h][16 * (c + 1) + l]), kd[c + 1], x); });
                        pair[h][i] = x;
                    });
                });
                repeat<HG>([&](auto h) {
                    const __m512 t = _mm512_add_ps(pair[h][0], pair[h][1]);
                    quarter[h] = odd == 0 ? t : _mm512_add_ps(quarter[h], t);
                });
            });
            repeat<HG>([&](auto h) {
                if constexpr (b % 2 == 0) half[h][b / 2] = quarter[h];
                else half[h][b / 2] = _mm512_add_ps(half[h][b / 2], quarter[h]);
            });
        });
        const __mmask16 mask = specdec::first_lanes(std::min<int64_t>(KEY_BLOCK, n - j0));
        repeat<HG>([&](auto h) {
            const __m512 dots = _mm512_mul_ps(_mm512_add_ps(half[h][0], half[h][1]), factor);
            _mm512_storeu_ps(buffer + h * stride + j0, dots);  // past n: never read
            top[h] = _mm512_mask_max_ps(top[h], mask, top[h], dots);
        });
    }
}
#pragma GCC pop_options

template <int HG, typename T>
__attribute__((target("avx512f,avx2,fma,f16c")))
void attend_heads_transposed(const Heads<HG, T>& it, const float* kt, float scale, std::vector<float>& buffer) {
    const int64_t stride = it.n + KEY_BLOCK;
    buffer.resize(static_cast<size_t>(HG * stride));
    __m512 top[HG];
    for (int h = 0; h < HG; ++h) top[h] = _mm512_set1_ps(-INFINITY);
    scores_transposed<HG>(it.q, kt, it.n, scale, buffer.data(), stride, top);
    float inverse[HG];
    for (int h = 0; h < HG; ++h)
        inverse[h] = softmax_weights16(buffer.data() + h * stride, it.n, _mm512_reduce_max_ps(top[h]));
    weighted_values<HG, 4, T>(it, buffer.data(), stride, inverse);
}

}  // namespace

at::Tensor attend_cached(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                            const at::Tensor& counts, const at::Tensor& slots, double scale, int64_t isa) {
    // q [rows, heads, new, head_dim]; keys, values [rows, kv_heads, S, head_dim] (any strides but
    // the last); counts [rows, new] int32; slots [rows, new, L] int32 or empty -> [rows, new, heads * head_dim];
    // isa as the products take it (the AVX-512 path for head_dim 64 or 128, else AVX2)
    specdec::require_avx2();
    TORCH_CHECK(q.dim() == 4 && q.scalar_type() == at::kFloat, "q must be [rows, heads, new, head_dim] float32");
    TORCH_CHECK(keys.dim() == 4 && values.sizes() == keys.sizes() &&
                    (keys.scalar_type() == at::kFloat || keys.scalar_type() == at::kHalf) &&
                    values.scalar_type() == keys.scalar_type(),
                "keys and values must be one [rows, kv_heads, S, head_dim] shape, both float32 or both float16");
    TORCH_CHECK(keys.stride(3) == 1 && values.stride(3) == 1 && keys.strides() == values.strides(),
                "keys and values must share strides, with contiguous head dimensions");
    const int64_t rows = q.size(0), heads = q.size(1), nq = q.size(2), head_dim = q.size(3);
    const int64_t kv_heads = keys.size(1), span = keys.size(2);
    TORCH_CHECK(keys.size(0) == rows && keys.size(3) == head_dim && heads % kv_heads == 0, "q and keys do not match");
    TORCH_CHECK(head_dim % 8 == 0, "head_dim must be a multiple of 8");
    TORCH_CHECK(counts.scalar_type() == at::kInt && counts.sizes() == at::IntArrayRef({rows, nq}),
                "counts must be [rows, new] int32");
    const bool listed = slots.numel() > 0;
    TORCH_CHECK(!listed || (slots.scalar_type() == at::kInt && slots.dim() == 3 && slots.size(0) == rows &&
                            slots.size(1) == nq), "slots must be [rows, new, L] int32");
    const at::Tensor qc = q.contiguous(), cc = counts.contiguous(), sc = listed ? slots.contiguous() : slots;
    const int32_t* count = cc.data_ptr<int32_t>();
    for (int64_t i = 0; i < rows * nq; ++i) {
        TORCH_CHECK(count[i] >= 0 && count[i] <= (listed ? sc.size(2) : span), "a query sees past the cache");
    }
    if (listed) {
        const int32_t* s = sc.data_ptr<int32_t>();
        for (int64_t i = 0; i < sc.numel(); ++i) TORCH_CHECK(s[i] >= 0 && s[i] < span, "a slot index is past the cache");
    }
    auto out = at::empty({rows, nq, heads * head_dim}, at::kFloat);
    const float* qp = qc.data_ptr<float>();
    const bool half = keys.scalar_type() == at::kHalf;
    float* op = out.data_ptr<float>();
    const int64_t group = heads / kv_heads;
    // Each task: one query of one row and a set of up to 3 heads sharing a key/value head (the
    // group split into balanced sets: 4 -> 2 + 2).
    const int64_t sets = (group + 2) / 3;
    const float fscale = static_cast<float>(scale);
    const bool wide = specdec::resolve_isa(isa) != specdec::ISA_AVX2 && (head_dim == 64 || head_dim == 128);
    const int64_t qs = qc.stride(1);  // between heads
    // Tasks differ in length (a prompt's later queries see more keys, rows of a batch hold
    // prefixes of their own): lane j takes every lanes-th task from the j-th, so that each lane
    // holds its share of long and short ones, where contiguous ranges left one thread a prompt's
    // longest queries. Lanes, 4 a thread, are claimed as the threads come (a descheduled thread
    // holds up no more than the lane it runs).
    const int64_t tasks = rows * nq * kv_heads * sets;
    // Many queries of rows that see prefixes (a prefill, a long chain): each row's keys transposed
    // once (scores_transposed), as far as its queries see, each (row, key/value head) a chunk.
    const bool transposed = wide && head_dim == KEY_DIM && !listed && nq >= TRANSPOSE_MIN_QUERIES;
    // Reused from call to call (only read where this call wrote); the workers see it through kt,
    // not by its name (a thread_local's name means each thread's own).
    thread_local std::vector<float> transposed_keys;
    float* kt = nullptr;
    int64_t kt_stride = 0;  // floats per (row, key/value head)
    if (transposed) {
        std::vector<int64_t> seen(rows, 0);
        for (int64_t r = 0; r < rows; ++r)
            for (int64_t i = 0; i < nq; ++i) seen[r] = std::max<int64_t>(seen[r], count[r * nq + i]);
        const int64_t most = *std::max_element(seen.begin(), seen.end());
        kt_stride = (most + KEY_BLOCK - 1) / KEY_BLOCK * KEY_BLOCK * KEY_DIM;
        const size_t size = static_cast<size_t>(rows * kv_heads * kt_stride);
        if (transposed_keys.size() < size) transposed_keys.resize(size);
        kt = transposed_keys.data();
        specdec::parallel_chunks(rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
            for (int64_t t = begin; t < end; ++t) {
                const int64_t r = t / kv_heads, kvh = t % kv_heads;
                const int64_t at = r * keys.stride(0) + kvh * keys.stride(1);
                float* const into = kt + t * kt_stride;
                if (half) transpose_keys(static_cast<const uint16_t*>(keys.data_ptr()) + at, keys.stride(2), seen[r], into);
                else transpose_keys(static_cast<const float*>(keys.data_ptr()) + at, keys.stride(2), seen[r], into);
            }
        });
    }
    // A lane's tasks: every lanes-th task; or, in a pass of several queries a row with enough
    // (row, key/value head) units to share out, every lanes-th unit with its queries one after
    // another, so that a unit's later queries find its slots in the caches. Which thread runs a
    // task never changes its bits.
    const int64_t units = rows * kv_heads * sets;
    const bool grouped = nq > 1 && !transposed && units >= 4 * specdec::kernel_threads();
    const int64_t lanes = std::max<int64_t>(1, std::min<int64_t>(4 * specdec::kernel_threads(), grouped ? units : tasks));
    // The k-th task of a lane (numbered by row, query, key/value head, set), or -1 past its last.
    auto task_of = [&](int64_t lane, int64_t k) -> int64_t {
        if (!grouped) return lane + k * lanes < tasks ? lane + k * lanes : -1;
        const int64_t unit = lane + (k / nq) * lanes;
        if (unit >= units) return -1;
        const int64_t r = unit / (sets * kv_heads);
        return ((r * nq + k % nq) * kv_heads + (unit / sets) % kv_heads) * sets + unit % sets;
    };
    specdec::parallel_chunks(lanes, 1, [&](int64_t first_lane, int64_t last_lane) {
        std::vector<float> buffer;
        for (int64_t lane = first_lane; lane < last_lane; ++lane) {
            for (int64_t k = 0, task = task_of(lane, 0); task >= 0; task = task_of(lane, ++k)) {
                const int64_t set = task % sets, kvh = (task / sets) % kv_heads;
                const int64_t i = (task / (sets * kv_heads)) % nq, r = task / (sets * kv_heads * nq);
                const int64_t first = kvh * group + set * group / sets, last = kvh * group + (set + 1) * group / sets;
                const float* qbase = qp + ((r * heads) * nq + i) * head_dim;
                float* obase = op + (r * nq + i) * heads * head_dim;
                const int32_t* sl = listed ? sc.data_ptr<int32_t>() + (r * nq + i) * sc.size(2) : nullptr;
                const int64_t n = count[r * nq + i];
                // the task this thread runs next (in this lane, else the next lane it holds), or -1
                int64_t next = task_of(lane, k + 1);
                if (next < 0 && lane + 1 < last_lane) next = task_of(lane + 1, 0);
                const int64_t next_kvh = (next / sets) % kv_heads, next_query = next / (sets * kv_heads);
                auto run = [&](auto heads_tag, auto element) {
                    constexpr int HG = decltype(heads_tag)::value;
                    using T = typename decltype(element)::type;
                    Heads<HG, T> it{};
                    for (int h = 0; h < HG; ++h) {
                        it.q[h] = qbase + (first + h) * qs;
                        it.out[h] = obase + (first + h) * head_dim;
                    }
                    it.keys = static_cast<const T*>(keys.data_ptr()) + r * keys.stride(0) + kvh * keys.stride(1);
                    it.values = static_cast<const T*>(values.data_ptr()) + r * values.stride(0) + kvh * values.stride(1);
                    it.slot_stride = keys.stride(2); it.slots = sl; it.n = n; it.head_dim = head_dim;
                    it.fetch_ahead = i == 0 || (rows > 1 && !grouped);
                    if (next >= 0) {  // next_query: its row times nq plus its index
                        const int64_t next_row = next_query / nq;
                        it.next_keys = static_cast<const T*>(keys.data_ptr()) + next_row * keys.stride(0) + next_kvh * keys.stride(1);
                        it.next_slots = listed ? sc.data_ptr<int32_t>() + next_query * sc.size(2) : nullptr;
                        it.next_n = count[next_query];
                    }
                    if (n == 0) {  // a padding query that sees nothing: zeros, not NaN
                        for (int h = 0; h < HG; ++h) std::fill(it.out[h], it.out[h] + head_dim, 0.0f);
                    } else if (transposed) {
                        attend_heads_transposed<HG, T>(it, kt + (r * kv_heads + kvh) * kt_stride, fscale, buffer);
                    } else if (!wide) attend_heads<HG, T>(it, fscale, buffer);
                    else if (head_dim == 64) attend_heads_avx512<HG, 4, T>(it, fscale, buffer);
                    else attend_heads_avx512<HG, 8, T>(it, fscale, buffer);
                };
                auto grouped = [&](auto element) {
                    switch (last - first) {
                        case 1: run(std::integral_constant<int, 1>{}, element); break;
                        case 2: run(std::integral_constant<int, 2>{}, element); break;
                        default: run(std::integral_constant<int, 3>{}, element); break;
                    }
                };
                if (half) grouped(Element<uint16_t>{});
                else grouped(Element<float>{});
            }
        }
    });
    return out;
}
