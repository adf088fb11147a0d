// The ops of vlite's C++ CPU extension; bound to Python in cpu_bindings.cpp. Shapes, dtypes and
// semantics are documented where Python calls them (cpu_attention.py, fused_ops.py).
#pragma once

#include <torch/extension.h>
#include <string>
#include <vector>

// cpu_paged_attention.cpp
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor seq_lens, double scale);

// cpu_fused_ops.cpp
void rms_norm(torch::Tensor out, torch::Tensor x, torch::Tensor weight, double eps);
void fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
torch::Tensor silu_and_mul(torch::Tensor gate_up);
std::vector<torch::Tensor> rotary_store(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin,
                                        torch::Tensor slot_mapping, torch::Tensor k_cache, torch::Tensor v_cache,
                                        int64_t num_heads, int64_t num_kv_heads);

// cpu_gemm.cpp
bool packed_gemm_supported(const std::string& dtype);
torch::Tensor pack_linear_weight(torch::Tensor w);
torch::Tensor packed_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias,
                            int64_t out_features);

// cpu_sampling.cpp
torch::Tensor argmax_rows(torch::Tensor logits);
