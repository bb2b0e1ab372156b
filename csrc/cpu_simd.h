// 16-lane forms of quant.h's E2M1 conversions and of the dtype conversions, for the CPU kernels.
//
// One NVFP4 group is 16 values, so a group is one vector. Written with GCC/Clang vector extensions, the
// same source compiles to AVX-512, AVX2 or SSE2 in each target clone of the kernels. The operations and
// their order are quant.h's (float32, no fused multiply-add), so results are bit-identical; the
// bit-exact op tests against reference.py cover these functions.
#pragma once

#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace vllm_nvfp4::simd {

// Always inlined: each kernel clone must compile these for its own vector width. An out-of-line copy
// would pass 64-byte vectors under the baseline ABI and the AVX-512 clone would misread them.
#define SIMD_INLINE inline __attribute__((always_inline))

typedef float f32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef int16_t i16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef float f32x8 __attribute__((vector_size(32)));  // the AVX2 attention's halves of a 16-lane vector
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef uint64_t u64x8 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint8_t u8x8 __attribute__((vector_size(8)));
typedef uint8_t u8x16 __attribute__((vector_size(16)));

SIMD_INLINE f32x16 as_f32(u32x16 u) { return __builtin_bit_cast(f32x16, u); }
SIMD_INLINE u32x16 as_u32(f32x16 f) { return __builtin_bit_cast(u32x16, f); }
SIMD_INLINE f32x8 as_f32(u32x8 u) { return __builtin_bit_cast(f32x8, u); }
SIMD_INLINE u32x8 as_u32(f32x8 f) { return __builtin_bit_cast(u32x8, f); }

template <typename V>
SIMD_INLINE V max(V a, V b) { return a > b ? a : b; }
template <typename V>
SIMD_INLINE V min(V a, V b) { return a < b ? a : b; }

// All-ones lanes where a > b, zero elsewhere (a - b must not overflow: callers compare non-negative values).
// Built from max/min, not a comparison: GCC 12 turns comparisons of 64-byte vectors into scalar code when
// only AVX2 is enabled, while max/min it vectorizes.
SIMD_INLINE u32x16 greater_mask(i32x16 a, i32x16 b) {
  return __builtin_bit_cast(u32x16, -min(max(a - b, i32x16{}), i32x16{} + 1));
}
SIMD_INLINE i32x16 as_i32(u32x16 u) { return __builtin_bit_cast(i32x16, u); }
SIMD_INLINE i32x8 as_i32(u32x8 u) { return __builtin_bit_cast(i32x8, u); }
template <typename U>
SIMD_INLINE U select(U mask, U yes, U no) {
  return (yes & mask) | (no & ~mask);
}
// `yes` in lanes where a > b, `no` elsewhere (callers compare non-negative values). `native`: a vector
// comparison, for AVX-512 and for 8-lane vectors on AVX2, where it is one instruction and a blend.
template <bool native, typename I, typename U>
SIMD_INLINE U where_greater(I a, I b, U yes, U no) {
  if constexpr (native)
    return a > b ? yes : no;
  else
    return select(greater_mask(a, b), yes, no);
}

// --- dtype <-> float32 (exact widening; rounding narrowing like torch's .to()) -------------------
SIMD_INLINE f32x16 load16(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
SIMD_INLINE f32x16 load16(const c10::BFloat16* p) {
  u16x16 raw;
  std::memcpy(&raw, p, sizeof raw);
  return as_f32(__builtin_convertvector(raw, u32x16) << 16);
}
// float16 -> float32 as c10's conversion (and F16C's) does, bit for bit on all 65536 inputs, in vector operations:
// normal values move their exponent and mantissa up, subnormals are their integer mantissa times 2^-24 (exact),
// inf and NaN take the top exponent (a NaN quieted, its payload kept).
SIMD_INLINE f32x16 load16(const c10::Half* p) {
  u16x16 raw;
  std::memcpy(&raw, p, sizeof raw);
  const u32x16 h = __builtin_convertvector(raw, u32x16);
  const u32x16 magnitude = h & 0x7FFFu;
  const u32x16 normal = (magnitude << 13) + ((127u - 15u) << 23);
  const u32x16 subnormal = as_u32(__builtin_convertvector(magnitude, f32x16) * 5.9604644775390625e-8f);
  u32x16 bits = select(greater_mask(i32x16{} + 0x400, as_i32(magnitude)), subnormal, normal);
  bits = select(greater_mask(as_i32(magnitude), i32x16{} + 0x7BFF), (magnitude << 13) | 0x7F800000u, bits);
  bits |= greater_mask(as_i32(magnitude), i32x16{} + 0x7C00) & 0x400000u;
  return as_f32(((h & 0x8000u) << 16) | bits);
}

SIMD_INLINE void store16(f32x16 v, float* p) { std::memcpy(p, &v, sizeof v); }
// Round to nearest even like c10::BFloat16(float); NaN -> 0x7FC0.
SIMD_INLINE u32x16 bf16_bits_of_numbers(f32x16 v) {  // right for every lane that is not NaN
  const u32x16 u = as_u32(v);
  return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
}
SIMD_INLINE void store16(f32x16 v, c10::BFloat16* p) {
  const u32x16 nan = greater_mask(as_i32(as_u32(v) & 0x7FFFFFFFu), i32x16{} + 0x7F800000);
  const u16x16 out = __builtin_convertvector(select(nan, u32x16{} + 0x7FC0u, bf16_bits_of_numbers(v)), u16x16);
  std::memcpy(p, &out, sizeof out);
}
// store16 for lanes the caller knows hold no NaN.
SIMD_INLINE void store16_numbers(f32x16 v, c10::BFloat16* p) {
  const u16x16 out = __builtin_convertvector(bf16_bits_of_numbers(v), u16x16);
  std::memcpy(p, &out, sizeof out);
}
// c10::Half(float) in vector operations (its software form, fp16_ieee_from_fp32_value: round to nearest even,
// NaN -> 0x7E00 with the sign), bit for bit on all 2^32 inputs.
SIMD_INLINE void store16(f32x16 v, c10::Half* p) {
  const u32x16 w = as_u32(v);
  f32x16 base = (as_f32(w & 0x7FFFFFFFu) * 0x1.0p+112f) * 0x1.0p-110f;
  const u32x16 bias = max((w + w) & 0xFF000000u, u32x16{} + 0x71000000u);
  base = as_f32((bias >> 1) + 0x07800000u) + base;
  const u32x16 bits = as_u32(base);
  const u32x16 nonsign = ((bits >> 13) & 0x7C00u) + (bits & 0xFFFu);
  const u32x16 nan = greater_mask(as_i32(w & 0x7FFFFFFFu), i32x16{} + 0x7F800000);
  const u16x16 out = __builtin_convertvector(((w & 0x80000000u) >> 16) | select(nan, u32x16{} + 0x7E00u, nonsign), u16x16);
  std::memcpy(p, &out, sizeof out);
}
template <typename T>  // float and half: no NaN fix-up to skip
SIMD_INLINE void store16_numbers(f32x16 v, T* p) { store16(v, p); }

// --- group helpers --------------------------------------------------------------------------------

// Pairwise maxima across lanes; every lane ends up holding the maximum. Signed lanes (the values are
// non-negative) because AVX2 has no unsigned 32-bit compare.
SIMD_INLINE i32x16 reduce_max(i32x16 m) {
  m = max(m, __builtin_shufflevector(m, m, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
  m = max(m, __builtin_shufflevector(m, m, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
  m = max(m, __builtin_shufflevector(m, m, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
  return max(m, __builtin_shufflevector(m, m, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
}
SIMD_INLINE i16x16 reduce_max(i16x16 m) {
  m = max(m, __builtin_shufflevector(m, m, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
  m = max(m, __builtin_shufflevector(m, m, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
  m = max(m, __builtin_shufflevector(m, m, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
  return max(m, __builtin_shufflevector(m, m, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
}

// Float32 bit pattern of max |x| over 16 values, or over n (the indexer's quantization blocks): |x| compares
// like its bits (NaN above inf, as torch's amax keeps NaN). 16-bit inputs are compared in their own format and
// only the maximum is widened.
SIMD_INLINE uint32_t amax_bits(const float* p, int64_t n = 16) {
  i32x16 m = {};
  int64_t e = 0;
  for (; e + 16 <= n; e += 16) m = max(m, __builtin_bit_cast(i32x16, as_u32(load16(p + e)) & 0x7FFFFFFFu));
  uint32_t best = reduce_max(m)[0];
  for (; e < n; ++e) best = std::max(best, __builtin_bit_cast(uint32_t, p[e]) & 0x7FFFFFFFu);
  return best;
}
SIMD_INLINE uint16_t max_abs_bits16(const void* p, int64_t n) {
  const uint16_t* bits = static_cast<const uint16_t*>(p);
  i16x16 m = {};
  int64_t e = 0;
  for (; e + 16 <= n; e += 16) {
    i16x16 raw;
    std::memcpy(&raw, bits + e, sizeof raw);
    m = max(m, raw & 0x7FFF);
  }
  uint16_t best = reduce_max(m)[0];
  for (; e < n; ++e) best = std::max<uint16_t>(best, bits[e] & 0x7FFF);
  return best;
}
SIMD_INLINE uint32_t amax_bits(const c10::BFloat16* p, int64_t n = 16) {
  return static_cast<uint32_t>(max_abs_bits16(p, n)) << 16;
}
SIMD_INLINE uint32_t amax_bits(const c10::Half* p, int64_t n = 16) {
  return __builtin_bit_cast(uint32_t, static_cast<float>(c10::Half(max_abs_bits16(p, n), c10::Half::from_bits())));
}

// The 16 E2M1 values by code (bit 3 is the sign, so code 8 is -0).
constexpr f32x16 E2M1_VALUES = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

// The 16 codes of 8 packed bytes (low nibble = even element), as 16- or 32-bit lane indices.
SIMD_INLINE u16x16 unpack_codes16(const uint8_t* bytes) {
  u8x8 raw;
  std::memcpy(&raw, bytes, sizeof raw);
  const u16x8 wide = __builtin_convertvector(raw, u16x8);
  return __builtin_shufflevector(wide & 0xF, wide >> 4, 0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
}

// Dequantizes one group: the 16 possible outputs (e2m1 · SF) · global, cast to the output dtype, form a
// table that the codes index, so the arithmetic is done once per code value instead of per element.
SIMD_INLINE void dequantize_group(const uint8_t* bytes, float sf, float global, float* out) {
  const f32x16 table = E2M1_VALUES * sf * global;
  const u16x16 codes = unpack_codes16(bytes);
  const f32x16 values = __builtin_shuffle(table, __builtin_convertvector(codes, u32x16));
  std::memcpy(out, &values, sizeof values);
}
template <typename T>
SIMD_INLINE void dequantize_group(const uint8_t* bytes, float sf, float global, T* out) {
  alignas(64) T table[16];
  // E2M1 values are finite, so the products hold no NaN when the scales are finite (inf rounds as a number).
  if (__builtin_isfinite(sf) && __builtin_isfinite(global))
    store16_numbers(E2M1_VALUES * sf * global, table);
  else
    store16(E2M1_VALUES * sf * global, table);
  u16x16 table_bits;
  std::memcpy(&table_bits, table, sizeof table_bits);
  const u16x16 values = __builtin_shuffle(table_bits, unpack_codes16(bytes));
  std::memcpy(out, &values, sizeof values);
}

// quant.h's e2m1_encode per lane: nearest, ties to the even code, saturating at ±6, sign bit kept.
SIMD_INLINE u32x16 e2m1_encode(f32x16 v) {
  const u32x16 bits = as_u32(v);
  const f32x16 a = as_f32(bits & 0x7FFFFFFFu);
  // A true vector comparison is -1, so subtracting each adds one code step.
  const auto steps = -(a > 0.25f) - (a >= 0.75f) - (a > 1.25f) - (a >= 1.75f) - (a > 2.5f) - (a >= 3.5f) - (a > 5.0f);
  return __builtin_bit_cast(u32x16, steps) | ((bits >> 31) << 3);
}

// 16 codes -> 8 bytes, low nibble = even element: seen as 64-bit lanes, each (even, odd) pair is
// `even | odd << 32`, and one shift brings the odd code next to the even one in the low byte.
SIMD_INLINE void pack_e2m1(u32x16 codes, uint8_t* out) {
  const u64x8 pairs = __builtin_bit_cast(u64x8, codes);
  const u8x8 packed = __builtin_convertvector(pairs | (pairs >> 28), u8x8);
  std::memcpy(out, &packed, sizeof packed);
}

// quant.h's e4m3_encode per lane (lanes hold the code in their low byte).
template <bool native>
SIMD_INLINE u32x16 e4m3_encode(f32x16 x) {
  const u32x16 bits = as_u32(x);
  const u32x16 sign = (bits >> 24) & 0x80u;
  const u32x16 mag = bits & 0x7FFFFFFFu;
  // quant.h's normal code grows with mag, so a minimum saturates from 448 (code 0x7E) up, inf included; below
  // 2^-6, where it wraps around, the subnormal code replaces it.
  const u32x16 normal = min(((mag + 0x7FFFFu + ((mag >> 20) & 1u)) >> 20) - ((127u - 7u) << 3), u32x16{} + 0x7Eu);
  const u32x16 subnormal = as_u32(as_f32(mag) + 16384.0f) - 0x46800000u;  // bits of 2^14
  const u32x16 code = where_greater<native>(i32x16{} + 0x3C800000, as_i32(mag), subnormal, normal);  // below 2^-6
  return sign | where_greater<native>(as_i32(mag), i32x16{} + 0x7F800000, u32x16{} + 0x7Fu, code);  // NaN
}

// quant.h's e4m3_decode per lane, of 16 or 8 lanes.
template <bool native, typename U>
SIMD_INLINE auto e4m3_decode(U code) {
  using I = decltype(as_i32(code));
  using F = decltype(as_f32(code));
  const U sign = (code & 0x80u) << 24;
  const U exp = (code >> 3) & 0xFu, man = code & 7u;
  const U normal = ((exp + 120u) << 23) | (man << 20);
  const U subnormal = as_u32(__builtin_convertvector(man, F) * 0.001953125f);
  const U mag = where_greater<native>(I{} + 1, as_i32(exp), subnormal, normal);  // exponent 0
  return as_f32(sign | where_greater<native>(as_i32(code & 0x7Fu), I{} + 0x7E, U{} + 0x7FC00000u, mag));
}

#undef SIMD_INLINE

}  // namespace vllm_nvfp4::simd
