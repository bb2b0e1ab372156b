// Software FP4 E2M1 / FP8 E4M3 conversions, bit-identical to vllm_nvfp4_plugin/reference.py.
//
// Host and device code share them (SM80/SM90 and the CPU have no e2m1 conversion instruction).
// All arithmetic is float32 in the reference's order; build without -ffast-math and with
// -ffp-contract=off so no multiply is fused or reordered.
#pragma once

#include <cstdint>
#include <cstring>
#include <cmath>

#include "layout.h"

namespace vllm_nvfp4 {

constexpr float E4M3_MAX = 448.0f;

NVFP4_HD inline uint32_t float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
#endif
}

NVFP4_HD inline float float_from_bits(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
#endif
}

// float32 -> E4M3 byte: round to nearest even, saturating at ±448 (the reference clamps first),
// NaN -> 0x7F with the sign, subnormals (below 2^-6) in steps of 2^-9.
NVFP4_HD inline uint8_t e4m3_encode(float x) {
  const uint32_t bits = float_bits(x);
  const uint8_t sign = (bits >> 24) & 0x80;
  const uint32_t mag = bits & 0x7FFFFFFFu;
  if (mag > 0x7F800000u) return sign | 0x7F;        // NaN
  if (mag >= 0x43E00000u) return sign | 0x7E;       // >= 448 (inf included): saturate
  if (mag < 0x3C800000u) {                          // below 2^-6: subnormal, code = round(|x| * 2^9)
    const float scaled = float_from_bits(mag) * 512.0f;  // exact: a power-of-two scaling
#if defined(__CUDA_ARCH__)
    return sign | static_cast<uint8_t>(rintf(scaled));
#else
    return sign | static_cast<uint8_t>(std::nearbyint(scaled));  // default rounding mode: to even
#endif
  }
  // Normal: keep 3 mantissa bits, rounding the 20 dropped ones to nearest even, then rebias 127 -> 7.
  const uint32_t rounded = mag + 0x7FFFFu + ((mag >> 20) & 1u);
  return sign | static_cast<uint8_t>((rounded >> 20) - ((127u - 7u) << 3));
}

NVFP4_HD inline float e4m3_decode(uint8_t code) {
  const uint32_t sign = static_cast<uint32_t>(code & 0x80) << 24;
  const uint32_t exp = (code >> 3) & 0xF, man = code & 7;
  if (exp == 0xF && man == 7) return float_from_bits(sign | 0x7FC00000u);  // NaN
  if (exp == 0) return float_from_bits(sign | float_bits(static_cast<float>(man) * 0.001953125f));
  return float_from_bits(sign | ((exp + 120u) << 23) | (man << 20));
}

// E2M1 code of a float32: nearest, ties to the even code, saturating at ±6; bit 3 is the float's sign
// bit (so -0 gets it too). `>` on a tie keeps the lower (even) code, `>=` moves up to the even one.
NVFP4_HD inline uint8_t e2m1_encode(float v) {
  const float a = std::fabs(v);
  const uint8_t code = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) +
                       (a >= 3.5f) + (a > 5.0f);
  return code | static_cast<uint8_t>((float_bits(v) >> 31) << 3);
}

NVFP4_HD inline float e2m1_decode(uint8_t code) {
  const float magnitudes[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  const float mag = magnitudes[code & 7];
  return (code & 8) ? -mag : mag;
}

}  // namespace vllm_nvfp4
