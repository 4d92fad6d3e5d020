// CPU detection and dispatch: which kernel paths this process runs, and the path an op takes for
// its `isa` argument. Asked at run time (the extension is built for baseline x86-64; each path's
// functions carry their own target attributes), once per process.

#include "cpu.h"

#include <c10/util/Exception.h>
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace specdec {
namespace {

constexpr long ARCH_REQ_XCOMP_PERM = 0x1023;
constexpr long XFEATURE_XTILEDATA = 18;

struct AmxState {
    bool usable;
    std::string reason;
};

// Linux hands a process the tile state only on request (arch_prctl): asked here, once.
const AmxState& amx_state() {
    static const AmxState s = []() -> AmxState {
        unsigned a = 0, b = 0, c = 0, d = 0;
        if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 25)))
            return {false, "this CPU has no AMX-INT8"};
        if (!has_avx512_vnni()) return {false, "this CPU has AMX but not the avx512_vnni path its epilogues run on"};
        if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0)
            return {false, std::string("Linux did not grant the AMX tile state (arch_prctl: ") +
                               std::strerror(errno) + ")"};
        return {true, ""};
    }();
    return s;
}

}  // namespace

bool has_avx2() {
    static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                            __builtin_cpu_supports("f16c");
    return yes;
}

bool has_avx512_vnni() {
    static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                            __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
    return yes;
}

bool amx_usable() { return amx_state().usable; }

std::string missing_reason(int64_t isa) {
    switch (isa) {
        case ISA_AVX2: return has_avx2() ? "" : "this CPU lacks AVX2, FMA or F16C";
        case ISA_AVX512_VNNI: return has_avx512_vnni() ? "" : "this CPU lacks AVX-512 F, BW, VL or VNNI";
        case ISA_AMX: return amx_state().reason;
        default: return "no such path";
    }
}

std::vector<std::string> instruction_sets() {
    std::vector<std::string> found;
    for (int64_t isa : {ISA_AVX2, ISA_AVX512_VNNI, ISA_AMX})
        if (missing_reason(isa).empty()) found.emplace_back(ISA_NAMES[isa]);
    return found;
}

int64_t resolve_isa(int64_t isa) {
    if (isa == ISA_AUTO) isa = amx_usable() ? ISA_AMX : has_avx512_vnni() ? ISA_AVX512_VNNI : ISA_AVX2;
    TORCH_CHECK(isa == ISA_AVX2 || isa == ISA_AVX512_VNNI || isa == ISA_AMX, "unknown kernel path ", isa);
    const std::string why = missing_reason(isa);
    TORCH_CHECK(why.empty(), "no ", ISA_NAMES[isa], " path: ", why);
    require_avx2();  // the faster paths run some of their work on it
    return isa;
}

void require_avx2() { TORCH_CHECK(has_avx2(), "no avx2 path: ", missing_reason(ISA_AVX2)); }

}  // namespace specdec
