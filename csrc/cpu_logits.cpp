// CPU kernels of the indexer's two logits ops (schemas in library.cpp, argument checks in checks.h):
//   logit[row, key] = Σ_h w[row, h] · relu(Σ_b s[key, b] · Σ_{d in quant block b} q[row, h, d] · k[key, d]).
//
// Keys go 16 at a time (a tile, one vector lane per key): their FP8 bytes are transposed and converted once into a
// float tile [head_dim][16], which every head and every query row that sees those keys reuses. Per head, q[h][d]
// broadcast times tile row d accumulates the 16 dot products with fused multiply-adds; 8 heads (AVX-512), 4 heads
// (AVX2) or 2 heads (baseline, no FMA) at a time keep their accumulators in registers. Where the CPU has AVX-512
// BF16 (Zen 4), the tiles hold the keys as exact bfloat16 pairs and a dot-product instruction does two
// multiply-adds a lane. The work is split into tasks of (query rows, 512 keys); each output comes from one tile
// call summing in a fixed order (d, quant block, head), so the results do not depend on the number of threads.
// Like cpu_ops.cpp, the kernels exist as AVX-512 (+ BF16), AVX2 and baseline x86-64 variants (cpu_isa.h);
// VLLM_NVFP4_CPU_ISA=avx512|avx2|baseline caps the choice (avx512: without the BF16 dot product).
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/tensor.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <string>

#include "checks.h"
#include "cpu_isa.h"
#include "cpu_simd.h"
#include "error.h"
#include "layout.h"
#include "quant.h"

namespace vllm_nvfp4 {
namespace {

#define NVFP4_INLINE inline __attribute__((always_inline))

constexpr int TILE = 16;                // keys a tile holds, one per vector lane
// 512 keys a task: its float tiles (256 KB at head_dim 128) stay in L2. 16 prefill rows share them. (32 rows or
// 1024 keys: the same times within noise.)
constexpr int64_t TILES_PER_TASK = 32;
constexpr int64_t ROWS_PER_TASK = 16;
// Below this many multiply-adds (40-70 µs of work here) a call runs on one thread: waking the team costs more.
constexpr int64_t PARALLEL_MIN_MACS = int64_t{1} << 22;
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

struct TileShape {
  int64_t heads, head_dim, quant_block_size, num_scales;
};

// The keys of one tile: where each key's head_dim FP8 bytes and num_scales float32 scales are.
struct TileKeys {
  const uint8_t* values[TILE];
  const uint8_t* scales[TILE];
};

// --- FP8 → the kernels' operands ----------------------------------------------------------------------
// Float32 kernels: a key tile is floats [head_dim][16], a query row floats [heads][head_dim]. BF16 kernels: E4M3
// values are exact in bfloat16 (the top half of their float32); a key tile is [head_dim / 2][16] 32-bit lanes,
// each the bf16 pair (dimension d in the low half, d + 1 in the high half) the dot product multiplies, and a query
// row is bf16 [heads][head_dim], whose pairs read the same way.

// Interleaving rows i and i + 8 rotates each element's 8-bit (row, column) address left by one bit, so four rounds
// swap row and column: the transpose of a 16×16 matrix (of bytes, or of 32-bit lanes).
template <typename V>
NVFP4_INLINE void transpose16(V (&m)[16]) {
  for (int round = 0; round < 4; ++round) {
    V next[16];
    for (int i = 0; i < 8; ++i) {
      next[2 * i] = __builtin_shufflevector(m[i], m[i + 8], 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
      next[2 * i + 1] =
          __builtin_shufflevector(m[i], m[i + 8], 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    }
    for (int i = 0; i < 16; ++i) m[i] = next[i];
  }
}

// The scale tile [num_scales][16] of a tile's keys.
NVFP4_INLINE void gather_scales(const TileKeys& keys, const TileShape& s, float* scales) {
  for (int64_t b = 0; b < s.num_scales; ++b)
    for (int j = 0; j < TILE; ++j) std::memcpy(scales + b * TILE + j, keys.scales[j] + 4 * b, 4);
}

// Float32 key tile: 16 dimensions at a time, the keys' codes transposed, then converted by `decode` (n codes →
// n floats, exact), the variant's own function.
template <void (*decode)(const uint8_t*, int64_t, void*)>
NVFP4_INLINE void convert_keys_f32(const TileKeys& keys, const TileShape& s, void* tile_out, float* scales) {
  float* tile = static_cast<float*>(tile_out);
  int64_t d0 = 0;
  for (; d0 + TILE <= s.head_dim; d0 += TILE) {
    simd::u8x16 rows[TILE];
    for (int j = 0; j < TILE; ++j) std::memcpy(&rows[j], keys.values[j] + d0, sizeof rows[j]);
    transpose16(rows);  // rows[i]: the 16 keys' codes of dimension d0 + i
    decode(reinterpret_cast<const uint8_t*>(rows), TILE * TILE, tile + d0 * TILE);
  }
  for (; d0 < s.head_dim; ++d0)
    for (int j = 0; j < TILE; ++j) tile[d0 * TILE + j] = e4m3_decode(keys.values[j][d0]);
  gather_scales(keys, s, scales);
}

// Baseline: quant.h's decode as vector operations.
void decode_baseline(const uint8_t* codes, int64_t n, void* out_buffer) {
  float* out = static_cast<float*>(out_buffer);
  int64_t e = 0;
  for (; e + TILE <= n; e += TILE) {
    simd::u8x16 c;
    std::memcpy(&c, codes + e, sizeof c);
    simd::store16(simd::e4m3_decode<false>(__builtin_convertvector(c, simd::u32x16)), out + e);
  }
  for (; e < n; ++e) out[e] = e4m3_decode(codes[e]);
}

#if NVFP4_X86
// AVX2 and AVX-512 through F16C: an E4M3 code's exponent and mantissa bits placed in a float16's are the value
// times 2^-8 (the exponent bias is 15 instead of 7; subnormals included), exact; NaN codes become a float16 NaN.
NVFP4_TARGET_AVX2 NVFP4_INLINE __m256i halves_of_codes(__m128i codes) {
  const __m256i words = _mm256_cvtepu8_epi16(codes);
  const __m256i magnitude = _mm256_and_si256(words, _mm256_set1_epi16(0x7F));
  const __m256i nan = _mm256_cmpeq_epi16(magnitude, _mm256_set1_epi16(0x7F));
  const __m256i bits = _mm256_blendv_epi8(_mm256_slli_epi16(magnitude, 7), _mm256_set1_epi16(0x7E00), nan);
  return _mm256_or_si256(bits, _mm256_and_si256(_mm256_slli_epi16(words, 8), _mm256_set1_epi16(-0x8000)));
}

NVFP4_TARGET_AVX2 void decode_avx2(const uint8_t* codes, int64_t n, void* out_buffer) {
  float* out = static_cast<float*>(out_buffer);
  const __m256 undo_bias = _mm256_set1_ps(256.0f);
  int64_t e = 0;
  for (; e + TILE <= n; e += TILE) {
    const __m256i halves = halves_of_codes(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + e)));
    _mm256_storeu_ps(out + e, _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(halves)), undo_bias));
    _mm256_storeu_ps(out + e + 8, _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(halves, 1)), undo_bias));
  }
  for (; e < n; ++e) out[e] = e4m3_decode(codes[e]);
}

NVFP4_TARGET_AVX512 void decode_avx512(const uint8_t* codes, int64_t n, void* out_buffer) {
  float* out = static_cast<float*>(out_buffer);
  const __m512 undo_bias = _mm512_set1_ps(256.0f);
  int64_t e = 0;
  for (; e + TILE <= n; e += TILE) {
    const __m256i halves = halves_of_codes(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + e)));
    _mm512_storeu_ps(out + e, _mm512_mul_ps(_mm512_cvtph_ps(halves), undo_bias));
  }
  for (; e < n; ++e) out[e] = e4m3_decode(codes[e]);
}

// AVX-512 BF16: 32 codes at a time become bf16 through two 64-entry word lookups.
struct Bf16OfE4m3 {
  alignas(64) uint16_t magnitude[128];  // bf16 bits of the E4M3 codes 0..127 (quant.h's decode, exact)
  Bf16OfE4m3() {
    for (int code = 0; code < 128; ++code)
      magnitude[code] = static_cast<uint16_t>(float_bits(e4m3_decode(static_cast<uint8_t>(code))) >> 16);
  }
};
const Bf16OfE4m3 BF16_OF_E4M3;

struct Bf16Lookup {
  __m512i table[4];
  NVFP4_TARGET_AVX512_BF16 NVFP4_INLINE Bf16Lookup() {
    for (int i = 0; i < 4; ++i) table[i] = _mm512_load_si512(BF16_OF_E4M3.magnitude + 32 * i);
  }
  // The bf16 bits of the 32 codes at p, in 16-bit lanes.
  NVFP4_TARGET_AVX512_BF16 NVFP4_INLINE __m512i operator()(const uint8_t* p) const {
    const __m512i codes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    const __m512i low = _mm512_permutex2var_epi16(table[0], codes, table[1]);   // index: the code's low 6 bits
    const __m512i high = _mm512_permutex2var_epi16(table[2], codes, table[3]);  // magnitudes 64..127
    const __m512i magnitude =
        _mm512_mask_blend_epi16(_mm512_test_epi16_mask(codes, _mm512_set1_epi16(0x40)), low, high);
    // ternary-logic 0xF8: a | b & c, the sign (bit 7) moved to bit 15
    return _mm512_ternarylogic_epi32(magnitude, _mm512_slli_epi16(codes, 8), _mm512_set1_epi16(-0x8000), 0xF8);
  }
};

// Needs head_dim % 32 == 0 (LogitsKernels::get): each key's 32 dimensions become 16 pairs in one lookup, and
// 16×16 transposes of 32-bit pairs put them in place.
NVFP4_TARGET_AVX512_BF16 void convert_keys_avx512_bf16(const TileKeys& keys, const TileShape& s, void* tile_out,
                                                       float* scales) {
  auto* tile = static_cast<uint8_t*>(tile_out);
  const Bf16Lookup bf16;
  for (int64_t d0 = 0; d0 < s.head_dim; d0 += 32) {
    simd::u32x16 pairs[TILE];  // pairs[j]: key j's 16 bf16 pairs of dimensions d0..d0+31
    for (int j = 0; j < TILE; ++j) pairs[j] = __builtin_bit_cast(simd::u32x16, bf16(keys.values[j] + d0));
    transpose16(pairs);  // pairs[i]: pair i of the 16 keys
    for (int i = 0; i < TILE; ++i) std::memcpy(tile + (d0 / 2 + i) * TILE * 4, &pairs[i], sizeof pairs[i]);
  }
  gather_scales(keys, s, scales);
}

NVFP4_TARGET_AVX512_BF16 void decode_avx512_bf16(const uint8_t* codes, int64_t n, void* out_buffer) {
  auto* out = static_cast<uint8_t*>(out_buffer);
  const Bf16Lookup bf16;
  for (int64_t e = 0; e < n; e += 32) _mm512_storeu_si512(out + 2 * e, bf16(codes + e));  // n: heads · head_dim
}
#endif

void convert_keys_baseline(const TileKeys& keys, const TileShape& s, void* tile, float* scales) {
  convert_keys_f32<decode_baseline>(keys, s, tile, scales);
}
#if NVFP4_X86
NVFP4_TARGET_AVX2 void convert_keys_avx2(const TileKeys& keys, const TileShape& s, void* tile, float* scales) {
  convert_keys_f32<decode_avx2>(keys, s, tile, scales);
}
NVFP4_TARGET_AVX512 void convert_keys_avx512(const TileKeys& keys, const TileShape& s, void* tile, float* scales) {
  convert_keys_f32<decode_avx512>(keys, s, tile, scales);
}
#endif

// --- tile kernels: out[16] = the logits of a tile's 16 keys for one query row ----------------------------
// q: the row's [heads][head_dim] floats, w: its heads' weights. Each adds Σ_h w[h] · relu(Σ_b s_b · dot_b)
// over HEADS heads to the running logits, heads in order.

// Baseline x86-64 (SSE2, no FMA; or any 128-bit SIMD): a tile row is four 4-lane vectors, which stay in registers
// (GCC keeps 16-lane generic vectors in memory there); 2 heads × 4 vectors of accumulators; multiply, then add.
typedef float f32x4 __attribute__((vector_size(16)));
constexpr int QUARTERS = TILE / 4;

NVFP4_INLINE f32x4 load4(const float* p) {
  f32x4 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <int HEADS>
NVFP4_INLINE void add_heads_generic(const float* q, const float* w, const TileShape& s, const float* tile,
                                    const float* scales, f32x4 (&logit)[QUARTERS]) {
  f32x4 score[HEADS][QUARTERS] = {};
  for (int64_t b = 0; b < s.num_scales; ++b) {
    const int64_t first = b * s.quant_block_size;
    f32x4 dot[HEADS][QUARTERS] = {};
    for (int64_t d = first; d < first + s.quant_block_size; ++d) {
      f32x4 k[QUARTERS];
      for (int r = 0; r < QUARTERS; ++r) k[r] = load4(tile + d * TILE + 4 * r);
      for (int i = 0; i < HEADS; ++i) {
        const float qv = q[i * s.head_dim + d];
        const f32x4 qd = {qv, qv, qv, qv};
        for (int r = 0; r < QUARTERS; ++r) dot[i][r] += qd * k[r];
      }
    }
    for (int r = 0; r < QUARTERS; ++r) {
      const f32x4 scale = load4(scales + b * TILE + 4 * r);
      for (int i = 0; i < HEADS; ++i) score[i][r] += dot[i][r] * scale;
    }
  }
  for (int i = 0; i < HEADS; ++i)
    for (int r = 0; r < QUARTERS; ++r)  // relu (NaN stays NaN), × w
      logit[r] += (score[i][r] < 0.0f ? f32x4{} : score[i][r]) * w[i];
}

void tile_logits_baseline(const void* q_row, const float* w, const TileShape& s, const void* tile_in,
                          const float* scales, float* out) {
  const auto* q = static_cast<const float*>(q_row);
  const auto* tile = static_cast<const float*>(tile_in);
  f32x4 logit[QUARTERS] = {};
  int64_t h = 0;
  for (; h + 2 <= s.heads; h += 2) add_heads_generic<2>(q + h * s.head_dim, w + h, s, tile, scales, logit);
  for (; h < s.heads; ++h) add_heads_generic<1>(q + h * s.head_dim, w + h, s, tile, scales, logit);
  std::memcpy(out, logit, sizeof logit);
}

#if NVFP4_X86
// AVX2: a tile row is two 8-lane vectors; 4 heads × 2 vectors of accumulators.
template <int HEADS>
NVFP4_TARGET_AVX2 NVFP4_INLINE void add_heads_avx2(const float* q, const float* w, const TileShape& s,
                                                    const float* tile, const float* scales, __m256 (&logit)[2]) {
  __m256 score[HEADS][2];
  for (int i = 0; i < HEADS; ++i) score[i][0] = score[i][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < s.num_scales; ++b) {
    const int64_t first = b * s.quant_block_size;
    __m256 dot[HEADS][2];
    for (int i = 0; i < HEADS; ++i) dot[i][0] = dot[i][1] = _mm256_setzero_ps();
    for (int64_t d = first; d < first + s.quant_block_size; ++d) {
      const __m256 k0 = _mm256_loadu_ps(tile + d * TILE), k1 = _mm256_loadu_ps(tile + d * TILE + 8);
      for (int i = 0; i < HEADS; ++i) {
        const __m256 qd = _mm256_broadcast_ss(q + i * s.head_dim + d);
        dot[i][0] = _mm256_fmadd_ps(qd, k0, dot[i][0]);
        dot[i][1] = _mm256_fmadd_ps(qd, k1, dot[i][1]);
      }
    }
    const __m256 s0 = _mm256_loadu_ps(scales + b * TILE), s1 = _mm256_loadu_ps(scales + b * TILE + 8);
    for (int i = 0; i < HEADS; ++i) {
      score[i][0] = _mm256_fmadd_ps(dot[i][0], s0, score[i][0]);
      score[i][1] = _mm256_fmadd_ps(dot[i][1], s1, score[i][1]);
    }
  }
  // max(0, x) is x when x is NaN (MAXPS returns its second operand then), as relu.
  for (int i = 0; i < HEADS; ++i) {
    const __m256 wi = _mm256_broadcast_ss(w + i);
    logit[0] = _mm256_fmadd_ps(_mm256_max_ps(_mm256_setzero_ps(), score[i][0]), wi, logit[0]);
    logit[1] = _mm256_fmadd_ps(_mm256_max_ps(_mm256_setzero_ps(), score[i][1]), wi, logit[1]);
  }
}

NVFP4_TARGET_AVX2 void tile_logits_avx2(const void* q_row, const float* w, const TileShape& s, const void* tile_in,
                                        const float* scales, float* out) {
  const auto* q = static_cast<const float*>(q_row);
  const auto* tile = static_cast<const float*>(tile_in);
  __m256 logit[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  int64_t h = 0;
  for (; h + 4 <= s.heads; h += 4) add_heads_avx2<4>(q + h * s.head_dim, w + h, s, tile, scales, logit);
  for (; h < s.heads; ++h) add_heads_avx2<1>(q + h * s.head_dim, w + h, s, tile, scales, logit);
  _mm256_storeu_ps(out, logit[0]);
  _mm256_storeu_ps(out + 8, logit[1]);
}

// AVX-512: a tile row is one vector; 8 heads of accumulators.
template <int HEADS>
NVFP4_TARGET_AVX512 NVFP4_INLINE __m512 add_heads_avx512(const float* q, const float* w, const TileShape& s,
                                                          const float* tile, const float* scales, __m512 logit) {
  __m512 score[HEADS];
  for (int i = 0; i < HEADS; ++i) score[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < s.num_scales; ++b) {
    const int64_t first = b * s.quant_block_size;
    __m512 dot[HEADS];
    for (int i = 0; i < HEADS; ++i) dot[i] = _mm512_setzero_ps();
    for (int64_t d = first; d < first + s.quant_block_size; ++d) {
      const __m512 k = _mm512_loadu_ps(tile + d * TILE);
      for (int i = 0; i < HEADS; ++i) dot[i] = _mm512_fmadd_ps(_mm512_set1_ps(q[i * s.head_dim + d]), k, dot[i]);
    }
    const __m512 scale = _mm512_loadu_ps(scales + b * TILE);
    for (int i = 0; i < HEADS; ++i) score[i] = _mm512_fmadd_ps(dot[i], scale, score[i]);
  }
  for (int i = 0; i < HEADS; ++i)
    logit = _mm512_fmadd_ps(_mm512_max_ps(_mm512_setzero_ps(), score[i]), _mm512_set1_ps(w[i]), logit);
  return logit;
}

NVFP4_TARGET_AVX512 void tile_logits_avx512(const void* q_row, const float* w, const TileShape& s,
                                            const void* tile_in, const float* scales, float* out) {
  const auto* q = static_cast<const float*>(q_row);
  const auto* tile = static_cast<const float*>(tile_in);
  __m512 logit = _mm512_setzero_ps();
  int64_t h = 0;
  for (; h + 8 <= s.heads; h += 8) logit = add_heads_avx512<8>(q + h * s.head_dim, w + h, s, tile, scales, logit);
  for (; h < s.heads; ++h) logit = add_heads_avx512<1>(q + h * s.head_dim, w + h, s, tile, scales, logit);
  _mm512_storeu_ps(out, logit);
}

// AVX-512 BF16: one dot-product instruction multiplies a pair of dimensions of 16 keys by q's pair (exact
// products, float32 sums), twice the multiply-adds of an FMA. No denormal arises: the E4M3 values are normal in
// bf16 and every partial sum is a multiple of 2^-18, so the instruction's flushing changes nothing.
template <int HEADS>
NVFP4_TARGET_AVX512_BF16 NVFP4_INLINE __m512 add_heads_bf16(const uint8_t* q, const float* w, const TileShape& s,
                                                             const uint8_t* tile, const float* scales,
                                                             __m512 logit) {
  __m512 score[HEADS];
  for (int i = 0; i < HEADS; ++i) score[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < s.num_scales; ++b) {
    const int64_t first = b * s.quant_block_size / 2;
    __m512 dot[HEADS];
    for (int i = 0; i < HEADS; ++i) dot[i] = _mm512_setzero_ps();
    for (int64_t p = first; p < first + s.quant_block_size / 2; ++p) {
      const __m512bh k = (__m512bh)_mm512_loadu_si512(tile + p * TILE * 4);
      for (int i = 0; i < HEADS; ++i) {
        int32_t q_pair;
        std::memcpy(&q_pair, q + (i * s.head_dim + 2 * p) * 2, 4);
        dot[i] = _mm512_dpbf16_ps(dot[i], (__m512bh)_mm512_set1_epi32(q_pair), k);
      }
    }
    const __m512 scale = _mm512_loadu_ps(scales + b * TILE);
    for (int i = 0; i < HEADS; ++i) score[i] = _mm512_fmadd_ps(dot[i], scale, score[i]);
  }
  for (int i = 0; i < HEADS; ++i)
    logit = _mm512_fmadd_ps(_mm512_max_ps(_mm512_setzero_ps(), score[i]), _mm512_set1_ps(w[i]), logit);
  return logit;
}

NVFP4_TARGET_AVX512_BF16 void tile_logits_avx512_bf16(const void* q_row, const float* w, const TileShape& s,
                                                      const void* tile_in, const float* scales, float* out) {
  const auto* q = static_cast<const uint8_t*>(q_row);
  const auto* tile = static_cast<const uint8_t*>(tile_in);
  const int64_t q_head_bytes = s.head_dim * 2;
  __m512 logit = _mm512_setzero_ps();
  int64_t h = 0;
  for (; h + 8 <= s.heads; h += 8) logit = add_heads_bf16<8>(q + h * q_head_bytes, w + h, s, tile, scales, logit);
  for (; h < s.heads; ++h) logit = add_heads_bf16<1>(q + h * q_head_bytes, w + h, s, tile, scales, logit);
  _mm512_storeu_ps(out, logit);
}
#endif

struct LogitsKernels {
  decltype(&convert_keys_baseline) convert_keys;
  decltype(&decode_baseline) convert_queries;
  decltype(&tile_logits_baseline) tile_logits;

  static LogitsKernels get(const TileShape& s) {
#if NVFP4_X86
    // The BF16 dot product multiplies pairs of dimensions, which must not straddle two quant blocks; its key
    // conversion takes 32 dimensions at a time.
    if (cpu_isa() >= Isa::Avx512Bf16 && s.quant_block_size % 2 == 0 && s.head_dim % 32 == 0)
      return {convert_keys_avx512_bf16, decode_avx512_bf16, tile_logits_avx512_bf16};
    if (cpu_isa() >= Isa::Avx512) return {convert_keys_avx512, decode_avx512, tile_logits_avx512};
    if (cpu_isa() == Isa::Avx2) return {convert_keys_avx2, decode_avx2, tile_logits_avx2};
#endif
    return {convert_keys_baseline, decode_baseline, tile_logits_baseline};
  }
};

// --- tasks: (query rows, up to TILES_PER_TASK tiles of keys) ------------------------------------------------

// One thread's operands (floats, or bf16 in the same storage): a query row, and the tiles of a task's keys (at
// most `tiles`). Left uninitialized: every part read was written first.
struct Scratch {
  TileShape shape;
  std::unique_ptr<float[]> q, tiles, scales;

  Scratch(const TileShape& s, int64_t tiles)
      : shape(s), q(new float[s.heads * s.head_dim]), tiles(new float[tiles * s.head_dim * TILE]),
        scales(new float[tiles * s.num_scales * TILE]) {}
  float* tile(int64_t t) { return tiles.get() + t * shape.head_dim * TILE; }
  float* tile_scales(int64_t t) { return scales.get() + t * shape.num_scales * TILE; }
};

// A task's keys [first, first + count) and the part of them [lo, hi) some row of the task sees.
struct KeyBlock {
  int64_t first, count, lo, hi;
  int64_t tiles() const { return (count + TILE - 1) / TILE; }
  bool tile_seen(int64_t t, int64_t row_lo, int64_t row_hi) const {
    const int64_t key0 = first + t * TILE;
    return key0 < row_hi && std::min(key0 + TILE, first + count) > row_lo;
  }
};

// Converts the block's tiles that the task's rows see; `locate(key, keys, j)` fills lane j of `keys` with that
// key. Lanes past the block's end, or past what the rows see, repeat the tile's first seen key: their results
// are never stored, and keys nobody sees (a paged table's stale entries) are never looked up.
template <typename Locate>
void convert_block(const LogitsKernels& kernels, const KeyBlock& block, Scratch& scratch, Locate&& locate) {
  for (int64_t t = 0; t < block.tiles(); ++t) {
    if (!block.tile_seen(t, block.lo, block.hi)) continue;
    const int64_t key0 = std::max(block.first + t * TILE, block.lo);
    const int64_t end = std::min({block.first + (t + 1) * TILE, block.first + block.count, block.hi});
    TileKeys keys;
    for (int64_t j = 0; j < TILE; ++j) {
      const int64_t key = block.first + t * TILE + j;
      locate(key >= key0 && key < end ? key : key0, keys, j);
    }
    kernels.convert_keys(keys, scratch.shape, scratch.tile(t), scratch.tile_scales(t));
  }
}

// logits row[first, first + count) of one query row (its q bytes, weights) that sees keys [lo, hi): the formula
// on the seen tiles, -inf on every other column. No byte past the block's last column is written.
void row_logits(const LogitsKernels& kernels, const KeyBlock& block, Scratch& scratch, const uint8_t* q,
                const float* w, int64_t lo, int64_t hi, float* row) {
  const TileShape& s = scratch.shape;
  lo = std::max(lo, block.first);
  hi = std::min(hi, block.first + block.count);
  if (lo < hi) kernels.convert_queries(q, s.heads * s.head_dim, scratch.q.get());
  for (int64_t t = 0; t < block.tiles(); ++t) {
    const int64_t key0 = block.first + t * TILE, n = std::min<int64_t>(TILE, block.first + block.count - key0);
    float* out = row + key0;
    if (lo >= hi || !block.tile_seen(t, lo, hi)) {
      std::fill(out, out + n, NEG_INF);
      continue;
    }
    alignas(64) float values[TILE];
    kernels.tile_logits(scratch.q.get(), w, s, scratch.tile(t), scratch.tile_scales(t), values);
    for (int64_t j = 0; j < n; ++j) out[j] = key0 + j >= lo && key0 + j < hi ? values[j] : NEG_INF;
  }
}

void indexer_mqa_logits_cpu(const Tensor& q, const Tensor& k, const Tensor& k_scale, const Tensor& weights,
                            const Tensor& ks, const Tensor& ke, Tensor& logits) {
  const MqaLogitsShape shape = check_indexer_mqa_logits(q, k, k_scale, weights, ks, ke, logits);
  const TileShape s{shape.heads, shape.head_dim, shape.quant_block_size, shape.head_dim / shape.quant_block_size};
  const int64_t rows = shape.rows, keys = shape.keys;
  if (rows == 0 || keys == 0) return;
  const auto* q_bytes = static_cast<const uint8_t*>(q.const_data_ptr());
  const auto* k_bytes = static_cast<const uint8_t*>(k.const_data_ptr());
  const auto* scale_bytes = static_cast<const uint8_t*>(k_scale.const_data_ptr());
  const float* w = weights.const_data_ptr<float>();
  const int32_t* starts = ks.const_data_ptr<int32_t>();
  const int32_t* ends = ke.const_data_ptr<int32_t>();
  float* out = logits.mutable_data_ptr<float>();
  const int64_t k_stride = k.stride(0), scale_stride = k_scale.stride(0) * k_scale.element_size();
  const int64_t out_stride = logits.stride(0), q_row = s.heads * s.head_dim;
  const int64_t key_blocks = (keys + TILES_PER_TASK * TILE - 1) / (TILES_PER_TASK * TILE);
  const int64_t row_blocks = (rows + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
  const LogitsKernels kernels = LogitsKernels::get(s);
  auto seen = [&](int64_t m, int64_t& lo, int64_t& hi) {  // ranges are clamped to [0, keys)
    lo = std::max<int64_t>(starts[m], 0);
    hi = std::min<int64_t>(ends[m], keys);
  };
  auto locate = [&](int64_t key, TileKeys& tile, int64_t j) {
    tile.values[j] = k_bytes + key * k_stride;
    tile.scales[j] = scale_bytes + key * scale_stride;
  };
#pragma omp parallel if (rows * keys * q_row >= PARALLEL_MIN_MACS)
  {
    Scratch scratch(s, std::min(TILES_PER_TASK, (keys + TILE - 1) / TILE));
#pragma omp for schedule(dynamic)
    for (int64_t task = 0; task < row_blocks * key_blocks; ++task) {
      const int64_t r0 = task / key_blocks * ROWS_PER_TASK, r1 = std::min(r0 + ROWS_PER_TASK, rows);
      KeyBlock block{task % key_blocks * TILES_PER_TASK * TILE, 0, keys, 0};
      block.count = std::min(TILES_PER_TASK * TILE, keys - block.first);
      for (int64_t m = r0; m < r1; ++m) {  // the union of the rows' ranges within the block
        int64_t lo, hi;
        seen(m, lo, hi);
        lo = std::max(lo, block.first);
        hi = std::min(hi, block.first + block.count);
        if (lo < hi) {
          block.lo = std::min(block.lo, lo);
          block.hi = std::max(block.hi, hi);
        }
      }
      convert_block(kernels, block, scratch, locate);
      for (int64_t m = r0; m < r1; ++m) {
        int64_t lo, hi;
        seen(m, lo, hi);
        row_logits(kernels, block, scratch, q_bytes + m * q_row, w + m * s.heads, lo, hi, out + m * out_stride);
      }
    }
  }
}

void indexer_paged_mqa_logits_cpu(const Tensor& q, const Tensor& kv_cache, const Tensor& weights,
                                  const Tensor& context_lens, const Tensor& block_table, int64_t quant_block_size,
                                  Tensor& logits) {
  const PagedMqaLogitsShape shape =
      check_indexer_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, quant_block_size, logits);
  const IndexerCacheLayout& layout = shape.layout;
  const TileShape s{shape.heads, layout.head_dim, layout.quant_block_size, layout.num_scales()};
  const int64_t batch = shape.batch, next_n = shape.next_n, columns = shape.columns;
  const int32_t* table = block_table.const_data_ptr<int32_t>();
  const int32_t* lens = context_lens.const_data_ptr<int32_t>();
  const int64_t table_stride = block_table.stride(0);
  check_paged_block_ids("indexer_paged_mqa_logits", table, table_stride, lens, batch, next_n, columns,
                        layout.block_size, kv_cache.size(0));
  if (batch == 0 || next_n == 0 || columns == 0) return;
  const auto* q_bytes = static_cast<const uint8_t*>(q.const_data_ptr());
  const auto* cache = static_cast<const uint8_t*>(kv_cache.const_data_ptr());
  const float* w = weights.const_data_ptr<float>();
  float* out = logits.mutable_data_ptr<float>();
  const int64_t block_stride = kv_cache.stride(0), out_stride = logits.stride(0), q_row = s.heads * s.head_dim;
  const int64_t key_blocks = (columns + TILES_PER_TASK * TILE - 1) / (TILES_PER_TASK * TILE);
  const LogitsKernels kernels = LogitsKernels::get(s);
  auto seen = [&](int64_t row) { return std::clamp<int64_t>(lens[row], 0, columns); };  // keys [0, seen)
#pragma omp parallel if (batch * next_n * columns * q_row >= PARALLEL_MIN_MACS)
  {
    Scratch scratch(s, std::min(TILES_PER_TASK, (columns + TILE - 1) / TILE));
#pragma omp for schedule(dynamic)
    for (int64_t task = 0; task < batch * key_blocks; ++task) {
      // The request's next_n query tokens share its pages: one conversion of the block's keys serves them all.
      const int64_t b = task / key_blocks;
      KeyBlock block{task % key_blocks * TILES_PER_TASK * TILE, 0, 0, 0};
      block.count = std::min(TILES_PER_TASK * TILE, columns - block.first);
      for (int64_t j = 0; j < next_n; ++j) block.hi = std::max(block.hi, seen(b * next_n + j));
      block.lo = block.first;
      block.hi = std::min(block.hi, block.first + block.count);
      const int32_t* pages = table + b * table_stride;
      convert_block(kernels, block, scratch, [&](int64_t c, TileKeys& tile, int64_t j) {
        const uint8_t* base = cache + pages[c / layout.block_size] * block_stride;
        const int64_t token = c % layout.block_size;
        tile.values[j] = base + layout.value_offset(token);
        tile.scales[j] = base + layout.scale_offset(token);
      });
      for (int64_t j = 0; j < next_n; ++j) {
        const int64_t row = b * next_n + j;
        row_logits(kernels, block, scratch, q_bytes + row * q_row, w + row * s.heads, 0, seen(row),
                   out + row * out_stride);
      }
    }
  }
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(vllm_nvfp4, CPU, m) {
  m.impl("indexer_mqa_logits", TORCH_BOX(&indexer_mqa_logits_cpu));
  m.impl("indexer_paged_mqa_logits", TORCH_BOX(&indexer_paged_mqa_logits_cpu));
}

}  // namespace vllm_nvfp4
