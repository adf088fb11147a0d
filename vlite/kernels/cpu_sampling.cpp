// Greedy sampling's argmax over a step's logits rows on CPU: torch's CPU argmax compares one
// value at a time (about 60 us per row of SmolLM2's 49,152 logits here, 4 ms for a 64-row
// decode step); this one compares 16 lanes at a time and gives torch's answer: the index of the
// first maximum, and of the first NaN when a row holds one (torch orders NaN above every number).
#include "cpu_ops.h"
#include "cpu_vec.h"

#include <ATen/Parallel.h>
#include <cmath>

using namespace vlite_cpu;

namespace {

int64_t first_nan(const float* row, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (std::isnan(row[i])) return i;
  return -1;
}

// row[0..n), n > 0: the index of the first maximum, or of the first NaN if there is one
int64_t first_max(const float* row, int64_t n) {
  int64_t j = 0, best_index = 0;
  float best = row[0];
  bool nan = false;
  if (n >= 16) {
    // each lane keeps its first maximum (strict >); the lanes' ties go to the smallest index
    v16 lane_max = load16(row);
    v16i lane_index = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, index = lane_index;
    v16i any_nan = (v16i)(lane_max != lane_max);
    for (j = 16; j + 16 <= n; j += 16) {
      index += 16;
      const v16 v = load16(row + j);
      const v16i greater = (v16i)(v > lane_max);
      lane_max = greater ? v : lane_max;
      lane_index = greater ? index : lane_index;
      any_nan |= (v16i)(v != v);
    }
    for (int l = 0; l < 16; ++l) nan |= any_nan[l] != 0;
    best = lane_max[0];
    best_index = lane_index[0];
    for (int l = 1; l < 16; ++l)
      if (lane_max[l] > best || (lane_max[l] == best && lane_index[l] < best_index)) {
        best = lane_max[l];
        best_index = lane_index[l];
      }
  }
  for (; j < n; ++j) {  // the tail past the last full vector (or a row under 16 values)
    nan |= std::isnan(row[j]);
    if (row[j] > best) {
      best = row[j];
      best_index = j;
    }
  }
  return nan ? first_nan(row, n) : best_index;
}

}  // namespace

torch::Tensor argmax_rows(torch::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.device().is_cpu() && logits.scalar_type() == at::kFloat &&
              logits.stride(1) == 1 && logits.size(1) > 0,
              "argmax_rows: logits [N, V] float32 on CPU, V > 0, rows contiguous");
  const int64_t rows = logits.size(0), n = logits.size(1), stride = logits.stride(0);
  auto out = torch::empty({rows}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  int64_t* idx = out.data_ptr<int64_t>();
  // a row is about 50 us of work on one thread: rows spread over threads once there are a few
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) idx[r] = first_max(x + r * stride, n);
  });
  return out;
}
