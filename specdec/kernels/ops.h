// The kernels' functions as the other sources call them (each defined in the file named).
#pragma once

#include <torch/extension.h>

#include <string>
#include <vector>

// Bytes per (unit of 16 output columns, block of 32 inputs) of the packed weights (quant.cpp).
constexpr int Q4_RECORD = 256 + 64;  // nibbles, then 16 float16 d and 16 float16 m
constexpr int Q8_RECORD = 512 + 32;  // int8, then 16 float16 d

// The kernel paths, as the `isa` arguments name them (specdec.kernels.ISAS on the Python side).
enum Isa : int64_t { ISA_AUTO = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 };

// quant.cpp: x [rows, in] float32 times packed q4 (Q4_0/Q4_1) or q8 (Q8_0) weights, plus the
// residual where given -> [rows, out] float32; isa: an Isa.
torch::Tensor quantized_matmul(const torch::Tensor& x, const torch::Tensor& packed, int64_t out_features,
                               int64_t isa, bool q4, const c10::optional<torch::Tensor>& residual);
std::vector<std::string> instruction_sets();
// The path a kernel takes: ISA_AUTO -> the best this CPU has (AVX-512 with VNNI, else AVX2).
int64_t resolve_isa(int64_t isa);

// attention.cpp
torch::Tensor attend_cached(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
                            const torch::Tensor& counts, const torch::Tensor& slots, double scale, int64_t isa);

// layer_ops.cpp
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps);
std::vector<torch::Tensor> rotary_split(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                                        int64_t rows, int64_t heads, int64_t kv_heads);
torch::Tensor silu_mul(const torch::Tensor& h);
