// Paged decode attention for CPU, float32 or bfloat16: one query token per sequence over its
// cached K/V, read straight from the blocks through the block table (no gather into a padded
// batch). bfloat16 inputs are widened to float32 on load (a 16-bit shift) and every sum is
// float32, as in SDPA's CPU math; only the output is rounded back to bfloat16.
//
// Layout (vlite/kernels/attention.py): q [n, Hq, D]; k_cache, v_cache [num_blocks, block_size,
// Hkv, D] contiguous; block_tables [n, max_blocks] int64; seq_lens [n] int64 (tokens).
// Returns [n, Hq, D]. GQA: the G = Hq / Hkv query heads of a KV head share each K/V load.
//
// Algorithm: PagedAttention's decode (Kwon et al. 2023, vLLM's csrc/cpu/attention.cpp) with a
// two-pass softmax per (sequence, KV head): scores q.k for every cached token, max, exp and
// sum, then the probability-weighted sum of V. One task per (sequence, KV head), spread over
// torch's OpenMP threads by at::parallel_for. Vectors are GCC vector extensions (16 floats),
// so the compiler emits AVX-512 (or pairs of AVX2 registers) for the machine it builds on.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

typedef uint16_t v16u16 __attribute__((vector_size(32)));

inline v16 load16(const float* p) { v16 v; std::memcpy(&v, p, sizeof(v)); return v; }
inline void store16(float* p, v16 v) { std::memcpy(p, &v, sizeof(v)); }
// bfloat16 -> float32 is exact: the 16 bits become the high half of the float.
inline v16 load16(const at::BFloat16* p) {
  v16u16 h;
  std::memcpy(&h, p, sizeof(h));
  v16i w = __builtin_convertvector(h, v16i) << 16;
  v16 v;
  std::memcpy(&v, &w, sizeof(v));
  return v;
}
// float32 -> bfloat16 rounds to nearest even (c10::BFloat16's conversion).
inline void store16(at::BFloat16* p, v16 v) {
  for (int l = 0; l < 16; ++l) p[l] = at::BFloat16(v[l]);
}
inline v16 splat(float x) { return v16{} + x; }

inline float hsum(v16 v) {
  float s = 0.f;
  for (int l = 0; l < 16; ++l) s += v[l];
  return s;
}

// exp(x) for x <= 0 (scores after the max is subtracted): Cephes' expf, 2^n * p(r) with a
// degree-6 polynomial, about 1 ulp; 16 lanes.
inline v16 exp16(v16 x) {
  x = x < splat(-87.0f) ? splat(-87.0f) : x;
  v16 t = x * 1.44269504088896341f;
  v16i ni = __builtin_convertvector(t - 0.5f, v16i);  // x <= 0: truncation rounds toward 0
  v16 n = __builtin_convertvector(ni, v16);
  v16 r = x - n * 0.693359375f + n * 2.12194440e-4f;
  v16 p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  v16i bits;
  std::memcpy(&bits, &p, 64);
  bits += ni << 23;
  std::memcpy(&p, &bits, 64);
  return p;
}

constexpr int kMaxGroup = 8;
constexpr int kMaxDimVecs = 16;  // head_dim <= 256

template <typename T>
void decode(const T* q, const T* kc, const T* vc, const int64_t* bt, const int64_t* lens,
                T* out, int64_t n, int64_t hq, int64_t hkv, int64_t dim, int64_t bs, int64_t table_stride,
                float scale) {
  const int64_t group = hq / hkv, dv = dim / 16, slot_stride = hkv * dim;
  at::parallel_for(0, n * hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t job = begin; job < end; ++job) {
      const int64_t seq = job / hkv, h = job % hkv, len = lens[seq];
      const int64_t* table = bt + seq * table_stride;
      v16 qv[kMaxGroup][kMaxDimVecs];
      for (int64_t g = 0; g < group; ++g)
        for (int64_t j = 0; j < dv; ++j) qv[g][j] = load16(q + (seq * hq + h * group + g) * dim + j * 16) * scale;
      const int64_t padded = (len + 15) / 16 * 16;
      scores.assign(group * padded, -INFINITY);
      // each cached token's [D] row of this KV head, in order, through the block table
      auto for_each_token = [&](const T* cache, auto&& visit) {
        for (int64_t t0 = 0, blk = 0; t0 < len; t0 += bs, ++blk) {
          const T* block = cache + table[blk] * bs * slot_stride + h * dim;
          for (int64_t o = 0, stop = std::min(bs, len - t0); o < stop; ++o) visit(t0 + o, block + o * slot_stride);
        }
      };
      for_each_token(kc, [&](int64_t t, const T* k) {
        v16 kv[kMaxDimVecs];
        for (int64_t j = 0; j < dv; ++j) kv[j] = load16(k + j * 16);
        for (int64_t g = 0; g < group; ++g) {
          v16 acc = qv[g][0] * kv[0];
          for (int64_t j = 1; j < dv; ++j) acc += qv[g][j] * kv[j];
          scores[g * padded + t] = hsum(acc);
        }
      });
      float inv[kMaxGroup];
      for (int64_t g = 0; g < group; ++g) {
        float* s = &scores[g * padded];
        v16 m = splat(-INFINITY);
        for (int64_t t = 0; t < padded; t += 16) { v16 x = load16(s + t); m = x > m ? x : m; }
        float mx = m[0];
        for (int l = 1; l < 16; ++l) mx = std::max(mx, m[l]);
        v16 sum = {};
        for (int64_t t = 0; t < padded; t += 16) {
          v16 e = exp16(load16(s + t) - mx);
          e = load16(s + t) == splat(-INFINITY) ? splat(0.f) : e;
          store16(s + t, e);
          sum += e;
        }
        inv[g] = 1.0f / hsum(sum);
      }
      v16 acc[kMaxGroup][kMaxDimVecs];
      for (int64_t g = 0; g < group; ++g)
        for (int64_t j = 0; j < dv; ++j) acc[g][j] = splat(0.f);
      for_each_token(vc, [&](int64_t t, const T* v) {
        v16 vv[kMaxDimVecs];
        for (int64_t j = 0; j < dv; ++j) vv[j] = load16(v + j * 16);
        for (int64_t g = 0; g < group; ++g) {
          const v16 p = splat(scores[g * padded + t]);
          for (int64_t j = 0; j < dv; ++j) acc[g][j] += p * vv[j];
        }
      });
      for (int64_t g = 0; g < group; ++g)
        for (int64_t j = 0; j < dv; ++j) store16(out + (seq * hq + h * group + g) * dim + j * 16, acc[g][j] * inv[g]);
    }
  });
}

}  // namespace

// Checks what the kernel assumes; the Python side only calls it when they hold.
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor seq_lens, double scale) {
  auto out = torch::empty_like(q);
  const int64_t n = q.size(0), hq = q.size(1), d = q.size(2), bs = k_cache.size(1), hkv = k_cache.size(2);
  const auto dtype = q.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && k_cache.scalar_type() == dtype &&
              v_cache.scalar_type() == dtype, "paged_decode: float32 or bfloat16, the same for q and the caches");
  TORCH_CHECK(d % 16 == 0 && d <= 16 * kMaxDimVecs && hq % hkv == 0 && hq / hkv <= kMaxGroup,
              "paged_decode: head_dim must be a multiple of 16 up to 256, with at most 8 query heads per KV head");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong &&
              block_tables.stride(1) == 1 && seq_lens.is_contiguous(),
              "paged_decode: contiguous q and caches, int64 block tables and seq_lens");
  TORCH_CHECK(k_cache.size(3) == d && v_cache.sizes() == k_cache.sizes() && seq_lens.size(0) == n &&
              block_tables.size(0) >= n, "paged_decode: shapes do not match");
  if (dtype == at::kFloat)
    decode<float>(q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
                  block_tables.data_ptr<int64_t>(), seq_lens.data_ptr<int64_t>(), out.data_ptr<float>(), n, hq, hkv, d,
                  bs, block_tables.stride(0), static_cast<float>(scale));
  else
    decode<at::BFloat16>(q.data_ptr<at::BFloat16>(), k_cache.data_ptr<at::BFloat16>(),
                         v_cache.data_ptr<at::BFloat16>(), block_tables.data_ptr<int64_t>(),
                         seq_lens.data_ptr<int64_t>(), out.data_ptr<at::BFloat16>(), n, hq, hkv, d, bs,
                         block_tables.stride(0), static_cast<float>(scale));
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention (float32 or bfloat16, CPU)");
}
