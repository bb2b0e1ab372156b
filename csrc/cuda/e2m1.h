// Software FP4 E2M1 encoding for SM80/SM90 kernels, also compiled on the host by the exhaustive test
// (tests/test_e2m1_exhaustive.py), so it includes no CUDA header.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "layout.h"
#include "quant.h"  // float_bits

namespace vllm_nvfp4 {

// The E2M1 magnitude code of |v| (nearest, ties to the even code, saturating at 6: docs/FORMATS.md §1) in the low
// 3 bits of the result; bit 3 is clear and the bits above are 0x4B000000's. A NaN gets code 7 on the GPU.
// E2M1 steps by 0.5 below 2, by 1 in [2, 4) and by 2 from 4 on, so the code is 2a below 2, a + 2 in [2, 4)
// and a / 2 + 4 from 4, each rounded to an integer, ties to even; each of the three is >= the code outside
// its own range, so the code is their minimum. Adding 2^23 (where float32's ulp is 1) makes the float add
// itself round, ties to even (the even offsets 2 and 4 keep the parity), and keeps the three comparable: as
// positive floats (or NaNs), their bits sort as unsigned integers. Only the last needs |v| clamped to 6: past
// 6 the first two exceed 2^23 + 7. On the GPU: one FMNMX, three FP32 ops and one three-way integer min.
NVFP4_HD inline uint32_t e2m1_magnitude_bits(float v) {
  const float a = fabsf(v);
#if defined(__CUDA_ARCH__)
  const float fine = __fmaf_rn(a, 2.0f, 8388608.0f);  // 2a and a/2 are exact: one rounding, as on the host
  const float coarse = __fmaf_rn(fminf(a, 6.0f), 0.5f, 8388612.0f);
  return __vimin3_u32(float_bits(fine), float_bits(a + 8388610.0f), float_bits(coarse));
#else
  const float fine = 2.0f * a + 8388608.0f, coarse = 0.5f * fminf(a, 6.0f) + 8388612.0f;
  const uint32_t finer = std::min(float_bits(fine), float_bits(a + 8388610.0f));
  return std::min(finer, float_bits(coarse));
#endif
}

// E2M1 code of `v` with its sign in bit 3. Bit-identical to quant.h's comparison ladder e2m1_encode for every
// non-NaN float (the exhaustive test checks all of them).
NVFP4_HD inline uint32_t e2m1_code(float v) {
  return (e2m1_magnitude_bits(v) & 7u) | ((float_bits(v) >> 28) & 8u);
}

}  // namespace vllm_nvfp4
