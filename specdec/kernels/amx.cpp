// The products on AMX tiles (Intel's Advanced Matrix Extensions): one tdpbsud (q4) or tdpbssd (q8)
// multiplies a block of 32 inputs for up to 16 activation rows by one unit of 16 output columns,
// where the VNNI path spends 8 vpdpbusd per row. The integer sums are exact on both paths, and
// each block's float epilogue here is the VNNI tile's sequence of operations on the same integer,
// so an AMX row is bitwise the VNNI row (and the reference's).
//
// Tiles: tmm0..tmm3 the int32 sums C [16 rows, 16 columns] of four blocks in flight, tmm4/tmm5
// activations A [16 rows, 32 bytes], tmm6/tmm7 weights B [8 rows of 4 inputs, 16 columns x 4
// bytes]. A q8 record is B's layout as packed; a q4 record's nibbles are split into bytes first
// (inputs 0..15 are the low nibbles of its 4 vectors, 16..31 the high ones). Blocks go in chunks
// of 8: the chunk's q4 bytes are written first (a tile load that read stores just made would wait
// for them), then its tile products run as four independent chains, then its epilogues in block
// order.
//
// Linux hands a process the tile state only on request (arch_prctl), and each thread must load a
// tile configuration before its first tile instruction: amx_begin() does that for every chunk of
// work a thread takes, and amx_end() releases the state, so that other code on the thread (oneDNN,
// say) finds it as it left it. GCC's tile intrinsics declare no memory operands, so the compiler
// could move the stores of a q4 block's bytes past the tile load that reads them: the wrappers
// below clobber memory.

#include "ops.h"
#include "quant.h"

#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>

namespace specdec {
namespace {

constexpr long ARCH_REQ_XCOMP_PERM = 0x1023;
constexpr long XFEATURE_XTILEDATA = 18;
constexpr int PREFETCH_AHEAD = 8;  // blocks, as the VNNI tiles
constexpr int CHUNK = 8;           // blocks whose tile products run before their epilogues

struct State {
    bool usable;
    std::string reason;
};

const State& state() {
    static const State s = []() -> State {
        unsigned a = 0, b = 0, c = 0, d = 0;
        if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 25)))
            return {false, "this CPU has no AMX-INT8"};
        if (!(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
              __builtin_cpu_supports("avx512vnni")))
            return {false, "this CPU has AMX but not the AVX-512 its epilogue runs on"};
        if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0)
            return {false, std::string("Linux did not grant the AMX tile state (arch_prctl: ") +
                               std::strerror(errno) + ")"};
        return {true, ""};
    }();
    return s;
}

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
// parity), C stored to sums; B from the nibbles' bytes or from the record itself.
template <int S, class K>
__attribute__((target(SPECDEC_AMX_TARGET), always_inline))
inline void issue(const uint8_t* rec, const int8_t* xq, const uint8_t* bytes, int32_t* sums) {
    constexpr int A = 4 + S % 2, B = 6 + S % 2;
    tile_load<B>(K::nibbles ? bytes : rec, 64);
    tile_load<A>(xq, QK);
    tile_zero<S>();
    tile_dot<S, A, B, is_affine<K>()>();
    tile_store<S>(sums, 64);
}

// A nibble record's weights as B's bytes (inputs 0..15: the low nibbles of its 4 vectors, 16..31
// the high ones), and the record PREFETCH_AHEAD blocks on asked for.
template <class K>
__attribute__((target(SPECDEC_AMX_TARGET), always_inline))
inline void prepare(const uint8_t* rec, uint8_t* bytes) {
    for (int line = 0; line < K::record; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(rec + PREFETCH_AHEAD * K::record + line), _MM_HINT_T0);
    if constexpr (K::nibbles) {
        const __m512i low = _mm512_set1_epi8(0x0F);
        for (int p = 0; p < 4; ++p) {
            const __m512i v = _mm512_loadu_si512(rec + 64 * p);
            _mm512_store_si512(bytes + 64 * p, _mm512_and_si512(v, low));
            _mm512_store_si512(bytes + 256 + 64 * p, _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
        }
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

template <int T, class K>
__attribute__((target(SPECDEC_AMX_TARGET)))
void tile_amx(const uint8_t* unit, const Rows& x, int64_t row0, float* out, const float* res, int64_t ldo, int ncols) {
    constexpr int RECORD = K::record;
    alignas(64) uint8_t bytes[CHUNK][QK * NC];       // nibble records: each block's weights as B's bytes
    alignas(64) int32_t sums[CHUNK][AMX_ROWS * NC];  // each block's C
    __m512 acc[T];
    for (int r = 0; r < T; ++r) acc[r] = _mm512_setzero_ps();
    const int8_t* xq = x.q + row0 * QK;
    const int64_t G = x.G, n = x.rows;
    for (int64_t g0 = 0; g0 < G; g0 += CHUNK) {
        // 1. The chunk's tile products, four independent chains (a block's product waits on its
        //    loads, and its store on the product: one block at a time would wait out each).
        const int64_t blocks = std::min<int64_t>(CHUNK, G - g0);
        auto rec = [&](int64_t i) { return unit + (g0 + i) * RECORD; };  // block g0 + i's weights
        auto act = [&](int64_t i) { return xq + (g0 + i) * n * QK; };      // and its activations
        for (int64_t i = 0; i < blocks; ++i) prepare<K>(rec(i), bytes[i]);
        for (int64_t i = 0; i < blocks; i += 4) {
            issue<0, K>(rec(i), act(i), bytes[i], sums[i]);
            if (i + 1 < blocks) issue<1, K>(rec(i + 1), act(i + 1), bytes[i + 1], sums[i + 1]);
            if (i + 2 < blocks) issue<2, K>(rec(i + 2), act(i + 2), bytes[i + 2], sums[i + 2]);
            if (i + 3 < blocks) issue<3, K>(rec(i + 3), act(i + 3), bytes[i + 3], sums[i + 3]);
        }
        // 2. Their epilogues, block by block in order.
        for (int64_t i = 0; i < blocks; ++i) {
            const int64_t g = g0 + i;
            finish<T, K>(unit + g * RECORD, sums[i], x.d + g * n + row0, x.sf + g * n + row0, acc);
        }
    }
    const __mmask16 mask = ncols >= NC ? 0xFFFF : static_cast<__mmask16>((1u << ncols) - 1);
    for (int r = 0; r < T; ++r) {
        const int64_t at = (row0 + r) * ldo;
        const __m512 v = res ? _mm512_add_ps(acc[r], _mm512_maskz_loadu_ps(mask, res + at)) : acc[r];
        _mm512_mask_storeu_ps(out + at, mask, v);
    }
}

template <class K, int... T>
TileFn pick(int rows, std::integer_sequence<int, T...>) {
    static const TileFn table[] = {tile_amx<T + 1, K>...};
    return table[rows - 1];
}

}  // namespace

bool amx_usable() { return state().usable; }
const std::string& amx_unavailable_reason() { return state().reason; }

TileFn q4_tile_amx(int rows) { return pick<Q4Half>(rows, std::make_integer_sequence<int, AMX_ROWS>{}); }
TileFn q4f_tile_amx(int rows) { return pick<Q4Float>(rows, std::make_integer_sequence<int, AMX_ROWS>{}); }
TileFn q5_tile_amx(int rows) { return pick<Q5Float>(rows, std::make_integer_sequence<int, AMX_ROWS>{}); }
TileFn q8_tile_amx(int rows) { return pick<Symmetric>(rows, std::make_integer_sequence<int, AMX_ROWS>{}); }

void amx_begin() { __asm__ volatile("ldtilecfg %0" ::"m"(CONFIG)); }
void amx_end() { __asm__ volatile("tilerelease" ::: "memory"); }

}  // namespace specdec
