// The float32 packed GEMM's 8 x 48 micro-kernel loop alone, on one thread, in registers: what a
// core can do with it (docs/kernels.md, "Registers, not the memory system"). y[M, N] = x[M, K] W
// with W in vlite's float32 panels [N/48][K][48]; prints the best of 5 sweeps in GFLOP/s.
//   g++ -O3 -march=native benchmarks/kernels/experiments/f32_microkernel.cpp -o /tmp/f32_microkernel
//   taskset -c 0 /tmp/f32_microkernel [M K N]      (default 2048 576 3072: a prefill gate_up)
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

constexpr long kRows = 8, kPanel = 48;

inline void block(const float* A, long lda, const float* P, long K, float* C, long ldc) {
  __m512 c[kRows][3];
  for (auto& row : c) row[0] = row[1] = row[2] = _mm512_setzero_ps();
  for (long k = 0; k < K; ++k) {
    const __m512 b0 = _mm512_loadu_ps(P + k * kPanel), b1 = _mm512_loadu_ps(P + k * kPanel + 16),
                 b2 = _mm512_loadu_ps(P + k * kPanel + 32);
    for (long i = 0; i < kRows; ++i) {
      const __m512 a = _mm512_set1_ps(A[i * lda + k]);
      c[i][0] = _mm512_fmadd_ps(a, b0, c[i][0]);
      c[i][1] = _mm512_fmadd_ps(a, b1, c[i][1]);
      c[i][2] = _mm512_fmadd_ps(a, b2, c[i][2]);
    }
  }
  for (long i = 0; i < kRows; ++i)
    for (long j = 0; j < 3; ++j) _mm512_storeu_ps(C + i * ldc + 16 * j, c[i][j]);
}

int main(int argc, char** argv) {
  const long M = argc > 1 ? atol(argv[1]) / kRows * kRows : 2048, K = argc > 2 ? atol(argv[2]) : 576,
             N = argc > 3 ? atol(argv[3]) / kPanel * kPanel : 3072;
  std::vector<float> X(M * K), W(K * N), Y(M * N);
  for (auto& v : X) v = rand() / static_cast<float>(RAND_MAX);
  for (auto& v : W) v = rand() / static_cast<float>(RAND_MAX);
  double best = 1e30;
  for (int r = 0; r < 5; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    for (long p = 0; p < N / kPanel; ++p)
      for (long m0 = 0; m0 < M; m0 += kRows) block(X.data() + m0 * K, K, W.data() + p * K * kPanel, K, Y.data() + m0 * N + p * kPanel, N);
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::printf("float32 8 x 48 micro-kernel, M %ld K %ld N %ld, one thread: %.1f GFLOP/s (checksum %g)\n", M, K, N,
              2.0 * M * K * N / best / 1e9, static_cast<double>(Y[0] + Y[M * N - 1]));
  return 0;
}
