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
// sum, then the probability-weighted sum of V. One job per sequence (all its KV heads, chunk by
// chunk) or, with few sequences, per (sequence, KV head), handed out longest first to torch's
// OpenMP threads. Vectors are GCC vector extensions (16 floats),
// so the compiler emits AVX-512 (or pairs of AVX2 registers) for the machine it builds on.
// bfloat16 scores on CPUs with AMX (block_size a multiple of 16, head_dim of 32): 16 tokens' K
// rows are one AMX A tile (rows a slot stride apart, straight from the block), the KV head's query
// heads q^T one B tile, and TDPBF16PS gives the 16 x G scores with no horizontal sums (products
// exact, sums float32, as VDPBF16PS); elsewhere VDPBF16PS or float32 FMAs and a transpose-add.
#include "cpu_amx.h"
#include "cpu_ops.h"
#include "cpu_prefetch.h"
#include "cpu_vec.h"

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <atomic>
#include <type_traits>
#include <cmath>
#include <cstring>
#include <vector>

using namespace vlite_cpu;

namespace {

constexpr int kMaxGroup = 8;
constexpr int kMaxDimVecs = 16;  // head_dim <= 256

// Pass 3 with the group size known at compile time: each V row of the chunk is loaded (and
// widened) once and feeds the sums of every query head of the KV head, all held in registers.
// src: the chunk's m rows; p: the softmax numerators of query head g at p[g * padded].
template <typename T, int kDV, int kG>
inline void weighted_v_rows(const T* const* src, int64_t m, const float* p, int64_t padded,
                            v16 (*acc)[kMaxDimVecs], StreamPrefetch& pf) {
  v16 a[kG][kDV];
  for (int g = 0; g < kG; ++g)
    for (int j = 0; j < kDV; ++j) a[g][j] = acc[g][j];
  for (int64_t i = 0; i < m; ++i) {
    pf.step();
    v16 vv[kDV];
    for (int j = 0; j < kDV; ++j) vv[j] = load16(src[i] + j * 16);
    for (int g = 0; g < kG; ++g) {
      const v16 w = splat(p[g * padded + i]);
      for (int j = 0; j < kDV; ++j) a[g][j] += w * vv[j];
    }
  }
  for (int g = 0; g < kG; ++g)
    for (int j = 0; j < kDV; ++j) acc[g][j] = a[g][j];
}

// kDV: head_dim / 16 when known at compile time (the loops over a row unroll and the V sums stay
// in registers), 0 for any head_dim.
template <typename T, int kDV>
void decode(const T* q, const T* kc, const T* vc, const int64_t* bt, const int64_t* lens,
            T* out, int64_t n, int64_t hq, int64_t hkv, int64_t dim, int64_t bs, int64_t table_stride,
            float scale) {
  const int64_t group = hq / hkv, dv = kDV ? kDV : dim / 16, slot_stride = hkv * dim;
  // block sizes are powers of two in practice: shifts instead of a division per row
  const int bs_shift = (bs & (bs - 1)) == 0 ? __builtin_ctzll(bs) : -1;
  // Jobs go to torch's threads one at a time, longest context first: a static split of the rows
  // leaves a thread idle when long contexts bunch up. A job is a whole sequence (its KV heads one
  // after another, so the heads' neighbouring cache lines are reused from this core's L2) when
  // there are enough sequences to go round, else one (sequence, KV head).
  const int64_t threads = at::get_num_threads();
  const int64_t heads_per_job = n >= 4 * threads ? hkv : 1, num_jobs = n * hkv / heads_per_job;
  std::vector<int64_t> order(num_jobs);
  for (int64_t j = 0; j < num_jobs; ++j) order[j] = j;
  auto seq_of = [&](int64_t job) { return job * heads_per_job / hkv; };
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return lens[seq_of(a)] > lens[seq_of(b)]; });
  std::atomic<int64_t> next{0};
#if defined(VLITE_HAVE_AMX)
  static_assert(kMaxGroup <= 16, "a KV head's query heads are the columns of one AMX B tile");
  const bool use_amx = std::is_same_v<T, at::BFloat16> && bs % 16 == 0 && dim % 32 == 0 && amx_permitted();
#else
  constexpr bool use_amx = false;
#endif
  at::parallel_for(0, std::min(threads, num_jobs), 1, [&](int64_t, int64_t) {
#if defined(VLITE_HAVE_AMX)
    if (use_amx) configure_tiles();
    // q^T as B tiles, per head of the job: [head][dim / 32][dim pair][query head]
    std::vector<uint32_t> q_tiles(use_amx ? heads_per_job * kMaxDimVecs / 2 * 256 : 0);
    alignas(64) float score_tile[16][16];  // [token][query head]
#endif
    std::vector<float> scores, widened(16 * dim);
    // pass 3's sums, [head of the job][query head of the group][dim / 16]
    std::vector<v16> acc_store(heads_per_job * kMaxGroup * kMaxDimVecs);
    std::vector<float> inv(heads_per_job * group);  // 1 / the softmax sums, [head of the job][query head]
    for (int64_t i; (i = next.fetch_add(1)) < num_jobs;) {
      const int64_t seq = seq_of(order[i]), len = lens[seq], h_first = order[i] * heads_per_job % hkv;
      const int64_t* table = bt + seq * table_stride;
      const int64_t padded = (len + 15) / 16 * 16;
      scores.resize(heads_per_job * group * padded);  // [head of the job][query head][token]
      // the slot of token t (all KV heads' rows, slot_stride elements)
      auto slot_of = [&](const T* cache, int64_t t) {
        const int64_t blk = bs_shift >= 0 ? t >> bs_shift : t / bs, off = bs_shift >= 0 ? t & (bs - 1) : t % bs;
        return cache + (table[blk] * bs + off) * slot_stride;
      };
      // The chunk of 16 tokens at t0, the job's heads' rows: with every KV head in the job these
      // are whole slots, and within a block consecutive slots are one contiguous run (12 KB for
      // SmolLM2's 3 x 64 float32 at block size 16). The passes walk a chunk's rows for every head
      // of the job before the next chunk, and ask for the next chunk's rows ahead: blocks are
      // scattered, so the hardware prefetcher restarts at each one (measured: reading scattered
      // 12 KB runs one head's rows at a time 5.7 GB/s, whole runs 7.8, whole runs with the next
      // asked for ahead 12.9, on the Zen 4 machine of 2026-12-02: benchmarks/kernels/experiments/scattered_read.c).
      const int64_t job_bytes = heads_per_job * dim * static_cast<int64_t>(sizeof(T));
      // The next chunk's rows for the job's heads (none past len), asked for over `steps` steps of
      // the work on this one: with whole slots, one contiguous run spread over the steps; else
      // each row at once.
      auto prefetch_chunk = [&](const T* cache, int64_t t0, int64_t steps) {
        if (t0 >= len) return StreamPrefetch();
        const int64_t m = std::min<int64_t>(16, len - t0);
        if (bs % 16 == 0 && heads_per_job == hkv) {
          const char* run = reinterpret_cast<const char*>(slot_of(cache, t0));
          return StreamPrefetch(run, run + m * job_bytes, m * job_bytes, steps);
        }
        for (int64_t t = t0; t < t0 + m; ++t) {
          const char* row = reinterpret_cast<const char*>(slot_of(cache, t) + h_first * dim);
          for (int64_t b = 0; b < job_bytes; b += 64) _mm_prefetch(row + b, _MM_HINT_T1);
        }
        return StreamPrefetch();
      };
      // the rows of head h for tokens t0 .. t0 + 15 (past the end: a valid row, its score masked to -inf)
      const T* src[16];
      auto chunk_ptrs = [&](const T* cache, int64_t h, int64_t t0, int64_t m) {
        if (bs % 16 == 0 && m == 16) {  // all 16 in one block, consecutive slots
          const T* first = slot_of(cache, t0) + h * dim;
          for (int i = 0; i < 16; ++i) src[i] = first + i * slot_stride;
        } else {
          for (int64_t i = 0; i < 16; ++i) src[i] = slot_of(cache, t0 + (i < m ? i : 0)) + h * dim;
        }
      };
      // the same rows as float32: bfloat16 rows are widened once into a buffer here, not once
      // per query head
      const float* rows[16];
      auto chunk_rows = [&](const T* cache, int64_t h, int64_t t0, int64_t m) {
        chunk_ptrs(cache, h, t0, m);
        if constexpr (std::is_same_v<T, float>) {
          for (int i = 0; i < 16; ++i) rows[i] = src[i];
        } else {
          for (int i = 0; i < 16; ++i) {
            for (int64_t j = 0; j < dv; ++j) store16(&widened[i * dim + j * 16], load16(src[i] + j * 16));
            rows[i] = &widened[i * dim];
          }
        }
      };
#if defined(VLITE_HAVE_AMX)
      if (use_amx) {  // pairs of q values, zero past the group's heads
        std::memset(q_tiles.data(), 0, q_tiles.size() * sizeof(uint32_t));
        for (int64_t hl = 0; hl < heads_per_job; ++hl)
          for (int64_t g = 0; g < group; ++g) {
            const uint32_t* pairs = reinterpret_cast<const uint32_t*>(q + (seq * hq + (h_first + hl) * group + g) * dim);
            for (int64_t c = 0; c < dim / 32; ++c)
              for (int r = 0; r < 16; ++r) q_tiles[((hl * kMaxDimVecs / 2 + c) * 16 + r) * 16 + g] = pairs[c * 16 + r];
          }
      }
#endif
      // pass 1: scores q.k, 16 tokens at a time so their 16 horizontal sums are one transpose-add
      prefetch_chunk(kc, 0, 1).drain();
      for (int64_t t0 = 0; t0 < len; t0 += 16) {
        const int64_t m = std::min<int64_t>(16, len - t0);
        StreamPrefetch pf = prefetch_chunk(kc, t0 + 16, heads_per_job * group * 16);
        for (int64_t hl = 0; hl < heads_per_job; ++hl) {
          const int64_t h = h_first + hl;
          float* head_scores = &scores[hl * group * padded];
#if defined(VLITE_HAVE_AMX)
          if (use_amx) {
            // the chunk's 16 slots of the block (rows past len are the block's unused slots: read,
            // then masked); score_tile[i][g] = k_i . q_g over the dims, 32 at a time
            const char* first = reinterpret_cast<const char*>(slot_of(kc, t0) + h * dim);
            _tile_zero(0);
            for (int64_t c = 0; c < dim / 32; ++c) {
              _tile_loadd(4, first + 64 * c, slot_stride * sizeof(T));
              _tile_loadd(6, &q_tiles[(hl * kMaxDimVecs / 2 + c) * 256], 64);
              _tile_dpbf16ps(0, 4, 6);
            }
            _tile_stored(0, score_tile, 64);
            const __m512i column = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240);
            for (int64_t g = 0; g < group; ++g) {
              for (int r = 0; r < 16; ++r) pf.step();
              v16 sums = (v16)_mm512_i32gather_ps(_mm512_add_epi32(column, _mm512_set1_epi32(g)), &score_tile[0][0], 4) * scale;
              for (int64_t r = m; r < 16; ++r) sums[r] = -INFINITY;
              store16(&head_scores[g * padded + t0], sums);
            }
            continue;
          }
#endif
#if defined(__AVX512BF16__)
          if constexpr (std::is_same_v<T, at::BFloat16>) {
            if (dim % 32 == 0) {  // bf16 rows straight into VDPBF16PS: exact products, float32 sums
              chunk_ptrs(kc, h, t0, m);
              for (int64_t g = 0; g < group; ++g) {
                const at::BFloat16* qrow = q + (seq * hq + h * group + g) * dim;
                v16 acc[16];
                if constexpr (kDV == 4 || kDV == 8) {  // the q row in registers, the row loop unrolled
                  constexpr int kPairs = kDV / 2;  // 32 bf16 values per VDPBF16PS
                  __m512bh qp[kPairs];
                  for (int j = 0; j < kPairs; ++j) qp[j] = (__m512bh)_mm512_loadu_si512(qrow + 32 * j);
                  for (int r = 0; r < 16; ++r) {
                    pf.step();
                    __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), qp[0], (__m512bh)_mm512_loadu_si512(src[r]));
                    for (int j = 1; j < kPairs; ++j)
                      a = _mm512_dpbf16_ps(a, qp[j], (__m512bh)_mm512_loadu_si512(src[r] + 32 * j));
                    acc[r] = (v16)a;
                  }
                } else {
                  for (int r = 0; r < 16; ++r) {
                    pf.step();
                    __m512 a = _mm512_setzero_ps();
                    for (int64_t j = 0; j < dim; j += 32)
                      a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(qrow + j), (__m512bh)_mm512_loadu_si512(src[r] + j));
                    acc[r] = (v16)a;
                  }
                }
                v16 sums = hsum16x16(acc) * scale;
                for (int64_t r = m; r < 16; ++r) sums[r] = -INFINITY;
                store16(&head_scores[g * padded + t0], sums);
              }
              continue;
            }
          }
#endif
          chunk_rows(kc, h, t0, m);
          for (int64_t g = 0; g < group; ++g) {
            const T* qrow = q + (seq * hq + h * group + g) * dim;
            v16 qv[kMaxDimVecs];
            for (int64_t j = 0; j < dv; ++j) qv[j] = load16(qrow + j * 16) * scale;
            v16 acc[16];
            for (int r = 0; r < 16; ++r) {
              pf.step();
              v16 a = qv[0] * load16(rows[r]);
              for (int64_t j = 1; j < dv; ++j) a += qv[j] * load16(rows[r] + j * 16);
              acc[r] = a;
            }
            v16 sums = hsum16x16(acc);
            for (int64_t r = m; r < 16; ++r) sums[r] = -INFINITY;
            store16(&head_scores[g * padded + t0], sums);
          }
        }
      }
      prefetch_chunk(vc, 0, 1).drain();  // the first V rows, while the softmax runs
      // pass 2: softmax numerators exp(s - max) in place (0 for the masked tail), and 1 / sum
      for (int64_t hg = 0; hg < heads_per_job * group; ++hg) {
        float* s = &scores[hg * padded];
        v16 mv = splat(-INFINITY);
        for (int64_t t = 0; t < padded; t += 16) { v16 x = load16(s + t); mv = x > mv ? x : mv; }
        float mx = mv[0];
        for (int l = 1; l < 16; ++l) mx = std::max(mx, mv[l]);
        v16 sum = {};
        for (int64_t t = 0; t < padded; t += 16) {
          v16 e = exp16_nonpositive(load16(s + t) - mx);
          e = load16(s + t) == splat(-INFINITY) ? splat(0.f) : e;
          store16(s + t, e);
          sum += e;
        }
        inv[hg] = 1.0f / hsum(sum);
      }
      // pass 3: the weighted sum of V, 16 rows at a time (in L1) for each query head in turn
      for (auto& v : acc_store) v = splat(0.f);
      for (int64_t t0 = 0; t0 < len; t0 += 16) {
        const int64_t m = std::min<int64_t>(16, len - t0);
        const bool rows_once = (kDV == 4 || kDV == 8) && group <= 4;  // weighted_v_rows: a step per row
        StreamPrefetch pf = prefetch_chunk(vc, t0 + 16, heads_per_job * (rows_once ? 1 : group) * 16);
        for (int64_t hl = 0; hl < heads_per_job; ++hl) {
          const int64_t h = h_first + hl;
          v16 (*acc)[kMaxDimVecs] = reinterpret_cast<v16 (*)[kMaxDimVecs]>(&acc_store[hl * kMaxGroup * kMaxDimVecs]);
          const float* head_p = &scores[hl * group * padded];
          if constexpr (kDV == 4 || kDV == 8) {
            if (group <= 4) {
              chunk_ptrs(vc, h, t0, m);
              const float* p = head_p + t0;
              switch (group) {
                case 1: weighted_v_rows<T, kDV, 1>(src, m, p, padded, acc, pf); break;
                case 2: weighted_v_rows<T, kDV, 2>(src, m, p, padded, acc, pf); break;
                case 3: weighted_v_rows<T, kDV, 3>(src, m, p, padded, acc, pf); break;
                default: weighted_v_rows<T, kDV, 4>(src, m, p, padded, acc, pf); break;
              }
              continue;
            }
          }
          chunk_rows(vc, h, t0, m);
          for (int64_t g = 0; g < group; ++g) {
            v16 a[kMaxDimVecs];
            for (int64_t j = 0; j < dv; ++j) a[j] = acc[g][j];
            const float* p = head_p + g * padded + t0;
            for (int r = 0; r < 16; ++r) {
              pf.step();
              const v16 w = splat(p[r]);
              for (int64_t j = 0; j < dv; ++j) a[j] += w * load16(rows[r] + j * 16);
            }
            for (int64_t j = 0; j < dv; ++j) acc[g][j] = a[j];
          }
        }
      }
      for (int64_t hl = 0; hl < heads_per_job; ++hl) {
        const int64_t h = h_first + hl;
        const v16* acc = &acc_store[hl * kMaxGroup * kMaxDimVecs];
        for (int64_t g = 0; g < group; ++g)
          for (int64_t j = 0; j < dv; ++j)
            store16(out + (seq * hq + h * group + g) * dim + j * 16, acc[g * kMaxDimVecs + j] * inv[hl * group + g]);
      }
    }
#if defined(VLITE_HAVE_AMX)
    if (use_amx) _tile_release();
#endif
  });
}

template <typename T>
void decode_any_dim(const T* q, const T* kc, const T* vc, const int64_t* bt, const int64_t* lens, T* out, int64_t n,
                    int64_t hq, int64_t hkv, int64_t dim, int64_t bs, int64_t table_stride, float scale) {
  switch (dim) {
    case 64: return decode<T, 4>(q, kc, vc, bt, lens, out, n, hq, hkv, dim, bs, table_stride, scale);
    case 128: return decode<T, 8>(q, kc, vc, bt, lens, out, n, hq, hkv, dim, bs, table_stride, scale);
    default: return decode<T, 0>(q, kc, vc, bt, lens, out, n, hq, hkv, dim, bs, table_stride, scale);
  }
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
    decode_any_dim<float>(q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
                  block_tables.data_ptr<int64_t>(), seq_lens.data_ptr<int64_t>(), out.data_ptr<float>(), n, hq, hkv, d,
                  bs, block_tables.stride(0), static_cast<float>(scale));
  else
    decode_any_dim<at::BFloat16>(q.data_ptr<at::BFloat16>(), k_cache.data_ptr<at::BFloat16>(),
                         v_cache.data_ptr<at::BFloat16>(), block_tables.data_ptr<int64_t>(),
                         seq_lens.data_ptr<int64_t>(), out.data_ptr<at::BFloat16>(), n, hq, hkv, d, bs,
                         block_tables.stride(0), static_cast<float>(scale));
  return out;
}
