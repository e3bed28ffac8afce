// Vectorizable float32 math shared by the native kernels (jrlhf/native/*.cc).

#ifndef JRLHF_NATIVE_VECTOR_MATH_H_
#define JRLHF_NATIVE_VECTOR_MATH_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace jrlhf {

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
