// Python bindings of vlite's C++ CPU extension (loaded by vlite/kernels/cpu_extension.py).
#include "cpu_ops.h"

// the GIL is released while a kernel runs, as torch's own ops do: another Python thread (the
// in-process server's event loop) goes on meanwhile
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, py::call_guard<py::gil_scoped_release>(), "paged decode attention (float32 or bfloat16, CPU)");
  m.def("rms_norm", &rms_norm, py::call_guard<py::gil_scoped_release>(), "out = RMSNorm(x) * weight");
  m.def("fused_add_rms_norm", &fused_add_rms_norm, py::call_guard<py::gil_scoped_release>(), "residual += x; x = RMSNorm(residual) * weight (in place)");
  m.def("silu_and_mul", &silu_and_mul, py::call_guard<py::gil_scoped_release>(), "SiLU(gate) * up of [.., 2I] -> [.., I]");
  m.def("packed_gemm_supported", &packed_gemm_supported, "whether packed_linear runs this dtype ('float32' or 'bfloat16') here");
  m.def("pack_linear_weight", &pack_linear_weight, py::call_guard<py::gil_scoped_release>(), "W [N, K] -> the packed layout packed_linear reads");
  m.def("packed_linear", &packed_linear, py::call_guard<py::gil_scoped_release>(), "y [M, N] = x [M, K] W^T (+ bias) on a packed W");
  m.def("argmax_rows", &argmax_rows, py::call_guard<py::gil_scoped_release>(), "index of each row's first maximum (first NaN if any), as torch.argmax(-1)");
  py::class_<CpuDecoderLayers>(m, "CpuDecoderLayers")
      .def(py::init<int64_t, int64_t, int64_t, double, double, torch::Tensor>())
      .def("add_layer", &CpuDecoderLayers::add_layer)
      .def("forward", &CpuDecoderLayers::forward, py::call_guard<py::gil_scoped_release>(),
           "every decoder layer and the final norm of one step; the hidden states [T, H]");
  m.def("rotary_store", &rotary_store, py::call_guard<py::gil_scoped_release>(), "rotary on q and k heads of qkv, k and v stored in the paged cache");
}
