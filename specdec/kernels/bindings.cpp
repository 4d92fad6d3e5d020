// The extension's Python functions: the one source that needs pybind11 and torch's tensor caster
// for it. torch/csrc/utils/pybind.h is the part of <torch/extension.h> that the bindings use; that
// header also pulls in the whole C++ API, which made this the slowest source to compile.

#include "ops.h"
#include "pool.h"

#include <torch/csrc/utils/pybind.h>

#include <iterator>

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("q4_matmul", [](const at::Tensor& x, const at::Tensor& packed, int64_t out_features, int64_t isa,
                          const c10::optional<at::Tensor>& residual) {
              return quantized_matmul(x, packed, out_features, isa, true, residual);
          }, "x [rows, in] float32 times packed q4 weights (+ residual) -> [rows, out] float32",
          py::arg("x"), py::arg("packed"), py::arg("out_features"), py::arg("isa"), py::arg("residual") = py::none());
    m.def("q8_matmul", [](const at::Tensor& x, const at::Tensor& packed, int64_t out_features, int64_t isa,
                          const c10::optional<at::Tensor>& residual) {
              return quantized_matmul(x, packed, out_features, isa, false, residual);
          }, "x [rows, in] float32 times packed q8 weights (+ residual) -> [rows, out] float32",
          py::arg("x"), py::arg("packed"), py::arg("out_features"), py::arg("isa"), py::arg("residual") = py::none());
    m.def("r8_matmul", &r8_matmul, "x [rows, in] float32 times r8 weights (+ residual) -> [rows, out] float32",
          py::arg("x"), py::arg("packed"), py::arg("out_features"), py::arg("isa"), py::arg("residual") = py::none());
    m.def("rotate_rows", &rotate_rows, "x [rows, in] float32, isa -> x R, the rotation of the r8 products (on that path)");
    m.def("f16_matmul", &half_matmul, "x [rows, in] float32 times float16 weights [out, in] (+ residual) -> [rows, out] float32",
          py::arg("x"), py::arg("weight"), py::arg("out_features"), py::arg("isa"), py::arg("residual") = py::none());
    m.def("attend_cached", &attend_cached, "a few queries per row over the KV cache -> [rows, new, heads * head_dim]");
    m.def("rms_norm", &rms_norm, "x [..., dim] float32 -> RMSNorm(x) * weight");
    m.def("rotary_split", &rotary_split, "qkv [tokens, width] -> rotated q, k and v [rows, heads, new, head_dim]");
    m.def("silu_mul", &silu_mul, "h [rows, 2 * inter] -> silu(gate) * up [rows, inter]");
    m.def("gelu_mul", &gelu_mul, "h [rows, 2 * inter] -> gelu_tanh(gate) * up [rows, inter]");
    m.def("embed_rows", &embed_rows, "rows ids [n] of a packed q8 or q4 matrix, dequantized -> [n, in] float32");
    m.def("argmax_rows", &argmax_rows, "x [rows, n] float32 -> [rows] int64, each row's first maximum (as torch.argmax)");
    m.def("draft_distribution", &draft_distribution,
          "logits [positions, vocab] -> top token, the k best draft tokens' positions and probabilities");
    // module_local: builds of the kernels loaded side by side (benchmarks/kernels_ab.py) each keep their own
    py::class_<LayerWeights>(m, "LayerWeights", py::module_local(), "a run of decoder layers' weights, as forward_layers reads them")
        .def(py::init<std::vector<at::Tensor>, LayerParts, std::vector<at::Tensor>, std::vector<at::Tensor>,
                      std::vector<at::Tensor>, LayerParts, std::vector<at::Tensor>, LayerParts, LayerParts,
                      std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<int64_t>>())
        .def("__len__", &LayerWeights::layers);
    m.def("forward_layers", &forward_layers, "decoder layers of a short pass in one call (see forward.cpp)");
    m.def("head_layer", &head_layer, "a draft head's decoder layer (EAGLE-3's) in one call (see forward.cpp)");
    // The machine and the pool, not ops (reference.py's NOT_OPS says so of each).
    m.def("isa_names", []() { return std::vector<std::string>(std::begin(specdec::ISA_NAMES), std::end(specdec::ISA_NAMES)); },
          "the kernel paths' names, indexed by the `isa` code the ops take (0: auto)");
    m.def("instruction_sets", &specdec::instruction_sets, "the kernel paths this CPU can run, by name");
    m.def("missing_reason", &specdec::missing_reason, "why this process cannot run path `isa` (empty where it can)");
    m.def("hold_threads", [](int64_t threads) { specdec::hold_threads(static_cast<int>(threads)); },
          "kernel calls from this thread use this many threads whatever torch's count (0: torch's)");
    m.def("kernel_threads", []() { return static_cast<int64_t>(specdec::kernel_threads()); },
          "the threads a kernel call from this thread uses now");
}
