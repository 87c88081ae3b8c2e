// The panel product of ops_ext/small_matmul.cc as a C++ function, for ops that multiply inside a larger
// kernel (ops_ext/decoder_layer.cc).
#pragma once
#include <cstdint>

namespace mtp {

constexpr int64_t kPanelColumns = 32;

// y[M, N] = x[M, K] @ W (+ bias[N]) with W packed as [N/32, K, 32] panels (mtpserve.model.small_matmul
// packs them): floats, or IEEE float16 bits (uint16_t) when `half`, widened exactly to float32 as they are
// read. Every row is summed in the same order whatever M is, so a row's result does not depend on the
// rows that share the call. bias may be nullptr.
void PanelMatmul(const float* x, int64_t m, int64_t k, const void* panels, bool half, int64_t n, const float* bias,
                 float* y);

}  // namespace mtp
