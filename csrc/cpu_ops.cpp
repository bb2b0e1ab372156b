// CPU kernels of the four ops: OpenMP over tokens, software E2M1/E4M3 (quant.h and its vector forms in
// cpu_simd.h), offsets from layout.h, argument checks from checks.h. On x86-64 the per-token row kernels
// exist as AVX-512, AVX2 and baseline variants; the best the CPU supports runs.
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/BFloat16.h>
#include "error.h"
#include <torch/headeronly/util/Half.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "checks.h"
#include "cpu_isa.h"
#include "layout.h"
#include "cpu_e2m1_avx512.h"
#include "cpu_simd.h"
#include "quant.h"

namespace vllm_nvfp4 {
namespace {

using torch::headeronly::ScalarType;

constexpr float ONE_SIXTH = 1.0f / 6.0f;  // float32, as the reference's f32(1) / f32(6)

// Below this many elements (or bytes, for the indexer gather) a call runs on one thread: waking the
// OpenMP team costs more than the work (a decode step stores one token per sequence).
constexpr int64_t PARALLEL_MIN_WORK = 1 << 15;
// Rows of a gather one OpenMP task copies (a run of rows in one block is one copy).
constexpr int64_t ROWS_PER_TASK = 256;

template <typename Fn>
void dispatch_float_types(ScalarType type, Fn&& fn) {
  switch (type) {
    case ScalarType::BFloat16: fn(c10::BFloat16{}); break;
    case ScalarType::Half: fn(c10::Half{}); break;
    case ScalarType::Float: fn(float{}); break;
    default: NVFP4_CHECK(false, "unsupported dtype ", type);  // the argument checks rule this out
  }
}

uint8_t* bytes_of(const Tensor& t) { return static_cast<uint8_t*>(t.mutable_data_ptr()); }

float global_scale(const Tensor& scale) { return *scale.const_data_ptr<float>(); }

#define NVFP4_INLINE inline __attribute__((always_inline))

constexpr int LANES = 16;  // NVFP4 groups (or scales) handled together by one vector

// Where an entry's scales sit: scale_offset(t, h, s, swizzled) == scale_offset(t - t % 4, h, 0, false)
// + delta[t % 4][s]. This holds because entry_index is linear in (token, head), and replaces the swizzle's
// per-scale divisions by one table built with layout.h's scale_offset itself.
std::vector<int64_t> scale_deltas(const NVFP4PageLayout& layout, bool swizzled) {
  std::vector<int64_t> delta(4 * layout.scale_dim());
  for (int64_t r = 0; r < 4; ++r)
    for (int64_t s = 0; s < layout.scale_dim(); ++s)
      delta[r * layout.scale_dim() + s] = layout.scale_offset(r, 0, s, swizzled) - layout.scale_offset(0, 0, 0, false);
  return delta;
}

// --- NVFP4 quantization of whole groups, per instruction set --------------------------------------------

// Groups quantized together: first all their block scales (independent vector computations that overlap),
// then all their codes.
constexpr int BATCH = 4 * LANES;

// Where the groups of a token sit, relative to the token (group g: head g / scale_dim, group g % scale_dim of its
// row). docs/FORMATS.md §1's offsets are affine in the token, so a call computes these once and a token only moves
// three base pointers. Scale offsets also depend on token % 4 (the swizzle): four rows of them.
struct GroupOffsets {
  std::vector<int64_t> src;    // elements, from the token's first value
  std::vector<int64_t> data;   // bytes, from data_offset(token, 0)
  std::vector<int64_t> scale;  // [4][groups] bytes, from scale_offset(token - token % 4, 0, 0, false)
  bool rows_of_eight = false;  // every 8 groups from a multiple of 8 have consecutive scale bytes (linear scales)
  bool even_rows = false;      // rows of an even number of groups: groups 2k and 2k + 1 are adjacent in and out

  GroupOffsets(const NVFP4PageLayout& layout, int64_t head_stride, bool swizzled) {
    const int64_t scale_dim = layout.scale_dim(), groups = layout.num_heads * scale_dim;
    const std::vector<int64_t> delta = scale_deltas(layout, swizzled);
    src.resize(groups);
    data.resize(groups);
    scale.resize(4 * groups);
    for (int64_t h = 0; h < layout.num_heads; ++h)
      for (int64_t s = 0; s < scale_dim; ++s) {
        const int64_t g = h * scale_dim + s;
        src[g] = h * head_stride + s * NVFP4_GROUP;
        data[g] = layout.data_offset(0, h) + s * NVFP4_GROUP / 2;
        for (int64_t r = 0; r < 4; ++r)
          scale[r * groups + g] =
              layout.scale_offset(0, h, 0, false) - layout.scale_offset(0, 0, 0, false) + delta[r * scale_dim + s];
      }
    even_rows = scale_dim % 2 == 0;
    rows_of_eight = scale_dim % 8 == 0;
    for (int64_t g = 0; g < 4 * groups; ++g) rows_of_eight &= scale[g] == scale[g - g % 8] + g % 8;
  }
};

// The groups of one token on one side of its block.
template <typename T>
struct TokenGroups {
  const T* x;
  uint8_t* data;   // side + data_offset(token, 0)
  uint8_t* scale;  // side + scale_offset(token - token % 4, 0, 0, false)
  const int64_t* src_offsets;
  const int64_t* data_offsets;
  const int64_t* scale_offsets;  // the token % 4 row
  bool scales_in_rows_of_eight;  // GroupOffsets::rows_of_eight
  bool even_rows;                // GroupOffsets::even_rows

  const T* values(int g) const { return x + src_offsets[g]; }
  uint8_t* codes(int g) const { return data + data_offsets[g]; }
};

// Writes the block scales (docs/FORMATS.md §1) of groups first..first+count-1 (count <= 16) from their max |x| (float32
// bits) and returns the float32 factors 1 / (SF · global) that bring each group onto the E2M1 grid (0 where SF is 0).
template <bool native, typename T>
NVFP4_INLINE simd::f32x16 write_block_scales(const TokenGroups<T>& t, int first, int count, simd::u32x16 amax,
                                             float global, float inv_global) {
  const simd::u32x16 sf = simd::e4m3_encode<native>(simd::as_f32(amax) * ONE_SIXTH * inv_global);
  const simd::f32x16 sf_value = simd::e4m3_decode<native>(sf);
  uint8_t sf_bytes[LANES];
  const simd::u8x16 narrowed = __builtin_convertvector(sf, simd::u8x16);
  std::memcpy(sf_bytes, &narrowed, sizeof sf_bytes);
  asm("" : : "m"(sf_bytes));  // keep the bytes in memory: byte loads beat one lane extraction each
  // Locals: a byte store may alias anything, so members would be reloaded after each one.
  uint8_t* const scale = t.scale;
  const int64_t* const offsets = t.scale_offsets + first;
  if (t.scales_in_rows_of_eight && count % 8 == 0)
    for (int i = 0; i < count; i += 8) std::memcpy(scale + offsets[i], sf_bytes + i, 8);
  else if (count == LANES)  // unrolled, no count checks
    for (int i = 0; i < LANES; ++i) scale[offsets[i]] = sf_bytes[i];
  else
    for (int i = 0; i < count; ++i) scale[offsets[i]] = sf_bytes[i];
  const simd::i32x16 sf_magnitude = simd::as_i32(simd::as_u32(sf_value) & 0x7FFFFFFFu);  // SF == 0: +0 or -0
  return simd::as_f32(simd::where_greater<native>(simd::i32x16{} + 1, sf_magnitude, simd::u32x16{},
                                                  simd::as_u32(1.0f / (sf_value * global))));
}

// Encodes groups first..first+count-1, each scaled by its out_scale in float32, into 8 packed bytes each:
// quant.h's e2m1_encode and nibble packing, one group a vector.
template <typename T>
NVFP4_INLINE void encode_groups_generic(const TokenGroups<T>& t, int first, int count, const float* out_scale) {
  for (int i = 0; i < count; ++i)
    simd::pack_e2m1(simd::e2m1_encode(simd::load16(t.values(first + i)) * out_scale[i]), t.codes(first + i));
}

// Quantizes a token's groups, a batch at a time: each group's max |x|, the block scales, then the codes by `encode`.
template <typename T, void (*encode)(const TokenGroups<T>&, int, int, const float*), bool native>
NVFP4_INLINE void quantize_token(const TokenGroups<T>& t, int groups, float global, float inv_global) {
  for (int batch = 0; batch < groups; batch += BATCH) {
    const int count = std::min(groups - batch, BATCH);
    alignas(64) float out_scale[BATCH];
    for (int first = 0; first < count; first += LANES) {
      const int n = std::min(count - first, LANES);
      simd::u32x16 amax = {};
      for (int i = 0; i < n; ++i) amax[i] = simd::amax_bits(t.values(batch + first + i));
      simd::store16(write_block_scales<native>(t, batch + first, n, amax, global, inv_global), out_scale + first);
    }
    encode(t, batch, count, out_scale);
  }
}

template <typename T>
void quantize_token_baseline(const TokenGroups<T>& t, int groups, float global, float inv_global) {
  quantize_token<T, encode_groups_generic<T>, false>(t, groups, global, inv_global);
}

#if NVFP4_X86
// AVX2: the code of a value is the number of thresholds it passes; as the comparisons' lane masks are nested
// (passing 1.75 implies passing 0.75), the code's bits are plain mask logic, and PDEP moves lane i's bits to
// nibble i of the 8 output bytes.
// m[k] has lane i set when |v_i| passes threshold k (> 0.25, >= 0.75, > 1.25, >= 1.75, > 2.5, >= 3.5, > 5).
__attribute__((target("bmi2"), always_inline)) inline uint64_t packed_codes(const uint32_t (&m)[7], uint32_t sign) {
  const uint32_t bit2 = m[3];
  const uint32_t bit1 = (m[1] & ~m[3]) | m[5];
  const uint32_t bit0 = (m[0] & ~m[1]) | (m[2] & ~m[3]) | (m[4] & ~m[5]) | m[6];
  return _pdep_u64(bit0, 0x1111111111111111ull) | _pdep_u64(bit1, 0x2222222222222222ull) |
         _pdep_u64(bit2, 0x4444444444444444ull) | _pdep_u64(sign, 0x8888888888888888ull);
}

// The lane mask of `a op t` over 16 lanes held in two 8-lane halves.
#define NVFP4_MASK16(lo, hi, t, op) \
  static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(lo, t, op)) | (_mm256_movemask_ps(_mm256_cmp_ps(hi, t, op)) << 8))

template <typename T>
NVFP4_TARGET_AVX2 void encode_groups_avx2(const TokenGroups<T>& t, int first, int count, const float* out_scale) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  for (int i = 0; i < count; ++i) {
    alignas(64) float scaled[NVFP4_GROUP];
    simd::store16(simd::load16(t.values(first + i)) * out_scale[i], scaled);
    const __m256 lo = _mm256_load_ps(scaled), hi = _mm256_load_ps(scaled + 8);
    const __m256 a_lo = _mm256_and_ps(lo, abs_mask), a_hi = _mm256_and_ps(hi, abs_mask);
    const uint32_t m[7] = {NVFP4_MASK16(a_lo, a_hi, _mm256_set1_ps(0.25f), _CMP_GT_OQ),
                           NVFP4_MASK16(a_lo, a_hi, _mm256_set1_ps(0.75f), _CMP_GE_OQ),
                           NVFP4_MASK16(a_lo, a_hi, _mm256_set1_ps(1.25f), _CMP_GT_OQ),
                           NVFP4_MASK16(a_lo, a_hi, _mm256_set1_ps(1.75f), _CMP_GE_OQ),
                           NVFP4_MASK16(a_lo, a_hi, _mm256_set1_ps(2.5f), _CMP_GT_OQ),
                           NVFP4_MASK16(a_lo, a_hi, _mm256_set1_ps(3.5f), _CMP_GE_OQ),
                           NVFP4_MASK16(a_lo, a_hi, _mm256_set1_ps(5.0f), _CMP_GT_OQ)};
    const uint32_t sign = _mm256_movemask_ps(lo) | (_mm256_movemask_ps(hi) << 8);
    const uint64_t packed = packed_codes(m, sign);
    std::memcpy(t.codes(first + i), &packed, sizeof packed);
  }
}
#undef NVFP4_MASK16

template <typename T>
NVFP4_TARGET_AVX2 void quantize_token_avx2(const TokenGroups<T>& t, int groups, float global, float inv_global) {
  quantize_token<T, encode_groups_avx2<T>, false>(t, groups, global, inv_global);
}

// AVX-512, float16 and float32 inputs: the generic form (vector comparisons are single instructions here).
template <typename T>
NVFP4_TARGET_AVX512 void quantize_token_avx512(const TokenGroups<T>& t, int groups, float global, float inv_global) {
  quantize_token<T, encode_groups_generic<T>, true>(t, groups, global, inv_global);
}

// AVX-512, bfloat16 (the usual KV dtype), two groups a vector. Read as 32-bit lanes, a pair of bf16 values is
// its even element in the low half and its odd element in the high half, so shifting and masking give the even
// and odd elements as float32 with no conversion, and an odd code shifted next to its even one is the packed
// byte. The maxima of 16 groups come from one transposing reduction over 8 vectors instead of one reduction each.

// Groups g and g + 1 (zeros past the last group).
NVFP4_TARGET_AVX512 NVFP4_INLINE __m512i load_pair(const TokenGroups<c10::BFloat16>& t, int groups, int g) {
  alignas(32) static const uint16_t zeros[NVFP4_GROUP] = {};
  const void* first = zeros;
  const void* second = zeros;
  if (g + 1 < groups) {  // one check for both in the usual case
    first = t.values(g);
    second = t.values(g + 1);
  } else if (g < groups) {
    first = t.values(g);
  }
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(static_cast<const __m256i*>(first))),
                            _mm256_loadu_si256(static_cast<const __m256i*>(second)), 1);
}

// Float32 bits of max |x| of groups first..first+15 (0 past the last group).
NVFP4_TARGET_AVX512 NVFP4_INLINE __m512i amax_bits16(const TokenGroups<c10::BFloat16>& t, int groups, int first) {
  __m512i magnitudes[LANES / 2];  // pair k: group 2k in the low 256 bits, 2k + 1 in the high
  for (int k = 0; k < LANES / 2; ++k)  // |x| as int16 orders like |x|
    magnitudes[k] = _mm512_and_si512(load_pair(t, groups, first + 2 * k), _mm512_set1_epi16(0x7FFF));
  // Each step merges two vectors and halves the lanes a group spans. Groups 4p..4p+3 in 128-bit chunks:
  __m512i quads[4];
  for (int p = 0; p < 4; ++p)
    quads[p] = _mm512_max_epi16(_mm512_shuffle_i64x2(magnitudes[2 * p], magnitudes[2 * p + 1], 0x88),
                                _mm512_shuffle_i64x2(magnitudes[2 * p], magnitudes[2 * p + 1], 0xDD));
  // Chunk c: groups c and 4 + c (halves0), 8 + c and 12 + c (halves1), 64 bits each.
  const __m512i halves0 = _mm512_max_epi16(_mm512_unpacklo_epi64(quads[0], quads[1]), _mm512_unpackhi_epi64(quads[0], quads[1]));
  const __m512i halves1 = _mm512_max_epi16(_mm512_unpacklo_epi64(quads[2], quads[3]), _mm512_unpackhi_epi64(quads[2], quads[3]));
  // 32-bit lane j of chunk c: group c + 4j, two values; then the maximum in the high half is the float32 bits.
  const __m512 h0 = _mm512_castsi512_ps(halves0), h1 = _mm512_castsi512_ps(halves1);
  __m512i pairs = _mm512_max_epi16(_mm512_castps_si512(_mm512_shuffle_ps(h0, h1, 0x88)),
                                   _mm512_castps_si512(_mm512_shuffle_ps(h0, h1, 0xDD)));
  pairs = _mm512_and_si512(_mm512_max_epi16(pairs, _mm512_slli_epi32(pairs, 16)), _mm512_set1_epi32(0xFFFF0000));
  return _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), pairs);
}

// The 16 code bytes of a pair of groups (as load_pair gives them) with factors[0] and factors[1].
NVFP4_TARGET_AVX512 NVFP4_INLINE __m128i encode_pair(__m512i words, const float* factors) {
  const __m512i magnitudes = _mm512_and_si512(words, _mm512_set1_epi16(0x7FFF));
  const __m512 factor = _mm512_permutexvar_ps(  // the first group's in lanes 0-7, the second's in lanes 8-15
      _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
      _mm512_castps128_ps512(_mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(factors)))));
  const __m512 even = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(magnitudes, 16)), factor);
  const __m512 odd = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_and_si512(magnitudes, _mm512_set1_epi32(0xFFFF0000))), factor);
  // Select bits by mask (ternary-logic 0xE4: mask ? a : b): even codes in bits 0-3, odd codes in bits 4-7, and
  // the signs (bits 15 and 31 of the pair) in bits 3 and 7.
  const __m512i codes = _mm512_ternarylogic_epi32(e2m1_magnitudes_avx512(even), _mm512_slli_epi32(e2m1_magnitudes_avx512(odd), 4),
                                                  _mm512_set1_epi32(0x0F), 0xE4);
  const __m512i signs = _mm512_ternarylogic_epi32(_mm512_srli_epi32(words, 12), _mm512_srli_epi32(words, 24),
                                                  _mm512_set1_epi32(0x08), 0xE4);
  return _mm512_cvtepi32_epi8(_mm512_ternarylogic_epi32(codes, signs, _mm512_set1_epi32(0x88), 0xF8));
}

template <>
NVFP4_TARGET_AVX512 void quantize_token_avx512(const TokenGroups<c10::BFloat16>& token, int groups, float global,
                                               float inv_global) {
  const TokenGroups<c10::BFloat16> t = token;  // a local: the code stores may alias anything, a local does not
  for (int batch = 0; batch < groups; batch += BATCH) {
    const int count = std::min(groups - batch, BATCH);
    alignas(64) float out_scale[BATCH];
    bool usable = true;  // every factor finite and non-negative: then |x · factor| = |x| · factor, its sign x's
    for (int first = 0; first < count; first += LANES) {
      const simd::f32x16 factors = write_block_scales<true>(
          t, batch + first, std::min(count - first, LANES),
          __builtin_bit_cast(simd::u32x16, amax_bits16(t, groups, batch + first)), global, inv_global);
      usable &= _mm512_cmplt_epu32_mask(__builtin_bit_cast(__m512i, factors), _mm512_set1_epi32(0x7F800000)) == 0xFFFF;
      simd::store16(factors, out_scale + first);
    }
    if (!usable) {
      encode_groups_generic(t, batch, count, out_scale);
      continue;
    }
    if (t.even_rows) {  // each pair in one load and one store
      for (int i = 0; i < count; i += 2)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(t.codes(batch + i)),
                         encode_pair(_mm512_loadu_si512(t.values(batch + i)), out_scale + i));
      continue;
    }
    for (int i = 0; i < count; i += 2) {
      const __m128i bytes = encode_pair(load_pair(t, groups, batch + i), out_scale + i);
      _mm_storel_epi64(reinterpret_cast<__m128i*>(t.codes(batch + i)), bytes);
      if (i + 1 < count) _mm_storeh_pi(reinterpret_cast<__m64*>(t.codes(batch + i + 1)), _mm_castsi128_ps(bytes));
    }
  }
}
#endif

// Quantizes the num_heads rows of one token into `side` (one side of one block), docs/FORMATS.md §1.
template <typename T>
NVFP4_INLINE void store_token_impl(const T* x, const GroupOffsets& offsets, const NVFP4PageLayout& layout,
                                   int64_t token, float global, float inv_global, uint8_t* side,
                                   void (*quantize)(const TokenGroups<T>&, int, float, float)) {
  const int groups = static_cast<int>(offsets.src.size());
  const TokenGroups<T> t{x, side + layout.data_offset(token, 0), side + layout.scale_offset(token - token % 4, 0, 0, false),
                         offsets.src.data(), offsets.data.data(), offsets.scale.data() + token % 4 * groups,
                         offsets.rows_of_eight, offsets.even_rows};
  quantize(t, groups, global, inv_global);
}

// quant.h's e4m3_decode of every byte, so the gather reads a group's block scale with one load.
const std::array<float, 256> E4M3_VALUES = [] {
  std::array<float, 256> values{};
  for (int code = 0; code < 256; ++code) values[code] = e4m3_decode(static_cast<uint8_t>(code));
  return values;
}();

#if NVFP4_X86
// simd::bf16_bits_of_numbers, left in the high half.
NVFP4_TARGET_AVX512 NVFP4_INLINE __m512i bf16_rounded(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  return _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)),
                          _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)));
}

// AVX-512, a bfloat16 row of an even number of groups and a finite global scale, two groups a vector: the 16
// possible outputs (e2m1 · SF) · global of each group, rounded to bf16 (finite, so no NaN fix-up), form one
// 32-entry table that the codes of both groups index (the second group's codes offset by 16). Groups with a NaN
// block scale take the general form.
NVFP4_TARGET_AVX512 void dequantize_row_bf16_avx512(const uint8_t* data, const uint8_t* scales, const int64_t* delta,
                                                    int64_t scale_dim, float global, c10::BFloat16* out) {
  const __m512 e2m1 = __builtin_bit_cast(__m512, simd::E2M1_VALUES);
  const __m512i second_group = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 16 << 16 | 16, 16 << 16 | 16,
                                                 16 << 16 | 16, 16 << 16 | 16, 16 << 16 | 16, 16 << 16 | 16,
                                                 16 << 16 | 16, 16 << 16 | 16);
  const __m512i high_halves = _mm512_setr_epi32(  // words 2k + 1 of two vectors: their bf16 roundings
      1 | 3 << 16, 5 | 7 << 16, 9 | 11 << 16, 13 | 15 << 16, 17 | 19 << 16, 21 | 23 << 16, 25 | 27 << 16, 29 | 31 << 16,
      33 | 35 << 16, 37 | 39 << 16, 41 | 43 << 16, 45 | 47 << 16, 49 | 51 << 16, 53 | 55 << 16, 57 | 59 << 16,
      61 | 63 << 16);
  for (int64_t s = 0; s < scale_dim; s += 2) {
    const float first_scale = E4M3_VALUES[scales[delta[s]]], second_scale = E4M3_VALUES[scales[delta[s + 1]]];
    if (std::isnan(first_scale) || std::isnan(second_scale)) {  // NaN groups: the general form
      simd::dequantize_group(data + s * NVFP4_GROUP / 2, first_scale, global, out + s * NVFP4_GROUP);
      simd::dequantize_group(data + (s + 1) * NVFP4_GROUP / 2, second_scale, global, out + (s + 1) * NVFP4_GROUP);
      continue;
    }
    const __m512 first = _mm512_mul_ps(_mm512_mul_ps(e2m1, _mm512_set1_ps(first_scale)), _mm512_set1_ps(global));
    const __m512 second = _mm512_mul_ps(_mm512_mul_ps(e2m1, _mm512_set1_ps(second_scale)), _mm512_set1_ps(global));
    const __m512i table = _mm512_permutex2var_epi16(bf16_rounded(first), high_halves, bf16_rounded(second));
    // Code bytes as 32-bit lanes; a byte's two nibbles go to the low and high 16 bits: (b | b << 12) & 0x000F000F.
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(data + s * NVFP4_GROUP / 2)));
    const __m512i codes = _mm512_ternarylogic_epi32(bytes, _mm512_slli_epi32(bytes, 12), _mm512_set1_epi32(0x000F000F), 0xA8);
    _mm512_storeu_si512(out + s * NVFP4_GROUP, _mm512_permutexvar_epi16(_mm512_or_si512(codes, second_group), table));
  }
}
#endif

// Dequantizes the num_heads entries of one token of `side`: (e2m1 · SF) · global in float32, then cast.
template <bool native, typename T>
NVFP4_INLINE void load_token_impl(const uint8_t* side, const NVFP4PageLayout& layout, int64_t token,
                                  const int64_t* scale_delta, float global, T* out, int64_t head_stride) {
  const int64_t r = token % 4, scale_dim = layout.scale_dim();
  for (int64_t h = 0; h < layout.num_heads; ++h) {
    const uint8_t* entry_data = side + layout.data_offset(token, h);
    const uint8_t* entry_scales = side + layout.scale_offset(token - r, h, 0, false);
    T* row = out + h * head_stride;
#if NVFP4_X86
    if constexpr (native && std::is_same_v<T, c10::BFloat16>) {
      if (scale_dim % 2 == 0 && std::isfinite(global)) {
        dequantize_row_bf16_avx512(entry_data, entry_scales, scale_delta + r * scale_dim, scale_dim, global, row);
        continue;
      }
    }
#endif
    for (int64_t s = 0; s < scale_dim; ++s) {
      const float sf = E4M3_VALUES[entry_scales[scale_delta[r * scale_dim + s]]];
      simd::dequantize_group(entry_data + s * NVFP4_GROUP / 2, sf, global, row + s * NVFP4_GROUP);
    }
  }
}

// ceil(log2 scale) as the reference gets it from frexp: the exponent of a positive normal scale, plus one unless
// the scale is a power of two; 0 for inf and NaN (frexp's exponent for them).
inline int ceil_log2(float scale) {
  const uint32_t bits = float_bits(scale);
  if ((bits >> 23) == 0xFFu) return 0;
  return static_cast<int>(bits >> 23) - 127 + ((bits & 0x7FFFFFu) != 0);
}

#if NVFP4_X86
// AVX-512, bfloat16 keys and a power-of-two scale 2^exponent (the UE8M0 formats): x / 2^exponent only moves the
// exponent, so quant.h's E4M3 codes come from the bf16 bits in 16-bit lanes, 32 values a vector. Normal codes
// (|x| / 2^exponent >= 2^-6): the 7 mantissa bits rounded to 3 (nearest even) and the exponent rebiased, saturating
// at 448 with a minimum. Subnormal ones, round(|x| · 2^(9 - exponent)), come from float32 arithmetic (adding 2^23
// rounds to an integer, ties to even) on the even and odd elements, read as the halves of 32-bit lanes.
NVFP4_TARGET_AVX512 NVFP4_INLINE __m512i e4m3_codes_bf16(__m512i words, int exponent) {
  const __m512i rebias = _mm512_set1_epi16(static_cast<int16_t>(7 - ((120 + exponent) << 7)));  // 7: rounding
  const __m512i smallest_normal = _mm512_set1_epi16(static_cast<int16_t>((121 + exponent) << 7));  // 2^(exponent-6)
  const __m512i magnitudes = _mm512_and_si512(words, _mm512_set1_epi16(0x7FFF));
  const __m512i odd_lsb = _mm512_and_si512(_mm512_srli_epi16(magnitudes, 4), _mm512_set1_epi16(1));
  __m512i code = _mm512_min_epu16(
      _mm512_srli_epi16(_mm512_add_epi16(_mm512_add_epi16(magnitudes, odd_lsb), rebias), 4), _mm512_set1_epi16(0x7E));
  // Codes below 2^-6 (zeros included) and NaN are rare in keys: computed only for vectors that hold them.
  if (const __mmask32 small = _mm512_cmplt_epu16_mask(magnitudes, smallest_normal)) {
    const __m512 to_subnormal = _mm512_set1_ps(float_from_bits(static_cast<uint32_t>(136 - exponent) << 23));
    const __m512 magic = _mm512_set1_ps(8388608.0f);  // 2^23
    const __m512i even = _mm512_castps_si512(
        _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(magnitudes, 16)), to_subnormal, magic));
    const __m512i odd = _mm512_castps_si512(_mm512_fmadd_ps(
        _mm512_castsi512_ps(_mm512_and_si512(magnitudes, _mm512_set1_epi32(0xFFFF0000))), to_subnormal, magic));
    // ternary-logic 0xE4: mask ? a : b, per bit
    code = _mm512_mask_blend_epi16(small, code,
                                   _mm512_ternarylogic_epi32(even, _mm512_slli_epi32(odd, 16), _mm512_set1_epi32(0xFFFF), 0xE4));
  }
  if (const __mmask32 nan = _mm512_cmpgt_epu16_mask(magnitudes, _mm512_set1_epi16(0x7F80)))
    code = _mm512_mask_mov_epi16(code, nan, _mm512_set1_epi16(0x7F));
  return _mm512_ternarylogic_epi32(code, _mm512_srli_epi16(words, 8), _mm512_set1_epi16(0x80), 0xF8);  // a | b & c
}

// The E4M3 codes of x[0..n) / 2^exponent (n a multiple of 32).
NVFP4_TARGET_AVX512 void e4m3_encode_bf16_avx512(const c10::BFloat16* x, int64_t n, int exponent, uint8_t* out) {
  int64_t e = 0;
  for (; e + 64 <= n; e += 64) {  // two vectors of codes narrowed by one pack (its 64-bit chunks then put in order)
    const __m512i packed = _mm512_packus_epi16(e4m3_codes_bf16(_mm512_loadu_si512(x + e), exponent),
                                               e4m3_codes_bf16(_mm512_loadu_si512(x + e + 32), exponent));
    _mm512_storeu_si512(out + e, _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7), packed));
  }
  for (; e < n; e += 32)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + e), _mm512_cvtepi16_epi8(e4m3_codes_bf16(_mm512_loadu_si512(x + e), exponent)));
}
#endif

// Quantizes one indexer key (docs/FORMATS.md §2) into its block: FP8 values, then the scales' bytes.
template <bool native, typename T>
NVFP4_INLINE void indexer_store_token_impl(const T* x, const IndexerCacheLayout& layout, ScaleFormat fmt,
                                           int64_t offset, uint8_t* block) {
  const int64_t qbs = layout.quant_block_size;
  for (int64_t j = 0; j < layout.num_scales(); ++j) {
    const T* xj = x + j * qbs;
    float scale = std::max(float_from_bits(simd::amax_bits(xj, qbs)), 1e-4f) / E4M3_MAX;
    uint8_t* values = block + layout.value_offset(offset) + j * qbs;
    auto encode = [&](int64_t e, auto scaled) __attribute__((always_inline)) {  // values e.. of the block
      for (; e + LANES <= qbs; e += LANES) {
        const simd::u8x16 codes = __builtin_convertvector(simd::e4m3_encode<native>(scaled(simd::load16(xj + e))), simd::u8x16);
        std::memcpy(values + e, &codes, sizeof codes);
      }
      for (; e < qbs; ++e) values[e] = e4m3_encode(scaled(static_cast<float>(xj[e])));
    };
    uint8_t* scale_out = block + layout.scale_offset(offset, j);
    if (fmt == ScaleFormat::Float32) {
      encode(0, [scale](auto v) { return v / scale; });
      std::memcpy(scale_out, &scale, 4);
      continue;
    }
    // Rounded up to a power of two 2^exponent, so multiplying by 2^-exponent divides exactly.
    const int exponent = ceil_log2(scale);
    scale = float_from_bits(static_cast<uint32_t>(exponent + 127) << 23);
    const float inverse = float_from_bits(static_cast<uint32_t>(127 - exponent) << 23);
    int64_t done = 0;
#if NVFP4_X86
    if constexpr (native && std::is_same_v<T, c10::BFloat16>) {
      done = qbs - qbs % 32;
      e4m3_encode_bf16_avx512(xj, done, exponent, values);
    }
#endif
    encode(done, [inverse](auto v) { return v * inverse; });
    if (fmt == ScaleFormat::MXFP8)
      std::memset(scale_out, exponent + 127, 4);  // the UE8M0 exponent byte, four times
    else
      std::memcpy(scale_out, &scale, 4);
  }
}

#define NVFP4_ROW_KERNELS(ISA, TARGET, NATIVE)                                                                    \
  template <typename T>                                                                                           \
  TARGET void store_token_##ISA(const T* x, const GroupOffsets& offsets, const NVFP4PageLayout& layout,           \
                                int64_t token, float global, float inv_global, uint8_t* side) {                   \
    store_token_impl(x, offsets, layout, token, global, inv_global, side, quantize_token_##ISA<T>);               \
  }                                                                                                               \
  template <typename T>                                                                                           \
  TARGET void load_token_##ISA(const uint8_t* side, const NVFP4PageLayout& layout, int64_t token,                 \
                               const int64_t* scale_delta, float global, T* out, int64_t head_stride) {           \
    load_token_impl<NATIVE>(side, layout, token, scale_delta, global, out, head_stride);                          \
  }                                                                                                               \
  template <typename T>                                                                                           \
  TARGET void indexer_store_token_##ISA(const T* x, const IndexerCacheLayout& layout, ScaleFormat fmt,            \
                                        int64_t offset, uint8_t* block) {                                         \
    indexer_store_token_impl<NATIVE>(x, layout, fmt, offset, block);                                              \
  }
NVFP4_ROW_KERNELS(baseline, , false)
#if NVFP4_X86
NVFP4_ROW_KERNELS(avx512, NVFP4_TARGET_AVX512, true)
NVFP4_ROW_KERNELS(avx2, NVFP4_TARGET_AVX2, false)
#endif
#undef NVFP4_ROW_KERNELS

// The row kernels of element type T for this CPU.
template <typename T>
struct RowKernels {
  decltype(&store_token_baseline<T>) store_token;
  decltype(&load_token_baseline<T>) load_token;
  decltype(&indexer_store_token_baseline<T>) indexer_store_token;

  static RowKernels get() {
#if NVFP4_X86
    if (cpu_isa() >= Isa::Avx512) return {store_token_avx512<T>, load_token_avx512<T>, indexer_store_token_avx512<T>};
    if (cpu_isa() == Isa::Avx2) return {store_token_avx2<T>, load_token_avx2<T>, indexer_store_token_avx2<T>};
#endif
    return {store_token_baseline<T>, load_token_baseline<T>, indexer_store_token_baseline<T>};
  }
};

// Sequence of output row `row`: the b with cu_seq_lens[b] <= row < cu_seq_lens[b + 1].
int64_t sequence_of(const int32_t* cu_seq_lens, int64_t batch, int64_t row) {
  return std::upper_bound(cu_seq_lens + 1, cu_seq_lens + batch + 1, row) - (cu_seq_lens + 1);
}

// The K side of an fp8_keys page: e4m3(k / k_scale), as vLLM's FP8 cache stores keys, and back (· k_scale).
template <typename T>
void store_fp8_key(const T* x, int64_t head_stride, const NVFP4PageLayout& layout, int64_t offset, float global,
                   uint8_t* side) {
  for (int64_t h = 0; h < layout.num_heads; ++h) {
    uint8_t* out = side + layout.fp8_key_offset(offset, h);
    for (int64_t i = 0; i < layout.head_size; ++i) out[i] = e4m3_encode(static_cast<float>(x[h * head_stride + i]) / global);
  }
}

template <typename T>
void load_fp8_key(const uint8_t* side, const NVFP4PageLayout& layout, int64_t offset, float global, T* out,
                  int64_t head_stride) {
  for (int64_t h = 0; h < layout.num_heads; ++h) {
    const uint8_t* in = side + layout.fp8_key_offset(offset, h);
    for (int64_t i = 0; i < layout.head_size; ++i) out[h * head_stride + i] = static_cast<T>(e4m3_decode(in[i]) * global);
  }
}

// The K side of an int8-key page (docs/FORMATS.md §1): per (token, head), v = k / k_scale in float32, scale =
// fp16(min(max |v| / 127, 65504)) to nearest even, codes round-half-even(v / scale) clamped to ±127 (0 where the
// scale is 0); a NaN in v stores the fp16 NaN 0x7E00 and all-zero codes. Decoded as code · scale · k_scale.
template <typename T>
void store_int8_key(const T* x, int64_t head_stride, const NVFP4PageLayout& layout, int64_t offset, float global,
                    uint8_t* side) {
  for (int64_t h = 0; h < layout.num_heads; ++h) {
    const T* row = x + h * head_stride;
    float amax = 0.0f;
    for (int64_t i = 0; i < layout.head_size; ++i) {
      const float a = std::fabs(static_cast<float>(row[i]) / global);
      amax = (a > amax || a != a) ? a : amax;  // a NaN sticks, as torch's amax
    }
    int8_t* codes = reinterpret_cast<int8_t*>(side + layout.int8_key_offset(offset, h));
    const c10::Half scale(std::isnan(amax) ? 0.0f : std::min(amax / 127.0f, 65504.0f));
    const float scale_value = static_cast<float>(scale);
    const uint16_t scale_bits = std::isnan(amax) ? 0x7E00 : scale.x;
    if (scale_value == 0.0f) {  // all zeros, or a NaN
      std::memset(codes, 0, layout.head_size);
    } else {
      for (int64_t i = 0; i < layout.head_size; ++i) {
        const float q = std::nearbyint(static_cast<float>(row[i]) / global / scale_value);
        codes[i] = static_cast<int8_t>(std::clamp(q, -127.0f, 127.0f));
      }
    }
    uint8_t* scale_out = side + layout.int8_key_scale_offset(offset, h);
    scale_out[0] = static_cast<uint8_t>(scale_bits & 0xFF);
    scale_out[1] = static_cast<uint8_t>(scale_bits >> 8);
  }
}

template <typename T>
void load_int8_key(const uint8_t* side, const NVFP4PageLayout& layout, int64_t offset, float global, T* out,
                   int64_t head_stride) {
  for (int64_t h = 0; h < layout.num_heads; ++h) {
    const int8_t* codes = reinterpret_cast<const int8_t*>(side + layout.int8_key_offset(offset, h));
    const uint8_t* scale_in = side + layout.int8_key_scale_offset(offset, h);
    const float scale = static_cast<float>(
        c10::Half(static_cast<uint16_t>(scale_in[0] | scale_in[1] << 8), c10::Half::from_bits()));
    for (int64_t i = 0; i < layout.head_size; ++i)
      out[h * head_stride + i] = static_cast<T>(static_cast<float>(codes[i]) * scale * global);
  }
}

void reshape_and_cache_nvfp4_cpu(const Tensor& key, const Tensor& value, Tensor& key_cache, Tensor& value_cache,
                                 const Tensor& slot_mapping, const Tensor& k_scale, const Tensor& v_scale,
                                 bool swizzle_v_scales) {
  const NVFP4PageLayout layout = check_reshape_and_cache_nvfp4(key, value, key_cache, value_cache, slot_mapping,
                                                               k_scale, v_scale, swizzle_v_scales);
  const int64_t num_tokens = slot_mapping.size(0);
  const int64_t* slots = slot_mapping.const_data_ptr<int64_t>();
  check_slot_range("reshape_and_cache_nvfp4", slots, num_tokens, key_cache.size(0) * layout.block_size);
  const float kg = global_scale(k_scale), vg = global_scale(v_scale);
  const float inv_kg = 1.0f / kg, inv_vg = 1.0f / vg;
  uint8_t* k_base = bytes_of(key_cache);
  uint8_t* v_base = bytes_of(value_cache);
  const int64_t k_block_stride = key_cache.stride(0), v_block_stride = value_cache.stride(0);
  const int64_t key_token_stride = key.stride(0), key_head_stride = key.stride(1);
  const int64_t value_token_stride = value.stride(0), value_head_stride = value.stride(1);
  const GroupOffsets k_offsets(layout, key_head_stride, false), v_offsets(layout, value_head_stride, swizzle_v_scales);
  dispatch_float_types(key.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const auto kernels = RowKernels<T>::get();
    const T* k = static_cast<const T*>(key.const_data_ptr());
    const T* v = static_cast<const T*>(value.const_data_ptr());
#pragma omp parallel for schedule(static) if (num_tokens * layout.num_heads * layout.head_size >= PARALLEL_MIN_WORK)
    for (int64_t i = 0; i < num_tokens; ++i) {
      const int64_t slot = slots[i];
      if (slot < 0) continue;  // padding token
      const int64_t block = slot / layout.block_size, offset = slot % layout.block_size;
      if (layout.fp8_keys())
        store_fp8_key(k + i * key_token_stride, key_head_stride, layout, offset, kg, k_base + block * k_block_stride);
      else if (layout.int8_keys())
        store_int8_key(k + i * key_token_stride, key_head_stride, layout, offset, kg, k_base + block * k_block_stride);
      else
        kernels.store_token(k + i * key_token_stride, k_offsets, layout, offset, kg, inv_kg,
                            k_base + block * k_block_stride);
      kernels.store_token(v + i * value_token_stride, v_offsets, layout, offset, vg, inv_vg,
                          v_base + block * v_block_stride);
    }
  });
}

// vLLM's "nvfp4_4over6": per group, the max/6 or the max/4 block scale (quant.h's nvfp4_4over6_group). Scalar:
// each group is quantized twice and its errors compared, so the SIMD paths of plain NVFP4 stay untouched.
template <typename T>
void store_token_4over6(const T* x, int64_t head_stride, const NVFP4PageLayout& layout, int64_t offset, float global,
                        float inv_global, bool swizzled, uint8_t* side) {
  for (int64_t h = 0; h < layout.num_heads; ++h)
    for (int64_t s = 0; s < layout.scale_dim(); ++s) {
      float group[NVFP4_GROUP];
      for (int64_t i = 0; i < NVFP4_GROUP; ++i) group[i] = static_cast<float>(x[h * head_stride + s * NVFP4_GROUP + i]);
      side[layout.scale_offset(offset, h, s, swizzled)] =
          nvfp4_4over6_group(group, global, inv_global, side + layout.data_offset(offset, h) + s * NVFP4_GROUP / 2);
    }
}

void reshape_and_cache_nvfp4_4over6_cpu(const Tensor& key, const Tensor& value, Tensor& key_cache,
                                        Tensor& value_cache, const Tensor& slot_mapping, const Tensor& k_scale,
                                        const Tensor& v_scale, bool swizzle_v_scales) {
  const char* op = "reshape_and_cache_nvfp4_4over6";
  const NVFP4PageLayout layout = check_reshape_and_cache_nvfp4(key, value, key_cache, value_cache, slot_mapping,
                                                               k_scale, v_scale, swizzle_v_scales, op);
  const int64_t num_tokens = slot_mapping.size(0);
  const int64_t* slots = slot_mapping.const_data_ptr<int64_t>();
  check_slot_range(op, slots, num_tokens, key_cache.size(0) * layout.block_size);
  const float kg = global_scale(k_scale), vg = global_scale(v_scale);
  const float inv_kg = 1.0f / kg, inv_vg = 1.0f / vg;
  uint8_t* k_base = bytes_of(key_cache);
  uint8_t* v_base = bytes_of(value_cache);
  const int64_t k_block_stride = key_cache.stride(0), v_block_stride = value_cache.stride(0);
  dispatch_float_types(key.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* k = static_cast<const T*>(key.const_data_ptr());
    const T* v = static_cast<const T*>(value.const_data_ptr());
#pragma omp parallel for schedule(static) if (num_tokens * layout.num_heads * layout.head_size >= PARALLEL_MIN_WORK / 8)
    for (int64_t i = 0; i < num_tokens; ++i) {
      const int64_t slot = slots[i];
      if (slot < 0) continue;  // padding token
      const int64_t block = slot / layout.block_size, offset = slot % layout.block_size;
      if (layout.fp8_keys())
        store_fp8_key(k + i * key.stride(0), key.stride(1), layout, offset, kg, k_base + block * k_block_stride);
      else if (layout.int8_keys())
        store_int8_key(k + i * key.stride(0), key.stride(1), layout, offset, kg, k_base + block * k_block_stride);
      else
        store_token_4over6(k + i * key.stride(0), key.stride(1), layout, offset, kg, inv_kg, false,
                           k_base + block * k_block_stride);
      store_token_4over6(v + i * value.stride(0), value.stride(1), layout, offset, vg, inv_vg, swizzle_v_scales,
                         v_base + block * v_block_stride);
    }
  });
}

void gather_nvfp4_kv_cache_cpu(const Tensor& key_cache, const Tensor& value_cache, const Tensor& block_table,
                               const Tensor& cu_seq_lens, const Tensor& k_scale, const Tensor& v_scale,
                               bool swizzle_v_scales, Tensor& out_key, Tensor& out_value) {
  const NVFP4PageLayout layout = check_gather_nvfp4_kv_cache(key_cache, value_cache, block_table, cu_seq_lens, k_scale,
                                                             v_scale, swizzle_v_scales, out_key, out_value);
  const int64_t batch = block_table.size(0), table_stride = block_table.stride(0);
  const int32_t* table = block_table.const_data_ptr<int32_t>();
  const int32_t* cu = cu_seq_lens.const_data_ptr<int32_t>();
  check_gather_ranges("gather_nvfp4_kv_cache", table, table_stride, block_table.size(1), cu, batch,
                      layout.block_size, key_cache.size(0), out_key.size(0));
  const float kg = global_scale(k_scale), vg = global_scale(v_scale);
  const uint8_t* k_base = bytes_of(key_cache);
  const uint8_t* v_base = bytes_of(value_cache);
  const int64_t num_rows = cu[batch];
  auto gather_side = [&](const uint8_t* base, int64_t block_stride, float global, KeyFormat format, bool swizzled,
                         Tensor& out) {
    const std::vector<int64_t> deltas = scale_deltas(layout, swizzled);
    dispatch_float_types(out.scalar_type(), [&](auto tag) {
      using T = decltype(tag);
      const auto kernels = RowKernels<T>::get();
      T* o = static_cast<T*>(out.mutable_data_ptr());
      const int64_t token_stride = out.stride(0), head_stride = out.stride(1);
#pragma omp parallel for schedule(static) if (num_rows * layout.num_heads * layout.head_size >= PARALLEL_MIN_WORK)
      for (int64_t row = 0; row < num_rows; ++row) {
        const int64_t b = sequence_of(cu, batch, row), p = row - cu[b];
        const uint8_t* side = base + table[b * table_stride + p / layout.block_size] * block_stride;
        if (format == KeyFormat::Fp8)
          load_fp8_key(side, layout, p % layout.block_size, global, o + row * token_stride, head_stride);
        else if (format == KeyFormat::Int8)
          load_int8_key(side, layout, p % layout.block_size, global, o + row * token_stride, head_stride);
        else
          kernels.load_token(side, layout, p % layout.block_size, deltas.data(), global, o + row * token_stride,
                             head_stride);
      }
    });
  };
  gather_side(k_base, key_cache.stride(0), kg, layout.key_format, false, out_key);
  gather_side(v_base, value_cache.stride(0), vg, KeyFormat::Nvfp4, swizzle_v_scales, out_value);
}

void indexer_k_quant_and_cache_cpu(const Tensor& k, Tensor& kv_cache, const Tensor& slot_mapping,
                                   int64_t quant_block_size, std::string scale_fmt) {
  const ScaleFormat fmt = parse_scale_fmt(scale_fmt);
  const IndexerCacheLayout layout = check_indexer_k_quant_and_cache(k, kv_cache, slot_mapping, quant_block_size);
  const int64_t num_tokens = slot_mapping.size(0);
  const int64_t* slots = slot_mapping.const_data_ptr<int64_t>();
  check_slot_range("indexer_k_quant_and_cache", slots, num_tokens, kv_cache.size(0) * layout.block_size);
  uint8_t* cache = bytes_of(kv_cache);
  const int64_t block_stride = kv_cache.stride(0), token_stride = k.stride(0);
  dispatch_float_types(k.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const auto kernels = RowKernels<T>::get();
    const T* x_base = static_cast<const T*>(k.const_data_ptr());
#pragma omp parallel for schedule(static) if (num_tokens * layout.head_dim >= PARALLEL_MIN_WORK)
    for (int64_t i = 0; i < num_tokens; ++i) {
      const int64_t slot = slots[i];
      if (slot < 0) continue;
      const int64_t offset = slot % layout.block_size;
      uint8_t* block = cache + slot / layout.block_size * block_stride;
      kernels.indexer_store_token(x_base + i * token_stride, layout, fmt, offset, block);
    }
  });
}

// Copies n rows of row_bytes, packed at src, to rows dst_stride apart.
void copy_rows(const uint8_t* src, int64_t row_bytes, int64_t n, uint8_t* dst, int64_t dst_stride) {
  if (dst_stride == row_bytes) {
    std::memcpy(dst, src, n * row_bytes);
    return;
  }
  for (int64_t i = 0; i < n; ++i) std::memcpy(dst + i * dst_stride, src + i * row_bytes, row_bytes);
}

void cp_gather_indexer_k_quant_cache_cpu(const Tensor& kv_cache, Tensor& dst_k, Tensor& dst_scale,
                                         const Tensor& block_table, const Tensor& cu_seq_lens) {
  const IndexerCacheLayout layout =
      check_cp_gather_indexer_k_quant_cache(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens);
  const int64_t batch = block_table.size(0), table_stride = block_table.stride(0);
  const int32_t* table = block_table.const_data_ptr<int32_t>();
  const int32_t* cu = cu_seq_lens.const_data_ptr<int32_t>();
  check_gather_ranges("cp_gather_indexer_k_quant_cache", table, table_stride, block_table.size(1), cu, batch,
                      layout.block_size, kv_cache.size(0), dst_k.size(0));
  const uint8_t* cache = bytes_of(kv_cache);
  uint8_t* k_out = bytes_of(dst_k);
  uint8_t* scale_out = bytes_of(dst_scale);
  const int64_t block_stride = kv_cache.stride(0), k_row_stride = dst_k.stride(0);
  const int64_t scale_row_stride = dst_scale.stride(0) * dst_scale.element_size(), num_rows = cu[batch];
#pragma omp parallel for schedule(static) if (num_rows * layout.row_bytes() >= PARALLEL_MIN_WORK)
  for (int64_t first = 0; first < num_rows; first += ROWS_PER_TASK) {
    const int64_t last = std::min(first + ROWS_PER_TASK, num_rows);
    // Rows of one sequence in one block are consecutive in the cache and in the outputs: one copy per run.
    for (int64_t row = first; row < last;) {
      const int64_t b = sequence_of(cu, batch, row), p = row - cu[b], offset = p % layout.block_size;
      const int64_t n = std::min({last - row, layout.block_size - offset, cu[b + 1] - row});
      const uint8_t* block = cache + table[b * table_stride + p / layout.block_size] * block_stride;
      copy_rows(block + layout.value_offset(offset), layout.head_dim, n, k_out + row * k_row_stride, k_row_stride);
      copy_rows(block + layout.scale_offset(offset), layout.scale_bytes(), n, scale_out + row * scale_row_stride,
                scale_row_stride);
      row += n;
    }
  }
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(vllm_nvfp4, CPU, m) {
  m.impl("reshape_and_cache_nvfp4", TORCH_BOX(&reshape_and_cache_nvfp4_cpu));
  m.impl("reshape_and_cache_nvfp4_4over6", TORCH_BOX(&reshape_and_cache_nvfp4_4over6_cpu));
  m.impl("gather_nvfp4_kv_cache", TORCH_BOX(&gather_nvfp4_kv_cache_cpu));
  m.impl("indexer_k_quant_and_cache", TORCH_BOX(&indexer_k_quant_and_cache_cpu));
  m.impl("cp_gather_indexer_k_quant_cache", TORCH_BOX(&cp_gather_indexer_k_quant_cache_cpu));
}

}  // namespace vllm_nvfp4
