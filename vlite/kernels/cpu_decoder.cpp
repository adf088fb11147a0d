// A Llama-family model's decoder layers on CPU in one call per step (vlite/engine/models/cpu_layer_loop.py).
//
// The same kernels the Python path calls (cpu_fused_ops.cpp, cpu_gemm.cpp, cpu_paged_attention.cpp),
// with the same arguments in the same order, so the hidden states are bit for bit the Python
// path's; what this removes is the Python between them: module calls, argument checks and
// dispatch, about 0.1 ms per layer while the other OpenMP thread waits (a SmolLM2 decode step on
// two cores takes 6-14% less time without it, docs/kernels.md). It runs only steps whose every query token the decode
// kernel attends (decode steps, and prefill chunks of short context): a longer prefill chunk
// needs SDPA, and the Python path takes that step.
#include "cpu_ops.h"

#include <utility>
#include <vector>

CpuDecoderLayers::CpuDecoderLayers(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double scale,
                                   double eps, torch::Tensor final_norm)
    : num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim), scale_(scale), eps_(eps),
      final_norm_(std::move(final_norm)) {}

void CpuDecoderLayers::add_layer(torch::Tensor input_norm, torch::Tensor qkv, c10::optional<torch::Tensor> qkv_bias,
                                 torch::Tensor o, c10::optional<torch::Tensor> o_bias, torch::Tensor post_norm,
                                 torch::Tensor gate_up, torch::Tensor down, int64_t intermediate_size) {
  layers_.push_back(Layer{std::move(input_norm), std::move(qkv), std::move(qkv_bias), std::move(o), std::move(o_bias),
                          std::move(post_norm), std::move(gate_up), std::move(down), intermediate_size});
}

torch::Tensor CpuDecoderLayers::forward(torch::Tensor x, torch::Tensor cos, torch::Tensor sin,
                                        torch::Tensor slot_mapping, const std::vector<torch::Tensor>& k_caches,
                                        const std::vector<torch::Tensor>& v_caches, torch::Tensor block_tables,
                                        torch::Tensor seq_lens) {
  const int64_t n = static_cast<int64_t>(layers_.size());
  TORCH_CHECK(static_cast<int64_t>(k_caches.size()) == n && static_cast<int64_t>(v_caches.size()) == n,
              "CpuDecoderLayers.forward: one K and one V cache per layer (", n, " layers)");
  const int64_t tokens = x.size(0), hidden = x.size(1), q_size = num_heads_ * head_dim_;
  const int64_t qkv_size = q_size + 2 * num_kv_heads_ * head_dim_;
  block_tables = block_tables.contiguous();
  // the first layer's norm has no residual to add: the embedding is the residual
  torch::Tensor residual = x;
  x = torch::empty_like(residual);
  for (int64_t i = 0; i < n; ++i) {
    const Layer& layer = layers_[i];
    if (i == 0)
      rms_norm(x, residual, layer.input_norm, eps_);
    else
      fused_add_rms_norm(x, residual, layer.input_norm, eps_);
    auto qk = rotary_store(packed_linear(x, layer.qkv, layer.qkv_bias, qkv_size), cos, sin, slot_mapping,
                           k_caches[i], v_caches[i], num_heads_, num_kv_heads_);
    auto attn = paged_decode(qk[0], k_caches[i], v_caches[i], block_tables, seq_lens, scale_);
    x = packed_linear(attn.view({tokens, q_size}), layer.o, layer.o_bias, hidden);
    fused_add_rms_norm(x, residual, layer.post_norm, eps_);
    x = packed_linear(silu_and_mul(packed_linear(x, layer.gate_up, c10::nullopt, 2 * layer.intermediate_size)),
                      layer.down, c10::nullopt, hidden);
  }
  fused_add_rms_norm(x, residual, final_norm_, eps_);
  return x;
}
