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
// NaN -> 0x7F with the sign, subnormals (below 2^-6) in steps of 2^-9. Branch-free, so it vectorizes.
NVFP4_HD inline uint8_t e4m3_encode(float x) {
  const uint32_t bits = float_bits(x);
  const uint32_t sign = (bits >> 24) & 0x80u;
  const uint32_t mag = bits & 0x7FFFFFFFu;
  // Normal: keep 3 mantissa bits, rounding the 20 dropped ones to nearest even, then rebias 127 -> 7.
  const uint32_t normal = ((mag + 0x7FFFFu + ((mag >> 20) & 1u)) >> 20) - ((127u - 7u) << 3);
  // Subnormal: adding 2^14 rounds |x| to a multiple of 2^-9 (the float ulp at 2^14), to nearest even;
  // the low bits of the sum are the code (code 8 when it rounds up to the smallest normal, 2^-6).
  const uint32_t subnormal = float_bits(float_from_bits(mag) + 16384.0f) - float_bits(16384.0f);
  uint32_t code = mag < 0x3C800000u ? subnormal : normal;  // 0x3C800000 = 2^-6
  code = mag >= 0x43E00000u ? 0x7Eu : code;                 // >= 448 (inf included): saturate
  code = mag > 0x7F800000u ? 0x7Fu : code;                  // NaN
  return static_cast<uint8_t>(sign | code);
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

// Codes 2..7 are the floats 2^((c>>1) - 1) · (1 + (c&1)/2), code 1 is 0.5: built from bits, no table.
NVFP4_HD inline float e2m1_decode(uint8_t code) {
  const uint32_t m = code & 7u;
  const uint32_t normal = ((126u + (m >> 1)) << 23) | ((m & 1u) << 22);
  const uint32_t mag = m >= 2 ? normal : (m == 1 ? 0x3F000000u : 0u);
  return float_from_bits(mag | (static_cast<uint32_t>(code & 8u) << 28));
}

// One NVFP4 group's candidate encoding with block scale SF = e4m3(amax · inv_divisor / global): writes the 16 E2M1
// codes and SF, returns the squared reconstruction error Σ ((e2m1 · SF) · global - x)², summed in element order.
NVFP4_HD inline float nvfp4_candidate(const float (&x)[16], float amax, float inv_divisor, float global,
                                      float inv_global, uint8_t (&codes)[16], uint8_t& sf) {
  sf = e4m3_encode(amax * inv_divisor * inv_global);
  const float sf_value = e4m3_decode(sf);
  const float out_scale = sf_value == 0.0f ? 0.0f : 1.0f / (sf_value * global);
  float err = 0.0f;
  for (int i = 0; i < 16; ++i) {
    codes[i] = e2m1_encode(x[i] * out_scale);
    const float d = e2m1_decode(codes[i]) * sf_value * global - x[i];
    err = err + d * d;
  }
  return err;
}

// vLLM's "nvfp4_4over6" for one group of 16: the block scale from max/6 (plain NVFP4) or from max/4, whichever
// reconstructs the group with the smaller squared error (max/6 on a tie or a NaN). Writes 8 packed code bytes
// (low nibble = even element) and returns the scale byte.
NVFP4_HD inline uint8_t nvfp4_4over6_group(const float (&x)[16], float global, float inv_global, uint8_t* packed) {
  float amax = 0.0f;
  for (int i = 0; i < 16; ++i) {
    const float a = std::fabs(x[i]);
    amax = (a > amax || a != a) ? a : amax;  // a NaN sticks, as torch's amax
  }
  uint8_t codes6[16], codes4[16], sf6, sf4;
  const float err6 = nvfp4_candidate(x, amax, 1.0f / 6.0f, global, inv_global, codes6, sf6);
  const float err4 = nvfp4_candidate(x, amax, 0.25f, global, inv_global, codes4, sf4);
  const bool four = err4 < err6;
  for (int i = 0; i < 8; ++i) {
    const uint8_t lo = four ? codes4[2 * i] : codes6[2 * i], hi = four ? codes4[2 * i + 1] : codes6[2 * i + 1];
    packed[i] = static_cast<uint8_t>(lo | (hi << 4));
  }
  return four ? sf4 : sf6;
}

}  // namespace vllm_nvfp4
