// Software prefetch shared by vlite's CPU kernels.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace vlite_cpu {

// Spreads the prefetch (into L2) of the next stretch of a stream over the steps of work on the
// current one: the stretch's cache lines over `steps` calls of step(), in order, never past `end`.
// Used for the packed GEMM's weight stream and the decode attention's next chunk of K/V: the same
// requests made in one burst at the start of the work measured slower (docs/kernels.md).
struct StreamPrefetch {
  const char* next;
  const char* end;
  int64_t per_step, every, countdown;

  StreamPrefetch() : next(nullptr), end(nullptr), per_step(0), every(1), countdown(1) {}  // asks for nothing
  StreamPrefetch(const char* from, const char* stream_end, int64_t bytes, int64_t steps)
      : next(from), end(std::min(from + bytes, stream_end)) {
    const int64_t lines = (bytes + 63) / 64;
    steps = std::max<int64_t>(1, steps);
    per_step = std::max<int64_t>(1, (lines + steps - 1) / steps);
    every = std::max<int64_t>(1, steps / std::max<int64_t>(1, lines));
    countdown = every;
  }
  inline void step() {
    if (--countdown) return;
    countdown = every;
    for (int64_t i = 0; i < per_step && next < end; ++i, next += 64) _mm_prefetch(next, _MM_HINT_T1);
  }
  // What is left of the stretch, at once (the first stretch of a pass has no work before it).
  inline void drain() {
    for (; next < end; next += 64) _mm_prefetch(next, _MM_HINT_T1);
  }
};

}  // namespace vlite_cpu
