// The r8 products: int8 weights with one scale per output column, times int8 activations with one
// scale per row, after a fixed rotation of the inputs that spreads a row's outliers over all of it.
//
// Why: GGUF's blocks (q4, q8) carry a scale every 32 inputs, for the weights and, in these kernels,
// for the activations, so every 32 inputs of every row end in a float epilogue; at 16 rows that
// epilogue costs several times the AMX tile product it follows. Here a row's integer sum runs over
// all of the inputs, in the tile where there is one, and meets its two scales once. A single scale
// per row is coarse where a few inputs are far larger than the rest; the rotation (QuaRot's idea,
// arXiv:2404.00456) mixes every input into every output first: x' = x R with R = kron(C^T, S H),
// x as [m blocks, 64]: each block's signs flipped (S) and its Walsh-Hadamard transform taken (H,
// unnormalized), then the blocks mixed by the orthonormal DCT-II matrix C [m, m]; about K (6 + m)
// float operations a row (blocks of 128 or 512 where K allows cost less but scored no better on
// the default model's perplexity: benchmarks/results). The weights are stored rotated the other
// way (W R^-T, packing.py), so x' W'^T = x W^T up to the quantization.
//
// Row invariance: the rotation is a fixed sequence of float32 adds and multiplies per element (8
// lanes at a time on the AVX2 path, 16 on the others, the same operations), a row's integer sum
// is exact on every path (AMX, VNNI, AVX2), and its epilogue is out = float(sum) * w_scale *
// x_scale, + residual: a row's bits never depend on the rows, threads or instruction set it runs
// with. reference.py's r8_matmul computes the same bits in PyTorch.
//
// Packed weights [units, K * 16 + 64] uint8 per unit of 16 columns: K / 4 lines of 64 bytes (line j:
// inputs 4 j .. 4 j + 3 of column c at bytes 4 c .. 4 c + 3, as an AMX tile's B and vpdpbusd read
// them), int8 values in -127..127, then the 16 columns' float32 scales.

#include "ops.h"
#include "quant.h"

#include "pool.h"
#include "simd.h"
#include <ATen/ops/empty.h>
#include <immintrin.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <vector>

namespace {

using specdec::fold;

constexpr int RB = 64;           // inputs per rotation block and per AMX tile product
constexpr int NC = specdec::NC;  // output columns per unit
constexpr int64_t MAX_INPUTS = 1 << 16;  // |sum| <= K * 127 * 255 stays within int32
// How far ahead of its reads a tile asks for the weights (they stream from memory; the hardware
// prefetcher stops at each 4 KB page).
constexpr int64_t PREFETCH_BYTES = 4096;

// The signs of S: a fixed pattern (bit 7 of i times Knuth's multiplicative hash), the same as packing.py's.
struct Signs {
    alignas(64) float s[RB];
    Signs() {
        for (int i = 0; i < RB; ++i) s[i] = ((static_cast<uint64_t>(i) * 2654435761ull) >> 7) & 1 ? 1.0f : -1.0f;
    }
};
const Signs SIGNS;

// C [m, m] row-major as float32: C[i][j] = cos(pi / m * (j + 1/2) * i) * sqrt(2 / m), row 0 times
// 1/sqrt(2); computed in double as packing.py computes it, then rounded once.
const std::vector<float>& dct(int64_t m) {
    static std::mutex lock;
    static std::map<int64_t, std::vector<float>> tables;
    std::lock_guard<std::mutex> guard(lock);
    auto found = tables.find(m);
    if (found != tables.end()) return found->second;
    std::vector<float> c(m * m);
    const double pi = 3.141592653589793;
    for (int64_t i = 0; i < m; ++i)
        for (int64_t j = 0; j < m; ++j) {
            double v = std::cos(pi / static_cast<double>(m) * (static_cast<double>(j) + 0.5) * static_cast<double>(i)) *
                       std::sqrt(2.0 / static_cast<double>(m));
            if (i == 0) v /= std::sqrt(2.0);
            c[i * m + j] = static_cast<float>(v);
        }
    return tables.emplace(m, std::move(c)).first->second;
}

// One row: x [K] -> x' = x R into y [K] (scratch z [K]). Each block of 64 inputs times S, then its
// butterflies on index bits 5, 4, 3 (across vectors of 8), then 2, 1, 0 (within them), each
// (a, b) -> (a + b, a - b); then y_i = C[i][0] z_0 + C[i][1] z_1 + ... block by block.
__attribute__((target("avx2,fma")))
void rotate_row(const float* x, int64_t K, const float* c, float* z, float* y) {
    constexpr int64_t b = RB, vectors = b / 8;
    const int64_t m = K / b;
    const float* signs = SIGNS.s;
    for (int64_t j = 0; j < m; ++j) {
        float* zb = z + j * b;
        for (int64_t i = 0; i < b; i += 8)
            _mm256_storeu_ps(zb + i, _mm256_mul_ps(_mm256_loadu_ps(x + j * b + i), _mm256_load_ps(signs + i)));
        for (int64_t h = vectors / 2; h >= 1; h /= 2)
            for (int64_t i = 0; i < vectors; ++i)
                if (!(i & h)) {
                    const __m256 p = _mm256_loadu_ps(zb + 8 * i), q = _mm256_loadu_ps(zb + 8 * (i + h));
                    _mm256_storeu_ps(zb + 8 * i, _mm256_add_ps(p, q));
                    _mm256_storeu_ps(zb + 8 * (i + h), _mm256_sub_ps(p, q));
                }
        for (int64_t i = 0; i < vectors; ++i) {
            __m256 v = _mm256_loadu_ps(zb + 8 * i);
            __m256 s = _mm256_permute2f128_ps(v, v, 0x01);  // lanes 4..7, 0..3
            v = _mm256_blend_ps(_mm256_add_ps(v, s), _mm256_sub_ps(s, v), 0xF0);
            s = _mm256_permute_ps(v, 0x4E);  // lanes 2, 3, 0, 1 in each half
            v = _mm256_blend_ps(_mm256_add_ps(v, s), _mm256_sub_ps(s, v), 0xCC);
            s = _mm256_permute_ps(v, 0xB1);  // lanes 1, 0, 3, 2
            v = _mm256_blend_ps(_mm256_add_ps(v, s), _mm256_sub_ps(s, v), 0xAA);
            _mm256_storeu_ps(zb + 8 * i, v);
        }
    }
    // A block's 8 vectors at once: 8 independent sums, each in the order above.
    for (int64_t i = 0; i < m; ++i) {
        const float* ci = c + i * m;
        __m256 acc[vectors];
        const __m256 c0 = _mm256_set1_ps(ci[0]);
        for (int64_t v = 0; v < vectors; ++v) acc[v] = _mm256_mul_ps(c0, _mm256_loadu_ps(z + 8 * v));
        for (int64_t j = 1; j < m; ++j) {
            const __m256 cj = _mm256_set1_ps(ci[j]);
            for (int64_t v = 0; v < vectors; ++v)
                acc[v] = _mm256_add_ps(acc[v], _mm256_mul_ps(cj, _mm256_loadu_ps(z + j * b + 8 * v)));
        }
        for (int64_t v = 0; v < vectors; ++v) _mm256_storeu_ps(y + i * b + 8 * v, acc[v]);
    }
}

// rotate_row 16 lanes wide (AVX-512): the same operations on every element in the same order (the
// butterflies on bits 5 and 4 across vectors of 16, 3 to 0 within them; the blocks mixed with a
// multiply and an add, never fused), so the same bits, in half the instructions.
__attribute__((target("avx512f")))
void rotate_row16(const float* x, int64_t K, const float* c, float* z, float* y) {
    constexpr int64_t b = RB, vectors = b / 16;
    const int64_t m = K / b;
    const float* signs = SIGNS.s;
    for (int64_t j = 0; j < m; ++j) {
        float* zb = z + j * b;
        __m512 v[vectors];
        for (int64_t i = 0; i < vectors; ++i)
            v[i] = _mm512_mul_ps(_mm512_loadu_ps(x + j * b + 16 * i), _mm512_load_ps(signs + 16 * i));
        for (int64_t h = vectors / 2; h >= 1; h /= 2)
            for (int64_t i = 0; i < vectors; ++i)
                if (!(i & h)) {
                    const __m512 p = v[i], q = v[i + h];
                    v[i] = _mm512_add_ps(p, q);
                    v[i + h] = _mm512_sub_ps(p, q);
                }
        for (int64_t i = 0; i < vectors; ++i) {
            // lane l pairs with lane l ^ 8, ^ 4, ^ 2, ^ 1 in turn: the lower takes a + b, the upper
            // s - v = a - b (s holds the lower's value in the upper's lane)
            __m512 w = v[i];
            __m512 s = _mm512_shuffle_f32x4(w, w, _MM_SHUFFLE(1, 0, 3, 2));
            w = _mm512_mask_blend_ps(0xFF00, _mm512_add_ps(w, s), _mm512_sub_ps(s, w));
            s = _mm512_shuffle_f32x4(w, w, _MM_SHUFFLE(2, 3, 0, 1));
            w = _mm512_mask_blend_ps(0xF0F0, _mm512_add_ps(w, s), _mm512_sub_ps(s, w));
            s = _mm512_permute_ps(w, 0x4E);
            w = _mm512_mask_blend_ps(0xCCCC, _mm512_add_ps(w, s), _mm512_sub_ps(s, w));
            s = _mm512_permute_ps(w, 0xB1);
            w = _mm512_mask_blend_ps(0xAAAA, _mm512_add_ps(w, s), _mm512_sub_ps(s, w));
            _mm512_storeu_ps(zb + 16 * i, w);
        }
    }
    for (int64_t i = 0; i < m; ++i) {
        const float* ci = c + i * m;
        __m512 acc[vectors];
        const __m512 c0 = _mm512_set1_ps(ci[0]);
        for (int64_t v = 0; v < vectors; ++v) acc[v] = _mm512_mul_ps(c0, _mm512_loadu_ps(z + 16 * v));
        for (int64_t j = 1; j < m; ++j) {
            const __m512 cj = _mm512_set1_ps(ci[j]);
            for (int64_t v = 0; v < vectors; ++v)
                acc[v] = _mm512_add_ps(acc[v], _mm512_mul_ps(cj, _mm512_loadu_ps(z + j * b + 16 * v)));
        }
        for (int64_t v = 0; v < vectors; ++v) _mm512_storeu_ps(y + i * b + 16 * v, acc[v]);
    }
}

// One rotated row to int8: d = amax / 127, q = round(y * (1 / d)) half to even, and the sum of q.
__attribute__((target("avx2,fma")))
void quantize_row(const float* y, int64_t K, int8_t* q, float* d, int32_t* s) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 top = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) top = _mm256_max_ps(top, _mm256_andnot_ps(sign, _mm256_loadu_ps(y + k)));
    __m128 mx = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
    mx = _mm_max_ps(mx, _mm_movehl_ps(mx, mx));
    mx = _mm_max_ss(mx, _mm_shuffle_ps(mx, mx, 1));
    const float scale = _mm_cvtss_f32(mx) / 127.0f;
    const __m256 inv = _mm256_set1_ps(scale > 0.0f ? 1.0f / scale : 0.0f);
    __m256i total = _mm256_setzero_si256();
    for (int64_t k = 0; k < K; k += 32) {
        __m256i v[4];
        for (int i = 0; i < 4; ++i) v[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(y + k + 8 * i), inv));
        total = _mm256_add_epi32(total, _mm256_add_epi32(_mm256_add_epi32(v[0], v[1]), _mm256_add_epi32(v[2], v[3])));
        const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + k),
                            _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    }
    *d = scale;
    *s = fold(total);
}

// Rotated, quantized rows: q [rows, K] int8 (row-major), d and s [rows].
struct RotRows {
    const int8_t* q;
    const float* d;
    const int32_t* s;
    int64_t rows, K;
};

// The rotation for a path: 16 lanes wide where it runs AVX-512, else 8 (the same bits).
using Rotation = void (*)(const float*, int64_t, const float*, float*, float*);
Rotation rotation_for(bool wide) { return wide ? rotate_row16 : rotate_row; }

void rotate_quantize(const float* x, int64_t rows, int64_t K, int8_t* q, float* d, int32_t* s, bool wide) {
    const std::vector<float>& c = dct(K / RB);
    const Rotation rotate = rotation_for(wide);
    // A row costs about K (6 + K / 64) float operations: chunks of some 50 thousand.
    specdec::parallel_chunks(rows, std::max<int64_t>(1, 50000 / (K * (6 + K / RB))), [&](int64_t begin, int64_t end) {
        thread_local std::vector<float> z, y;
        z.resize(K);
        y.resize(K);
        for (int64_t r = begin; r < end; ++r) {
            rotate(x + r * K, K, c.data(), z.data(), y.data());
            quantize_row(y.data(), K, q + r * K, d + r, s + r);
        }
    });
}

// One row's 16 columns from its exact sums: float(sum) * w_scale * x_scale (+ residual), the
// AVX-512 tiles' and the AMX panels' one epilogue (AVX2's is the same operations, 8 lanes at a time).
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"), always_inline))
inline void store_row(__m512i sum, __m512 ws, float xd, float* out, const float* res, __mmask16 mask) {
    __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sum), ws), _mm512_set1_ps(xd));
    if (res) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, res));
    _mm512_mask_storeu_ps(out, mask, v);
}

// ---------------------------------------------------------------------------------------------
// AVX-512 VNNI: T rows times U units (16 U columns) in one pass over the inputs; w + 128 as unsigned
// bytes, the exact signed sum sum((w + 128) x) - 128 sum(x). Each broadcast of 4 activations feeds U
// products and each weight line T (a one-unit tile spends a broadcast on every product). The T x U
// sums are one chain each: a line's T U products are independent. The arrays are indexed by
// compile-time constants and the products are simd.h's dpbusd, so the sums stay in registers; a
// pragma, not an attribute, gives the lambdas that unroll the loops the target too.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni")
template <int T, int U>
void block_avx512(const uint8_t* unit, int64_t unit_bytes, const RotRows& x, int64_t row0, float* out, const float* res,
                  int64_t ldo, int last_cols) {
    using specdec::repeat;
    const int64_t K = x.K, lines = K / 4;
    __m512i acc[T * U];  // row r, unit u at r U + u
    repeat<T * U>([&](auto i) { acc[i] = _mm512_setzero_si512(); });
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    const int8_t* xq = x.q + row0 * K;
    for (int64_t j = 0; j < lines; ++j) {
        // (a plain loop: GCC 12 drops a prefetch written in one of these lambdas)
        for (int u = 0; u < U; ++u)
            _mm_prefetch(reinterpret_cast<const char*>(unit + u * unit_bytes + 64 * j + PREFETCH_BYTES), _MM_HINT_T0);
        __m512i w[U];
        repeat<U>([&](auto u) { w[u] = _mm512_xor_si512(_mm512_loadu_si512(unit + u * unit_bytes + 64 * j), flip); });
        repeat<T>([&](auto r) {
            int32_t a;
            std::memcpy(&a, xq + r * K + 4 * j, 4);
            const __m512i b = _mm512_set1_epi32(a);
            repeat<U>([&](auto u) { specdec::dpbusd(acc[r * U + u], w[u], b); });
        });
    }
    repeat<U>([&](auto u) {
        const __m512 ws = _mm512_loadu_ps(reinterpret_cast<const float*>(unit + u * unit_bytes + K * NC));
        const int ncols = u == U - 1 ? last_cols : NC;
        const __mmask16 mask = specdec::first_lanes(ncols);
        repeat<T>([&](auto r) {
            const __m512i sum = _mm512_sub_epi32(acc[r * U + u], _mm512_set1_epi32(128 * x.s[row0 + r]));
            const int64_t at = (row0 + r) * ldo + u * NC;
            store_row(sum, ws, x.d[row0 + r], out + at, res ? res + at : nullptr, mask);
        });
    });
}

// A pass of a few rows (a step, a verification), whose weights stream from memory: one unit at a
// time, so that the matrix is read as one stream (the units lie one after another), T rows with CH
// sums each (consecutive lines alternate between them) to hide the product's latency.
template <int T>
void tile_avx512(const uint8_t* unit, const RotRows& x, int64_t row0, float* out, const float* res, int64_t ldo, int ncols) {
    using specdec::repeat;
    constexpr int CH = T <= 2 ? 4 : 2;
    const int64_t K = x.K, lines = K / 4;  // a multiple of 16
    __m512i acc[T * CH];  // row r, chain h at r CH + h
    repeat<T * CH>([&](auto i) { acc[i] = _mm512_setzero_si512(); });
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    const int8_t* xq = x.q + row0 * K;
    for (int64_t j = 0; j < lines; j += CH) {
        for (int h = 0; h < CH; ++h)  // a plain loop, as block_avx512's
            _mm_prefetch(reinterpret_cast<const char*>(unit + 64 * (j + h) + PREFETCH_BYTES), _MM_HINT_T0);
        repeat<CH>([&](auto h) {
            const __m512i w = _mm512_xor_si512(_mm512_loadu_si512(unit + 64 * (j + h)), flip);
            repeat<T>([&](auto r) {
                int32_t a;
                std::memcpy(&a, xq + r * K + 4 * (j + h), 4);
                specdec::dpbusd(acc[r * CH + h], w, _mm512_set1_epi32(a));
            });
        });
    }
    const __m512 ws = _mm512_loadu_ps(reinterpret_cast<const float*>(unit + K * NC));
    const __mmask16 mask = specdec::first_lanes(ncols);
    repeat<T>([&](auto r) {
        __m512i sum = acc[r * CH];
        repeat<CH - 1>([&](auto h) { sum = _mm512_add_epi32(sum, acc[r * CH + h + 1]); });
        sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(128 * x.s[row0 + r]));
        const int64_t at = (row0 + r) * ldo;
        store_row(sum, ws, x.d[row0 + r], out + at, res ? res + at : nullptr, mask);
    });
}
#pragma GCC pop_options

// ---------------------------------------------------------------------------------------------
// AVX2: 8 columns at a time; |w| times x with w's sign (maddubs: |pair| <= 2 * 127 * 127).
__attribute__((target("avx2,fma")))
inline void store8(float* dst, const float* res, __m256 v, int ncols) {
    alignas(32) float tmp[8];
    if (ncols >= 8) {
        _mm256_storeu_ps(dst, res ? _mm256_add_ps(v, _mm256_loadu_ps(res)) : v);
    } else if (ncols > 0) {
        std::memset(tmp, 0, sizeof(tmp));
        if (res) std::memcpy(tmp, res, sizeof(float) * ncols);
        _mm256_store_ps(tmp, res ? _mm256_add_ps(v, _mm256_load_ps(tmp)) : v);
        std::memcpy(dst, tmp, sizeof(float) * ncols);
    }
}

template <int T>
__attribute__((target("avx2,fma")))
void tile_avx2(const uint8_t* unit, const RotRows& x, int64_t row0, float* out, const float* res, int64_t ldo, int ncols) {
    const int64_t K = x.K, lines = K / 4;
    const __m256i ones = _mm256_set1_epi16(1);
    const int8_t* xq = x.q + row0 * K;
    for (int h = 0; h < 2; ++h) {
        __m256i acc[T];
        for (int r = 0; r < T; ++r) acc[r] = _mm256_setzero_si256();
        for (int64_t j = 0; j < lines; ++j) {
            if (h == 0) _mm_prefetch(reinterpret_cast<const char*>(unit + 64 * j + PREFETCH_BYTES), _MM_HINT_T0);
            const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(unit + 64 * j + 32 * h));
            const __m256i wabs = _mm256_abs_epi8(w);
            for (int r = 0; r < T; ++r) {
                int32_t a;
                std::memcpy(&a, xq + r * K + 4 * j, 4);
                const __m256i xs = _mm256_sign_epi8(_mm256_set1_epi32(a), w);
                acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, xs), ones));
            }
        }
        const __m256 ws = _mm256_loadu_ps(reinterpret_cast<const float*>(unit + K * NC) + 8 * h);
        for (int r = 0; r < T; ++r) {
            const __m256 v = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(acc[r]), ws), _mm256_set1_ps(x.d[row0 + r]));
            const int64_t at = (row0 + r) * ldo + 8 * h;
            store8(out + at, res ? res + at : nullptr, v, ncols - 8 * h);
        }
    }
}

// An AMX panel's sums [16 rows, 16 columns] -> out.
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
void amx_epilogue(const int32_t* sums, const uint8_t* scales, const float* xd, float* out, const float* res,
                  int64_t ldo, int ncols) {
    const __mmask16 mask = specdec::first_lanes(ncols);
    const __m512 ws = _mm512_loadu_ps(reinterpret_cast<const float*>(scales));
    for (int r = 0; r < specdec::AMX_ROWS; ++r)
        store_row(_mm512_load_si512(sums + NC * r), ws, xd[r], out + r * ldo, res ? res + r * ldo : nullptr, mask);
}

using Tile = void (*)(const uint8_t*, const RotRows&, int64_t, float*, const float*, int64_t, int);
using Block = void (*)(const uint8_t*, int64_t, const RotRows&, int64_t, float*, const float*, int64_t, int);

// The VNNI path's shapes: for many rows, blocks of up to 6 rows times 4 units (24 sums, 4 weight
// lines and a broadcast in the 32 registers), the weights coming from the caches; up to 8 rows
// (SHORT_ROWS), tile_avx512's single stream.
constexpr int BLOCK_UNITS = 4;  // units a group (and an AMX panel's activations) covers
constexpr int BLOCK_ROWS = 6;
constexpr int SHORT_ROWS = 8;

template <int T, int... U>
constexpr std::array<Block, sizeof...(U)> blocks_of_rows(std::integer_sequence<int, U...>) {
    return {block_avx512<T, U + 1>...};
}
template <int... T>
constexpr std::array<std::array<Block, BLOCK_UNITS>, sizeof...(T)> block_table(std::integer_sequence<int, T...>) {
    return {blocks_of_rows<T + 1>(std::make_integer_sequence<int, BLOCK_UNITS>{})...};
}
Block pick_block(int rows, int units) {
    static constexpr auto table = block_table(std::make_integer_sequence<int, BLOCK_ROWS>{});
    return table[rows - 1][units - 1];
}
template <int... T>
Tile pick_short(int rows, std::integer_sequence<int, T...>) {
    static constexpr Tile table[] = {tile_avx512<T + 1>...};
    return table[rows - 1];
}
template <int... T>
Tile pick2(int rows, std::integer_sequence<int, T...>) {
    static const Tile table[] = {tile_avx2<T + 1>...};
    return table[rows - 1];
}

}  // namespace

// x [rows, K] float32 -> x R [rows, K] (the rotation the r8 products apply; for tests).
at::Tensor rotate_rows(const at::Tensor& x, int64_t isa) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be [rows, in] float32");
    const int64_t rows = x.size(0), K = x.size(1);
    TORCH_CHECK(K % RB == 0 && K > 0, "the r8 rotation needs inputs divisible by ", RB, ", got ", K);
    const at::Tensor xc = x.contiguous();
    auto y = at::empty({rows, K}, at::kFloat);
    const std::vector<float>& c = dct(K / RB);
    std::vector<float> z(K);
    const Rotation rotate = rotation_for(specdec::resolve_isa(isa) != specdec::ISA_AVX2);
    for (int64_t r = 0; r < rows; ++r)
        rotate(xc.data_ptr<float>() + r * K, K, c.data(), z.data(), y.data_ptr<float>() + r * K);
    return y;
}

at::Tensor r8_matmul(const at::Tensor& x, const at::Tensor& packed, int64_t out_features, int64_t isa,
                     const c10::optional<at::Tensor>& residual) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be [rows, in] float32");
    TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous(),
                "r8 weights must be a contiguous [units, in * 16 + 64] uint8 tensor");
    const int64_t rows = x.size(0), K = x.size(1), units = packed.size(0);
    TORCH_CHECK(K % RB == 0 && K > 0 && K <= MAX_INPUTS, "r8 needs inputs divisible by ", RB, " (at most ",
                MAX_INPUTS, "), got ", K);
    TORCH_CHECK(packed.size(1) == K * NC + 64, "r8 weights hold ", packed.size(1) / NC, " inputs a column, x ", K);
    TORCH_CHECK(out_features > (units - 1) * NC && out_features <= units * NC, "out_features does not match units");
    isa = specdec::resolve_isa(isa);
    const at::Tensor xc = x.contiguous();
    const bool amx = isa == specdec::ISA_AMX && rows >= specdec::AMX_ROWS;
    thread_local std::vector<int8_t> q_buf;
    thread_local std::vector<float> d_buf;
    thread_local std::vector<int32_t> s_buf;
    // An AMX tile loads 16 rows whatever the panel's own: room past the last row.
    q_buf.resize(rows * K + (amx ? specdec::AMX_ROWS * K : 0));
    d_buf.resize(rows);
    s_buf.resize(rows);
    rotate_quantize(xc.data_ptr<float>(), rows, K, q_buf.data(), d_buf.data(), s_buf.data(), isa != specdec::ISA_AVX2);
    auto out = at::empty({rows, out_features}, at::kFloat);
    at::Tensor res_c;  // the residual stream, added in the tiles' stores
    const float* res = residual_rows(residual, rows, out_features, res_c);
    const RotRows xr{q_buf.data(), d_buf.data(), s_buf.data(), rows, K};
    const uint8_t* w = packed.data_ptr<uint8_t>();
    float* o = out.data_ptr<float>();
    const int64_t unit_bytes = K * NC + 64;
    const bool wide = isa != specdec::ISA_AVX2;  // resolve_isa: avx512_vnni or amx, whose vectors are AVX-512
    const int64_t amx_rows = amx ? rows / specdec::AMX_ROWS * specdec::AMX_ROWS : 0;
    const int64_t left = rows - amx_rows;
    const bool short_pass = wide && left > 0 && left <= SHORT_ROWS;
    const int max_tile = !wide ? 4 : short_pass ? SHORT_ROWS : BLOCK_ROWS;
    // Rows in tiles as few as the registers allow, of balanced sizes; on AMX, whole panels of 16.
    std::vector<std::pair<int64_t, int>> tiles;  // (first row, rows)
    const int64_t count = (left + max_tile - 1) / max_tile;
    for (int64_t t = 0, row = amx_rows; t < count; ++t) {
        const int size = static_cast<int>((rows - row) / (count - t) + ((rows - row) % (count - t) ? 1 : 0));
        tiles.emplace_back(row, size);
        row += size;
    }
    constexpr int GROUP = BLOCK_UNITS;
    specdec::parallel_runs((units + GROUP - 1) / GROUP, [&](int64_t begin, int64_t end) {
        if (amx_rows) specdec::amx_begin_r8();
        alignas(64) int32_t sums[GROUP][specdec::AMX_ROWS * NC];
        for (int64_t g = begin; g < end; ++g) {
            const int64_t u0 = g * GROUP;
            const int n = static_cast<int>(std::min<int64_t>(GROUP, units - u0));
            for (int64_t p0 = 0; p0 < amx_rows; p0 += specdec::AMX_ROWS) {
                specdec::r8_tiles_amx(w + u0 * unit_bytes, unit_bytes, n, xr.q + p0 * K, K, &sums[0][0]);
                for (int u = 0; u < n; ++u) {
                    const uint8_t* unit = w + (u0 + u) * unit_bytes;
                    const int ncols = static_cast<int>(std::min<int64_t>(NC, out_features - (u0 + u) * NC));
                    const int64_t at = p0 * out_features + (u0 + u) * NC;
                    amx_epilogue(sums[u], unit + K * NC, xr.d + p0, o + at, res ? res + at : nullptr, out_features, ncols);
                }
            }
            const int last_cols = static_cast<int>(std::min<int64_t>(NC, out_features - (u0 + n - 1) * NC));
            if (short_pass) {
                for (int u = 0; u < n; ++u)
                    for (const auto& [row, size] : tiles)
                        pick_short(size, std::make_integer_sequence<int, SHORT_ROWS>{})(
                            w + (u0 + u) * unit_bytes, xr, row, o + (u0 + u) * NC, res ? res + (u0 + u) * NC : nullptr,
                            out_features, u == n - 1 ? last_cols : NC);
                continue;
            }
            if (wide) {
                for (const auto& [row, size] : tiles)
                    pick_block(size, n)(w + u0 * unit_bytes, unit_bytes, xr, row, o + u0 * NC, res ? res + u0 * NC : nullptr,
                                        out_features, last_cols);
                continue;
            }
            for (int u = 0; u < n; ++u) {
                const uint8_t* unit = w + (u0 + u) * unit_bytes;
                const int ncols = u == n - 1 ? last_cols : NC;
                for (const auto& [row, size] : tiles)
                    pick2(size, std::make_integer_sequence<int, 4>{})(unit, xr, row, o + (u0 + u) * NC,
                                                                      res ? res + (u0 + u) * NC : nullptr, out_features, ncols);
            }
        }
        if (amx_rows) specdec::amx_end();
    });
    return out;
}
