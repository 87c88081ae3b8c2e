// The row norm of ops_ext/rms_norm.cc as a C++ function, for ops that normalise inside a larger kernel.
#pragma once
#include <cstdint>

namespace mtp {

// y[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w for `rows` rows of h floats (y may not alias x).
void RmsNormRows(const float* x, const float* w, float* y, int64_t rows, int64_t h, float eps);

}  // namespace mtp
