// What the products' sources share (quant.cpp: quantization, the AVX2 and AVX-512 VNNI tiles and
// the choice of tiles; amx.cpp: the AMX tiles): the quantized activations and a tile's signature.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace specdec {

constexpr int QK = 32;  // inputs per block
constexpr int NC = 16;  // output columns per unit

// Weights stream from memory (a model's matrices do not fit in the caches): each tile asks for
// the record this many blocks ahead, which the hardware prefetcher alone does not fetch early
// enough once the loop does several rows' arithmetic per record. Prefetching changes no bits.
constexpr int PREFETCH_AHEAD = 8;

template <int RECORD>
inline void prefetch_ahead(const uint8_t* rec) {
    for (int line = 0; line < RECORD; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(rec + PREFETCH_AHEAD * RECORD + line), _MM_HINT_T0);
}

// Quantized activation rows, block-major: block g of row r at q + (g * rows + r) * QK.
struct Rows {
    const int8_t* q;    // [G, rows, 32]
    const float* d;     // [G, rows]
    const int32_t* s;   // [G, rows]
    const float* sf;    // [G, rows] the sums as floats
    const int32_t* s16; // [G, rows] the sums of each block's first 16 (q8 records with a scale per 16)
    int64_t rows, G;
};

// The records of the affine family (w = d q + m: quant.cpp's q4 layouts) as the tiles read them:
// the weights as nibbles (q in 0..15) or as bytes (q in 0..31, Q5_K), where each record's 16 d
// start (its 16 m follow them), and whether they are float32 or float16.
template <bool NIBBLES, bool F32, int RECORD>
struct Affine {
    static constexpr bool nibbles = NIBBLES, f32 = F32;
    static constexpr int record = RECORD, scales = NIBBLES ? 256 : 512, mins = scales + (F32 ? 64 : 32);
};
using Q4Half = Affine<true, false, 256 + 64>;    // Q4_0, Q4_1
using Q4Float = Affine<true, true, 256 + 128>;   // Q4_K
using Q5Float = Affine<false, true, 512 + 128>;  // Q5_K

// Rows row0 .. row0 + T - 1 times one unit (16 columns) of packed weights into out (row stride
// ldo), plus the residual's same elements where res is given; ncols < 16 for a matrix's last unit.
using TileFn = void (*)(const uint8_t* unit, const Rows& x, int64_t row0, float* out, const float* res,
                        int64_t ldo, int ncols);

// amx.cpp (which of its tiles a process may run: cpu.h's amx_usable).
// The largest tile: an AMX tile holds 16 rows.
constexpr int AMX_ROWS = 16;
// Tiles of 1 .. 16 rows. A thread runs them between amx_begin() (its tile configuration) and
// amx_end() (the tile state released). A tile of nibble records (q4) takes the unit's weights
// already split into bytes (amx_split_unit, once for all of a unit's tiles) or null to split them
// itself; other records are read as they are.
using AmxTileFn = void (*)(const uint8_t* unit, const uint8_t* unpacked, const Rows& x, int64_t row0, float* out,
                           const float* res, int64_t ldo, int ncols);
AmxTileFn q4_tile_amx(int rows);
AmxTileFn q4f_tile_amx(int rows);  // q4 records with float32 scales
AmxTileFn q5_tile_amx(int rows);   // q4's form with bytes for weights (Q5_K)
AmxTileFn q8_tile_amx(int rows);
// A nibble unit's G records (each `record` bytes) as B's bytes, QK * NC a block.
void amx_split_unit(const uint8_t* unit, int64_t G, int record, uint8_t* bytes);
void amx_begin();
void amx_end();
// The r8 products' tiles (rotated.cpp): their own configuration (amx_begin_r8, then amx_end), and
// 16 rows of int8 activations (xq, row stride K) times `units` (1..4) consecutive units of r8
// weights, each unit_bytes long -> the int32 sums [units][16 rows][16 columns] over all of K.
void amx_begin_r8();
void r8_tiles_amx(const uint8_t* w, int64_t unit_bytes, int units, const int8_t* xq, int64_t K, int32_t* sums);
// The bytes a tile may read past the last row of the activations' last block (a 16-row tile
// loads 16 rows whatever its size; the rows past its own only reach accumulator rows it ignores).
constexpr int64_t AMX_PAD_BYTES = AMX_ROWS * QK;

}  // namespace specdec
