// Fused elementwise ops of a Llama decoder layer on CPU, float32 or bfloat16, the ones vLLM
// also fuses (csrc/layernorm_kernels.cu, activation_kernels.cu, pos_encoding_kernels.cu,
// cache_kernels.cu): RMSNorm with the residual add, SiLU-and-mul, and rotary embedding with the
// KV-cache store. Each replaces 2-12 torch ops whose cost at decode sizes (a few rows of 576
// values) is mostly torch's per-op dispatch, not arithmetic.
//
// Numerics follow the torch ops they replace (vlite/kernels/fused_ops.py, the reference): each
// intermediate a torch op would round to the tensor's dtype is rounded here too (round_to), and
// rotary keeps its multiply and add as two roundings (no FMA contraction). What can differ is
// the order of the float32 sum of squares in RMSNorm and the last bit of exp in SiLU (Cephes'
// expf here, Sleef's in torch): a few ulp, tested in tests/kernels/test_cpu_fused_ops.py.
#include "cpu_ops.h"
#include "cpu_vec.h"

#include <ATen/Parallel.h>
#include <cmath>

using namespace vlite_cpu;

namespace {

// rows per task: about 16K values, so a decode step's few rows run on one thread without
// OpenMP's fork-join and a prefill chunk spreads over every thread
int64_t grain(int64_t row_len) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(row_len, 1)); }

template <typename T>
void rms_norm_rows(T* x, T* residual, const T* w, T* out, int64_t rows, int64_t h, float eps) {
  at::parallel_for(0, rows, grain(h), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* xr = x + r * h;
      T* rr = residual ? residual + r * h : nullptr;
      // transformers: hidden = residual + hidden (rounded to the dtype), then norm in float32
      v16 acc = splat(0.f);
      for (int64_t j = 0; j < h; j += 16) {
        v16 v = load16(xr + j);
        if (rr) {
          v = round_to<T>(v + load16(rr + j));
          store16(rr + j, v);
        }
        acc += v * v;
      }
      const float var = hsum(acc) / static_cast<float>(h);
      const float inv = 1.0f / std::sqrt(var + eps);
      const T* src = rr ? rr : xr;
      T* dst = out + r * h;
      for (int64_t j = 0; j < h; j += 16)
        store16(dst + j, load16(w + j) * round_to<T>(load16(src + j) * inv));
    }
  });
}

template <typename T>
void silu_and_mul_rows(const T* gate_up, T* out, int64_t rows, int64_t inter) {
  at::parallel_for(0, rows, grain(2 * inter), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gate_up + r * 2 * inter;
      const T* u = g + inter;
      T* o = out + r * inter;
      for (int64_t j = 0; j < inter; j += 16) {
        v16 gv = load16(g + j);
        v16 silu = round_to<T>(gv / (1.0f + exp16(-gv)));  // torch: x / (1 + exp(-x))
        store16(o + j, silu * load16(u + j));
      }
    }
  });
}

// x * cos + roll(x, D/2) * sin_signed for one head's [D] row (rotate in fused_ops.py): two
// roundings to T, as torch's separate mul and add (no FMA contraction)
template <typename T>
__attribute__((optimize("fp-contract=off"))) inline void rotate_head(const T* x, const T* cos, const T* sin,
                                                                     T* dst, int64_t dim) {
  const int64_t half = dim / 2;
  if (half % 16 == 0) {
    for (int64_t j = 0; j < dim; j += 16) {
      const int64_t k = j < half ? j + half : j - half;
      v16 a = round_to<T>(load16(x + j) * load16(cos + j));
      v16 b = round_to<T>(load16(x + k) * load16(sin + j));
      store16(dst + j, a + b);
    }
    return;
  }
  for (int64_t j = 0; j < dim; ++j) {  // small heads (e.g. the tests' head_dim 16)
    const int64_t k = j < half ? j + half : j - half;
    const float a = static_cast<float>(static_cast<T>(static_cast<float>(x[j]) * static_cast<float>(cos[j])));
    const float b = static_cast<float>(static_cast<T>(static_cast<float>(x[k]) * static_cast<float>(sin[j])));
    dst[j] = static_cast<T>(a + b);
  }
}

template <typename T>
void rotary_store_rows(const T* qkv, const T* cos, const T* sin, const int64_t* slots, T* q_out, T* k_out,
                       T* k_cache, T* v_cache, int64_t tokens, int64_t hq, int64_t hkv, int64_t dim) {
  const int64_t width = (hq + 2 * hkv) * dim, kv_width = hkv * dim;
  at::parallel_for(0, tokens, grain(width), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* row = qkv + t * width;
      const T* c = cos + t * dim;
      const T* s = sin + t * dim;
      for (int64_t h = 0; h < hq; ++h) rotate_head(row + h * dim, c, s, q_out + (t * hq + h) * dim, dim);
      T* k = k_out + t * kv_width;
      for (int64_t h = 0; h < hkv; ++h) rotate_head(row + (hq + h) * dim, c, s, k + h * dim, dim);
      const int64_t slot = slots[t];
      if (slot < 0) continue;  // a padding token: nothing to cache
      std::memcpy(k_cache + slot * kv_width, k, kv_width * sizeof(T));
      std::memcpy(v_cache + slot * kv_width, row + (hq + hkv) * dim, kv_width * sizeof(T));
    }
  });
}

void check_dtype(const torch::Tensor& t, const char* op) {
  TORCH_CHECK(t.device().is_cpu() && (t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16) &&
              t.is_contiguous(), op, ": contiguous float32 or bfloat16 CPU tensors");
}

}  // namespace

void rms_norm(torch::Tensor out, torch::Tensor x, torch::Tensor weight, double eps) {
  check_dtype(x, "rms_norm");
  const int64_t h = x.size(-1), rows = x.numel() / std::max<int64_t>(h, 1);
  TORCH_CHECK(h % 16 == 0 && weight.numel() == h && weight.scalar_type() == x.scalar_type() &&
              weight.is_contiguous() && out.sizes() == x.sizes() && out.scalar_type() == x.scalar_type() &&
              out.is_contiguous(), "rms_norm: hidden size a multiple of 16; weight [H] and out like x");
  if (x.scalar_type() == at::kFloat)
    rms_norm_rows<float>(x.data_ptr<float>(), nullptr, weight.data_ptr<float>(), out.data_ptr<float>(), rows, h,
                         static_cast<float>(eps));
  else
    rms_norm_rows<at::BFloat16>(x.data_ptr<at::BFloat16>(), nullptr, weight.data_ptr<at::BFloat16>(),
                                out.data_ptr<at::BFloat16>(), rows, h, static_cast<float>(eps));
}

void fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  check_dtype(x, "fused_add_rms_norm");
  const int64_t h = x.size(-1), rows = x.numel() / std::max<int64_t>(h, 1);
  TORCH_CHECK(h % 16 == 0 && weight.numel() == h && weight.scalar_type() == x.scalar_type() &&
              weight.is_contiguous() && residual.sizes() == x.sizes() &&
              residual.scalar_type() == x.scalar_type() && residual.is_contiguous(),
              "fused_add_rms_norm: hidden size a multiple of 16; weight [H] and residual like x");
  if (x.scalar_type() == at::kFloat)
    rms_norm_rows<float>(x.data_ptr<float>(), residual.data_ptr<float>(), weight.data_ptr<float>(),
                         x.data_ptr<float>(), rows, h, static_cast<float>(eps));
  else
    rms_norm_rows<at::BFloat16>(x.data_ptr<at::BFloat16>(), residual.data_ptr<at::BFloat16>(),
                                weight.data_ptr<at::BFloat16>(), x.data_ptr<at::BFloat16>(), rows, h,
                                static_cast<float>(eps));
}

torch::Tensor silu_and_mul(torch::Tensor gate_up) {
  check_dtype(gate_up, "silu_and_mul");
  const int64_t inter = gate_up.size(-1) / 2, rows = gate_up.numel() / std::max<int64_t>(gate_up.size(-1), 1);
  TORCH_CHECK(gate_up.size(-1) % 32 == 0, "silu_and_mul: the last dim (gate and up) a multiple of 32");
  auto sizes = gate_up.sizes().vec();
  sizes.back() = inter;
  auto out = torch::empty(sizes, gate_up.options());
  if (gate_up.scalar_type() == at::kFloat)
    silu_and_mul_rows<float>(gate_up.data_ptr<float>(), out.data_ptr<float>(), rows, inter);
  else
    silu_and_mul_rows<at::BFloat16>(gate_up.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), rows, inter);
  return out;
}

std::vector<torch::Tensor> rotary_store(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin,
                                        torch::Tensor slot_mapping, torch::Tensor k_cache, torch::Tensor v_cache,
                                        int64_t num_heads, int64_t num_kv_heads) {
  check_dtype(qkv, "rotary_store");
  const int64_t t = qkv.size(0), dim = k_cache.size(-1);
  TORCH_CHECK(dim % 2 == 0 && qkv.dim() == 2 && qkv.size(1) == (num_heads + 2 * num_kv_heads) * dim,
              "rotary_store: qkv [T, (Hq + 2 Hkv) D] with D even");
  for (const auto& c : {cos, sin})
    TORCH_CHECK(c.scalar_type() == qkv.scalar_type() && c.is_contiguous() && c.size(0) == t && c.size(-1) == dim,
                "rotary_store: cos and sin [T, D] in qkv's dtype");
  TORCH_CHECK(k_cache.scalar_type() == qkv.scalar_type() && v_cache.sizes() == k_cache.sizes() &&
              v_cache.scalar_type() == qkv.scalar_type() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              k_cache.size(-2) == num_kv_heads, "rotary_store: caches [blocks, block_size, Hkv, D] in qkv's dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() && slot_mapping.numel() == t,
              "rotary_store: slot_mapping [T] int64");
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t i = 0; i < t; ++i)
    TORCH_CHECK(slots[i] < num_slots, "rotary_store: slot ", slots[i], " is past the cache's ", num_slots, " slots");
  auto q = torch::empty({t, num_heads, dim}, qkv.options());
  auto k = torch::empty({t, num_kv_heads, dim}, qkv.options());
  if (qkv.scalar_type() == at::kFloat)
    rotary_store_rows<float>(qkv.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), slots,
                             q.data_ptr<float>(), k.data_ptr<float>(), k_cache.data_ptr<float>(),
                             v_cache.data_ptr<float>(), t, num_heads, num_kv_heads, dim);
  else
    rotary_store_rows<at::BFloat16>(qkv.data_ptr<at::BFloat16>(), cos.data_ptr<at::BFloat16>(),
                                    sin.data_ptr<at::BFloat16>(), slots, q.data_ptr<at::BFloat16>(),
                                    k.data_ptr<at::BFloat16>(), k_cache.data_ptr<at::BFloat16>(),
                                    v_cache.data_ptr<at::BFloat16>(), t, num_heads, num_kv_heads, dim);
  return {q, k};
}
