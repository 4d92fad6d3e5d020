// The products on AMX tiles (Intel's Advanced Matrix Extensions): one tdpbsud (q4) or tdpbssd (q8)
// multiplies a block of 32 inputs for up to 16 activation rows by one unit of 16 output columns,
// where the VNNI path spends 8 vpdpbusd per row. The integer sums are exact on both paths, and
// each block's float epilogue here is the VNNI tile's sequence of operations on the same integer,
// so an AMX row is bitwise the VNNI row (and the reference's).
//
// Tiles: tmm0..tmm3 the int32 sums C [16 rows, 16 columns] of four blocks in flight, tmm4/tmm5
// activations A [16 rows, 32 bytes], tmm6/tmm7 weights B [8 rows of 4 inputs, 16 columns x 4
// bytes]. A q8 record is B's layout as packed; a q4 record's nibbles are split into bytes first
// (inputs 0..15 are the low nibbles of its 4 vectors, 16..31 the high ones), once a unit when
// several tiles read it. A block's sums are stored two products after its own (a store right
// after its product waits for it, and holds up the tile unit), and the blocks' epilogues run a
// group of four behind their products, in block order.
//
// Linux hands a process the tile state only on request (cpu.cpp asks, once), and each thread must
// load a tile configuration before its first tile instruction: amx_begin() does that for every
// chunk of work a thread takes, and amx_end() releases the state, so that other code on the thread
// (oneDNN, say) finds it as it left it. GCC's tile intrinsics declare no memory operands, so the compiler
// could move the stores of a q4 block's bytes past the tile load that reads them: the wrappers
// below clobber memory.

#include "ops.h"
#include "quant.h"
#include "simd.h"

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>

namespace specdec {
namespace {

// Palette 1; colsb and rows per tile as the header above lays them out.
struct alignas(64) TileConfig {
    uint8_t palette = 1;
    uint8_t start_row = 0;
    uint8_t reserved[14] = {};
    uint16_t colsb[16] = {64, 64, 64, 64, QK, QK, 64, 64};
    uint8_t rows[16] = {AMX_ROWS, AMX_ROWS, AMX_ROWS, AMX_ROWS, AMX_ROWS, AMX_ROWS, QK / 4, QK / 4};
};
static_assert(sizeof(TileConfig) == 64, "a tile configuration is 64 bytes");
const TileConfig CONFIG{};

template <int N>
inline void tile_load(const void* base, long stride) {
    __asm__ volatile("tileloadd (%0,%1,1), %%tmm%c2" ::"r"(base), "r"(stride), "i"(N) : "memory");
}
template <int N>
inline void tile_store(void* base, long stride) {
    __asm__ volatile("tilestored %%tmm%c2, (%0,%1,1)" ::"r"(base), "r"(stride), "i"(N) : "memory");
}
template <int N>
inline void tile_zero() {
    __asm__ volatile("tilezero %%tmm%c0" ::"i"(N));
}
// C += A B: A's bytes signed; B's unsigned (q4's nibbles) or signed (q8).
template <int C, int A, int B, bool UNSIGNED_B>
inline void tile_dot() {
    if constexpr (UNSIGNED_B) __asm__ volatile("tdpbsud %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"i"(C), "i"(A), "i"(B));
    else __asm__ volatile("tdpbssd %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"i"(C), "i"(A), "i"(B));
}

#define SPECDEC_AMX_TARGET "amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512vnni,f16c"

// The records a tile reads: the affine family's (Q4Half, Q4Float, Q5Float: B's bytes unsigned)
// or q8's (w = d q, signed, float16 d).
struct Symmetric {
    static constexpr bool nibbles = false, f32 = false;
    static constexpr int record = Q8_RECORD, scales = 512;
};
template <class K>
constexpr bool is_affine() { return !std::is_same_v<K, Symmetric>; }

// One block's tile product, C = A B, into tile S of tmm0..3 (A and B in tmm4/5 and tmm6/7 by S's
// parity); B from the nibbles' bytes or from the record itself. The caller stores C later: a
// store right after its product waits for it, and the tile unit with it.
template <int S, class K>
__attribute__((target(SPECDEC_AMX_TARGET), always_inline))
inline void issue(const uint8_t* weights, const int8_t* xq) {
    constexpr int A = 4 + S % 2, B = 6 + S % 2;
    tile_load<B>(weights, 64);
    tile_load<A>(xq, QK);
    tile_zero<S>();
    tile_dot<S, A, B, is_affine<K>()>();
}

// A nibble record's weights as B's bytes (inputs 0..15: the low nibbles of its 4 vectors, 16..31
// the high ones).
__attribute__((target(SPECDEC_AMX_TARGET), always_inline))
inline void split_nibbles(const uint8_t* rec, uint8_t* bytes) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int p = 0; p < 4; ++p) {
        const __m512i v = _mm512_loadu_si512(rec + 64 * p);
        _mm512_storeu_si512(bytes + 64 * p, _mm512_and_si512(v, low));
        _mm512_storeu_si512(bytes + 256 + 64 * p, _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
    }
}

// A record's 16 d or m (at byte `at`), as float32.
template <class K>
__attribute__((target(SPECDEC_AMX_TARGET), always_inline))
inline __m512 scales(const uint8_t* rec, int at) {
    if constexpr (K::f32) return _mm512_loadu_ps(reinterpret_cast<const float*>(rec + at));
    else return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + at)));
}

// A block's epilogue from its sums (row r at 16 r): the VNNI tile's operations, in its order.
// xd, xs: the tile's rows' activation scales and sums for this block.
template <int T, class K>
__attribute__((target(SPECDEC_AMX_TARGET), always_inline))
inline void finish(const uint8_t* rec, const int32_t* sums, const float* xd, const float* xs, __m512* acc) {
    const __m512 dw = scales<K>(rec, K::scales);
    if constexpr (is_affine<K>()) {
        const __m512 mw = scales<K>(rec, K::mins);
        for (int r = 0; r < T; ++r) {
            __m512 t = _mm512_cvtepi32_ps(_mm512_load_si512(sums + NC * r));
            t = _mm512_mul_ps(t, dw);
            t = _mm512_add_ps(t, _mm512_mul_ps(_mm512_set1_ps(xs[r]), mw));
            t = _mm512_mul_ps(t, _mm512_set1_ps(xd[r]));
            acc[r] = _mm512_add_ps(acc[r], t);
        }
    } else {
        for (int r = 0; r < T; ++r) {
            __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(sums + NC * r)), dw);
            t = _mm512_mul_ps(t, _mm512_set1_ps(xd[r]));
            acc[r] = _mm512_add_ps(acc[r], t);
        }
    }
}

// A tile's blocks in flight: the nibble records' bytes (a ring of three groups) and the blocks'
// sums (a ring of two), in buffers of the caller's. The accumulators stay with the caller too: the
// tile instructions' memory clobbers would otherwise send them to memory at every block.
template <class K>
struct Pipeline {
    static constexpr int W = 4, RECORD = K::record;
    const uint8_t* unit;
    const uint8_t* unpacked;  // the caller's bytes for nibble records, or null
    const Rows& x;
    int64_t row0;
    uint8_t (*bytes)[QK * NC];      // [3 W], when unpacked is null
    int32_t (*sums)[AMX_ROWS * NC];  // [2 W]

    const uint8_t* rec(int64_t g) const { return unit + g * RECORD; }
    const int8_t* act(int64_t g) const { return x.q + (g * x.rows + row0) * QK; }
    // B's bytes for block g: the record's own (q8, bytes), the caller's split copy, or the ring's
    const uint8_t* weights(int64_t g) const {
        if constexpr (!K::nibbles) return rec(g);
        else return unpacked ? unpacked + g * QK * NC : bytes[g % (3 * W)];
    }

    // Group g0's bytes split from their nibbles and its records asked for PREFETCH_AHEAD blocks
    // on, where the caller has not split the unit.
    __attribute__((target(SPECDEC_AMX_TARGET), always_inline)) void split(int64_t g0) const {
        if (unpacked) return;
        for (int64_t g = g0; g < std::min<int64_t>(g0 + W, x.G); ++g) {
            prefetch_ahead<K::record>(rec(g));
            if constexpr (K::nibbles) split_nibbles(rec(g), bytes[g % (3 * W)]);
        }
    }
    int32_t* slot(int64_t g) const { return sums[g % (2 * W)]; }
    // Block g's product into tile S, and the sums of block g - 2 (tile S + 2) stored: two products
    // stand between a product and its store.
    template <int S>
    __attribute__((target(SPECDEC_AMX_TARGET), always_inline)) void block(int64_t g) const {
        issue<S, K>(weights(g), act(g));
        if (g >= 2) tile_store<(S + 2) % 4>(slot(g - 2), 64);
    }
    __attribute__((target(SPECDEC_AMX_TARGET), always_inline)) void products(int64_t g0) const {
        if (g0 < x.G) block<0>(g0);
        if (g0 + 1 < x.G) block<1>(g0 + 1);
        if (g0 + 2 < x.G) block<2>(g0 + 2);
        if (g0 + 3 < x.G) block<3>(g0 + 3);
    }
    // The last two blocks' sums, which no later product stores.
    __attribute__((target(SPECDEC_AMX_TARGET), always_inline)) void flush() const {
        for (int64_t g = std::max<int64_t>(0, x.G - 2); g < x.G; ++g) {
            switch (g % 4) {
                case 0: tile_store<0>(slot(g), 64); break;
                case 1: tile_store<1>(slot(g), 64); break;
                case 2: tile_store<2>(slot(g), 64); break;
                default: tile_store<3>(slot(g), 64); break;
            }
        }
    }
    template <int T>
    __attribute__((target(SPECDEC_AMX_TARGET), always_inline)) void epilogues(int64_t g0, __m512* acc) const {
        for (int64_t g = g0; g < std::min<int64_t>(g0 + W, x.G); ++g)
            finish<T, K>(rec(g), slot(g), x.d + g * x.rows + row0, x.sf + g * x.rows + row0, acc);
    }
};

// Blocks go in groups of 4, software-pipelined: group i's tile products are issued, then group
// i + 2's nibbles split into bytes (a tile load right after the stores that made its bytes would
// wait for them), then group i - 1's epilogues run, in block order.
template <int T, class K>
__attribute__((target(SPECDEC_AMX_TARGET)))
void tile_amx(const uint8_t* unit, const uint8_t* unpacked, const Rows& x, int64_t row0, float* out,
              const float* res, int64_t ldo, int ncols) {
    constexpr int W = Pipeline<K>::W;
    alignas(64) uint8_t bytes[3 * W][QK * NC];
    alignas(64) int32_t sums[2 * W][AMX_ROWS * NC];
    const Pipeline<K> p{unit, unpacked, x, row0, bytes, sums};
    __m512 acc[T];
    for (int r = 0; r < T; ++r) acc[r] = _mm512_setzero_ps();
    p.split(0);
    p.split(W);
    for (int64_t g0 = 0; g0 < x.G; g0 += W) {
        p.products(g0);
        if (g0 + W >= x.G) p.flush();
        p.split(g0 + 2 * W);
        if (g0 > 0) p.template epilogues<T>(g0 - W, acc);
    }
    p.template epilogues<T>((x.G - 1) / W * W, acc);
    const __mmask16 mask = specdec::first_lanes(ncols);
    for (int r = 0; r < T; ++r) {
        const int64_t at = (row0 + r) * ldo;
        const __m512 v = res ? _mm512_add_ps(acc[r], _mm512_maskz_loadu_ps(mask, res + at)) : acc[r];
        _mm512_mask_storeu_ps(out + at, mask, v);
    }
}

template <class K, int... T>
AmxTileFn pick(int rows, std::integer_sequence<int, T...>) {
    static const AmxTileFn table[] = {tile_amx<T + 1, K>...};
    return table[rows - 1];
}

}  // namespace

AmxTileFn q4_tile_amx(int rows) { return pick<Q4Half>(rows, std::make_integer_sequence<int, AMX_ROWS>{}); }
AmxTileFn q4f_tile_amx(int rows) { return pick<Q4Float>(rows, std::make_integer_sequence<int, AMX_ROWS>{}); }
AmxTileFn q5_tile_amx(int rows) { return pick<Q5Float>(rows, std::make_integer_sequence<int, AMX_ROWS>{}); }
AmxTileFn q8_tile_amx(int rows) { return pick<Symmetric>(rows, std::make_integer_sequence<int, AMX_ROWS>{}); }

__attribute__((target(SPECDEC_AMX_TARGET)))
void amx_split_unit(const uint8_t* unit, int64_t G, int record, uint8_t* bytes) {
    for (int64_t g = 0; g < G; ++g) split_nibbles(unit + g * record, bytes + g * QK * NC);
}

void amx_begin() { __asm__ volatile("ldtilecfg %0" ::"m"(CONFIG)); }

// The r8 products (rotated.cpp): tmm0..3 the int32 sums C of up to four units, tmm4 the panel's
// activations A [16 rows, 64 inputs], tmm5..7 a unit's weights B [16 lines of 4 inputs, 16 columns
// x 4 bytes]; a row's sum runs over all of K in C, signed bytes times signed bytes.
namespace {
struct alignas(64) R8Config {
    uint8_t palette = 1;
    uint8_t start_row = 0;
    uint8_t reserved[14] = {};
    uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
    uint8_t rows[16] = {AMX_ROWS, AMX_ROWS, AMX_ROWS, AMX_ROWS, AMX_ROWS, AMX_ROWS, AMX_ROWS, AMX_ROWS};
};
const R8Config R8_CONFIG{};
constexpr int64_t R8_AHEAD = 2048;  // bytes: the unit's chunk two on (then the next unit's first)

// C_U += A B_U for k-chunk `k` (B in tmm5 + U % 3), and the unit's weights R8_AHEAD on asked for.
template <int U>
__attribute__((target(SPECDEC_AMX_TARGET), always_inline))
inline void r8_step(const uint8_t* w, int64_t unit_bytes, int64_t k) {
    constexpr int B = 5 + U % 3;
    const uint8_t* b = w + U * unit_bytes + k * NC;
    for (int line = 0; line < 1024; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(b + R8_AHEAD + line), _MM_HINT_T0);
    tile_load<B>(b, 64);
    tile_dot<U, 4, B, false>();
}

template <int N>
__attribute__((target(SPECDEC_AMX_TARGET)))
void r8_tiles(const uint8_t* w, int64_t unit_bytes, const int8_t* xq, int64_t K, int32_t* sums) {
    tile_zero<0>();
    if constexpr (N > 1) tile_zero<1>();
    if constexpr (N > 2) tile_zero<2>();
    if constexpr (N > 3) tile_zero<3>();
    for (int64_t k = 0; k < K; k += 64) {
        tile_load<4>(xq + k, K);
        r8_step<0>(w, unit_bytes, k);
        if constexpr (N > 1) r8_step<1>(w, unit_bytes, k);
        if constexpr (N > 2) r8_step<2>(w, unit_bytes, k);
        if constexpr (N > 3) r8_step<3>(w, unit_bytes, k);
    }
    constexpr int C = AMX_ROWS * NC;
    tile_store<0>(sums, 64);
    if constexpr (N > 1) tile_store<1>(sums + C, 64);
    if constexpr (N > 2) tile_store<2>(sums + 2 * C, 64);
    if constexpr (N > 3) tile_store<3>(sums + 3 * C, 64);
}
}  // namespace

void amx_begin_r8() { __asm__ volatile("ldtilecfg %0" ::"m"(R8_CONFIG)); }

void r8_tiles_amx(const uint8_t* w, int64_t unit_bytes, int units, const int8_t* xq, int64_t K, int32_t* sums) {
    switch (units) {
        case 1: r8_tiles<1>(w, unit_bytes, xq, K, sums); break;
        case 2: r8_tiles<2>(w, unit_bytes, xq, K, sums); break;
        case 3: r8_tiles<3>(w, unit_bytes, xq, K, sums); break;
        default: r8_tiles<4>(w, unit_bytes, xq, K, sums); break;
    }
}
void amx_end() { __asm__ volatile("tilerelease" ::: "memory"); }

}  // namespace specdec
