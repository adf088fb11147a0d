// Python bindings of vlite's C++ CPU extension (loaded by vlite/kernels/cpu_extension.py).
#include "cpu_ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention (float32 or bfloat16, CPU)");
  m.def("rms_norm", &rms_norm, "out = RMSNorm(x) * weight");
  m.def("fused_add_rms_norm", &fused_add_rms_norm, "residual += x; x = RMSNorm(residual) * weight (in place)");
  m.def("silu_and_mul", &silu_and_mul, "SiLU(gate) * up of [.., 2I] -> [.., I]");
  m.def("rotary_store", &rotary_store, "rotary on q and k heads of qkv, k and v stored in the paged cache");
}
