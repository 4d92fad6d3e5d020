// specdec's CPU kernels: products of a few float rows with GGUF-style quantized weights.
//
// Activations are quantized per row and per block of 32 to int8 (d = amax / 127, q = round(x / d)
// computed as round(x * (1 / d)), half to even), with each block's integer sum kept beside its scale.
// Weights are in blocks of 32 along the input as the GGUF stores them (the affine family, q4: w =
// d q + m with q in 0..15 for Q4_1, Q4_0 (m = -8 d) and Q4_K, 0..31 for Q5_1 and Q5_K; the
// symmetric one, q8: w = d q with q in -128..127 for Q8_0, Q5_0 and, per 16 inputs, Q6_K),
// repacked so that 16 output columns are interleaved: one 512-bit integer dot product (vpdpbusd)
// computes 16 columns x 4 inputs, the activation's 4 bytes broadcast, and the unpacking of a
// weight vector is shared by every row.
//
// Row invariance, which makes a verification pass bitwise a plain step: each row's integer sums
// are exact, and its float epilogue is the same sequence of IEEE operations (no FMA, fixed order
// over blocks) whatever the number of rows, the tile a row lands in, the thread that computes a
// column, or the instruction set. The AVX2 path computes the same integers (maddubs) and the same
// float operations per lane, so both paths give the same bits; `reference.py` is the plain PyTorch
// emulation of the same arithmetic that the tests hold both to.
//
// Packed layouts (U = output columns / 16, G = inputs / 32), one contiguous record per (unit, block):
//   q4: 256 bytes of nibbles, then 16 float16 d, then 16 float16 m           (320 bytes)
//       byte 64 p + 4 c + i: low nibble input 4 p + i, high nibble input 16 + 4 p + i, column c
//       or, for scales that float16 cannot hold (Q4_K's d * scale and dmin * min), the same
//       nibbles, then 16 float32 d, then 16 float32 m                       (384 bytes)
//       or, for 5-bit values (Q5_K, Q5_1), a byte a value laid out as q8's, then 16
//       float32 d, then 16 float32 m                                        (640 bytes)
//   q8: 512 bytes of int8, then 16 float16 d                                   (544 bytes)
//       byte 64 j + 4 c + i: input 4 j + i, column c
//       or, with a scale per 16 inputs (Q6_K's d * scale), the same bytes, then 16 float32 d of
//       inputs 0..15 and 16 of inputs 16..31                                (640 bytes); a block's
//       two halves then sum apart, each scaled: t = s_lo d_lo + s_hi d_hi

#include "ops.h"
#include "quant.h"

#include "pool.h"
#include "simd.h"
#include <ATen/ops/empty.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

namespace {

using specdec::NC;
using specdec::QK;
using specdec::Rows;
using specdec::TileFn;
using specdec::fold;
using specdec::prefetch_ahead;
// Q4_RECORD and Q8_RECORD, the bytes per (unit, block): ops.h.

// Under the AMX path, rows run on AMX tiles 16 at a time, and a remainder of fewer than this many
// rows on the VNNI tiles (the same bits): an AMX tile's loads, product and stores cost about the
// same for 1 row as for 16, so the VNNI tiles are cheaper for a few rows.
constexpr int64_t AMX_MIN_ROWS = 8;

// Rows are quantized and multiplied in panels of this many (an AMX tile's rows), and a thread's
// columns run over PANEL_GROUP panels at a time.
constexpr int64_t PANEL = specdec::AMX_ROWS;
constexpr int64_t PANEL_GROUP = 8;

// ---------------------------------------------------------------------------------------------
// One block of 32: d = amax / 127, q = round(x * (1 / d)) half to even (the default rounding mode,
// as nearbyint), and the sum of q. The maximum is exact in any order and each element's multiply
// and rounding are single IEEE operations, so this is bitwise the scalar definition. The sum of
// the first 16 q is kept too (for weights with a scale per 16 inputs).
__attribute__((target("avx2,fma")))
void quantize_block_avx2(const float* xb, int8_t* qb, float* d, int32_t* s, float* sf, int32_t* s16) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4];
    __m256 top = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
        v[i] = _mm256_loadu_ps(xb + 8 * i);
        top = _mm256_max_ps(top, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    const float amax = _mm_cvtss_f32(m);
    const float scale = amax / 127.0f;
    const float inverse = scale > 0.0f ? 1.0f / scale : 0.0f;
    const __m256 inv = _mm256_set1_ps(inverse);
    __m256i q[4];
    for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));  // rounds half to even
    const int32_t first = fold(_mm256_add_epi32(q[0], q[1]));
    const int32_t sum = first + fold(_mm256_add_epi32(q[2], q[3]));
    // Pack 32 int32 (each in -127..127) to int8 in order: packs interleave 128-bit lanes, so fix
    // the order with a permute.
    const __m256i w01 = _mm256_packs_epi32(q[0], q[1]);
    const __m256i w23 = _mm256_packs_epi32(q[2], q[3]);
    const __m256i b = _mm256_packs_epi16(w01, w23);
    const __m256i ordered = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb), ordered);
    *d = scale;
    *s = sum;
    *sf = static_cast<float>(sum);
    *s16 = first;
}

// Activation quantization: x [rows, K] float -> panels of up to PANEL rows, each block-major: the
// panel of rows p0 .. p0 + n - 1 holds q [G, n, 32] int8 and d, s, sf, s16 [G, n], and starts
// where the rows before it end (rows p0 .. with block g of its row i at (p0 G + g n + i) * 32).
// Block-major, so that a tile reads every row's block g from one pointer at fixed offsets (no
// per-row pointers competing for registers in the inner loop); in panels, so that a tile's rows
// over all blocks are a few kilobytes in a row (with all rows block-major, a tile's blocks lay
// rows * 32 bytes apart: at a prefill's thousand rows, 32 KB, one cache set). One thread quantizes
// up to 1024 blocks: a worker quantizing part of a short pass would pull the caller's float rows
// into its core and the caller then pull the bytes back, which costs more than the work saved.
void quantize_rows(const float* x, int64_t rows, int64_t K, int8_t* q, float* d, int32_t* s, float* sf, int32_t* s16) {
    const int64_t G = K / QK;
    specdec::parallel_chunks(rows * G, 1024, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
            const int64_t r = i / G, g = i % G, p0 = r / PANEL * PANEL;
            const int64_t j = p0 * G + g * std::min<int64_t>(PANEL, rows - p0) + (r - p0);
            quantize_block_avx2(x + r * K + g * QK, q + j * QK, d + j, s + j, sf + j, s16 + j);
        }
    });
}

// The panel of rows p0 .. p0 + n - 1 as the tiles read it.
Rows panel(const Rows& all, int64_t p0, int64_t n) {
    const int64_t at = p0 * all.G;
    return {all.q + at * QK, all.d + at, all.s + at, all.sf + at, all.s16 + at, n, all.G};
}

// ---------------------------------------------------------------------------------------------
// AVX-512 VNNI: a tile of T rows times one unit of 16 columns.

// An affine record's 16 d or m (the 16 starting at byte `at`), as float32.
template <class K>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c")))
inline __m512 affine_scales16(const uint8_t* rec, int at) {
    if constexpr (K::f32) return _mm512_loadu_ps(reinterpret_cast<const float*>(rec + at));
    else return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + at)));
}

// The same for columns 8 h .. 8 h + 7.
template <class K>
__attribute__((target("avx2,fma,f16c")))
inline __m256 affine_scales8(const uint8_t* rec, int at, int h) {
    if constexpr (K::f32) return _mm256_loadu_ps(reinterpret_cast<const float*>(rec + at) + 8 * h);
    else return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + at + 16 * h)));
}

// The affine family (K: quant.h's Q4Half, Q4Float, Q5Float): weights as nibbles or as bytes, the
// same epilogue. The tiles' arrays are indexed by compile-time constants only (specdec::repeat) and
// their products go through specdec::dpbusd, so that GCC keeps them in registers (simd.h); a
// pragma, not an attribute, gives the lambdas the target too.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,f16c")
// A tile's results, plus the residual stream's rows where given (x + W y: one float add per
// element, the same add as after the product). Inlined into the tile, so that its accumulators,
// indexed by constants only, stay in registers.
template <int T>
__attribute__((always_inline)) inline void store_tile(const __m512 (&acc)[T], float* out, const float* res, int64_t row0,
                                                      int64_t ldo, int ncols) {
    const __mmask16 mask = specdec::first_lanes(ncols);
    specdec::repeat<T>([&](auto r) {
        const int64_t at = (row0 + r) * ldo;
        const __m512 v = res ? _mm512_add_ps(acc[r], _mm512_maskz_loadu_ps(mask, res + at)) : acc[r];
        _mm512_mask_storeu_ps(out + at, mask, v);
    });
}

template <int T, class K>
void q4_tile_avx512(const uint8_t* unit, const Rows& x, int64_t row0, float* out, const float* res, int64_t ldo, int ncols) {
    using specdec::repeat;
    constexpr int RECORD = K::record;
    __m512 acc[T];
    repeat<T>([&](auto r) { acc[r] = _mm512_setzero_ps(); });
    const __m512i low = _mm512_set1_epi8(0x0F);
    const int8_t* xq = x.q + row0 * QK;
    const float* xd = x.d + row0;
    const float* xs = x.sf + row0;
    for (int64_t g = 0; g < x.G; ++g, xq += x.rows * QK, xd += x.rows, xs += x.rows) {
        const uint8_t* rec = unit + g * RECORD;
        prefetch_ahead<RECORD>(rec);
        __m512i lo_sum[T], hi_sum[T];  // two dependency chains per row
        repeat<T>([&](auto r) { lo_sum[r] = hi_sum[r] = _mm512_setzero_si512(); });
        repeat<4>([&](auto p) {
            // inputs 4 p .. 4 p + 3 (wl) and 16 + 4 p .. (wh): a nibble record's low and high
            // nibbles, or a byte record's vectors p and 4 + p
            __m512i wl, wh;
            if constexpr (K::nibbles) {
                const __m512i v = _mm512_loadu_si512(rec + 64 * p);
                wl = _mm512_and_si512(v, low);
                wh = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            } else {
                wl = _mm512_loadu_si512(rec + 64 * p);
                wh = _mm512_loadu_si512(rec + 64 * (p + 4));
            }
            repeat<T>([&](auto r) {
                const int8_t* xb = xq + r * QK;
                int32_t a, b;
                std::memcpy(&a, xb + 4 * p, 4);
                std::memcpy(&b, xb + 16 + 4 * p, 4);
                specdec::dpbusd(lo_sum[r], wl, _mm512_set1_epi32(a));
                specdec::dpbusd(hi_sum[r], wh, _mm512_set1_epi32(b));
            });
        });
        const __m512 dw = affine_scales16<K>(rec, K::scales);
        const __m512 mw = affine_scales16<K>(rec, K::mins);
        repeat<T>([&](auto r) {
            __m512 t = _mm512_cvtepi32_ps(_mm512_add_epi32(lo_sum[r], hi_sum[r]));
            t = _mm512_mul_ps(t, dw);
            t = _mm512_add_ps(t, _mm512_mul_ps(_mm512_set1_ps(xs[r]), mw));
            t = _mm512_mul_ps(t, _mm512_set1_ps(xd[r]));
            acc[r] = _mm512_add_ps(acc[r], t);
        });
    }
    store_tile<T>(acc, out, res, row0, ldo, ncols);
}

// Q6: the 640-byte records, a float32 scale per 16 inputs (see the layouts above).
template <int T, bool Q6>
void q8_tile_avx512(const uint8_t* unit, const Rows& x, int64_t row0, float* out, const float* res, int64_t ldo, int ncols) {
    using specdec::repeat;
    constexpr int RECORD = Q6 ? Q6_RECORD : Q8_RECORD;
    __m512 acc[T];
    repeat<T>([&](auto r) { acc[r] = _mm512_setzero_ps(); });
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    const int8_t* xq = x.q + row0 * QK;
    const float* xd = x.d + row0;
    const int32_t* xs = x.s + row0;
    const int32_t* xs16 = x.s16 + row0;
    for (int64_t g = 0; g < x.G; ++g, xq += x.rows * QK, xd += x.rows, xs += x.rows, xs16 += x.rows) {
        const uint8_t* rec = unit + g * RECORD;
        prefetch_ahead<RECORD>(rec);
        __m512i lo[T], hi[T];  // inputs 0..15 and 16..31: two dependency chains per row
        repeat<T>([&](auto r) { lo[r] = hi[r] = _mm512_setzero_si512(); });
        repeat<4>([&](auto j) {
            // w + 128 as unsigned bytes: sum((w + 128) x) - 128 sum(x) is the exact signed sum.
            const __m512i w0 = _mm512_xor_si512(_mm512_loadu_si512(rec + 64 * j), flip);
            const __m512i w1 = _mm512_xor_si512(_mm512_loadu_si512(rec + 64 * (j + 4)), flip);
            repeat<T>([&](auto r) {
                const int8_t* xb = xq + r * QK;
                int32_t a, b;
                std::memcpy(&a, xb + 4 * j, 4);
                std::memcpy(&b, xb + 16 + 4 * j, 4);
                specdec::dpbusd(lo[r], w0, _mm512_set1_epi32(a));
                specdec::dpbusd(hi[r], w1, _mm512_set1_epi32(b));
            });
        });
        if constexpr (Q6) {
            const __m512 dlo = _mm512_loadu_ps(reinterpret_cast<const float*>(rec + 512));
            const __m512 dhi = _mm512_loadu_ps(reinterpret_cast<const float*>(rec + 576));
            repeat<T>([&](auto r) {
                const __m512i l = _mm512_sub_epi32(lo[r], _mm512_set1_epi32(128 * xs16[r]));
                const __m512i h = _mm512_sub_epi32(hi[r], _mm512_set1_epi32(128 * (xs[r] - xs16[r])));
                __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(l), dlo);
                t = _mm512_add_ps(t, _mm512_mul_ps(_mm512_cvtepi32_ps(h), dhi));
                t = _mm512_mul_ps(t, _mm512_set1_ps(xd[r]));
                acc[r] = _mm512_add_ps(acc[r], t);
            });
        } else {
            const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 512)));
            repeat<T>([&](auto r) {
                const __m512i sum = _mm512_sub_epi32(_mm512_add_epi32(lo[r], hi[r]), _mm512_set1_epi32(128 * xs[r]));
                __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(sum), dw);
                t = _mm512_mul_ps(t, _mm512_set1_ps(xd[r]));
                acc[r] = _mm512_add_ps(acc[r], t);
            });
        }
    }
    store_tile<T>(acc, out, res, row0, ldo, ncols);
}
#pragma GCC pop_options

// ---------------------------------------------------------------------------------------------
// AVX2: the same records, 8 columns at a time (half h of a unit), maddubs for the integer sums.

__attribute__((target("avx2,fma,f16c")))
inline void store_cols(float* dst, const float* res, __m256 v, int ncols) {
    if (ncols >= 8) {
        _mm256_storeu_ps(dst, res ? _mm256_add_ps(v, _mm256_loadu_ps(res)) : v);
    } else if (ncols > 0) {
        alignas(32) float tmp[8] = {};
        if (res) std::memcpy(tmp, res, sizeof(float) * ncols);
        _mm256_store_ps(tmp, res ? _mm256_add_ps(v, _mm256_load_ps(tmp)) : v);
        std::memcpy(dst, tmp, sizeof(float) * ncols);
    }
}

template <int T, class K>
__attribute__((target("avx2,fma,f16c")))
void q4_tile_avx2(const uint8_t* unit, const Rows& x, int64_t row0, float* out, const float* res, int64_t ldo, int ncols) {
    constexpr int RECORD = K::record;
    const __m256i low = _mm256_set1_epi8(0x0F);
    const __m256i ones = _mm256_set1_epi16(1);
    for (int h = 0; h < 2; ++h) {
        __m256 acc[T];
        for (int r = 0; r < T; ++r) acc[r] = _mm256_setzero_ps();
        const int8_t* xq = x.q + row0 * QK;
        const float* xd = x.d + row0;
        const float* xs = x.sf + row0;
        for (int64_t g = 0; g < x.G; ++g, xq += x.rows * QK, xd += x.rows, xs += x.rows) {
            const uint8_t* rec = unit + g * RECORD;
            if (h == 0) prefetch_ahead<RECORD>(rec);
            // The pair sums of maddubs are added in 16 bits over `spans` vectors p before one madd
            // widens them: |w x + w' x'| <= 2 * 15 * 127 = 3,810 for nibbles, whose 8 (4 p, low and
            // high) stay within 30,480; 7,874 for Q5's 5-bit bytes, whose 4 (2 p) stay within
            // 31,496. Exact integers either way: the same sums as widening each one.
            constexpr int spans = K::nibbles ? 4 : 2;
            __m256i sum[T], pairs[T];
            for (int r = 0; r < T; ++r) sum[r] = pairs[r] = _mm256_setzero_si256();
            for (int p = 0; p < 4; ++p) {
                __m256i wl, wh;  // as the AVX-512 tile's, columns 8 h .. 8 h + 7
                if constexpr (K::nibbles) {
                    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 64 * p + 32 * h));
                    wl = _mm256_and_si256(v, low);
                    wh = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                } else {
                    wl = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 64 * p + 32 * h));
                    wh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 64 * (p + 4) + 32 * h));
                }
                for (int r = 0; r < T; ++r) {
                    const int8_t* xb = xq + r * QK;
                    int32_t a, b;
                    std::memcpy(&a, xb + 4 * p, 4);
                    std::memcpy(&b, xb + 16 + 4 * p, 4);
                    const __m256i pl = _mm256_maddubs_epi16(wl, _mm256_set1_epi32(a));
                    const __m256i ph = _mm256_maddubs_epi16(wh, _mm256_set1_epi32(b));
                    pairs[r] = _mm256_add_epi16(pairs[r], _mm256_add_epi16(pl, ph));
                }
                if ((p + 1) % spans == 0) {
                    for (int r = 0; r < T; ++r) {
                        sum[r] = _mm256_add_epi32(sum[r], _mm256_madd_epi16(pairs[r], ones));
                        pairs[r] = _mm256_setzero_si256();
                    }
                }
            }
            const __m256 dw = affine_scales8<K>(rec, K::scales, h);
            const __m256 mw = affine_scales8<K>(rec, K::mins, h);
            for (int r = 0; r < T; ++r) {
                __m256 t = _mm256_cvtepi32_ps(sum[r]);
                t = _mm256_mul_ps(t, dw);
                t = _mm256_add_ps(t, _mm256_mul_ps(_mm256_set1_ps(xs[r]), mw));
                t = _mm256_mul_ps(t, _mm256_set1_ps(xd[r]));
                acc[r] = _mm256_add_ps(acc[r], t);
            }
        }
        for (int r = 0; r < T; ++r)
            store_cols(out + (row0 + r) * ldo + 8 * h, res ? res + (row0 + r) * ldo + 8 * h : nullptr, acc[r], ncols - 8 * h);
    }
}

template <int T, bool Q6>
__attribute__((target("avx2,fma,f16c")))
void q8_tile_avx2(const uint8_t* unit, const Rows& x, int64_t row0, float* out, const float* res, int64_t ldo, int ncols) {
    constexpr int RECORD = Q6 ? Q6_RECORD : Q8_RECORD;
    const __m256i ones = _mm256_set1_epi16(1);
    for (int h = 0; h < 2; ++h) {
        __m256 acc[T];
        for (int r = 0; r < T; ++r) acc[r] = _mm256_setzero_ps();
        const int8_t* xq = x.q + row0 * QK;
        const float* xd = x.d + row0;
        for (int64_t g = 0; g < x.G; ++g, xq += x.rows * QK, xd += x.rows) {
            const uint8_t* rec = unit + g * RECORD;
            if (h == 0) prefetch_ahead<RECORD>(rec);
            __m256i lo[T], hi[T];  // inputs 0..15 and 16..31
            for (int r = 0; r < T; ++r) lo[r] = hi[r] = _mm256_setzero_si256();
            for (int j = 0; j < 8; ++j) {
                const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 64 * j + 32 * h));
                const __m256i wabs = _mm256_abs_epi8(w);  // -128 becomes 128 as an unsigned byte
                for (int r = 0; r < T; ++r) {
                    int32_t a;
                    std::memcpy(&a, xq + r * QK + 4 * j, 4);
                    // |w| times x with w's sign: |pair sum| <= 2 * 128 * 127, no saturation.
                    const __m256i xs = _mm256_sign_epi8(_mm256_set1_epi32(a), w);
                    const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, xs), ones);
                    if (j < 4) lo[r] = _mm256_add_epi32(lo[r], p);
                    else hi[r] = _mm256_add_epi32(hi[r], p);
                }
            }
            if constexpr (Q6) {
                const __m256 dlo = _mm256_loadu_ps(reinterpret_cast<const float*>(rec + 512) + 8 * h);
                const __m256 dhi = _mm256_loadu_ps(reinterpret_cast<const float*>(rec + 576) + 8 * h);
                for (int r = 0; r < T; ++r) {
                    __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(lo[r]), dlo);
                    t = _mm256_add_ps(t, _mm256_mul_ps(_mm256_cvtepi32_ps(hi[r]), dhi));
                    t = _mm256_mul_ps(t, _mm256_set1_ps(xd[r]));
                    acc[r] = _mm256_add_ps(acc[r], t);
                }
            } else {
                const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 512 + 16 * h)));
                for (int r = 0; r < T; ++r) {
                    __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(lo[r], hi[r])), dw);
                    t = _mm256_mul_ps(t, _mm256_set1_ps(xd[r]));
                    acc[r] = _mm256_add_ps(acc[r], t);
                }
            }
        }
        for (int r = 0; r < T; ++r)
            store_cols(out + (row0 + r) * ldo + 8 * h, res ? res + (row0 + r) * ldo + 8 * h : nullptr, acc[r], ncols - 8 * h);
    }
}

// ---------------------------------------------------------------------------------------------
// Dispatch: rows in tiles of the largest size the instruction set keeps in registers.

// Each kernel's tiles of 1 .. N rows, indexed by rows (AVX-512: up to 8 rows, AVX2: up to 4).
template <class K, int... T>
TileFn q4_avx512(int rows, std::integer_sequence<int, T...>) {
    static const TileFn table[] = {q4_tile_avx512<T + 1, K>...};
    return table[rows - 1];
}
template <bool Q6, int... T>
TileFn q8_avx512(int rows, std::integer_sequence<int, T...>) {
    static const TileFn table[] = {q8_tile_avx512<T + 1, Q6>...};
    return table[rows - 1];
}
template <class K, int... T>
TileFn q4_avx2(int rows, std::integer_sequence<int, T...>) {
    static const TileFn table[] = {q4_tile_avx2<T + 1, K>...};
    return table[rows - 1];
}
template <bool Q6, int... T>
TileFn q8_avx2(int rows, std::integer_sequence<int, T...>) {
    static const TileFn table[] = {q8_tile_avx2<T + 1, Q6>...};
    return table[rows - 1];
}
constexpr auto AVX512_ROWS = std::make_integer_sequence<int, 8>{};
constexpr auto AVX2_ROWS = std::make_integer_sequence<int, 4>{};

}  // namespace

at::Tensor quantized_matmul(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                               int64_t isa, bool q4, const c10::optional<at::Tensor>& residual) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be [rows, in] float32");
    TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous(),
                "packed weights must be a contiguous [units, blocks, bytes] uint8 tensor");
    // q4's records hold nibbles with float16 or float32 scales or bytes (Q5_K), q8's a scale per
    // 32 or per 16 inputs: their size says which.
    const bool f32 = q4 && packed.size(2) == Q4F_RECORD;
    const bool q5 = q4 && packed.size(2) == Q5_RECORD;
    const bool q6 = !q4 && packed.size(2) == Q6_RECORD;
    const int record = q4 ? (q5 ? Q5_RECORD : f32 ? Q4F_RECORD : Q4_RECORD) : (q6 ? Q6_RECORD : Q8_RECORD);
    const int64_t units = packed.size(0), G = packed.size(1), K = G * QK;
    TORCH_CHECK(packed.size(2) == record, "packed record size ", packed.size(2), ", expected ", record);
    TORCH_CHECK(x.size(1) == K, "x has ", x.size(1), " inputs, the weights ", K);
    TORCH_CHECK(out_features > (units - 1) * NC && out_features <= units * NC, "out_features does not match units");
    isa = specdec::resolve_isa(isa);

    const at::Tensor xc = x.contiguous();
    const int64_t rows = xc.size(0);
    // The quantized activations live in a per-thread scratch buffer, reused from call to call.
    thread_local std::vector<int8_t> q_buf;
    thread_local std::vector<float> d_buf, sf_buf;
    thread_local std::vector<int32_t> s_buf, s16_buf;
    // On AMX a tile loads 16 rows of a block whatever its own size: room for the last block's.
    // Records with a scale per 16 inputs run the VNNI tiles under it (the same bits).
    const bool amx = isa == specdec::ISA_AMX && rows >= specdec::AMX_ROWS && !q6;
    q_buf.resize(rows * K + (amx ? specdec::AMX_PAD_BYTES : 0));
    d_buf.resize(rows * G);
    sf_buf.resize(rows * G);
    s_buf.resize(rows * G);
    s16_buf.resize(rows * G);
    quantize_rows(xc.data_ptr<float>(), rows, K, q_buf.data(), d_buf.data(), s_buf.data(), sf_buf.data(),
                  s16_buf.data());
    auto out = at::empty({rows, out_features}, at::kFloat);
    at::Tensor res_c;  // the residual stream, added in the tiles' stores
    const float* res = residual_rows(residual, rows, out_features, res_c);
    const Rows xr{q_buf.data(), d_buf.data(), s_buf.data(), sf_buf.data(), s16_buf.data(), rows, G};
    const uint8_t* w = packed.data_ptr<uint8_t>();
    float* o = out.data_ptr<float>();
    auto vnni_tile = [&](int n) {
        if (isa == specdec::ISA_AVX2) {
            if (q4) return q5 ? q4_avx2<specdec::Q5Float>(n, AVX2_ROWS) : f32 ? q4_avx2<specdec::Q4Float>(n, AVX2_ROWS)
                                                                             : q4_avx2<specdec::Q4Half>(n, AVX2_ROWS);
            return q6 ? q8_avx2<true>(n, AVX2_ROWS) : q8_avx2<false>(n, AVX2_ROWS);
        }
        if (q4) return q5 ? q4_avx512<specdec::Q5Float>(n, AVX512_ROWS) : f32 ? q4_avx512<specdec::Q4Float>(n, AVX512_ROWS)
                                                                                 : q4_avx512<specdec::Q4Half>(n, AVX512_ROWS);
        return q6 ? q8_avx512<true>(n, AVX512_ROWS) : q8_avx512<false>(n, AVX512_ROWS);
    };
    auto amx_tile = [&](int n) {
        if (q4) return q5 ? specdec::q5_tile_amx(n) : f32 ? specdec::q4f_tile_amx(n) : specdec::q4_tile_amx(n);
        return specdec::q8_tile_amx(n);
    };
    // Per panel of 16 rows (the last may hold fewer): an AMX tile, or VNNI/AVX2 tiles, as few as
    // the registers allow, of balanced sizes (7 rows: 4 + 3, not 6 + 1, whose lone row would be
    // latency-bound). A row's bits never depend on the tile it lands in.
    struct Panel {
        Rows x;
        int64_t first;                                   // its first row
        specdec::AmxTileFn amx;                           // or null
        std::vector<std::pair<int64_t, TileFn>> tiles;    // (first row in the panel, tile function)
    };
    std::vector<Panel> panels;
    const int max_tile = isa == specdec::ISA_AVX2 ? 4 : 8;
    int64_t amx_panels = 0;
    for (int64_t p0 = 0; p0 < rows; p0 += PANEL) {
        const int64_t n = std::min<int64_t>(PANEL, rows - p0);
        Panel pn{panel(xr, p0, n), p0, nullptr, {}};
        if (amx && n >= AMX_MIN_ROWS) {
            pn.amx = amx_tile(static_cast<int>(n));
            ++amx_panels;
        } else {
            const int64_t tiles = (n + max_tile - 1) / max_tile;
            for (int64_t t = 0, row = 0; t < tiles; ++t) {
                const int size = static_cast<int>((n - row) / (tiles - t) + ((n - row) % (tiles - t) ? 1 : 0));
                pn.tiles.emplace_back(row, vnni_tile(size));
                row += size;
            }
        }
        panels.push_back(std::move(pn));
    }
    // A thread's units run over a group of panels at a time: the group's rows of the thread's
    // columns (their outputs) stay in its caches until they are done, where a unit over all of a
    // prefill's rows would leave a line of each row half written. A nibble unit that several AMX
    // tiles read is split into bytes once a group.
    const bool split = amx_panels > 1 && q4 && !q5;
    specdec::parallel_runs(units, [&](int64_t begin, int64_t end) {
        if (amx) specdec::amx_begin();
        thread_local std::vector<uint8_t> bytes;
        if (split) bytes.resize(G * QK * NC);
        for (size_t first = 0; first < panels.size(); first += PANEL_GROUP) {
            const size_t last = std::min(panels.size(), first + PANEL_GROUP);
            for (int64_t u = begin; u < end; ++u) {
                const uint8_t* unit = w + u * G * record;
                const int ncols = static_cast<int>(std::min<int64_t>(NC, out_features - u * NC));
                if (split) specdec::amx_split_unit(unit, G, record, bytes.data());
                for (size_t i = first; i < last; ++i) {
                    const Panel& pn = panels[i];
                    float* col = o + pn.first * out_features + u * NC;
                    const float* res_col = res ? res + pn.first * out_features + u * NC : nullptr;
                    if (pn.amx) pn.amx(unit, split ? bytes.data() : nullptr, pn.x, 0, col, res_col, out_features, ncols);
                    for (const auto& [row, fn] : pn.tiles) fn(unit, pn.x, row, col, res_col, out_features, ncols);
                }
            }
        }
        if (amx) specdec::amx_end();
    });
    return out;
}
