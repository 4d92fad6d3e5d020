"""The CPU's ceiling for int8 multiply-adds: what products of many rows can reach at best.

Compiles a probe (with the kernels' compiler flags) that runs 24 independent chains of the
instruction each kernel path multiplies int8 with, on 1 and on `--threads` threads at once, and
reports billions of multiply-adds a second:

- avx512_vnni: `vpdpbusd` on 512-bit registers (64 multiply-adds an instruction);
- avx2: `vpmaddubsw`, `vpmaddwd` and `vpaddd` on 256-bit registers (32 for the three).

Nothing else runs in the probe (no loads, no float epilogue), so a kernel can only come near it.
Use it to bound what a workload can reach: a pass over R rows of the default model multiplies
about 134 M per row (106 M in the layers, 28 M in the LM head).

    python benchmarks/int8_peak.py --threads 2
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from torch.utils import cpp_extension

from specdec import kernels
from specdec.models.backend import cpu_model

SOURCE = r"""
#include <immintrin.h>
#include <chrono>
#include <thread>
#include <vector>

namespace {
constexpr int CHAINS = 24;

__attribute__((target("avx512f,avx512vnni"))) double vnni(long rounds) {
    __m512i acc[CHAINS];
    for (int i = 0; i < CHAINS; ++i) acc[i] = _mm512_set1_epi32(i);
    const __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(5);
    const auto start = std::chrono::steady_clock::now();
    for (long n = 0; n < rounds; ++n)
        for (int i = 0; i < CHAINS; ++i) asm volatile("vpdpbusd %2, %1, %0" : "+v"(acc[i]) : "v"(a), "v"(b));
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return double(rounds) * CHAINS * 64 / s;
}

__attribute__((target("avx2"))) double avx2(long rounds) {
    __m256i acc[CHAINS / 2];
    for (int i = 0; i < CHAINS / 2; ++i) acc[i] = _mm256_set1_epi32(i);
    const __m256i a = _mm256_set1_epi8(3), b = _mm256_set1_epi8(5), ones = _mm256_set1_epi16(1);
    const auto start = std::chrono::steady_clock::now();
    for (long n = 0; n < rounds; ++n)
        for (int i = 0; i < CHAINS / 2; ++i) {
            __m256i t;
            asm volatile("vpmaddubsw %2, %1, %0" : "=v"(t) : "v"(a), "v"(b));
            asm volatile("vpmaddwd %2, %1, %0" : "=v"(t) : "v"(t), "v"(ones));
            asm volatile("vpaddd %2, %1, %0" : "+v"(acc[i]) : "v"(acc[i]), "v"(t));
        }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return double(rounds) * (CHAINS / 2) * 32 / s;
}
}  // namespace

// Multiply-adds a second of `path` (0: avx2, 1: avx512_vnni) on `threads` threads at once.
double peak(int64_t path, int64_t threads, int64_t rounds) {
    std::vector<double> rate(threads);
    std::vector<std::thread> team;
    for (int64_t t = 0; t < threads; ++t)
        team.emplace_back([&, t] { rate[t] = path ? vnni(rounds) : avx2(rounds); });
    for (auto& th : team) th.join();
    double total = 0;
    for (double r : rate) total += r;
    return total;
}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=10_000_000, help="rounds of the 24 chains per thread")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    probe = cpp_extension.load_inline("specdec_int8_peak", cpp_sources=SOURCE, functions=["peak"],
                                      extra_cflags=kernels.CFLAGS, verbose=False)
    paths = [p for p in ("avx2", "avx512_vnni") if p in kernels.instruction_sets()]
    report = {"cpu": cpu_model(), "threads": args.threads, "g_multiply_adds_per_s": {}}
    for path in paths:
        code = 1 if path == "avx512_vnni" else 0
        one, many = probe.peak(code, 1, args.rounds) / 1e9, probe.peak(code, args.threads, args.rounds) / 1e9
        report["g_multiply_adds_per_s"][path] = {"1": one, str(args.threads): many}
        print(f"{path}: {one:.0f} G int8 multiply-adds/s on 1 thread, {many:.0f} on {args.threads}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
