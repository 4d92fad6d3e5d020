// Products of float32 rows with float16 weights (GGUF's F16 matrices, float16 checkpoints): the
// weights stay 2 bytes each, as the file holds them, and widen exactly (F16C) as they are read.
//
// Each output is a dot product in one fixed order whatever the rows, tile, thread or instruction
// set: 16 lanes, lane j summing inputs j, 16 + j, 32 + j, ... first to last (a multiply, then an
// add, each rounded: no FMA), then the lanes folded in halves (j + 8, then the 8 lanes as
// simd.h's horizontal_sum), then the residual added where given. The AVX-512 path holds the 16
// lanes in one register, the AVX2 path in two; `reference.py`'s f16_matmul is the same sequence
// in PyTorch.
//
// Layout: the matrix as is, [out, in] float16 row-major (in a multiple of 16), so that the
// token embedding can be the tied LM head's own table and rows are gathered by index.

#include "ops.h"
#include "pool.h"
#include "simd.h"

#include <ATen/ops/empty.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <utility>

namespace {

constexpr int LANES = 16;   // inputs per step of a dot product
constexpr int UNIT = 16;    // output columns a thread claims at a time

// A tile's C columns are C * K contiguous weights, and the next tile's follow them: a tile reads
// its columns side by side, which the hardware prefetcher does not follow as one stream, so each
// step of 16 inputs asks for its share of the next tile's lines (the same bits; prefetches only).
template <int C>
inline void prefetch_next(const uint16_t* w, int64_t K, int64_t k) {
    constexpr int LINES = (C + 1) / 2;  // C * K * 2 bytes over K / 16 steps, in 64-byte lines
    const char* next = reinterpret_cast<const char*>(w + C * K) + (k / LANES) * LINES * 64;
    for (int line = 0; line < LINES; ++line) _mm_prefetch(next + line * 64, _MM_HINT_T0);
}

using HalfTile = void (*)(const uint16_t* w, int64_t K, const float* x, float* out, const float* res, int64_t ldo);

// T rows x C columns: x [T rows, stride K], w [C rows, stride K] -> out [T, ldo] (+ res [T, ldo]).
template <int T, int C>
__attribute__((target("avx512f,avx2,fma,f16c")))
void tile_avx512(const uint16_t* w, int64_t K, const float* x, float* out, const float* res, int64_t ldo) {
    __m512 acc[T][C];
    for (int r = 0; r < T; ++r)
        for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += LANES) {
        prefetch_next<C>(w, K, k);
        __m512 xv[T];
        for (int r = 0; r < T; ++r) xv[r] = _mm512_loadu_ps(x + r * K + k);
        for (int c = 0; c < C; ++c) {
            const __m512 wv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + c * K + k)));
            for (int r = 0; r < T; ++r) acc[r][c] = _mm512_add_ps(acc[r][c], _mm512_mul_ps(xv[r], wv));
        }
    }
    for (int r = 0; r < T; ++r)
        for (int c = 0; c < C; ++c) {
            const __m256 high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[r][c]), 1));
            const __m256 folded = _mm256_add_ps(_mm512_castps512_ps256(acc[r][c]), high);
            const float sum = specdec::horizontal_sum(folded);
            out[r * ldo + c] = res ? sum + res[r * ldo + c] : sum;
        }
}

template <int T, int C>
__attribute__((target("avx2,fma,f16c")))
void tile_avx2(const uint16_t* w, int64_t K, const float* x, float* out, const float* res, int64_t ldo) {
    __m256 lo[T][C], hi[T][C];  // lanes 0..7 and 8..15
    for (int r = 0; r < T; ++r)
        for (int c = 0; c < C; ++c) lo[r][c] = hi[r][c] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += LANES) {
        prefetch_next<C>(w, K, k);
        __m256 xl[T], xh[T];
        for (int r = 0; r < T; ++r) {
            xl[r] = _mm256_loadu_ps(x + r * K + k);
            xh[r] = _mm256_loadu_ps(x + r * K + k + 8);
        }
        for (int c = 0; c < C; ++c) {
            const __m256 wl = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + c * K + k)));
            const __m256 wh = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + c * K + k + 8)));
            for (int r = 0; r < T; ++r) {
                lo[r][c] = _mm256_add_ps(lo[r][c], _mm256_mul_ps(xl[r], wl));
                hi[r][c] = _mm256_add_ps(hi[r][c], _mm256_mul_ps(xh[r], wh));
            }
        }
    }
    for (int r = 0; r < T; ++r)
        for (int c = 0; c < C; ++c) {
            const float sum = specdec::horizontal_sum(_mm256_add_ps(lo[r][c], hi[r][c]));
            out[r * ldo + c] = res ? sum + res[r * ldo + c] : sum;
        }
}

// The tiles a path runs: 1 .. ROWS rows by as many columns as keep the accumulators in registers
// and, for a single row, enough independent sums to hide the add's latency; and single columns
// for a matrix's last few.
template <int T> constexpr int avx512_cols = T == 1 ? 8 : 4;
template <int T> constexpr int avx2_cols = T == 1 ? 4 : 2;

struct Tile {
    HalfTile fn;
    int cols;
};

template <int... T>
Tile avx512_tile(int rows, bool wide, std::integer_sequence<int, T...>) {
    static const Tile wide_tiles[] = {{tile_avx512<T + 1, avx512_cols<T + 1>>, avx512_cols<T + 1>}...};
    static const Tile narrow_tiles[] = {{tile_avx512<T + 1, 1>, 1}...};
    return wide ? wide_tiles[rows - 1] : narrow_tiles[rows - 1];
}

template <int... T>
Tile avx2_tile(int rows, bool wide, std::integer_sequence<int, T...>) {
    static const Tile wide_tiles[] = {{tile_avx2<T + 1, avx2_cols<T + 1>>, avx2_cols<T + 1>}...};
    static const Tile narrow_tiles[] = {{tile_avx2<T + 1, 1>, 1}...};
    return wide ? wide_tiles[rows - 1] : narrow_tiles[rows - 1];
}

}  // namespace

at::Tensor half_matmul(const at::Tensor& x, const at::Tensor& w, int64_t out_features, int64_t isa,
                       const c10::optional<at::Tensor>& residual) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be [rows, in] float32");
    TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kHalf && w.is_contiguous(),
                "the weights must be a contiguous [out, in] float16 matrix");
    const int64_t K = w.size(1), rows = x.size(0);
    TORCH_CHECK(K % LANES == 0, "float16 weights need in_features divisible by ", LANES, ", got ", K);
    TORCH_CHECK(x.size(1) == K, "x has ", x.size(1), " inputs, the weights ", K);
    TORCH_CHECK(w.size(0) == out_features, "out_features does not match the weights");
    // AMX has no exact float16 product: its path runs the AVX-512 tiles here.
    const bool avx512 = specdec::resolve_isa(isa) != specdec::ISA_AVX2;
    const int max_rows = avx512 ? 4 : 2;

    const at::Tensor xc = x.contiguous();
    auto out = at::empty({rows, out_features}, at::kFloat);
    at::Tensor res_c;  // the residual stream, added in the tiles' stores
    const float* res = residual_rows(residual, rows, out_features, res_c);
    const float* xp = xc.data_ptr<float>();
    const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::Half>());
    float* o = out.data_ptr<float>();
    auto tile = [&](int n, bool wide) {
        return avx512 ? avx512_tile(n, wide, std::make_integer_sequence<int, 4>{})
                      : avx2_tile(n, wide, std::make_integer_sequence<int, 2>{});
    };
    const int64_t units = (out_features + UNIT - 1) / UNIT;
    specdec::parallel_runs(units, [&](int64_t begin, int64_t end) {
        for (int64_t u = begin; u < end; ++u) {
            const int64_t c_end = std::min(out_features, (u + 1) * UNIT);
            for (int64_t row = 0; row < rows; row += max_rows) {
                const int n = static_cast<int>(std::min<int64_t>(max_rows, rows - row));
                const Tile wide = tile(n, true), narrow = tile(n, false);
                for (int64_t c = u * UNIT; c < c_end;) {
                    const Tile& t = c_end - c >= wide.cols ? wide : narrow;
                    t.fn(wp + c * K, K, xp + row * K, o + row * out_features + c,
                         res ? res + row * out_features + c : nullptr, out_features);
                    c += t.cols;
                }
            }
        }
    });
    return out;
}
