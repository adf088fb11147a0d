// Read bandwidth of one thread over 600 MB in 12 KB runs (one 16-token block of SmolLM2's K in
// float32: 16 slots x 3 KV heads x 64), in the orders the decode attention kernel could use
// (docs/kernels.md, the software prefetch;
// docs/benchmarks.md, "Runs of 2026-12-02 07:21-10:20, on an AMD Zen 4" and "Runs of 2026-12-02 12:36-15:30, on an AMD Zen 5").
//   gcc -O2 -march=native benchmarks/kernels/experiments/scattered_read.c -o /tmp/scattered_read && /tmp/scattered_read
// Run two at once to see both cores.
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

enum { kRunFloats = 12288 / 4, kRuns = 50000, kSlotFloats = 192, kHeadFloats = 64 };

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

// order: 0 the run's floats in address order, 1 one head's rows of the 16 slots at a time.
// prefetch: 0 none, 1 the next run's 192 lines in one burst first, 2 spread over this run's loads.
static __m512 read_run(const float* p, const char* next, int order, int prefetch, __m512 acc) {
  if (prefetch == 1)
    for (int l = 0; l < 192; ++l) _mm_prefetch(next + 64 * l, _MM_HINT_T1);
  int line = 0;
  for (int h = 0; h < (order ? 3 : 1); ++h)
    for (int s = 0; s < 16; ++s)
      for (int j = 0; j < (order ? kHeadFloats : kSlotFloats); j += 16) {
        const float* at = order ? p + s * kSlotFloats + h * kHeadFloats + j : p + s * kSlotFloats + j;
        if (prefetch == 2) _mm_prefetch(next + 64 * (line++ % 192), _MM_HINT_T1);
        acc = _mm512_add_ps(acc, _mm512_load_ps(at));
      }
  return acc;
}

int main(void) {
  float* x = aligned_alloc(64, (size_t)kRuns * kRunFloats * 4);
  for (long i = 0; i < (long)kRuns * kRunFloats; ++i) x[i] = 1.f;
  int* perm = malloc(kRuns * sizeof(int));
  for (int i = 0; i < kRuns; ++i) perm[i] = i;
  srand(1);
  for (int i = kRuns - 1; i > 0; --i) {
    int j = rand() % (i + 1), t = perm[i];
    perm[i] = perm[j];
    perm[j] = t;
  }
  const struct { int scattered, order, prefetch; const char* name; } cases[] = {
      {0, 0, 0, "runs in address order, contiguous"},
      {0, 1, 0, "runs in address order, one head at a time"},
      {1, 0, 0, "scattered runs, contiguous"},
      {1, 1, 0, "scattered runs, one head at a time"},
      {1, 1, 1, "scattered runs, one head at a time, next run prefetched in a burst"},
      {1, 0, 2, "scattered runs, contiguous, next run prefetched spread"},
      {1, 1, 2, "scattered runs, one head at a time, next run prefetched spread"},
  };
  for (unsigned c = 0; c < sizeof(cases) / sizeof(cases[0]); ++c) {
    double best = 1e9;
    __m512 acc = _mm512_setzero_ps();
    for (int rep = 0; rep < 3; ++rep) {
      const double t0 = now();
      for (int b = 0; b < kRuns; ++b) {
        const int run = cases[c].scattered ? perm[b] : b, after = cases[c].scattered ? perm[(b + 1) % kRuns] : (b + 1) % kRuns;
        acc = read_run(x + (long)run * kRunFloats, (const char*)(x + (long)after * kRunFloats), cases[c].order,
                       cases[c].prefetch, acc);
      }
      const double t = now() - t0;
      if (t < best) best = t;
    }
    printf("%-70s %5.1f GB/s (checksum %g)\n", cases[c].name, (double)kRuns * kRunFloats * 4 / best / 1e9, acc[0]);
  }
  return 0;
}
