// Scalar maths written so that loops of it vectorise, shared by the CPU kernels.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

// Functions holding such loops are compiled for AVX-512, AVX2 and plain x86-64, picked at load time.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MTP_VECTOR_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define MTP_VECTOR_CLONES
#endif

namespace mtp {

// exp(x) for x <= 0 in plain arithmetic, so a loop of it vectorises (std::exp is a libm call per
// element): Cephes' expf, x = n ln2 + r with |r| <= ln2/2, a degree-6 polynomial for e^r, times 2^n
// built in the exponent bits; relative error about 1e-7. Below -87 it returns ~1e-38 instead of less.
inline float ExpNonPositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// silu(g) = g * sigmoid(g), through ExpNonPositive of -|g| so that it vectorises and never overflows.
inline float Silu(float g) {
  const float e = ExpNonPositive(-std::fabs(g));
  return g * (g >= 0.0f ? 1.0f : e) / (1.0f + e);
}

}  // namespace mtp
