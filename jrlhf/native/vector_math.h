// Vectorizable float32 math shared by the native kernels (jrlhf/native/*.cc).

#ifndef JRLHF_NATIVE_VECTOR_MATH_H_
#define JRLHF_NATIVE_VECTOR_MATH_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace jrlhf {

// 16 floats, one AVX-512 register (the compiler splits it where registers are narrower).
typedef float Lanes __attribute__((vector_size(16 * sizeof(float))));

inline Lanes Load(const float* p) {
  Lanes v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void Store(float* p, Lanes v) { std::memcpy(p, &v, sizeof(v)); }

// Lanes of (a, b) picked by index into their concatenation (0-15: a's, 16-31: b's), indices
// known at compile time. GCC has had __builtin_shuffle since 4.7 (__builtin_shufflevector only
// since 12); clang has only __builtin_shufflevector.
typedef int32_t LaneIndex __attribute__((vector_size(16 * sizeof(int32_t))));
#if defined(__clang__)
#define JRLHF_SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define JRLHF_SHUFFLE(a, b, ...) __builtin_shuffle(a, b, (LaneIndex{__VA_ARGS__}))
#endif

// The lane sums of 16 vectors as one vector, in 15 steps that each add the halves of two
// vectors interleaved (two shuffles and an add) instead of a horizontal sum of each vector: the
// sum of x[kSumSlot[j]]'s lanes lands in lane j.
constexpr int kSumSlot[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};

inline Lanes SumEach16(const Lanes x[16]) {
  Lanes y[8], z[4], w[2];
  for (int m = 0; m < 8; ++m)  // lanes 0-7: partial sums of x[2m]; 8-15: of x[2m + 1]
    y[m] = JRLHF_SHUFFLE(x[2 * m], x[2 * m + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21,
                         22, 23) +
           JRLHF_SHUFFLE(x[2 * m], x[2 * m + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28,
                         29, 30, 31);
  for (int m = 0; m < 4; ++m)  // groups of 4 lanes: x[4m], x[4m + 2], x[4m + 1], x[4m + 3]
    z[m] = JRLHF_SHUFFLE(y[2 * m], y[2 * m + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25,
                         26, 27) +
           JRLHF_SHUFFLE(y[2 * m], y[2 * m + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29,
                         30, 31);
  for (int m = 0; m < 2; ++m)  // pairs of lanes: x[8m + {0, 4, 2, 6, 1, 5, 3, 7}]
    w[m] = JRLHF_SHUFFLE(z[2 * m], z[2 * m + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13,
                         28, 29) +
           JRLHF_SHUFFLE(z[2 * m], z[2 * m + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15,
                         30, 31);
  // lane 2i: x[{0, 4, 2, 6, 1, 5, 3, 7}[i]], lane 2i + 1: x[8 + that]
  return JRLHF_SHUFFLE(w[0], w[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
         JRLHF_SHUFFLE(w[0], w[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
}

// exp(x) for x <= 0 (scores less their maximum) in plain arithmetic, so that loops over it
// vectorize: x = k ln2 + r with |r| <= ln2 / 2, exp(r) by its degree-6 Taylor polynomial
// (relative error within 3e-7 there), times 2^k built in the exponent bits. Below -87 it returns
// 0 (float32's exp is below 1.7e-38 there), and a select keeps the loop vectorizable.
inline float ExpNonPositive(float x) {
  const float y = std::max(x, -87.0f);  // a NaN x stays NaN (std::max returns its first operand)
  const float k = std::nearbyint(y * 1.44269504088896341f);
  const float r = (y - k * 0.693145751953125f) - k * 1.428606765330187e-06f;
  float poly = 1.0f / 720.0f;
  poly = poly * r + 1.0f / 120.0f;
  poly = poly * r + 1.0f / 24.0f;
  poly = poly * r + 1.0f / 6.0f;
  poly = poly * r + 0.5f;
  poly = poly * r + 1.0f;
  poly = poly * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(k == k ? k : 0.0f) + 127) << 23;  // NaN: any scale
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < -87.0f ? 0.0f : poly * scale;
}

// The maximum and the sum of x[0, n), each in 16 independent partial results combined as a
// tree: a serial max or sum is a chain of dependent instructions (the compiler may not reorder
// float operations), which took most of a short attention row's time. MaxOf keeps a NaN only
// where std::max would (a NaN in x[0]); the kernels' scores are finite.
inline float MaxOf(const float* x, int64_t n) {
  float part[16];
  for (int j = 0; j < 16; ++j) part[j] = -INFINITY;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) part[j] = x[i + j] > part[j] ? x[i + j] : part[j];
  for (int j = 0; i < n; ++i, ++j) part[j] = x[i] > part[j] ? x[i] : part[j];
  for (int w = 8; w >= 1; w /= 2)
    for (int j = 0; j < w; ++j) part[j] = part[j + w] > part[j] ? part[j + w] : part[j];
  return part[0];
}

inline float SumOf(const float* x, int64_t n) {
  float part[16] = {0};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) part[j] += x[i + j];
  for (int j = 0; i < n; ++i, ++j) part[j] += x[i];
  for (int w = 8; w >= 1; w /= 2)
    for (int j = 0; j < w; ++j) part[j] += part[j + w];
  return part[0];
}

}  // namespace jrlhf

#endif  // JRLHF_NATIVE_VECTOR_MATH_H_
