// CPU detection and the choice of a kernel path, which every op makes (cpu.cpp). The paths' names
// are the ones Python uses (specdec.kernels.ISAS, kernels.instruction_sets(), the CLI's output):
// one vocabulary from here to the user.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace specdec {

// The kernel paths, numbered as the ops' `isa` arguments take them, and named by ISA_NAMES.
// ISA_AMX: AMX tiles for products of several rows, the avx512_vnni path for the rest and for attention.
enum Isa : int64_t { ISA_AUTO = 0, ISA_AVX2 = 1, ISA_AVX512_VNNI = 2, ISA_AMX = 3 };
inline constexpr const char* ISA_NAMES[] = {"auto", "avx2", "avx512_vnni", "amx"};  // indexed by Isa

// What each path needs, asked once: avx2: AVX2, FMA and F16C (every op runs on it); avx512_vnni:
// AVX-512 F, BW, VL and VNNI; amx: AMX-INT8 with avx512_vnni for its epilogues, and Linux's grant
// of the tile state to this process.
bool has_avx2();
bool has_avx512_vnni();
bool amx_usable();

// Why this process cannot run path `isa` (an Isa other than ISA_AUTO); empty where it can.
std::string missing_reason(int64_t isa);
// The paths this process runs, by name, slowest first.
std::vector<std::string> instruction_sets();
// The path a kernel takes: ISA_AUTO -> the best this CPU has (amx, else avx512_vnni, else avx2);
// a named path this CPU lacks is an error that says why.
int64_t resolve_isa(int64_t isa);
// An op's check that the avx2 path runs here (every op has an avx2 path; a few have only that).
void require_avx2();

}  // namespace specdec
