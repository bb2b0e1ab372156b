// Software FP4 E2M1 encoding for SM80/SM90 kernels, also compiled on the host by the exhaustive test
// (tests/test_e2m1_exhaustive.py), so it includes no CUDA header.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "layout.h"

namespace vllm_nvfp4 {

NVFP4_HD inline uint32_t bits_of(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
#endif
}

NVFP4_HD inline float float_of(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  std::memcpy(&x, &u, 4);
  return x;
#endif
}

// E2M1 code of `v` with its sign in bit 3: nearest, ties to the even code, saturating at ±6 (FORMATS.md §1).
// Bit-identical to quant.h's comparison ladder e2m1_encode for every non-NaN float (the exhaustive test
// checks all of them) in fewer instructions; a NaN gets code 7 instead of 0.
NVFP4_HD inline uint32_t e2m1_code(float v) {
  const uint32_t bits = bits_of(v);
  const float a = fminf(fabsf(v), 6.0f);  // every |v| above 5 has code 7
  // E2M1 steps by 0.5 below 2, by 1 in [2, 4) and by 2 in [4, 6]. Adding 2^22, 2^23 or 2^24 (whose float32
  // ulp is that step) makes float32 itself round `a` to a step, ties to even; the sum's low mantissa bits
  // then count the steps, and each octave above [0, 2) starts 2 codes higher.
  const uint32_t exponent = bits_of(a) & 0x7F800000u;
  const uint32_t octave = (exponent > 0x3F800000u ? exponent : 0x3F800000u) - 0x3F800000u;  // 0, 1 or 2 << 23
  const uint32_t magic = octave + 0x4A800000u;                                                // 2^(22 + octave)
  const uint32_t steps = bits_of(a + float_of(magic)) - magic;
  return (steps + (octave >> 22)) | ((bits >> 28) & 8u);
}

}  // namespace vllm_nvfp4
