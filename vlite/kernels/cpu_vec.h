// 16-lane float32 vectors for vlite's CPU kernels (GCC vector extensions: the compiler emits
// AVX-512, or pairs of AVX2 registers, for the machine it builds on with -march=native), with
// loads and stores of float32 and bfloat16 and the roundings torch applies between ops.
#pragma once

#include <torch/extension.h>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <immintrin.h>

namespace vlite_cpu {

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16u16 __attribute__((vector_size(32)));

inline v16 splat(float x) { return v16{} + x; }

inline v16 load16(const float* p) { v16 v; std::memcpy(&v, p, sizeof(v)); return v; }
inline void store16(float* p, v16 v) { std::memcpy(p, &v, sizeof(v)); }

// bfloat16 -> float32 is exact: the 16 bits become the high half of the float.
inline v16 load16(const at::BFloat16* p) {
#if defined(__AVX512F__)
  // one zero-extending load and one shift (the generic form below compiles to extracts of
  // 128-bit halves on GCC)
  const __m512i w = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
  return (v16)_mm512_castsi512_ps(w);
#else
  v16u16 h;
  std::memcpy(&h, p, sizeof(h));
  v16u w = __builtin_convertvector(h, v16u) << 16;
  v16 v;
  std::memcpy(&v, &w, sizeof(v));
  return v;
#endif
}

// float32 -> bfloat16 bits, rounded to nearest even with NaN kept quiet: c10::BFloat16's
// round_to_nearest_even, 16 lanes at once.
inline v16u bf16_bits(v16 v) {
  v16u u;
  std::memcpy(&u, &v, sizeof(u));
  v16u rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  v16u nan = (v16u)(v != v);  // all ones where NaN
  return (rounded & ~nan) | (0x7FC0u & nan);
}

inline void store16(at::BFloat16* p, v16 v) {
  v16u16 h = __builtin_convertvector(bf16_bits(v), v16u16);
  std::memcpy(p, &h, sizeof(h));
}

// What storing into T and loading back gives: identity for float32, the rounding of a bfloat16
// tensor op for bfloat16 (torch computes bf16 ops in float32 and rounds each result).
template <typename T> inline v16 round_to(v16 v);
template <> inline v16 round_to<float>(v16 v) { return v; }
template <> inline v16 round_to<at::BFloat16>(v16 v) {
  v16u w = bf16_bits(v) << 16;
  v16 r;
  std::memcpy(&r, &w, sizeof(r));
  return r;
}

inline float hsum(v16 v) {
  float s = 0.f;
  for (int l = 0; l < 16; ++l) s += v[l];
  return s;
}

// The 16 horizontal sums of a[0..15] as one vector (lane i = sum of a[i]'s lanes): a transpose
// and add in 4 halving steps, 30 shuffles and 15 adds for 16 sums instead of 15 dependent scalar
// adds each. Each step pairs vectors whose rows hold P partial sums in blocks of P lanes and
// leaves P/2 per row, x's rows before y's.
inline v16 hsum16x16(const v16* a) {
  v16 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)  // P = 16 -> 8
    b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)  // P = 8 -> 4
    c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(b[2 * i], b[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)  // P = 4 -> 2
    d[i] = __builtin_shufflevector(c[2 * i], c[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(c[2 * i], c[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(d[0], d[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +  // 2 -> 1
         __builtin_shufflevector(d[0], d[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

// Cephes' expf core: exp(r) for r = x - n ln2 (|r| <= ln2 / 2), a degree-6 polynomial, about 1 ulp.
inline v16 exp_reduced(v16 x, v16 n) {
  v16 r = x - n * 0.693359375f + n * 2.12194440e-4f;
  v16 p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  return p;
}

// exp(x) for x <= 0 (scores after the max is subtracted): 2^n * exp_reduced; 16 lanes.
inline v16 exp16_nonpositive(v16 x) {
  x = x < splat(-87.0f) ? splat(-87.0f) : x;
  v16 t = x * 1.44269504088896341f;
  v16i ni = __builtin_convertvector(t - 0.5f, v16i);  // x <= 0: truncation rounds toward 0
  v16 n = __builtin_convertvector(ni, v16);
  v16 p = exp_reduced(x, n);
  v16i bits;
  std::memcpy(&bits, &p, 64);
  bits += ni << 23;
  std::memcpy(&p, &bits, 64);
  return p;
}

// exp(x) for any x: Cephes' expf on [-87, 88.72], +inf above where float32's exp overflows (as
// torch's), the value at -87 below. With AVX-512 the 2^n scaling is one VSCALEFPS (exact, and
// +inf past float32's range) and n one VRNDSCALEPS: 13 vector ops instead of about 30, which is
// most of SiLU's time (the two 512-bit ports bound it). The same polynomial and accuracy; n is
// rounded to nearest even instead of floor(t + 0.5), so about 0.2% of values differ by 1 ulp.
inline v16 exp16(v16 x) {
#if defined(__AVX512F__)
  // max/min with the constant first: a NaN x comes back as x
  __m512 c = _mm512_min_ps(_mm512_set1_ps(89.0f), _mm512_max_ps(_mm512_set1_ps(-87.0f), (__m512)x));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(c, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return (v16)_mm512_scalef_ps((__m512)exp_reduced((v16)c, (v16)n), n);
#else
  const v16 overflow = (v16)((v16i)(x > splat(88.7228394f)) & (v16i)splat(INFINITY));
  x = x < splat(-87.0f) ? splat(-87.0f) : x;
  x = x > splat(88.3762626647949f) ? splat(88.3762626647949f) : x;
  v16 t = x * 1.44269504088896341f + 0.5f;
  v16i ni = __builtin_convertvector(t, v16i);  // truncation toward 0
  ni -= (v16i)(__builtin_convertvector(ni, v16) > t) & 1;  // -> floor(t): round to nearest
  v16 n = __builtin_convertvector(ni, v16);
  v16 p = exp_reduced(x, n);
  // 2^n in two factors: n can reach 128, one past the largest float exponent
  v16i half = ni >> 1;
  v16i e1 = (half + 127) << 23, e2 = (ni - half + 127) << 23;
  v16 s1, s2;
  std::memcpy(&s1, &e1, 64);
  std::memcpy(&s2, &e2, 64);
  p = p * s1 * s2;
  return overflow == splat(INFINITY) ? overflow : p;
#endif
}

}  // namespace vlite_cpu
