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

// cpu_decoder.cpp: every decoder layer of a Llama-family model (one tensor-parallel rank of one,
// weights packed by cpu_gemm) in one call, through the ops above
class CpuDecoderLayers {
 public:
  CpuDecoderLayers(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double scale, double eps,
                   torch::Tensor final_norm);
  void add_layer(torch::Tensor input_norm, torch::Tensor qkv, c10::optional<torch::Tensor> qkv_bias, torch::Tensor o,
                 c10::optional<torch::Tensor> o_bias, torch::Tensor post_norm, torch::Tensor gate_up,
                 torch::Tensor down, int64_t intermediate_size);
  torch::Tensor forward(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, torch::Tensor slot_mapping,
                        const std::vector<torch::Tensor>& k_caches, const std::vector<torch::Tensor>& v_caches,
                        torch::Tensor block_tables, torch::Tensor seq_lens);

 private:
  struct Layer {
    torch::Tensor input_norm, qkv;
    c10::optional<torch::Tensor> qkv_bias;
    torch::Tensor o;
    c10::optional<torch::Tensor> o_bias;
    torch::Tensor post_norm, gate_up, down;
    int64_t intermediate_size;
  };
  int64_t num_heads_, num_kv_heads_, head_dim_;
  double scale_, eps_;
  torch::Tensor final_norm_;
  std::vector<Layer> layers_;
};
