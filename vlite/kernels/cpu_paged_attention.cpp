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
#include "cpu_ops.h"
#include "cpu_vec.h"

#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <vector>

using namespace vlite_cpu;

namespace {

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
      // scores q.k, 16 tokens at a time so their 16 horizontal sums are one transpose-add
      const T* rows[16];
      for (int64_t t0 = 0; t0 < len; t0 += 16) {
        const int64_t m = std::min<int64_t>(16, len - t0);
        if (bs % 16 == 0 && m == 16) {  // all 16 in one block, consecutive slots
          const T* first = kc + (table[t0 / bs] * bs + t0 % bs) * slot_stride + h * dim;
          for (int i = 0; i < 16; ++i) rows[i] = first + i * slot_stride;
        } else {
          for (int64_t i = 0; i < 16; ++i) {
            const int64_t t = t0 + (i < m ? i : 0);  // past the end: any valid row, masked below
            rows[i] = kc + (table[t / bs] * bs + t % bs) * slot_stride + h * dim;
          }
        }
        for (int64_t g = 0; g < group; ++g) {
          v16 acc[16];
          for (int i = 0; i < 16; ++i) {
            v16 a = qv[g][0] * load16(rows[i]);
            for (int64_t j = 1; j < dv; ++j) a += qv[g][j] * load16(rows[i] + j * 16);
            acc[i] = a;
          }
          v16 sums = hsum16x16(acc);
          for (int64_t i = m; i < 16; ++i) sums[i] = -INFINITY;
          store16(&scores[g * padded + t0], sums);
        }
      }
      float inv[kMaxGroup];
      for (int64_t g = 0; g < group; ++g) {
        float* s = &scores[g * padded];
        v16 m = splat(-INFINITY);
        for (int64_t t = 0; t < padded; t += 16) { v16 x = load16(s + t); m = x > m ? x : m; }
        float mx = m[0];
        for (int l = 1; l < 16; ++l) mx = std::max(mx, m[l]);
        v16 sum = {};
        for (int64_t t = 0; t < padded; t += 16) {
          v16 e = exp16_nonpositive(load16(s + t) - mx);
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
