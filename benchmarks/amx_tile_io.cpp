// What AMX tile traffic costs on this CPU, one thread: a 1 KB tile load against zmm loads of the
// same bytes, from L1, L2 and memory; a 16 x 16 x 64 tdpbssd alone; and the tile parts of the
// kernels' two AMX loops (specdec/kernels/amx.cpp): r8's (an activation tile and four weight
// tiles per 64 inputs) and q4's per block of 32 inputs (512 B of activations and 512 B of
// weights loaded, 1 KB of sums stored), the latter also with one activation load shared by two
// units. The figures in benchmarks/results (round 15) and docs/backends.md (AMX) come from it.
//
//     g++ -O2 -march=native -o /tmp/amx_tile_io benchmarks/amx_tile_io.cpp && /tmp/amx_tile_io
//
// It needs AMX-INT8 and Linux's tile state (asked for here, as the kernels do); without them it
// says so and exits 1.

#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <vector>

namespace {

struct alignas(64) Config {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
    uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};

#define LOAD(t, p, stride) \
    asm volatile("tileloadd (%0,%1,1), %%tmm" #t ::"r"(p), "r"(static_cast<long>(stride)) : "memory")
#define STORE(t, p) asm volatile("tilestored %%tmm" #t ", (%0,%1,1)" ::"r"(p), "r"(64L) : "memory")
#define ZERO(t) asm volatile("tilezero %%tmm" #t ::)
#define DOT(c, a, b) asm volatile("tdpbssd %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::)

// ns per item of `body(items)`, the best of three timings of enough repeats for ~0.2 s.
double ns_per(long items, const std::function<void()>& body) {
    const long repeats = 40000000 / items + 1;
    double best = 1e30;
    for (int t = 0; t < 3; ++t) {
        const auto start = std::chrono::steady_clock::now();
        for (long r = 0; r < repeats; ++r) body();
        const double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count();
        best = std::min(best, ns / (static_cast<double>(repeats) * items));
    }
    return best;
}

__attribute__((target("amx-tile,amx-int8"))) void tile_loads(const uint8_t* p, long kb) {
    for (long i = 0; i < kb; i += 4) {
        LOAD(4, p + i * 1024, 64);
        LOAD(5, p + (i + 1) * 1024, 64);
        LOAD(6, p + (i + 2) * 1024, 64);
        LOAD(7, p + (i + 3) * 1024, 64);
    }
}

__attribute__((target("avx512f"))) int zmm_loads(const uint8_t* p, long kb) {
    __m512i acc = _mm512_setzero_si512();
    for (long i = 0; i < kb * 16; i += 4)
        for (int j = 0; j < 4; ++j) acc = _mm512_add_epi32(acc, _mm512_loadu_si512(p + (i + j) * 64));
    return _mm512_reduce_add_epi32(acc);
}

__attribute__((target("amx-tile,amx-int8"))) void dots(long n) {
    for (long i = 0; i < n; i += 4) {
        DOT(0, 4, 5);
        DOT(1, 4, 6);
        DOT(2, 4, 7);
        DOT(3, 4, 5);
    }
}

// r8: per 64 inputs an activation tile (16 rows, stride K) and four units' weight tiles.
__attribute__((target("amx-tile,amx-int8"))) void r8_loop(const uint8_t* w, long units, const int8_t* x, long K,
                                                         int32_t* sums) {
    const long unit_bytes = K * 16;
    for (long u = 0; u < units; u += 4) {
        const uint8_t* g = w + u * unit_bytes;
        ZERO(0); ZERO(1); ZERO(2); ZERO(3);
        for (long k = 0; k < K; k += 64) {
            LOAD(4, x + k, K);
            LOAD(5, g + k * 16, 64); DOT(0, 4, 5);
            LOAD(6, g + unit_bytes + k * 16, 64); DOT(1, 4, 6);
            LOAD(7, g + 2 * unit_bytes + k * 16, 64); DOT(2, 4, 7);
            LOAD(5, g + 3 * unit_bytes + k * 16, 64); DOT(3, 4, 5);
        }
        STORE(0, sums); STORE(1, sums + 256); STORE(2, sums + 512); STORE(3, sums + 768);
    }
}

// q4's tile part, a unit at a time: per block B (8 rows x 64 B) and A (16 rows x 32 B) loaded, C
// zeroed, one product, C stored (the kernel stores it a block later; so does this).
__attribute__((target("amx-tile,amx-int8"))) void q4_loop(const uint8_t* w, long units, long G, const int8_t* a,
                                                         int32_t* sums) {
    for (long u = 0; u < units; ++u)
        for (long g = 0; g < G; g += 2) {
            const uint8_t* b = w + (u * G + g) * 512;
            LOAD(6, b, 64); LOAD(4, a + g * 512, 32); ZERO(0); DOT(0, 4, 6);
            LOAD(7, b + 512, 64); LOAD(5, a + (g + 1) * 512, 32); ZERO(1); DOT(1, 5, 7);
            STORE(0, sums + (g % 4) * 256);
            STORE(1, sums + ((g + 1) % 4) * 256);
        }
}

// The same with two units sharing each block's activation tile.
__attribute__((target("amx-tile,amx-int8"))) void q4_shared(const uint8_t* w, long units, long G, const int8_t* a,
                                                           int32_t* sums) {
    for (long u = 0; u < units; u += 2)
        for (long g = 0; g < G; ++g) {
            LOAD(4, a + g * 512, 32);
            LOAD(6, w + (u * G + g) * 512, 64); ZERO(0); DOT(0, 4, 6);
            LOAD(7, w + ((u + 1) * G + g) * 512, 64); ZERO(1); DOT(1, 4, 7);
            STORE(0, sums + (g % 4) * 256);
            STORE(1, sums + ((g + 1) % 4) * 256);
        }
}

}  // namespace

int main() {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 25))) {
        std::puts("this CPU has no AMX-INT8");
        return 1;
    }
    if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) {  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
        std::puts("Linux did not grant the AMX tile state");
        return 1;
    }
    static const Config general{};
    asm volatile("ldtilecfg %0" ::"m"(general));

    std::puts("1 KB tile loads against zmm loads of the same bytes, ns a KB (GB/s):");
    for (long kb : {4L, 8L, 16L, 32L, 512L, 65536L}) {
        std::vector<uint8_t> buf(kb * 1024 + 4096, 1);
        volatile int sink = 0;
        const double tile = ns_per(kb, [&] { tile_loads(buf.data(), kb); });
        const double zmm = ns_per(kb, [&] { sink = sink + zmm_loads(buf.data(), kb); });
        std::printf("  %6ld KB: tile %6.2f (%5.1f), zmm %6.2f (%5.1f)\n", kb, tile, 1024 / tile, zmm, 1024 / zmm);
    }
    std::printf("tdpbssd 16 x 16 x 64, four chains: %.2f ns each\n", ns_per(4096, [] { dots(4096); }));

    const long K = 576;
    std::vector<int8_t> x(16 * K + 1024, 1);
    std::vector<int32_t> sums(1024);
    std::puts("r8's tile loop, ns a weight tile (1 KB):");
    for (long units : {4L, 64L, 7200L}) {
        std::vector<uint8_t> w(units * K * 16 + 4096, 3);
        std::printf("  weights %7.0f KB: %6.2f\n", units * K * 16 / 1024.0,
                    ns_per(units * K / 64, [&] { r8_loop(w.data(), units, x.data(), K, sums.data()); }));
    }

    static Config q4{};
    for (int t = 4; t < 6; ++t) q4.colsb[t] = 32;  // A: 16 rows x 32 inputs
    for (int t = 6; t < 8; ++t) q4.rows[t] = 8;    // B: 8 lines of 4 inputs x 16 columns
    asm volatile("ldtilecfg %0" ::"m"(q4));
    const long G = 18;
    std::vector<int8_t> act(G * 512 + 1024, 1);
    std::puts("q4's tile part, ns a block of 32 inputs (one unit, two units sharing A):");
    for (long units : {2L, 64L}) {
        std::vector<uint8_t> w(units * G * 512 + 4096, 3);
        std::printf("  weights %5.0f KB: %6.2f, %6.2f\n", units * G * 512 / 1024.0,
                    ns_per(units * G, [&] { q4_loop(w.data(), units, G, act.data(), sums.data()); }),
                    ns_per(units * G, [&] { q4_shared(w.data(), units, G, act.data(), sums.data()); }));
    }
    asm volatile("tilerelease" ::: "memory");
    return 0;
}
