// Small AVX2 helpers shared by the kernels: fixed-order reductions and an exponential whose bits
// do not depend on the machine's libm.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <utility>

namespace specdec {

__attribute__((target("avx2,fma"))) inline float horizontal_sum(__m256 v) {
    // Fixed order: (0+4, 1+5, 2+6, 3+7), then pairs, then the last two.
    const __m128 folded = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 pairs = _mm_add_ps(folded, _mm_movehl_ps(folded, folded));
    return _mm_cvtss_f32(_mm_add_ss(pairs, _mm_shuffle_ps(pairs, pairs, 1)));
}

// The 8 lanes' sum (integers: any order).
__attribute__((target("avx2"))) inline int32_t fold(__m256i v) {
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1)));
}

// acc += the 4-byte dot products of unsigned w and signed x per lane (vpdpbusd). GCC 12 copies the
// intrinsic's accumulator to another register and back around each instruction of a tile's loop
// (two moves a product: the loop's bottleneck); in asm, on a local copy (an asm operand that names
// an array element would keep the array in memory), the accumulator stays in its register.
__attribute__((target("avx512f,avx512vnni"), always_inline)) inline void dpbusd(__m512i& acc, __m512i w, __m512i x) {
    __m512i a = acc;
    asm("vpdpbusd %2, %1, %0" : "+v"(a) : "v"(w), "v"(x));
    acc = a;
}

// The mask of a 16-lane vector's first n lanes (all 16 from n = 16 on): a tile's last, partial unit
// of columns, a block's last keys.
inline __mmask16 first_lanes(int64_t n) {
    return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
}

// f(std::integral_constant<int, i>) for i = 0 .. N - 1, unrolled at compile time: a tile's
// accumulator arrays indexed only by constants, which GCC keeps in registers (loops unrolled by
// the optimizer leave them in memory).
template <typename F, int... I>
__attribute__((always_inline)) inline void each_index(F&& f, std::integer_sequence<int, I...>) {
    (f(std::integral_constant<int, I>{}), ...);
}
template <int N, typename F>
__attribute__((always_inline)) inline void repeat(F&& f) {
    each_index(f, std::make_integer_sequence<int, N>{});
}

__attribute__((target("avx2,fma"))) inline __m256 exp8(__m256 x) {
    // x = n ln2 + r with |r| <= ln2 / 2, exp(r) by a degree-6 polynomial (relative error ~2e-7),
    // scaled by 2^n through the exponent bits; x is clamped to [-87, 88] (no infinities, no denormals).
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504089f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    // 2^n in two factors, so that n = 128 (x near 88) stays finite.
    const __m256i half = _mm256_srai_epi32(_mm256_cvtps_epi32(n), 1);
    const __m256i rest = _mm256_sub_epi32(_mm256_cvtps_epi32(n), half);
    const __m256 a = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, _mm256_set1_epi32(127)), 23));
    const __m256 b = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(rest, _mm256_set1_epi32(127)), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, a), b);
}

// exp8's operations on 16 lanes: each lane's bits are exp8's for the same input.
__attribute__((target("avx512f"))) inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504089f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    const __m512i half = _mm512_srai_epi32(_mm512_cvtps_epi32(n), 1);
    const __m512i rest = _mm512_sub_epi32(_mm512_cvtps_epi32(n), half);
    const __m512 a = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(half, _mm512_set1_epi32(127)), 23));
    const __m512 b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(rest, _mm512_set1_epi32(127)), 23));
    return _mm512_mul_ps(_mm512_mul_ps(p, a), b);
}

}  // namespace specdec
