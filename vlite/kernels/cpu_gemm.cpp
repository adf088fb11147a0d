// Linear layers y = x W^T (+ b) on a weight packed once at load, for the small row counts of a
// decode step. Both kernels stream the packed weight once per call, every thread its own
// contiguous share of it, and ask for the next part of that stream ahead of use (software
// prefetch into L2): at a decode step's 1-64 rows a linear layer is a read of its weight from
// DRAM, and oneDNN's kernels leave the memory system idle between their loads (measured:
// docs/kernels.md, "The packed GEMM").
//
// float32 (any CPU with AVX-512F): the weight in panels of 48 output columns, [ceil(N/48)][K][48]
// (zero-padded past N). A micro-kernel keeps an 8 x 48 block of y in 24 registers and adds one
// rank-1 update per k (one broadcast of x, three loads of the panel, 24 FMAs): a plain float32
// dot product per output in k order, as a BLAS micro-kernel does (Goto and van de Geijn 2008).
//
// bfloat16 (CPUs with AMX-BF16, Intel Sapphire Rapids and later; or else AVX512-BF16, see
// dpbf16_linear): the weight in VNNI blocks of 16
// output columns, [ceil(N/32)*2][K/2][16][2] (pairs of k side by side, zero-padded past N), so a
// block's 16 rows of 64 bytes are one AMX B tile. Each pass computes 32 x 32 outputs in 4 tiles
// (2 row tiles of x times 2 column tiles of W), products exact in float32 and sums in float32,
// rounded to bfloat16 once at the end as torch rounds (nearest even). AMX needs the kernel's
// permission to use the tile state (Linux ``arch_prctl(ARCH_REQ_XCOMP_PERM)``), asked once.
#include "cpu_amx.h"
#include "cpu_ops.h"
#include "cpu_prefetch.h"
#include "cpu_vec.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>

using namespace vlite_cpu;

namespace {

constexpr int64_t kPanel = 48;  // float32 panel width (3 vectors)
constexpr int64_t kRows = 8;    // float32 rows per pass
constexpr int64_t kPrefetchK = 16;  // float32: k values per prefetch step

// Contiguous share [begin, end) of `units` for thread t of `threads`.
inline void share(int64_t units, int64_t t, int64_t threads, int64_t& begin, int64_t& end) {
  begin = units * t / threads;
  end = units * (t + 1) / threads;
}

#if defined(__AVX512F__)
// y[0..MR) x [0..n_valid) of one panel: C = A . panel (+ bias), A's rows `lda` apart.
template <int MR>
inline void f32_block(const float* A, int64_t lda, const float* P, int64_t K, const float* bias, float* C,
                      int64_t ldc, int64_t rows, int64_t n_valid, StreamPrefetch& pf) {
  __m512 c[MR][3];
  for (int i = 0; i < MR; ++i) c[i][0] = c[i][1] = c[i][2] = _mm512_setzero_ps();
  // One prefetch step per kPrefetchK values of k: with one per k the prefetcher's state took
  // registers the 8 row pointers need, and GCC spilled a panel vector to the stack (docs/kernels.md).
  for (int64_t k0 = 0; k0 < K; k0 += kPrefetchK) {
    pf.step();
    const int64_t k1 = std::min(K, k0 + kPrefetchK);
    for (int64_t k = k0; k < k1; ++k) {
      const __m512 b0 = _mm512_loadu_ps(P + k * kPanel), b1 = _mm512_loadu_ps(P + k * kPanel + 16),
                   b2 = _mm512_loadu_ps(P + k * kPanel + 32);
      for (int i = 0; i < MR; ++i) {
        const __m512 a = _mm512_set1_ps(A[i * lda + k]);
        c[i][0] = _mm512_fmadd_ps(a, b0, c[i][0]);
        c[i][1] = _mm512_fmadd_ps(a, b1, c[i][1]);
        c[i][2] = _mm512_fmadd_ps(a, b2, c[i][2]);
      }
    }
  }
  __mmask16 mask[3];
  for (int j = 0; j < 3; ++j) {
    const int64_t left = std::clamp<int64_t>(n_valid - 16 * j, 0, 16);
    mask[j] = static_cast<__mmask16>((1u << left) - 1u);
  }
  __m512 b[3];
  for (int j = 0; j < 3; ++j) b[j] = bias ? _mm512_maskz_loadu_ps(mask[j], bias + 16 * j) : _mm512_setzero_ps();
  for (int i = 0; i < MR && i < rows; ++i)
    for (int j = 0; j < 3; ++j)
      _mm512_mask_storeu_ps(C + i * ldc + 16 * j, mask[j], bias ? _mm512_add_ps(c[i][j], b[j]) : c[i][j]);
}

void f32_linear(const float* X, const float* W, const float* bias, float* Y, int64_t M, int64_t K, int64_t N) {
  const int64_t panels = (N + kPanel - 1) / kPanel, panel_floats = K * kPanel;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), panels);
  const int64_t passes = (M + kRows - 1) / kRows;
  at::parallel_for(0, threads, 1, [&](int64_t t_begin, int64_t t_end) {
    for (int64_t t = t_begin; t < t_end; ++t) {
      int64_t p0, p1;
      share(panels, t, threads, p0, p1);
      const char* stream_end = reinterpret_cast<const char*>(W + p1 * panel_floats);
      for (int64_t p = p0; p < p1; ++p) {
        const float* P = W + p * panel_floats;
        StreamPrefetch pf(reinterpret_cast<const char*>(P + panel_floats), stream_end, panel_floats * 4,
                          passes * ((K + kPrefetchK - 1) / kPrefetchK));
        const int64_t n0 = p * kPanel, n_valid = std::min(kPanel, N - n0);
        const float* b = bias ? bias + n0 : nullptr;
        for (int64_t m0 = 0; m0 < M; m0 += kRows) {
          const int64_t rows = std::min(kRows, M - m0);
          const float* A = X + m0 * K;
          float* C = Y + m0 * N + n0;
          switch (rows) {
            case 8: f32_block<8>(A, K, P, K, b, C, N, rows, n_valid, pf); break;
            case 7: f32_block<7>(A, K, P, K, b, C, N, rows, n_valid, pf); break;
            case 6: f32_block<6>(A, K, P, K, b, C, N, rows, n_valid, pf); break;
            case 5: f32_block<5>(A, K, P, K, b, C, N, rows, n_valid, pf); break;
            case 4: f32_block<4>(A, K, P, K, b, C, N, rows, n_valid, pf); break;
            case 3: f32_block<3>(A, K, P, K, b, C, N, rows, n_valid, pf); break;
            case 2: f32_block<2>(A, K, P, K, b, C, N, rows, n_valid, pf); break;
            default: f32_block<1>(A, K, P, K, b, C, N, rows, n_valid, pf); break;
          }
        }
      }
    }
  });
}
#endif  // __AVX512F__

#if defined(VLITE_HAVE_AMX)
// Tiles: 0-3 the 32 x 32 float32 sums (row tile r, column tile c at 2r + c), 4-5 two row tiles of
// x (16 rows x 32 k), 6-7 two column tiles of W (16 k pairs x 16 columns).
constexpr int64_t kTileBytes = 1024;  // 16 rows x 64 bytes

// One pass over a pair of column blocks: RT (1 or 2) row tiles from a0 / a1 (rows `lda` elements
// apart), K/32 steps, sums stored to c.
template <int RT>
inline void amx_pass(const at::BFloat16* a0, const at::BFloat16* a1, int64_t lda, const char* B0, const char* B1,
                     int64_t k_steps, StreamPrefetch& pf, float (*c)[16][16]) {
  _tile_zero(0);
  _tile_zero(1);
  if (RT > 1) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t kb = 0; kb < k_steps; ++kb) {
    pf.step();
    _tile_loadd(6, B0 + kb * kTileBytes, 64);
    _tile_loadd(7, B1 + kb * kTileBytes, 64);
    _tile_loadd(4, a0 + kb * 32, lda * 2);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (RT > 1) {
      _tile_loadd(5, a1 + kb * 32, lda * 2);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c[0], 64);
  _tile_stored(1, c[1], 64);
  if (RT > 1) {
    _tile_stored(2, c[2], 64);
    _tile_stored(3, c[3], 64);
  }
}

void bf16_linear(const at::BFloat16* X, const at::BFloat16* W, const at::BFloat16* bias, at::BFloat16* Y, int64_t M,
                 int64_t K, int64_t N) {
  constexpr int64_t kRowBlock = 256;  // rows of x kept in L2 while the thread's weight share streams by
  const int64_t pairs = (N + 31) / 32, k_steps = K / 32, block_bytes = K / 2 * 64, pair_bytes = 2 * block_bytes;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), pairs);
  // a last row tile of fewer than 16 rows is read from a zero-padded copy
  const int64_t full_tiles = M / 16, tail_rows = M - full_tiles * 16;
  std::vector<at::BFloat16> tail(tail_rows ? 16 * K : 0, at::BFloat16(0.f));
  if (tail_rows) std::memcpy(tail.data(), X + full_tiles * 16 * K, tail_rows * K * sizeof(at::BFloat16));
  const int64_t row_tiles = full_tiles + (tail_rows ? 1 : 0);
  auto tile_rows = [&](int64_t rt) { return rt < full_tiles ? X + rt * 16 * K : tail.data(); };
  at::parallel_for(0, threads, 1, [&](int64_t t_begin, int64_t t_end) {
    configure_tiles();
    alignas(64) float c[4][16][16];
    for (int64_t t = t_begin; t < t_end; ++t) {
      int64_t q0, q1;
      share(pairs, t, threads, q0, q1);
      const char* base = reinterpret_cast<const char*>(W);
      const char* stream_end = base + q1 * pair_bytes;
      for (int64_t rb = 0; rb < row_tiles; rb += kRowBlock / 16) {
        const int64_t rb_end = std::min(row_tiles, rb + kRowBlock / 16), passes = (rb_end - rb + 1) / 2;
        for (int64_t q = q0; q < q1; ++q) {
          const char* B0 = base + q * pair_bytes;
          // the pair after this one; after the share's last pair, its first (read again for the next row block)
          const char* ahead = q + 1 < q1 ? B0 + pair_bytes : (rb_end < row_tiles ? base + q0 * pair_bytes : stream_end);
          StreamPrefetch pf(ahead, stream_end, pair_bytes, passes * k_steps);
          for (int64_t rt = rb; rt < rb_end; rt += 2) {
            const int tiles = rt + 1 < rb_end ? 2 : 1;
            if (tiles == 2)
              amx_pass<2>(tile_rows(rt), tile_rows(rt + 1), K, B0, B0 + block_bytes, k_steps, pf, c);
            else
              amx_pass<1>(tile_rows(rt), nullptr, K, B0, B0 + block_bytes, k_steps, pf, c);
            for (int tr = 0; tr < tiles; ++tr)
              for (int r = 0; r < 16; ++r) {
                const int64_t m = (rt + tr) * 16 + r;
                if (m >= M) break;
                for (int tc = 0; tc < 2; ++tc) {
                  const int64_t n0 = q * 32 + tc * 16;
                  if (n0 >= N) break;
                  v16 sum = load16(c[tr * 2 + tc][r]);
                  if (bias) {
                    alignas(64) at::BFloat16 bb[16] = {};
                    std::memcpy(bb, bias + n0, std::min<int64_t>(16, N - n0) * sizeof(at::BFloat16));
                    sum += load16(bb);
                  }
                  if (N - n0 >= 16) {
                    store16(Y + m * N + n0, sum);
                  } else {
                    alignas(64) at::BFloat16 out[16];
                    store16(out, sum);
                    std::memcpy(Y + m * N + n0, out, (N - n0) * sizeof(at::BFloat16));
                  }
                }
              }
          }
        }
      }
    }
    _tile_release();
  });
}
#endif  // AMX

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define VLITE_HAVE_AVX512_BF16 1
// bfloat16 without AMX (AVX512-BF16 CPUs: AMD Zen 4 and later, Intel Cooper Lake): the AMX
// layout's pair of 16-column blocks, one 64-byte row of k pairs per step from each. VDPBF16PS adds
// a[k] b[k] + a[k+1] b[k+1] into each float32 lane; the products are exact in float32 and the sums
// float32, as in the AMX pass.
constexpr int64_t kDpRows = 12;  // rows per pass: 24 accumulators, 2 weight and 1 broadcast registers

template <int MR>
inline void dpbf16_block(const at::BFloat16* A, int64_t lda, const char* B0, const char* B1, int64_t k_pairs,
                         const at::BFloat16* bias, at::BFloat16* C, int64_t ldc, int64_t rows, int64_t n_valid,
                         StreamPrefetch& pf) {
  __m512 c[MR][2];
  for (int i = 0; i < MR; ++i) c[i][0] = c[i][1] = _mm512_setzero_ps();
  const int32_t* a32 = reinterpret_cast<const int32_t*>(A);  // one k pair of bfloat16 per int32
  const int64_t lda32 = lda / 2;
  for (int64_t kk = 0; kk < k_pairs; ++kk) {
    pf.step();
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(B0 + kk * 64), b1 = (__m512bh)_mm512_loadu_si512(B1 + kk * 64);
    for (int i = 0; i < MR; ++i) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(a32[i * lda32 + kk]);
      c[i][0] = _mm512_dpbf16_ps(c[i][0], a, b0);
      c[i][1] = _mm512_dpbf16_ps(c[i][1], a, b1);
    }
  }
  v16 b[2] = {};
  for (int j = 0; j < 2; ++j) {
    const int64_t left = std::clamp<int64_t>(n_valid - 16 * j, 0, 16);
    if (bias && left) {
      alignas(64) at::BFloat16 bb[16] = {};
      std::memcpy(bb, bias + 16 * j, left * sizeof(at::BFloat16));
      b[j] = load16(bb);
    }
  }
  for (int i = 0; i < MR && i < rows; ++i)
    for (int j = 0; j < 2; ++j) {
      const int64_t left = std::clamp<int64_t>(n_valid - 16 * j, 0, 16);
      if (!left) break;
      const v16 sum = (v16)c[i][j] + b[j];
      if (left == 16) {
        store16(C + i * ldc + 16 * j, sum);
      } else {
        alignas(64) at::BFloat16 out[16];
        store16(out, sum);
        std::memcpy(C + i * ldc + 16 * j, out, left * sizeof(at::BFloat16));
      }
    }
}

template <int MR>
inline void dpbf16_rows(int64_t rows, const at::BFloat16* A, int64_t lda, const char* B0, const char* B1,
                        int64_t k_pairs, const at::BFloat16* bias, at::BFloat16* C, int64_t ldc, int64_t n_valid,
                        StreamPrefetch& pf) {
  if constexpr (MR > 1) {
    if (rows < MR) return dpbf16_rows<MR - 1>(rows, A, lda, B0, B1, k_pairs, bias, C, ldc, n_valid, pf);
  }
  dpbf16_block<MR>(A, lda, B0, B1, k_pairs, bias, C, ldc, rows, n_valid, pf);
}

void dpbf16_linear(const at::BFloat16* X, const at::BFloat16* W, const at::BFloat16* bias, at::BFloat16* Y, int64_t M,
                   int64_t K, int64_t N) {
  const int64_t pairs = (N + 31) / 32, k_pairs = K / 2, block_bytes = K / 2 * 64, pair_bytes = 2 * block_bytes;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), pairs);
  // rows of x kept in L2 (about 256 KB of them) while the thread's weight share streams by once
  const int64_t row_block = std::max<int64_t>(1, (256 * 1024) / (2 * K) / kDpRows) * kDpRows;
  at::parallel_for(0, threads, 1, [&](int64_t t_begin, int64_t t_end) {
    for (int64_t t = t_begin; t < t_end; ++t) {
      int64_t q0, q1;
      share(pairs, t, threads, q0, q1);
      const char* base = reinterpret_cast<const char*>(W);
      const char* stream_end = base + q1 * pair_bytes;
      for (int64_t r0 = 0; r0 < M; r0 += row_block) {
        const int64_t r1 = std::min(M, r0 + row_block), passes = (r1 - r0 + kDpRows - 1) / kDpRows;
        for (int64_t q = q0; q < q1; ++q) {
          const char* B0 = base + q * pair_bytes;
          // the pair after this one; after the share's last pair, its first (read again for the next row block)
          const char* ahead = q + 1 < q1 ? B0 + pair_bytes : (r1 < M ? base + q0 * pair_bytes : stream_end);
          StreamPrefetch pf(ahead, stream_end, pair_bytes, passes * k_pairs);
          const int64_t n0 = q * 32, n_valid = std::min<int64_t>(32, N - n0);
          const at::BFloat16* b = bias ? bias + n0 : nullptr;
          for (int64_t m0 = r0; m0 < r1; m0 += kDpRows)
            dpbf16_rows<kDpRows>(std::min(kDpRows, r1 - m0), X + m0 * K, K, B0, B0 + block_bytes, k_pairs, b,
                                 Y + m0 * N + n0, N, n_valid, pf);
        }
      }
    }
  });
}
#endif  // AVX512-BF16

// Which bfloat16 kernel runs here: AMX where the process may use it, else AVX512-BF16.
enum class Bf16Kernel { kNone, kAmx, kAvx512Bf16 };
Bf16Kernel bf16_kernel() {
#if defined(VLITE_HAVE_AMX)
  if (amx_permitted()) return Bf16Kernel::kAmx;
#endif
#if defined(VLITE_HAVE_AVX512_BF16)
  return Bf16Kernel::kAvx512Bf16;
#else
  return Bf16Kernel::kNone;
#endif
}

}  // namespace

namespace {
bool supported(c10::ScalarType dtype) {
#if defined(__AVX512F__)
  if (dtype == at::kFloat) return true;
#endif
  if (dtype == at::kBFloat16) return bf16_kernel() != Bf16Kernel::kNone;
  return false;
}

}  // namespace

bool packed_gemm_supported(const std::string& dtype) {
  return supported(dtype == "bfloat16" ? at::kBFloat16 : dtype == "float32" ? at::kFloat : at::kDouble);
}

torch::Tensor pack_linear_weight(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.device().is_cpu(), "pack_linear_weight: a contiguous 2-D CPU weight");
  TORCH_CHECK(supported(w.scalar_type()), "pack_linear_weight: no packed GEMM for ", w.scalar_type(),
              " on this CPU");
  const int64_t N = w.size(0), K = w.size(1);
  if (w.scalar_type() == at::kFloat) {
    const int64_t padded = (N + kPanel - 1) / kPanel * kPanel;
    auto full = torch::zeros({padded, K}, w.options());
    full.narrow(0, 0, N).copy_(w);
    return full.view({padded / kPanel, kPanel, K}).permute({0, 2, 1}).contiguous();
  }
  TORCH_CHECK(K % 32 == 0, "pack_linear_weight: bfloat16 needs in_features a multiple of 32, got ", K);
  const int64_t padded = (N + 31) / 32 * 32;
  auto full = torch::zeros({padded, K}, w.options());
  full.narrow(0, 0, N).copy_(w);
  return full.view({padded / 16, 16, K / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

torch::Tensor packed_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias,
                            int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.device().is_cpu() && x.scalar_type() == packed.scalar_type(),
              "packed_linear: x must be a contiguous [M, K] CPU tensor of the weight's dtype");
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  if (bias) TORCH_CHECK(bias->is_contiguous() && bias->numel() == N && bias->scalar_type() == x.scalar_type(),
                        "packed_linear: bias must be [out_features] in x's dtype");
#if defined(__AVX512F__)
  if (x.scalar_type() == at::kFloat) {
    TORCH_CHECK(packed.dim() == 3 && packed.size(1) == K && packed.size(2) == kPanel &&
                packed.size(0) * kPanel >= N, "packed_linear: the weight was packed for another shape");
    f32_linear(x.data_ptr<float>(), packed.data_ptr<float>(), bias ? bias->data_ptr<float>() : nullptr,
               y.data_ptr<float>(), M, K, N);
    return y;
  }
#endif
  if (x.scalar_type() == at::kBFloat16 && bf16_kernel() != Bf16Kernel::kNone) {
    TORCH_CHECK(packed.dim() == 4 && packed.size(1) == K / 2 && K % 32 == 0 && packed.size(0) * 16 >= N,
                "packed_linear: the weight was packed for another shape");
    const auto* xp = x.data_ptr<at::BFloat16>();
    const auto* wp = packed.data_ptr<at::BFloat16>();
    const auto* bp = bias ? bias->data_ptr<at::BFloat16>() : nullptr;
    auto* yp = y.data_ptr<at::BFloat16>();
#if defined(VLITE_HAVE_AMX)
    if (bf16_kernel() == Bf16Kernel::kAmx) {
      bf16_linear(xp, wp, bp, yp, M, K, N);
      return y;
    }
#endif
#if defined(VLITE_HAVE_AVX512_BF16)
    dpbf16_linear(xp, wp, bp, yp, M, K, N);
#endif
    return y;
  }
  TORCH_CHECK(false, "packed_linear: no packed GEMM for ", x.scalar_type(), " on this CPU");
  return y;
}
