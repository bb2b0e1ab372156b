// CPU kernel of nvfp4_paged_attention (schema in library.cpp, argument checks in checks.h): attention read
// straight from the NVFP4 pages, for decode, prefill and chunked prefill of a whole batch in one call.
//
// Work. A unit is (request, KV head, block of query rows); the block's rows times the G = Hq / Hkv query heads
// of the KV head ("pairs") share every dequantized tile of 16 keys. Keys are cut at fixed positions into splits
// of SPLIT keys. Each pair attends split by split (an online softmax over the split's tiles), and the splits'
// partial results (max, sum, weighted values) are merged in split order by one function. A unit runs either as
// one task that merges as it goes, or, for decode-sized units of a small batch, as one task per split whose
// partials a second pass merges. Both run the same operations in the same order, so a result depends neither on
// the plan nor on the thread count, nor on the other rows of its unit: a prompt fed in chunks gives the bytes
// of the prompt in one step, and a decode row those of the same row in a prefill where both take the same code
// (prefill below).
//
// Arithmetic, per tile of 16 keys: the keys' E2M1 codes are transposed (16 x 16 blocks of 32-bit words) so that
// a vector holds one dimension of the 16 keys, decoded to e2m1 values and multiplied by each query's broadcast
// element: one fused multiply-add per dimension and a block scale per group give 16 scores, no horizontal sums.
// Values are decoded by rows as e2m1 · SF and accumulated with the probabilities broadcast. Scores, softmax and sums
// are float32; k_scale is folded into the score scale and v_scale into the final 1 / sum. Like cpu_ops.cpp,
// the tile kernel exists as AVX-512, AVX2 (a tile's halves of 8 keys, Avx2) and baseline x86-64 code (cpu_isa.h),
// and for bf16 queries over NVFP4 keys as AVX512-BF16 code, whose scores are bf16 dot products (exact products, float32
// sums in another order), and as AMX-BF16 code: scores are tile products of the bf16 queries and the keys decoded to
// bf16 (e2m1 · SF is a bf16 value), so every product is exact; the weighted sums are tile products of the values
// decoded to bf16 and each probability split into a bf16 high part plus a bf16 low part (within 2^-16 of it), float32
// sums. Each output element of a tile product is its own pair's sum, whatever the tile's other rows hold.
//
// Prefill of bf16 queries over NVFP4 keys (requests of PREFILL_MIN_ROWS query rows or more) takes a split at a time
// where the CPU has AVX512-BF16 (Bf16Split; with AMX, Amx::attend_split for head 64, the per-tile AMX code for the
// other sizes): the split's tiles are decoded once, and each group of 16 pairs, one a vector lane, takes all its
// scores first, keys by pairs, so that a pair's max over the split is a vector maximum, then its probabilities
// against that max (2^x of logits in log2 units) and their weighted sums, never rescaled: AVX512-BF16 dot products
// and float32 fused multiply-adds of the probabilities by each value broadcast, or AMX tiles that hold the sums for
// the whole split. Shorter requests take the per-tile AVX512-BF16 code on such a CPU (with AMX, a tile product per
// group of 16 dimensions for its scores, Amx::group_scores; tiles for the weighted sums too made decode slower), so
// there a decode row, or a chunk that short, matches the same row in a longer step to the accuracy contract
// (rel-L2 1e-3), not byte for byte; chunks of PREFILL_MIN_ROWS rows or more give the bytes of the whole prompt, and
// the other guarantees above hold for every variant.
//
// Model features. A sliding window starts a unit's keys at its first row's window: older keys, and splits and
// tiles holding none of the unit's keys, are never read; inside a tile each row masks its own window edge. Tiles
// stay at multiples of TILE, so a key's lane, and with it every sum, is the same whichever row reads it. The
// soft-cap maps each fully scaled logit (scale · k_scale · q · k) before the softmax; a head's sink joins the
// denominator when its rows are written.
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include "checks.h"
#include "cpu_isa.h"
#include "cpu_simd.h"
#include "error.h"
#include "layout.h"
#include "quant.h"

namespace vllm_nvfp4 {
namespace {

using simd::f32x16;
using simd::f32x8;
using simd::i32x16;
using simd::u32x16;
using simd::u32x8;
using torch::headeronly::ScalarType;

constexpr int TILE = 16;            // keys a tile holds, one per vector lane
constexpr int64_t SPLIT = 512;      // keys a split holds; splits start at multiples of SPLIT
constexpr int64_t UNIT_PAIRS = 32;  // (query row, head) pairs a unit holds, at least one row
// Pairs a unit holds in requests of PREFILL_MIN_ROWS query rows or more (prefill): a unit's pairs share each decoded
// tile, and a causal prompt decodes each tile once for every unit after it (benchmarks/results/cpu_attention.md).
constexpr int64_t PREFILL_UNIT_PAIRS = 192;
// Units of at most SPLIT_UNIT_ROWS rows run one task per split when the batch has fewer than SPLIT_BATCH_UNITS
// units (decode of a small batch: a unit per KV head leaves threads idle), within PARTIAL_FLOATS_MAX of partials.
constexpr int64_t SPLIT_UNIT_ROWS = 4;
constexpr int64_t SPLIT_BATCH_UNITS = 64;
constexpr int64_t PARTIAL_FLOATS_MAX = int64_t{1} << 25;
// Below this many (pair, key) scores (about 0.1 ms of work) a call runs on one thread: waking the OpenMP team
// costs more.
constexpr int64_t PARALLEL_MIN_SCORES = int64_t{1} << 12;
// Requests of fewer query rows (decode, speculative decode, short chunks) take the per-tile code: a vector of 16 pairs
// would hold a decode row's few heads, and where the CPU has AMX, decode ran up to 1.6x slower with tiles for the
// weighted sums too.
constexpr int64_t PREFILL_MIN_ROWS = 16;
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
constexpr float LOG2E = 1.44269504088896341f, LN2 = 0.693147180559945309f;

#define NVFP4_INLINE inline __attribute__((always_inline))

// Flushes denormal floats to zero (MXCSR's FTZ and DAZ) on the thread for its lifetime, then restores the caller's
// mode. Probabilities near exp(-87) times small values, and sums rescaled by tiny factors, are denormal, and on Intel
// cores each such result takes a microcode assist: a decode over random caches ran 1.6x slower with them. What they
// would add lies far below the accuracy contract, and every thread flushes alike, so results stay independent of the
// thread count. (The AVX512-BF16 and AMX dot products flush whatever the mode.)
struct FlushDenormals {
#if NVFP4_X86
  const unsigned saved = _mm_getcsr();
  FlushDenormals() { _mm_setcsr(saved | 0x8040); }
  ~FlushDenormals() { _mm_setcsr(saved); }
#endif
};

// --- what every task reads ------------------------------------------------------------------------------

struct Batch {
  NVFP4PageLayout layout;
  int64_t group;  // query heads per KV head
  const uint8_t* key_base;
  const uint8_t* value_base;
  int64_t key_block_stride, value_block_stride;
  const int32_t* block_table;
  int64_t table_stride;
  float score_scale;  // scale · k_scale
  float v_global;
  bool causal;
  int64_t window;                         // > 0: the query at position p sees keys > p - window
  float soft_cap;                         // > 0: a scaled logit s becomes soft_cap · tanh(s / soft_cap)
  const float* sinks;                     // [Hq] logits that join the softmax's denominator, or null
  int64_t v_scale_delta[4][NVFP4_GROUP];  // V scale s of token t: scale_offset(t - t % 4, h, 0, false) + [t % 4][s]
};

struct Unit {
  int64_t request, kv_head;
  int64_t row0, rows;  // query rows [row0, row0 + rows) of the batch
  int64_t pos0;        // the context position of row0
  int64_t seq_len;
  int64_t key_begin, key_end;  // keys [key_begin, key_end) are seen by some row; no other key is read
  int64_t partials;            // offset of the unit's per-split partials, or -1: one task merges as it goes
  bool prefill;                // the request has PREFILL_MIN_ROWS query rows or more

  // The splits holding the unit's keys, [split_begin(), split_end()).
  int64_t split_begin() const { return key_begin / SPLIT; }
  int64_t split_end() const { return (key_end + SPLIT - 1) / SPLIT; }
  int64_t num_splits() const { return split_end() - split_begin(); }
  // Keys [visible_begin(i), visible_end(i)) are seen by row row0 + i.
  int64_t visible_begin(const Batch& b, int64_t i) const {
    return b.window > 0 ? std::max<int64_t>(0, pos0 + i - b.window + 1) : 0;
  }
  int64_t visible_end(const Batch& b, int64_t i) const { return b.causal ? pos0 + i + 1 : seq_len; }
  // Rows [first_row_seeing(lo), end_row_seeing(hi)) see some key of [lo, hi]: with a causal mask rows see growing
  // prefixes, and a window leaves the oldest keys behind as rows advance.
  int64_t first_row_seeing(const Batch& b, int64_t lo) const {
    return b.causal ? std::clamp<int64_t>(lo - pos0, 0, rows) : 0;
  }
  int64_t end_row_seeing(const Batch& b, int64_t hi) const {
    return b.window > 0 ? std::clamp<int64_t>(hi + b.window - pos0, 0, rows) : rows;
  }
};

// The softmax state of `pairs` (query row, head) pairs over some keys: running max m, sum l and the
// probability-weighted values acc [pairs][D]. l == 0: no key seen.
struct State {
  std::unique_ptr<float[]> m, l, acc;
  State(int64_t pairs, int64_t head_size)
      : m(new float[pairs]), l(new float[pairs]), acc(new float[pairs * head_size]) {}
};

// One thread's buffers. Left uninitialized: every part read was written first. AMX tiles of 16 pairs read and
// write up to 15 rows past the last pair: q_bf16 and probs have those rows, zeroed, and what lands there is unused.
struct Scratch {
  int64_t head_size;
  std::unique_ptr<float[]> q;              // [pairs][D] float32 queries
  std::unique_ptr<uint32_t[]> q_bf16;      // [pairs + 15][D / 2]: bf16 queries in pair_scores_bf16's order
  std::unique_ptr<float[]> keys;           // [D][TILE]: dimension d of the tile's keys (bf16 pairs: [D / 2][TILE])
  std::unique_ptr<float[]> values;         // [TILE][D] (AMX: [D / 16][TILE][16] bf16 pairs)
  std::unique_ptr<float[]> probs;          // [pairs + 15][TILE]
  std::unique_ptr<float[]> alpha;          // [pairs]: the factor that rescales a pair's sums for this tile
  std::unique_ptr<uint16_t[]> prob_parts;  // AMX: [16][2][TILE] bf16 high and low parts of 16 pairs' probabilities
  std::unique_ptr<float[]> tile_sums;      // AMX: [16][D] 16 pairs' weighted values of one tile
  // Prefill of bf16 queries (Bf16Split, and Amx for head 64), allocated on first use: one split's keys and values
  // decoded (Bf16Split::decode_tile, Amx::decode_tile), and a group of 16 pairs' logits over the split.
  std::unique_ptr<uint32_t[]> split_keys;
  std::unique_ptr<float[]> split_values;
  std::unique_ptr<float[]> split_logits;
  State split, total;

  Scratch(int64_t pairs, int64_t head_size)
      : head_size(head_size),
        q(new float[pairs * head_size]),
        q_bf16(new uint32_t[(pairs + 15) * head_size / 2]()),
        keys(new float[head_size * TILE]),
        values(new float[TILE * head_size]),
        probs(new float[(pairs + 15) * TILE]()),
        alpha(new float[pairs]),
        prob_parts(new uint16_t[2 * 16 * TILE]),
        tile_sums(new float[16 * head_size]),
        split(pairs, head_size),
        total(pairs, head_size) {}

  void allocate_split() {
    if (split_keys) return;
    split_keys.reset(new uint32_t[SPLIT * head_size / 2]);
    split_values.reset(new float[SPLIT * head_size]);
    split_logits.reset(new float[SPLIT * 16]);
  }
};

// --- vector helpers -------------------------------------------------------------------------------------

NVFP4_INLINE f32x16 load(const float* p) { return simd::load16(p); }
NVFP4_INLINE void store(f32x16 v, float* p) { simd::store16(v, p); }
// A shuffle of lane 0, which compiles to one broadcast (f32x16{} + x is an addition the compiler must keep
// without fast math, and a 16-element initializer is built lane by lane).
NVFP4_INLINE f32x16 broadcast(float x) {
  const f32x16 v = {x};
  return __builtin_shufflevector(v, v, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
}
// x in every lane of a 16- or 8-lane vector (a constant folds; a variable takes a broadcast of its width).
template <typename V>
NVFP4_INLINE V splat(float x) {
  if constexpr (sizeof(V) == sizeof(f32x16)) {
    return broadcast(x);
  } else {
    const f32x8 v = {x};
    return __builtin_shufflevector(v, v, 0, 0, 0, 0, 0, 0, 0, 0);
  }
}
NVFP4_INLINE u32x16 broadcast_word(uint32_t x) {
  const u32x16 v = {x};
  return __builtin_shufflevector(v, v, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
}

// a · b + c: fused on AVX-512 and on Avx2's 8-lane vectors; the baseline rounds the product first.
template <Isa I>
struct Fma {
  static inline f32x16 apply(f32x16 a, f32x16 b, f32x16 c) { return a * b + c; }
};
#if NVFP4_X86
template <>
struct Fma<Isa::Avx2> {  // Avx2's 8-lane vectors: fused
  NVFP4_TARGET_AVX2 static inline f32x8 apply(f32x8 a, f32x8 b, f32x8 c) {
    return __builtin_bit_cast(f32x8, _mm256_fmadd_ps(__builtin_bit_cast(__m256, a), __builtin_bit_cast(__m256, b),
                                                     __builtin_bit_cast(__m256, c)));
  }
};
template <>
struct Fma<Isa::Avx512> {
  NVFP4_TARGET_AVX512 static inline f32x16 apply(f32x16 a, f32x16 b, f32x16 c) {
    return __builtin_bit_cast(f32x16, _mm512_fmadd_ps(__builtin_bit_cast(__m512, a), __builtin_bit_cast(__m512, b),
                                                      __builtin_bit_cast(__m512, c)));
  }
};
#endif

#if NVFP4_X86
template <>
struct Fma<Isa::Avx512Bf16> : Fma<Isa::Avx512> {};
template <>
struct Fma<Isa::Amx> : Fma<Isa::Avx512> {};
#endif

// The 16 bytes at p as 32-bit lanes (GCC builds __builtin_convertvector of bytes lane by lane).
template <Isa I>
struct Widen {
  static inline u32x16 bytes(const uint8_t* p) {
    simd::u8x16 v;
    std::memcpy(&v, p, sizeof v);
    return __builtin_convertvector(v, u32x16);
  }
};
#if NVFP4_X86
template <>
struct Widen<Isa::Avx512> {
  NVFP4_TARGET_AVX512 static inline u32x16 bytes(const uint8_t* p) {
    return __builtin_bit_cast(u32x16, _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
};
template <>
struct Widen<Isa::Avx512Bf16> : Widen<Isa::Avx512> {};
template <>
struct Widen<Isa::Amx> : Widen<Isa::Avx512> {};

// AVX512-BF16 scores (bf16 queries): E2M1 values and a bf16 query are exact in bf16, and their products in float32,
// so one dot-product instruction takes two dimensions of 16 keys where fused multiply-adds take one.
struct Bf16 {
  typedef uint16_t u16x32 __attribute__((vector_size(64)));
  // Lane j: the bf16 values of codes (words[j] >> shift) & 0xF and (words[j] >> (16 + shift)) & 0xF. vpermw reads 5
  // bits of each 16-bit index, so the table of the 16 E2M1 values is there twice.
  NVFP4_TARGET_AVX512_BF16 static inline u32x16 e2m1_pairs(u32x16 words, int shift) {
    const u16x32 table = {0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0, 0x8000, 0xBF00, 0xBF80,
                          0xBFC0, 0xC000, 0xC040, 0xC080, 0xC0C0, 0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040,
                          0x4080, 0x40C0, 0x8000, 0xBF00, 0xBF80, 0xBFC0, 0xC000, 0xC040, 0xC080, 0xC0C0};
    const u16x32 index = __builtin_bit_cast(u16x32, words) >> shift;
    return __builtin_bit_cast(
        u32x16, _mm512_permutexvar_epi16(__builtin_bit_cast(__m512i, index), __builtin_bit_cast(__m512i, table)));
  }
  // Both bf16 halves of each lane times the lane's float32 scale; exact where the products are bf16 values, as
  // E2M1 values times E4M3 block scales are (at most 6 significant bits, exponents within float32's).
  NVFP4_TARGET_AVX512_BF16 static inline u32x16 scale_pairs(u32x16 pairs, f32x16 scale) {
    const u32x16 low = simd::as_u32(simd::as_f32(pairs << 16) * scale);
    const u32x16 high = simd::as_u32(simd::as_f32(pairs & 0xFFFF0000u) * scale);
    return (low >> 16) | (high & 0xFFFF0000u);
  }
  // acc + a.lo · b.lo + a.hi · b.hi in each lane, a and b pairs of bf16.
  NVFP4_TARGET_AVX512_BF16 static inline f32x16 dot(f32x16 acc, u32x16 a, u32x16 b) {
    return __builtin_bit_cast(f32x16, _mm512_dpbf16_ps(__builtin_bit_cast(__m512, acc), __builtin_bit_cast(__m512bh, a),
                                                       __builtin_bit_cast(__m512bh, b)));
  }
};
#endif

// E2M1 values of the codes in the low 4 bits of each lane (higher bits ignored). AVX-512: one table permute.
// Otherwise from bits, as quant.h's e2m1_decode (a variable permute of 16 lanes has no single AVX2 or SSE2
// instruction, and the compiler would build it lane by lane).
template <Isa I>
NVFP4_INLINE f32x16 e2m1_values(u32x16 codes) {
  if constexpr (I >= Isa::Avx512) {
    return __builtin_shuffle(simd::E2M1_VALUES, codes);  // indices are taken modulo 16
  } else {
    const u32x16 m = codes & 7u;
    const u32x16 normal = ((126u + (m >> 1)) << 23) | ((m & 1u) << 22);  // 2^((m >> 1) - 1) · (1 + (m & 1) / 2)
    const u32x16 small = m * 0x3F000000u;                                // codes 0 and 1: 0 and 0.5
    return simd::as_f32(simd::select(simd::greater_mask(simd::i32x16{} + 2, simd::as_i32(m)), small, normal) |
                        ((codes & 8u) << 28));
  }
}

// exp(x) for x <= 0 (Cephes' expf: x = n·ln 2 + r, |r| <= ln2 / 2, a degree-7 polynomial, times 2^n), within
// 2 ulp; below -87 it returns exp(-87) instead of a denormal or 0 (callers mask the lanes that must be 0). 16 lanes,
// or 8 (the AVX2 tile code).
template <Isa I, typename V>
inline V exp_nonpositive(V x) {
  using F = Fma<I>;
  using U = decltype(simd::as_u32(x));
  using S = decltype(simd::as_i32(U{}));
  x = simd::max(x, splat<V>(-87.0f));
  const V round = splat<V>(12582912.0f);  // 1.5 · 2^23: adding it rounds to an integer
  const V n = (x * 1.44269504088896341f + round) - round;
  V r = F::apply(n, splat<V>(-0.693359375f), x);  // ln 2 in two parts: n · ln2_hi is exact
  r = F::apply(n, splat<V>(2.12194440e-4f), r);
  V y = splat<V>(1.9875691500e-4f);
  y = F::apply(y, r, splat<V>(1.3981999507e-3f));
  y = F::apply(y, r, splat<V>(8.3334519073e-3f));
  y = F::apply(y, r, splat<V>(4.1665795894e-2f));
  y = F::apply(y, r, splat<V>(1.6666665459e-1f));
  y = F::apply(y, r, splat<V>(5.0000001201e-1f));
  y = F::apply(y, r * r, r + 1.0f);
  const U scale = __builtin_convertvector(__builtin_convertvector(n, S) + 127, U) << 23;
  return y * simd::as_f32(scale);
}

template <Isa I>
inline float exp_nonpositive(float x) {
  return exp_nonpositive<I>(broadcast(x))[0];
}

// cap · tanh(s · inverse_cap), tanh as Cephes' tanhf: an odd polynomial below |x| = 0.625, where 1 - 2 / (e^2|x| + 1)
// would lose bits, that formula above it (through e^-2|x|, which stays in exp_nonpositive's range); the sign put back.
template <Isa I, typename V>
inline V soft_cap(V s, float cap, float inverse_cap) {
  using F = Fma<I>;
  using U = decltype(simd::as_u32(s));
  const V x = s * inverse_cap;
  const U sign = simd::as_u32(x) & 0x80000000u;
  const V a = simd::as_f32(simd::as_u32(x) & 0x7FFFFFFFu);
  const V z = a * a;
  V y = F::apply(splat<V>(-5.70498872745e-3f), z, splat<V>(2.06390887954e-2f));
  y = F::apply(y, z, splat<V>(-5.37397155531e-2f));
  y = F::apply(y, z, splat<V>(1.33314422036e-1f));
  y = F::apply(y, z, splat<V>(-3.33332819422e-1f));
  const V small = F::apply(y * z, a, a);
  const V e = exp_nonpositive<I>(a * -2.0f);
  const V large = 1.0f - (e + e) / (1.0f + e);
  // non-negative floats compare like their bits
  constexpr bool native = I >= Isa::Avx512 || sizeof(V) == sizeof(f32x8);
  const U t = simd::where_greater<native>(simd::as_i32(simd::as_u32(splat<V>(0.625f))), simd::as_i32(simd::as_u32(a)),
                                          simd::as_u32(small), simd::as_u32(large));
  return simd::as_f32(t | sign) * cap;
}

// Every lane ends up holding the maximum / the sum of the 8 lanes (a fixed pairwise order).
NVFP4_INLINE float lanes_max(f32x8 v) {
  v = simd::max(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3));
  v = simd::max(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5));
  return simd::max(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6))[0];
}
NVFP4_INLINE float lanes_sum(f32x8 v) {
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5);
  return (v + __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6))[0];
}
// The same over 16 lanes: fold the high half onto the low one, then the 8-lane order.
NVFP4_INLINE f32x8 low_half(f32x16 v) { return __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7); }
NVFP4_INLINE f32x8 high_half(f32x16 v) { return __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15); }
NVFP4_INLINE float lanes_max(f32x16 v) { return lanes_max(simd::max(low_half(v), high_half(v))); }
NVFP4_INLINE float lanes_sum(f32x16 v) { return lanes_sum(low_half(v) + high_half(v)); }

// LANE_MASKS[n]: all ones in lanes 0..n-1.
struct LaneMasks {
  u32x16 mask[TILE + 1];
  LaneMasks() {
    for (int n = 0; n <= TILE; ++n)
      for (int j = 0; j < TILE; ++j) mask[n][j] = j < n ? ~0u : 0u;
  }
};
const LaneMasks LANE_MASKS;

// Transposes a 16 x 16 matrix of 32-bit words in four rounds; round s swaps the off-diagonal s x s blocks of
// each 2s x 2s block (rows i and i + s exchange their lanes of bit s). ROWS 8: rows 0-7 hold two 8 x 8 matrices,
// one per half of the lanes, and the last three rounds transpose each.
template <int ROWS>
NVFP4_INLINE void transpose_words(u32x16 (&m)[16]) {
  if constexpr (ROWS == 16)
    for (int i = 0; i < 8; ++i) {
      const u32x16 a = m[i], b = m[i + 8];
      m[i] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
      m[i + 8] = __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    }
  for (int i = 0; i < ROWS; i += 8)
    for (int k = i; k < i + 4; ++k) {
      const u32x16 a = m[k], b = m[k + 4];
      m[k] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27);
      m[k + 4] = __builtin_shufflevector(a, b, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
    }
  for (int i = 0; i < ROWS; i += 4)
    for (int k = i; k < i + 2; ++k) {
      const u32x16 a = m[k], b = m[k + 2];
      m[k] = __builtin_shufflevector(a, b, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29);
      m[k + 2] = __builtin_shufflevector(a, b, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
    }
  for (int k = 0; k < ROWS; k += 2) {
    const u32x16 a = m[k], b = m[k + 1];
    m[k] = __builtin_shufflevector(a, b, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30);
    m[k + 1] = __builtin_shufflevector(a, b, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
  }
}

// --- one tile ---------------------------------------------------------------------------------------------

// quant.h's e4m3_decode of every byte: a value row's block scales are table loads.
struct E4m3Values {
  float value[256];
  E4m3Values() {
    for (int code = 0; code < 256; ++code) value[code] = e4m3_decode(static_cast<uint8_t>(code));
  }
};
const E4m3Values E4M3;

// E2M1_VALUES times the e4m3 value of every scale byte: a value group's 16 possible values are one table load, not
// a broadcast and a multiply (16 KB, which stays in L1).
struct ScaledE2m1 {
  alignas(64) float row[256][TILE];
  ScaledE2m1() {
    for (int code = 0; code < 256; ++code) store(simd::E2M1_VALUES * E4M3.value[code], row[code]);
  }
};
const ScaledE2m1 SCALED_E2M1;

// Where a tile's keys sit: per key, its codes (FP8 keys: its bytes) and scales on both sides. Tiles start at multiples
// of TILE, so a key has the same lane whatever range of keys is read; lanes outside [first, n) hold no key and are not
// read.
struct TileTokens {
  int first, n;
  const uint8_t* key_data[TILE];
  const uint8_t* key_scales[TILE];
  const uint8_t* value_data[TILE];
  const uint8_t* value_scales[TILE];  // scale_offset(t - t % 4, h, 0, false)
  const int64_t* value_delta[TILE];   // the rows of Batch::v_scale_delta for t % 4
};

// Walks a request's pages tile by tile.
struct TileCursor {
  const Batch& b;
  const int32_t* pages;
  int64_t kv_head, page, offset;

  TileCursor(const Batch& b, const Unit& u, int64_t key)
      : b(b),
        pages(b.block_table + u.request * b.table_stride),
        kv_head(u.kv_head),
        page(key / b.layout.block_size),
        offset(key % b.layout.block_size) {}

  // Locates the next keys, lanes [first, n) of a tile, and asks the memory system for their bytes. The keys of one
  // page are rows a fixed step apart, so each page's run of keys is located once. Prefetches go key by key: the
  // lines of a key's rows together (fetched stream by stream, the tiles of long contexts ran up to 1.4x slower).
  void next(int first, int n, TileTokens& t) {
    const NVFP4PageLayout& layout = b.layout;
    t.first = first;
    t.n = n;
    const int64_t key_bytes = layout.key_format == KeyFormat::Nvfp4 ? layout.data_dim() : layout.head_size;
    const int64_t key_scale_bytes = layout.int8_keys() ? INT8_KEY_SCALE_BYTES : layout.scale_dim();
    const int64_t step = layout.token_step();
    for (int j = first; j < n;) {
      const int run = static_cast<int>(std::min<int64_t>(n - j, layout.block_size - offset));
      const uint8_t* key_side = b.key_base + pages[page] * b.key_block_stride;
      const uint8_t* value_side = b.value_base + pages[page] * b.value_block_stride;
      const int64_t entry = layout.entry_index(offset, kv_head);
      const uint8_t* key_data = key_side + entry * key_bytes;
      const uint8_t* key_scales = key_side + (layout.int8_keys() ? layout.int8_key_scale_offset(offset, kv_head)
                                                                 : layout.scale_offset(offset, kv_head, 0, false));
      const uint8_t* value_data = value_side + entry * layout.data_dim();
      const uint8_t* value_scales = value_side + layout.scale_offset(offset, kv_head, 0, false);
      for (int i = 0; i < run; ++i) {
        const int64_t r = (offset + i) & 3;
        t.key_data[j + i] = key_data + i * step * key_bytes;
        t.key_scales[j + i] = key_scales + i * step * key_scale_bytes;
        t.value_data[j + i] = value_data + i * step * layout.data_dim();
        t.value_scales[j + i] = value_scales + (i - r) * step * layout.scale_dim();
        t.value_delta[j + i] = b.v_scale_delta[r];
        if (!layout.fp8_keys()) __builtin_prefetch(t.key_scales[j + i]);
        for (int64_t line = 0; line < key_bytes; line += 64) __builtin_prefetch(t.key_data[j + i] + line);
        for (int64_t line = 0; line < layout.data_dim(); line += 64) __builtin_prefetch(t.value_data[j + i] + line);
        __builtin_prefetch(t.value_scales[j + i]);
      }
      j += run;
      offset += run;
      if (offset == layout.block_size) {
        offset = 0;
        ++page;
      }
    }
  }
};

// The keys [begin, end) of one split of a unit.
struct KeyRange {
  int64_t begin, end;
};

// Starts a split: each pair's max at -inf and sum at 0 (the caller sets its sums of values); returns the split's keys.
NVFP4_INLINE KeyRange start_split(const Batch& b, const Unit& u, int64_t split, State& st) {
  const int64_t pairs = u.rows * b.group;
  std::fill(st.m.get(), st.m.get() + pairs, NEG_INF);
  std::fill(st.l.get(), st.l.get() + pairs, 0.0f);
  return {std::max(split * SPLIT, u.key_begin), std::min((split + 1) * SPLIT, u.key_end)};
}

// The tiles over keys [key_begin, key_end), each one's keys fetched while the tile before it is worked on:
//   for (TileWalk walk(b, u, key_begin, key_end); walk.next();) ...
// A walker, not a function taking each tile's work as a lambda: a lambda's body is compiled without the caller's
// target attribute, and GCC turned the AVX-512 and AMX helpers in one into scalar code.
class TileWalk {
 public:
  NVFP4_INLINE TileWalk(const Batch& b, const Unit& u, int64_t key_begin, int64_t key_end)
      : cursor(b, u, key_begin), end(key_end), key(key_begin - key_begin % TILE) {
    cursor.next(static_cast<int>(key_begin - key), static_cast<int>(std::min<int64_t>(TILE, key_end - key)), tiles[0]);
    key -= TILE;
  }

  // Moves to the next tile and fetches the keys of the one after it; false past the last tile.
  NVFP4_INLINE bool next() {
    key += TILE;
    if (key >= end) return false;
    i ^= 1;
    if (key + TILE < end) cursor.next(0, static_cast<int>(std::min<int64_t>(TILE, end - key - TILE)), tiles[i ^ 1]);
    return true;
  }

  NVFP4_INLINE const TileTokens& tokens() const { return tiles[i]; }
  NVFP4_INLINE int64_t key0() const { return key; }  // the tile's first key, a multiple of TILE

 private:
  TileCursor cursor;
  TileTokens tiles[2];  // this tile's keys, and the next one's
  int64_t end, key;
  int i = 1;  // tiles[i] is this tile
};

// keys[d][j] = e2m1 of dimension d of key j (zeros outside lanes [first, n)) and scales[s][j] = its block scale s.
// Key j's 8 code bytes per 16 dimensions, read as 32-bit words (word w: dimensions 8w..8w+7, low nibble first), are
// transposed so that word w of all keys is one vector; nibble e of it is dimension 8w + e of the 16 keys.
template <Isa I, int D>
NVFP4_INLINE void decode_keys(const TileTokens& t, float* keys, f32x16 (&scales)[D / NVFP4_GROUP]) {
  constexpr int WORDS = D / 8, SCALE_WORDS = D / NVFP4_GROUP / 4;
  // The block scales, four a word; scale_words[w][j]: scales 4w..4w+3 of key j.
  alignas(64) uint32_t scale_words[SCALE_WORDS][TILE] = {};
  for (int j = t.first; j < t.n; ++j)
    for (int w = 0; w < SCALE_WORDS; ++w) std::memcpy(&scale_words[w][j], t.key_scales[j] + 4 * w, 4);
  for (int w = 0; w < SCALE_WORDS; ++w) {
    u32x16 word;
    std::memcpy(&word, scale_words[w], sizeof word);
    for (int e = 0; e < 4; ++e) scales[4 * w + e] = simd::e4m3_decode<I >= Isa::Avx512>((word >> (8 * e)) & 0xFFu);
  }
  for (int w0 = 0; w0 < WORDS; w0 += 16) {
    constexpr int BYTES = 4 * std::min(16, WORDS);
    u32x16 words[16];
    if constexpr (WORDS == 8) {
      // Head 64: keys j and j + 8 share row j (a half each), and half the transpose does.
      for (int j = 0; j < 8; ++j) {
        simd::u32x8 low = {}, high = {};
        if (t.first <= j && j < t.n) std::memcpy(&low, t.key_data[j], sizeof low);
        if (t.first <= j + 8 && j + 8 < t.n) std::memcpy(&high, t.key_data[j + 8], sizeof high);
        words[j] = __builtin_shufflevector(low, high, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
      }
      transpose_words<8>(words);
    } else {
      for (int j = 0; j < TILE; ++j) {
        words[j] = u32x16{};
        if (t.first <= j && j < t.n) std::memcpy(&words[j], t.key_data[j] + 4 * w0, BYTES);
      }
      transpose_words<16>(words);
    }
    for (int w = w0; w < std::min(w0 + 16, WORDS); ++w) {
#if NVFP4_X86
      if constexpr (I >= Isa::Avx512Bf16) {
        // keys[4w + k] as bf16 pairs: dimensions 8w + k and 8w + 4 + k (the two 16-bit halves of word w). AMX:
        // times the block scale of the word's group, as the tile product has no place to apply it per group.
        for (int k = 0; k < 4; ++k) {
          u32x16 pairs = Bf16::e2m1_pairs(words[w - w0], 4 * k);
          if constexpr (I == Isa::Amx) pairs = Bf16::scale_pairs(pairs, scales[w / 2]);
          std::memcpy(keys + (4 * w + k) * TILE, &pairs, sizeof pairs);
        }
        continue;
      }
#endif
      for (int e = 0; e < 8; ++e) store(e2m1_values<I>(words[w - w0] >> (4 * e)), keys + (8 * w + e) * TILE);
    }
  }
}

// FP8 keys: keys[d][j] = e4m3 value of dimension d of key j, every scale 1. Key j's bytes, read as 32-bit words
// (word w: dimensions 4w..4w+3), are transposed as decode_keys' codes are.
template <Isa I, int D>
NVFP4_INLINE void decode_fp8_keys(const TileTokens& t, float* keys, f32x16 (&scales)[D / NVFP4_GROUP]) {
  for (int s = 0; s < D / NVFP4_GROUP; ++s) scales[s] = broadcast(1.0f);
  for (int w0 = 0; w0 < D / 4; w0 += 16) {
    u32x16 words[16];
    for (int j = 0; j < TILE; ++j) {
      words[j] = u32x16{};
      if (t.first <= j && j < t.n) std::memcpy(&words[j], t.key_data[j] + 4 * w0, sizeof words[j]);
    }
    transpose_words<16>(words);
    for (int w = 0; w < 16; ++w)
      for (int e = 0; e < 4; ++e)
        store(simd::e4m3_decode<I >= Isa::Avx512>((words[w] >> (8 * e)) & 0xFFu), keys + (4 * (w0 + w) + e) * TILE);
  }
}

// INT8 keys: keys[d][j] = int8 code of dimension d of key j, and every scale of key j its fp16 scale (decoded as
// c10's conversion does). The codes are transposed as decode_fp8_keys' bytes are, then sign-extended.
template <Isa I, int D>
NVFP4_INLINE void decode_int8_keys(const TileTokens& t, float* keys, f32x16 (&scales)[D / NVFP4_GROUP]) {
  alignas(64) c10::Half key_scale[TILE] = {};
  for (int j = t.first; j < t.n; ++j) std::memcpy(&key_scale[j], t.key_scales[j], sizeof key_scale[j]);
  const f32x16 scale = simd::load16(key_scale);
  for (int s = 0; s < D / NVFP4_GROUP; ++s) scales[s] = scale;
  for (int w0 = 0; w0 < D / 4; w0 += 16) {
    u32x16 words[16];
    for (int j = 0; j < TILE; ++j) {
      words[j] = u32x16{};
      if (t.first <= j && j < t.n) std::memcpy(&words[j], t.key_data[j] + 4 * w0, sizeof words[j]);
    }
    transpose_words<16>(words);
    for (int w = 0; w < 16; ++w)
      for (int e = 0; e < 4; ++e)
        store(__builtin_convertvector(simd::as_i32(words[w] << (24 - 8 * e)) >> 24, f32x16),
              keys + (4 * (w0 + w) + e) * TILE);
  }
}

// Scores of pairs [first, last) for the tile's 16 keys: Σ_s SF_s · Σ_{d in group s} q[d] · e2m1[d] (exact
// values, the block scale applied once a group), one multiply-add chain per pair, four pairs at a time.
template <Isa I, int D, int COUNT>
NVFP4_INLINE void pair_scores(const float* q, const float* keys, const f32x16 (&scales)[D / NVFP4_GROUP], float* out) {
  using F = Fma<I>;
  f32x16 score[COUNT] = {};
  for (int s = 0; s < D / NVFP4_GROUP; ++s) {
    f32x16 dot[COUNT] = {};
    for (int d = NVFP4_GROUP * s; d < NVFP4_GROUP * (s + 1); ++d) {
      const f32x16 k = load(keys + d * TILE);
      for (int i = 0; i < COUNT; ++i) dot[i] = F::apply(broadcast(q[i * D + d]), k, dot[i]);
    }
    for (int i = 0; i < COUNT; ++i) score[i] = F::apply(dot[i], scales[s], score[i]);
  }
  for (int i = 0; i < COUNT; ++i) store(score[i], out + i * TILE);
}

#if NVFP4_X86
// pair_scores over bf16 pairs (decode_keys' keys[4w + k], the queries' q_bf16 in the same order). A group runs as
// four chains (words 2s and 2s + 1, even and odd k), which keeps enough dot products in flight to hide their
// latency, added before the block scale.
template <Isa I, int D, int COUNT>
NVFP4_INLINE void pair_scores_bf16(const uint32_t* q, const float* keys, const f32x16 (&scales)[D / NVFP4_GROUP],
                                   float* out) {
  f32x16 score[COUNT] = {};
  for (int s = 0; s < D / NVFP4_GROUP; ++s) {
    f32x16 dot[4][COUNT] = {};
#pragma GCC unroll 2  // unrolled, the sums stay in registers
    for (int k = 0; k < 4; k += 2)
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {  // chain c: word 2s + c / 2, shift k + c % 2
        const int e = 8 * s + 4 * (c / 2) + k + c % 2;
        u32x16 key;
        std::memcpy(&key, keys + e * TILE, sizeof key);
        for (int i = 0; i < COUNT; ++i) dot[c][i] = Bf16::dot(dot[c][i], key, broadcast_word(q[i * D / 2 + e]));
      }
    for (int i = 0; i < COUNT; ++i)
      score[i] = Fma<I>::apply((dot[0][i] + dot[1][i]) + (dot[2][i] + dot[3][i]), scales[s], score[i]);
  }
  for (int i = 0; i < COUNT; ++i) store(score[i], out + i * TILE);
}
#endif

template <Isa I, int D, int COUNT>
NVFP4_INLINE void pair_scores_any(const Scratch& scratch, int64_t p, const f32x16 (&scales)[D / NVFP4_GROUP]) {
#if NVFP4_X86
  if constexpr (I == Isa::Avx512Bf16) {
    pair_scores_bf16<I, D, COUNT>(scratch.q_bf16.get() + p * D / 2, scratch.keys.get(), scales,
                                  scratch.probs.get() + p * TILE);
    return;
  }
#endif
  pair_scores<I, D, COUNT>(scratch.q.get() + p * D, scratch.keys.get(), scales, scratch.probs.get() + p * TILE);
}

// Pairs [first, last) four at a time, then the last one to three together, so that a GQA group of 3 or 7 reads each
// key or value row once: step(p, count), count a std::integral_constant.
template <class Step>
NVFP4_INLINE void by_pair_groups(int64_t first, int64_t last, Step&& step) {
  int64_t p = first;
  for (; p + 4 <= last; p += 4) step(p, std::integral_constant<int, 4>());
  if (last - p == 3) step(p, std::integral_constant<int, 3>());
  if (last - p == 2) step(p, std::integral_constant<int, 2>());
  if (last - p == 1) step(p, std::integral_constant<int, 1>());
}

// Scores of pairs [first, last) into scratch.probs.
template <Isa I, int D>
NVFP4_INLINE void tile_scores(const Scratch& scratch, const f32x16 (&scales)[D / NVFP4_GROUP], int64_t first,
                              int64_t last) {
  by_pair_groups(first, last,
                 [&](int64_t p, auto count) { pair_scores_any<I, D, decltype(count)::value>(scratch, p, scales); });
}

// Value rows hold each 32 dimensions as the 16 even ones, then the 16 odd ones: the low and high nibbles of 16
// code bytes. The weighted sums keep that order (they are sums of rows); write_rows puts it back.
// Dimensions 32c..32c+31 of key j, e2m1 · SF. AVX-512: the 16 possible values of each of the two groups form
// one 32-entry table that both nibble vectors index (the second group's lanes offset by 16); otherwise the values
// times the two groups' scales.
template <Isa I>
NVFP4_INLINE void decode_value_pair(const TileTokens& t, int j, int c, f32x16& even, f32x16& odd) {
  const uint8_t* scales = t.value_scales[j];
  const int64_t* delta = t.value_delta[j];
  const u32x16 codes = Widen<I>::bytes(t.value_data[j] + 16 * c);
  if constexpr (I >= Isa::Avx512) {
    const u32x16 second_group = {0, 0, 0, 0, 0, 0, 0, 0, 16, 16, 16, 16, 16, 16, 16, 16};
    const f32x16 first_values = load(SCALED_E2M1.row[scales[delta[2 * c]]]);
    const f32x16 second_values = load(SCALED_E2M1.row[scales[delta[2 * c + 1]]]);
    even = __builtin_shuffle(first_values, second_values, (codes & 0xFu) | second_group);
    odd = __builtin_shuffle(first_values, second_values, (codes >> 4) | second_group);
  } else {
    const f32x16 first = broadcast(E4M3.value[scales[delta[2 * c]]]);
    const f32x16 second = broadcast(E4M3.value[scales[delta[2 * c + 1]]]);
    const f32x16 sf = __builtin_shufflevector(first, second, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
    even = e2m1_values<I>(codes) * sf;
    odd = e2m1_values<I>(codes >> 4) * sf;
  }
}

template <Isa I, int D>
NVFP4_INLINE void decode_values(const TileTokens& t, float* values) {
  for (int j = t.first; j < t.n; ++j)
    for (int c = 0; c < D / 32; ++c) {
      f32x16 even, odd;
      decode_value_pair<I>(t, j, c, even, odd);
      store(even, values + j * D + 32 * c);
      store(odd, values + j * D + 32 * c + 16);
    }
}

// sums[p] = sums[p] · alpha[p] + Σ_j prob[p][j] · values[j], j in key order, for pairs [first, last). A pair's keys
// outside what its row sees have probability 0, which adds exactly nothing, so every pair runs over the tile's keys.
// Few pairs (decode): the values are decoded straight into the sums of up to four pairs; many (prefill): decoded
// once into rows that each pair's sums read.
template <Isa I, int D, int COUNT>
NVFP4_INLINE void pair_values(const TileTokens& t, const float* probs, const float* alpha, float* sums) {
  using F = Fma<I>;
  for (int c = 0; c < D / 32; ++c) {
    f32x16 even[COUNT], odd[COUNT];
    for (int i = 0; i < COUNT; ++i) {
      even[i] = load(sums + i * D + 32 * c);
      odd[i] = load(sums + i * D + 32 * c + 16);
      if (alpha[i] != 1.0f) {
        even[i] *= alpha[i];
        odd[i] *= alpha[i];
      }
    }
    for (int j = t.first; j < t.n; ++j) {
      f32x16 e, o;
      decode_value_pair<I>(t, j, c, e, o);
      for (int i = 0; i < COUNT; ++i) {
        const f32x16 pj = broadcast(probs[i * TILE + j]);
        even[i] = F::apply(pj, e, even[i]);
        odd[i] = F::apply(pj, o, odd[i]);
      }
    }
    for (int i = 0; i < COUNT; ++i) {
      store(even[i], sums + i * D + 32 * c);
      store(odd[i], sums + i * D + 32 * c + 16);
    }
  }
}

template <Isa I, int D>
NVFP4_INLINE void tile_values(const TileTokens& t, const float* probs, const float* alpha, int64_t first, int64_t last,
                              float* values, float* sums) {
  if (last - first <= 8) {
    by_pair_groups(first, last, [&](int64_t p, auto count) {
      pair_values<I, D, decltype(count)::value>(t, probs + p * TILE, alpha + p, sums + p * D);
    });
    return;
  }
  decode_values<I, D>(t, values);
  for (int64_t p = first; p < last; ++p) {
    float* acc = sums + p * D;
    const float* prob = probs + p * TILE;
    f32x16 sum[D / 16];
    for (int c = 0; c < D / 16; ++c) sum[c] = load(acc + 16 * c);
    if (alpha[p] != 1.0f)
      for (int c = 0; c < D / 16; ++c) sum[c] *= alpha[p];
    for (int j = t.first; j < t.n; ++j) {
      const f32x16 pj = broadcast(prob[j]);
      for (int c = 0; c < D / 16; ++c) sum[c] = Fma<I>::apply(pj, load(values + j * D + 16 * c), sum[c]);
    }
    for (int c = 0; c < D / 16; ++c) store(sum[c], acc + 16 * c);
  }
}

#if NVFP4_X86
// --- AVX2: a tile as two halves of 8 lanes --------------------------------------------------------------------
// Where the target has no 64-byte registers GCC keeps 64-byte vectors in memory, so on AVX2 each 16-lane operation
// of the code above goes through the stack (decode ran 15x slower than AVX-512). The AVX2 variant runs a tile's
// steps on its two halves of 8 keys instead, in 32-byte vectors that stay in registers, with fused multiply-adds.
// Keys are decoded with their scales applied (e2m1 · SF, an INT8 code times its fp16 scale: exact in float32), so a
// score is one multiply-add chain a (pair, half). Values are e2m1 · SF from SCALED_E2M1's rows, as the AVX-512
// code takes them: a permute of the row's first 8 entries, the code's sign put back.
struct Avx2 {
  NVFP4_TARGET_AVX2 static inline f32x8 load(const float* p) {
    f32x8 v;
    std::memcpy(&v, p, sizeof v);
    return v;
  }
  NVFP4_TARGET_AVX2 static inline void store(f32x8 v, float* p) { std::memcpy(p, &v, sizeof v); }
  NVFP4_TARGET_AVX2 static inline f32x8 fma(f32x8 a, f32x8 b, f32x8 c) { return Fma<Isa::Avx2>::apply(a, b, c); }
  NVFP4_TARGET_AVX2 static inline u32x8 lane_mask(int n, int half) {
    u32x8 m;
    std::memcpy(&m, reinterpret_cast<const char*>(&LANE_MASKS.mask[n]) + sizeof m * half, sizeof m);
    return m;
  }

  // rows[i] = the 8 words at rows_of(i), transposed: word w of the 8 rows is rows[w]. Rows that rows_of gives as
  // null are zero.
  template <typename RowsOf>
  NVFP4_TARGET_AVX2 static inline void transposed_words(RowsOf rows_of, u32x8 (&rows)[8]) {
    __m256i m[8], t[8];
    for (int i = 0; i < 8; ++i) {
      const uint8_t* row = rows_of(i);
      m[i] = row ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row)) : _mm256_setzero_si256();
    }
    for (int i = 0; i < 8; i += 2) {
      t[i] = _mm256_unpacklo_epi32(m[i], m[i + 1]);  // words 0 1 4 5 of rows i, i + 1, interleaved
      t[i + 1] = _mm256_unpackhi_epi32(m[i], m[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
      m[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);  // word 0 (4) of rows i..i + 3
      m[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
      m[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
      m[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 4; ++i) {
      rows[i] = __builtin_bit_cast(u32x8, _mm256_permute2x128_si256(m[i], m[i + 4], 0x20));
      rows[i + 4] = __builtin_bit_cast(u32x8, _mm256_permute2x128_si256(m[i], m[i + 4], 0x31));
    }
  }

  // The E2M1 values (from `table`'s 8 magnitudes) of the codes in bits [shift, shift + 4) of each lane.
  NVFP4_TARGET_AVX2 static inline f32x8 e2m1(__m256 table, u32x8 words, int shift) {
    const __m256 magnitude = _mm256_permutevar8x32_ps(table, __builtin_bit_cast(__m256i, words >> shift));
    return simd::as_f32(simd::as_u32(__builtin_bit_cast(f32x8, magnitude)) ^ ((words << (28 - shift)) & 0x80000000u));
  }

  // keys[d][j] = dimension d of key j with its scale applied (0 in lanes outside [first, n)). `KeyFormat` as the
  // page's: NVFP4 codes, FP8 E4M3 bytes or INT8 codes with an fp16 scale a key.
  template <int D, KeyFormat FORMAT>
  NVFP4_TARGET_AVX2 static inline void decode_keys(const TileTokens& t, float* keys) {
    constexpr int SCALES = FORMAT == KeyFormat::Nvfp4 ? D / NVFP4_GROUP : 1;
    alignas(32) float scale[SCALES][TILE] = {};
    for (int j = t.first; j < t.n; ++j)
      for (int s = 0; s < SCALES; ++s) {
        if constexpr (FORMAT == KeyFormat::Nvfp4) {
          scale[s][j] = E4M3.value[t.key_scales[j][s]];
        } else if constexpr (FORMAT == KeyFormat::Int8) {
          c10::Half h;
          std::memcpy(&h, t.key_scales[j], sizeof h);
          scale[s][j] = static_cast<float>(h);
        }
      }
    constexpr int ROW_BYTES = FORMAT == KeyFormat::Nvfp4 ? D / 2 : D;
    constexpr int PER_WORD = FORMAT == KeyFormat::Nvfp4 ? 8 : 4;  // dimensions a 32-bit word holds
    const __m256 e2m1_table = _mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f);
    for (int half = 0; half < 2; ++half)
      for (int offset = 0; offset < ROW_BYTES; offset += 32) {
        u32x8 words[8];
        transposed_words(
            [&](int i) {
              const int j = 8 * half + i;
              return t.first <= j && j < t.n ? t.key_data[j] + offset : nullptr;
            },
            words);
        for (int w = 0; w < 8; ++w)
          for (int e = 0; e < PER_WORD; ++e) {
            const int d = (offset / 4 + w) * PER_WORD + e;
            f32x8 v;
            if constexpr (FORMAT == KeyFormat::Nvfp4)
              v = e2m1(e2m1_table, words[w], 4 * e) * load(scale[d / NVFP4_GROUP] + 8 * half);
            else if constexpr (FORMAT == KeyFormat::Fp8)
              v = simd::e4m3_decode<true>((words[w] >> (8 * e)) & 0xFFu);
            else
              v = __builtin_convertvector(simd::as_i32(words[w] << (24 - 8 * e)) >> 24, f32x8) *
                  load(scale[0] + 8 * half);
            store(v, keys + d * TILE + 8 * half);
          }
      }
  }

  // Scores of COUNT pairs (queries q [COUNT][D]) for the tile's keys.
  template <int D, int COUNT>
  NVFP4_TARGET_AVX2 static inline void pair_scores(const float* q, const float* keys, float* out) {
    f32x8 score[COUNT][2] = {};
    for (int d = 0; d < D; ++d) {
      const f32x8 low = load(keys + d * TILE), high = load(keys + d * TILE + 8);
      for (int i = 0; i < COUNT; ++i) {
        const f32x8 qd = splat<f32x8>(q[i * D + d]);
        score[i][0] = fma(qd, low, score[i][0]);
        score[i][1] = fma(qd, high, score[i][1]);
      }
    }
    for (int i = 0; i < COUNT; ++i) {
      store(score[i][0], out + i * TILE);
      store(score[i][1], out + i * TILE + 8);
    }
  }

  template <int D>
  NVFP4_TARGET_AVX2 static inline void tile_scores(const Scratch& scratch, int64_t first, int64_t last) {
    const float* q = scratch.q.get();
    const float* keys = scratch.keys.get();
    float* out = scratch.probs.get();
    by_pair_groups(first, last, [&](int64_t p, auto count) {
      pair_scores<D, decltype(count)::value>(q + p * D, keys, out + p * TILE);
    });
  }

  // attend_split_impl's online softmax step for pairs [first, last), on halves.
  NVFP4_TARGET_AVX2 static inline void probabilities(const Batch& b, const Unit& u, int64_t key0, int64_t key_end,
                                                     int64_t first, int64_t last, Scratch& scratch, State& st) {
    const float inverse_cap = b.soft_cap > 0.0f ? 1.0f / b.soft_cap : 0.0f;
    for (int64_t p = first; p < last; ++p) {
      const int64_t row = p / b.group;
      const int seen_begin = static_cast<int>(std::clamp<int64_t>(u.visible_begin(b, row) - key0, 0, TILE));
      const int seen_end =
          static_cast<int>(std::clamp<int64_t>(std::min<int64_t>(u.visible_end(b, row), key_end) - key0, 0, TILE));
      float* prob = scratch.probs.get() + p * TILE;
      u32x8 mask[2];
      f32x8 scores[2];
      for (int h = 0; h < 2; ++h) {
        mask[h] = lane_mask(seen_end, h) & ~lane_mask(seen_begin, h);
        f32x8 logits = load(prob + 8 * h) * b.score_scale;
        if (b.soft_cap > 0.0f) logits = soft_cap<Isa::Avx2>(logits, b.soft_cap, inverse_cap);
        scores[h] = simd::as_f32(simd::select(mask[h], simd::as_u32(logits), simd::as_u32(splat<f32x8>(NEG_INF))));
      }
      const float m = std::max(st.m[p], lanes_max(simd::max(scores[0], scores[1])));
      float alpha = 1.0f;
      if (m > st.m[p]) {
        alpha = exp_nonpositive<Isa::Avx2>(splat<f32x8>(st.m[p] - m))[0];
        st.m[p] = m;
      }
      f32x8 probs[2];
      for (int h = 0; h < 2; ++h) {
        probs[h] = simd::as_f32(simd::as_u32(exp_nonpositive<Isa::Avx2>(scores[h] - m)) & mask[h]);
        store(probs[h], prob + 8 * h);
      }
      st.l[p] = st.l[p] * alpha + lanes_sum(probs[0] + probs[1]);  // the 16-lane lanes_sum's order
      scratch.alpha[p] = alpha;
    }
  }

  // decode_value_pair's half g (lanes 8g..8g + 7) of dimensions 32c..32c+31 of key j: even[g] and odd[g].
  NVFP4_TARGET_AVX2 static inline void value_half(const TileTokens& t, int j, int c, int g, f32x8& even, f32x8& odd) {
    const __m256 row = _mm256_load_ps(SCALED_E2M1.row[t.value_scales[j][t.value_delta[j][2 * c + g]]]);
    const u32x8 codes = __builtin_bit_cast(
        u32x8,
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(t.value_data[j] + 16 * c + 8 * g))));
    even = e2m1(row, codes, 0);
    odd = e2m1(row, codes, 4);
  }

  // tile_values: few pairs decode each value half straight into their sums, many decode the tile's rows once.
  template <int D, int COUNT>
  NVFP4_TARGET_AVX2 static inline void pair_values(const TileTokens& t, const float* probs, const float* alpha,
                                                   float* sums) {
    for (int c = 0; c < D / 32; ++c)
      for (int g = 0; g < 2; ++g) {
        f32x8 even[COUNT], odd[COUNT];
        for (int i = 0; i < COUNT; ++i) {
          even[i] = load(sums + i * D + 32 * c + 8 * g) * alpha[i];
          odd[i] = load(sums + i * D + 32 * c + 16 + 8 * g) * alpha[i];
        }
        for (int j = t.first; j < t.n; ++j) {
          f32x8 e, o;
          value_half(t, j, c, g, e, o);
          for (int i = 0; i < COUNT; ++i) {
            const f32x8 pj = splat<f32x8>(probs[i * TILE + j]);
            even[i] = fma(pj, e, even[i]);
            odd[i] = fma(pj, o, odd[i]);
          }
        }
        for (int i = 0; i < COUNT; ++i) {
          store(even[i], sums + i * D + 32 * c + 8 * g);
          store(odd[i], sums + i * D + 32 * c + 16 + 8 * g);
        }
      }
  }

  template <int D>
  NVFP4_TARGET_AVX2 static inline void tile_values(const TileTokens& t, const float* probs, const float* alpha,
                                                   int64_t first, int64_t last, float* values, float* sums) {
    if (last - first <= 8) {
      by_pair_groups(first, last, [&](int64_t p, auto count) {
        pair_values<D, decltype(count)::value>(t, probs + p * TILE, alpha + p, sums + p * D);
      });
      return;
    }
    for (int j = t.first; j < t.n; ++j)
      for (int c = 0; c < D / 32; ++c)
        for (int g = 0; g < 2; ++g) {
          f32x8 e, o;
          value_half(t, j, c, g, e, o);
          store(e, values + j * D + 32 * c + 8 * g);
          store(o, values + j * D + 32 * c + 16 + 8 * g);
        }
    constexpr int PART = std::min(D, 64);  // dimensions whose sums stay in registers
    for (int64_t p = first; p < last; ++p)
      for (int d0 = 0; d0 < D; d0 += PART) {
        float* acc = sums + p * D + d0;
        f32x8 sum[PART / 8];
        for (int k = 0; k < PART / 8; ++k) sum[k] = load(acc + 8 * k) * alpha[p];
        for (int j = t.first; j < t.n; ++j) {
          const f32x8 pj = splat<f32x8>(probs[p * TILE + j]);
          for (int k = 0; k < PART / 8; ++k) sum[k] = fma(pj, load(values + j * D + d0 + 8 * k), sum[k]);
        }
        for (int k = 0; k < PART / 8; ++k) store(sum[k], acc + 8 * k);
      }
  }

  // One tile of attend_split_impl.
  template <int D>
  NVFP4_TARGET_AVX2 static inline void tile(const Batch& b, const Unit& u, const TileTokens& tokens, int64_t key0,
                                            int64_t key_end, Scratch& scratch, State& st) {
    if (b.layout.fp8_keys())
      decode_keys<D, KeyFormat::Fp8>(tokens, scratch.keys.get());
    else if (b.layout.int8_keys())
      decode_keys<D, KeyFormat::Int8>(tokens, scratch.keys.get());
    else
      decode_keys<D, KeyFormat::Nvfp4>(tokens, scratch.keys.get());
    const int64_t first = u.first_row_seeing(b, key0 + tokens.first) * b.group;
    const int64_t last = u.end_row_seeing(b, key0 + tokens.n - 1) * b.group;
    tile_scores<D>(scratch, first, last);
    probabilities(b, u, key0, key_end, first, last, scratch, st);
    tile_values<D>(tokens, scratch.probs.get(), scratch.alpha.get(), first, last, scratch.values.get(), st.acc.get());
  }
};
#endif

#if NVFP4_X86
// --- bf16 queries over NVFP4 keys, prefill: a split at a time, 16 pairs a vector -----------------------------
// The pairs of a unit in groups of 16, one lane each, so that a key's scores, logits and probabilities of the group
// are one vector: a pair's max over the split is a vector maximum, and no softmax step needs a horizontal one.

// The pairs [p0, p0 + count) of a unit over keys [key_begin, key_end) of a split: lane i sees keys [begin[i], end[i])
// (lanes past `count` none). The group reads the tiles over [group_begin, group_end) and masks those that some lane
// sees only in part: all but [all_begin, all_end).
struct PairGroup {
  int64_t count, group_begin, group_end, all_begin, all_end;
  i32x16 begin, end;

  PairGroup(const Batch& b, const Unit& u, int64_t p0, int64_t end_pair, int64_t key_begin, int64_t key_end)
      : count(std::min<int64_t>(16, end_pair - p0)),
        group_begin(key_end),
        group_end(key_begin),
        all_begin(key_begin),
        all_end(key_end) {
    for (int i = 0; i < 16; ++i) {
      int64_t lo = key_begin, hi = key_begin;
      if (i < count) {
        const int64_t row = (p0 + i) / b.group;
        lo = std::clamp(u.visible_begin(b, row), key_begin, key_end);
        hi = std::clamp(u.visible_end(b, row), key_begin, key_end);
      }
      begin[i] = static_cast<int32_t>(lo);
      end[i] = static_cast<int32_t>(hi);
      if (lo < hi) {
        group_begin = std::min(group_begin, lo);
        group_end = std::max(group_end, hi);
      }
      all_begin = std::max(all_begin, lo);
      all_end = std::min(all_end, hi);
    }
  }
  bool empty() const { return group_begin >= group_end; }
  int64_t key_first() const { return group_begin - group_begin % TILE; }  // the first tile's first key
  int64_t tiles() const { return (group_end - key_first() + TILE - 1) / TILE; }
  // Whether the tile starting at key0 needs its keys masked lane by lane.
  bool masked(int64_t key0) const { return key0 < all_begin || key0 + TILE > all_end; }
  // Lane i: whether pair i sees `key`.
  NVFP4_TARGET_AVX512_BF16 u32x16 sees(int64_t key) const {
    const __m512i k = _mm512_set1_epi32(static_cast<int32_t>(key));
    const __mmask16 inside = _mm512_cmpge_epi32_mask(k, __builtin_bit_cast(__m512i, begin)) &
                             _mm512_cmplt_epi32_mask(k, __builtin_bit_cast(__m512i, end));
    return __builtin_bit_cast(u32x16, _mm512_movm_epi32(inside));
  }
};

struct Bf16Split {
  typedef uint16_t u16x32 __attribute__((vector_size(64)));

  // Dimensions 32c..32c+31 of key j as bf16, in decode_values' order (the 16 even ones, then the 16 odd ones):
  // e2m1 · SF is a bf16 value, so a 32-entry table of the two groups' products' high halves that the codes index.
  NVFP4_TARGET_AVX512_BF16 static inline u16x32 value_row(const TileTokens& t, int j, int c) {
    const uint8_t* scales = t.value_scales[j];
    const int64_t* delta = t.value_delta[j];
    return bf16_row(t.value_data[j] + 16 * c, E4M3.value[scales[delta[2 * c]]], E4M3.value[scales[delta[2 * c + 1]]]);
  }
  // The 32 dimensions whose codes are the 16 bytes at `codes` (the low nibbles, then the high ones), times the scale
  // of their group (the first 8 bytes' or the last 8 bytes').
  NVFP4_TARGET_AVX512_BF16 static inline u16x32 bf16_row(const uint8_t* codes, float first_scale, float second_scale) {
    const f32x16 first = simd::E2M1_VALUES * first_scale;
    const f32x16 second = simd::E2M1_VALUES * second_scale;
    const u16x32 table = __builtin_shufflevector(__builtin_bit_cast(u16x32, first), __builtin_bit_cast(u16x32, second),
                                                 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31, 33, 35, 37,
                                                 39, 41, 43, 45, 47, 49, 51, 53, 55, 57, 59, 61, 63);
    simd::u8x16 bytes;
    std::memcpy(&bytes, codes, sizeof bytes);
    const simd::u16x16 nibbles = __builtin_convertvector(bytes, simd::u16x16);
    const u16x32 second_group = {0, 0, 0, 0, 0, 0, 0, 0, 16, 16, 16, 16, 16, 16, 16, 16,
                                 0, 0, 0, 0, 0, 0, 0, 0, 16, 16, 16, 16, 16, 16, 16, 16};
    const u16x32 index =
        __builtin_shufflevector(nibbles & 0xF, nibbles >> 4, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16,
                                17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31) |
        second_group;
    return __builtin_bit_cast(
        u16x32, _mm512_permutexvar_epi16(__builtin_bit_cast(__m512i, index), __builtin_bit_cast(__m512i, table)));
  }

  // 2^x (Cephes' exp2f: x = n + f, |f| <= 1/2, 1 + f · P(f) of degree 6, times 2^n by vscalefps), within 2 ulp;
  // 0 far below 2^-126, as the thread flushes denormals. Half the instructions of exp_nonpositive.
  NVFP4_TARGET_AVX512_BF16 static inline f32x16 pow2(f32x16 x) {
    const __m512 v = __builtin_bit_cast(__m512, x);
    const __m512 n = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const f32x16 f = __builtin_bit_cast(f32x16, _mm512_sub_ps(v, n));
    using F = Fma<Isa::Avx512Bf16>;
    f32x16 y = F::apply(broadcast(1.535336188319500e-4f), f, broadcast(1.339887440266574e-3f));
    y = F::apply(y, f, broadcast(9.618437357674640e-3f));
    y = F::apply(y, f, broadcast(5.550332471162809e-2f));
    y = F::apply(y, f, broadcast(2.402264791363012e-1f));
    y = F::apply(y, f, broadcast(6.931472028550421e-1f));
    y = F::apply(y, f, broadcast(1.0f));
    return __builtin_bit_cast(f32x16, _mm512_scalef_ps(__builtin_bit_cast(__m512, y), n));
  }

  // queries[c][r][i]: dimensions 2r and 2r + 1 of chunk c (32 dimensions in bf16_row's order) of pair i, for
  // `count` pairs of float32 queries that are bf16 values; zero for pairs past them.
  template <int D>
  NVFP4_TARGET_AVX512_BF16 static inline void transpose_queries(const float* q, int64_t count, uint32_t* queries) {
    for (int c = 0; c < D / 32; ++c) {
      u32x16 words[16];
      for (int i = 0; i < 16; ++i) {
        words[i] = u32x16{};
        if (i >= count) continue;
        const u16x32 low = __builtin_bit_cast(u16x32, load(q + i * D + 32 * c));
        const u16x32 high = __builtin_bit_cast(u16x32, load(q + i * D + 32 * c + 16));
        // the high halves of dimensions 0, 2, ..., 30, then of 1, 3, ..., 31
        words[i] = __builtin_bit_cast(
            u32x16, __builtin_shufflevector(low, high, 1, 5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45, 49, 53, 57, 61, 3,
                                            7, 11, 15, 19, 23, 27, 31, 35, 39, 43, 47, 51, 55, 59, 63));
      }
      transpose_words<16>(words);
      std::memcpy(queries + c * 16 * 16, words, sizeof words);
    }
  }

  // Tile of keys as keys [TILE][D / 2] (bf16 pairs, bf16_row's order, scaled: exact) and values [TILE][D] (float32,
  // decode_values' order); absent keys are 0, as their probabilities are, and 0 · NaN would not be.
  template <int D>
  NVFP4_TARGET_AVX512_BF16 static inline void decode_tile(const TileTokens& t, uint32_t* keys, float* values) {
    for (int j = 0; j < TILE; ++j)
      for (int c = 0; c < D / 32; ++c) {
        u16x32 key = {};
        f32x16 even = {}, odd = {};
        if (t.first <= j && j < t.n) {
          key = bf16_row(t.key_data[j] + 16 * c, E4M3.value[t.key_scales[j][2 * c]],
                         E4M3.value[t.key_scales[j][2 * c + 1]]);
          decode_value_pair<Isa::Avx512Bf16>(t, j, c, even, odd);
        }
        std::memcpy(keys + j * D / 2 + 16 * c, &key, sizeof key);
        store(even, values + j * D + 32 * c);
        store(odd, values + j * D + 32 * c + 16);
      }
  }

  // scores[j] = the raw scores of 8 keys (keys [8][D / 2]) for the group's pairs (queries [D / 2][16], transposed):
  // a dot product per dimension pair, the key's pair broadcast; eight chains hide the dot product's latency.
  template <int D>
  NVFP4_TARGET_AVX512_BF16 static inline void scores8(const uint32_t* queries, const uint32_t* keys,
                                                      f32x16 (&scores)[8]) {
    for (int j = 0; j < 8; ++j) scores[j] = f32x16{};
    for (int w = 0; w < D / 2; ++w) {
      u32x16 q;
      std::memcpy(&q, queries + 16 * w, sizeof q);
      for (int j = 0; j < 8; ++j) scores[j] = Bf16::dot(scores[j], q, broadcast_word(keys[j * D / 2 + w]));
    }
  }

  // One split of one unit (attend_split_impl's contract). The split's tiles are decoded once; each group of 16 pairs
  // takes its logits over the split (log2 units) and its max first, then its probabilities against that max, so its
  // sums are never rescaled, then the weighted sums 16 dimensions at a time: per key, the group's probabilities times
  // each value broadcast, one float32 fused multiply-add a (pair, dimension). What a pair gets depends on its own
  // keys only, whichever lane and group it has.
  template <int D>
  NVFP4_TARGET_AVX512_BF16 static inline void attend_split(const Batch& b, const Unit& u, int64_t split,
                                                           Scratch& scratch) {
    State& st = scratch.split;
    const auto [key_begin, key_end] = start_split(b, u, split, st);
    const int64_t tile_begin = key_begin - key_begin % TILE;
    scratch.allocate_split();
    uint32_t* keys = scratch.split_keys.get();
    float* values = scratch.split_values.get();
    for (TileWalk walk(b, u, key_begin, key_end); walk.next();) {
      const int64_t at = walk.key0() - tile_begin;
      decode_tile<D>(walk.tokens(), keys + at * D / 2, values + at * D);
    }
    const float inverse_cap = b.soft_cap > 0.0f ? 1.0f / b.soft_cap : 0.0f;
    const float log2_scale = b.score_scale * LOG2E;
    const int64_t end_pair = u.end_row_seeing(b, key_end - 1) * b.group;
    for (int64_t p0 = u.first_row_seeing(b, key_begin) * b.group; p0 < end_pair; p0 += 16) {
      const PairGroup g(b, u, p0, end_pair, key_begin, key_end);
      if (g.empty()) continue;
      alignas(64) uint32_t queries[D / 2 * 16];
      transpose_queries<D>(scratch.q.get() + p0 * D, g.count, queries);
      const int64_t key_first = g.key_first(), count = g.tiles() * TILE;
      const uint32_t* group_keys = keys + (key_first - tile_begin) * D / 2;
      const float* group_values = values + (key_first - tile_begin) * D;
      float* probs = scratch.split_logits.get();  // [count][16]: the logits, then the probabilities in place
      f32x16 top = broadcast(NEG_INF);            // log2 units
      for (int64_t j0 = 0; j0 < count; j0 += 8) {
        f32x16 scores[8];
        scores8<D>(queries, group_keys + j0 * D / 2, scores);
        const int64_t key0 = key_first + j0 - j0 % TILE;
        for (int j = 0; j < 8; ++j) {
          f32x16 logit;
          if (b.soft_cap > 0.0f)
            logit = soft_cap<Isa::Avx512Bf16>(scores[j] * b.score_scale, b.soft_cap, inverse_cap) * LOG2E;
          else
            logit = scores[j] * log2_scale;
          if (g.masked(key0))
            logit = simd::as_f32(
                simd::select(g.sees(key_first + j0 + j), simd::as_u32(logit), simd::as_u32(broadcast(NEG_INF))));
          top = simd::max(top, logit);
          store(logit, probs + (j0 + j) * 16);
        }
      }
      // Keys a pair does not see (logit -inf) get probability 0.
      f32x16 total = {};
      for (int64_t j = 0; j < count; ++j) {
        f32x16 p = pow2(load(probs + j * 16) - top);
        if (g.masked(key_first + j - j % TILE)) p = simd::as_f32(simd::as_u32(p) & g.sees(key_first + j));
        total += p;
        store(p, probs + j * 16);
      }
      for (int c = 0; c < D / 16; ++c) {
        f32x16 sums[16] = {};  // sums[d]: dimension 16c + d of each pair
        for (int64_t j = 0; j < count; ++j) {
          const f32x16 p = load(probs + j * 16);
          const float* v = group_values + j * D + 16 * c;
          for (int d = 0; d < 16; ++d) sums[d] = Fma<Isa::Avx512Bf16>::apply(broadcast(v[d]), p, sums[d]);
        }
        u32x16 words[16];
        for (int d = 0; d < 16; ++d) words[d] = simd::as_u32(sums[d]);
        transpose_words<16>(words);
        for (int64_t i = 0; i < g.count; ++i) std::memcpy(st.acc.get() + (p0 + i) * D + 16 * c, &words[i], 64);
      }
      for (int64_t i = 0; i < g.count; ++i) {
        st.m[p0 + i] = top[i] * LN2;
        st.l[p0 + i] = total[i];
      }
    }
  }
};
#endif

#if NVFP4_X86
// AMX-BF16 tile products for bf16 queries over NVFP4 keys, every tile 16 rows of 64 bytes. Tiles: 0 scores (16 pairs
// x 16 keys, float32), 1 queries (16 pairs x 32 dimensions, bf16), 2 keys (16 dimension pairs x 16 keys), 3 the
// probabilities (16 pairs x their bf16 high parts of 16 keys, then their low parts), 4 values (8 key pairs x 16
// dimensions, twice: for the high and the low parts), 5 weighted values (16 pairs x 16 dimensions, float32). Each
// output element is one pair's own sum in the hardware's fixed order, whatever the other rows of its tile hold.
// The instructions are written out with a memory clobber: GCC's tile intrinsics do not tell the compiler that they
// read and write memory.
#define NVFP4_TILE_LOAD(tile, base, stride) \
  asm volatile("tileloadd (%0,%1,1), %%tmm" #tile::"r"(base), "r"(static_cast<int64_t>(stride)) : "memory")
#define NVFP4_TILE_STORE(tile, base, stride) \
  asm volatile("tilestored %%tmm" #tile ", (%0,%1,1)" ::"r"(base), "r"(static_cast<int64_t>(stride)) : "memory")
#define NVFP4_TILE_ZERO(tile) asm volatile("tilezero %%tmm" #tile::)
#define NVFP4_TILE_DOT(acc, a, b) asm volatile("tdpbf16ps %%tmm" #b ", %%tmm" #a ", %%tmm" #acc::)

struct Amx {
  typedef uint16_t u16x32 __attribute__((vector_size(64)));

  struct alignas(64) Config {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
  };
  static void configure() {
    Config config = {};
    config.palette = 1;
    for (int tile = 0; tile < 8; ++tile) {
      config.rows[tile] = 16;
      config.bytes_per_row[tile] = 64;
    }
    asm volatile("ldtilecfg %0" ::"m"(config));
  }
  static void release() { asm volatile("tilerelease" ::: "memory"); }

  // Decode's tiles (group_scores): as many rows as the unit has pairs, up to 16; tile 0 one group's scores, 1 the
  // queries' 8 dimension pairs of the group, 2 the keys' (8 rows of 16 keys).
  static void configure_scores(int64_t pairs) {
    Config config = {};
    config.palette = 1;
    const auto rows = static_cast<uint8_t>(std::min<int64_t>(16, pairs));
    config.rows[0] = rows;
    config.bytes_per_row[0] = 64;
    config.rows[1] = rows;
    config.bytes_per_row[1] = 32;
    config.rows[2] = 8;
    config.bytes_per_row[2] = 64;
    asm volatile("ldtilecfg %0" ::"m"(config));
  }

  // Scores of pairs [first, last) over decode_keys' unscaled bf16 pairs (the AVX512-BF16 layout), into
  // scratch.probs: a tile product per group of 16 dimensions, then each group's block scales as pair_scores_bf16
  // applies them. On Intel cores vdpbf16ps occupies the shuffle port for two cycles; a tile product of up to 16
  // pairs and 16 keys replaces the 8 a group takes per 4 pairs.
  template <int D>
  static void group_scores(const Scratch& scratch, const f32x16 (&scales)[D / NVFP4_GROUP], int64_t first,
                           int64_t last) {
    constexpr int GROUPS = D / NVFP4_GROUP;
    alignas(64) float sums[GROUPS][16][TILE];
    for (int64_t p0 = first; p0 < last; p0 += 16) {
      for (int s = 0; s < GROUPS; ++s) {
        NVFP4_TILE_ZERO(0);
        NVFP4_TILE_LOAD(1, scratch.q_bf16.get() + p0 * D / 2 + 8 * s, 2 * D);
        NVFP4_TILE_LOAD(2, scratch.keys.get() + 8 * s * TILE, 4 * TILE);
        NVFP4_TILE_DOT(0, 1, 2);
        NVFP4_TILE_STORE(0, sums[s][0], 4 * TILE);
      }
      for (int64_t p = p0; p < std::min(last, p0 + 16); ++p) {
        f32x16 score = {};
        for (int s = 0; s < GROUPS; ++s) score = Fma<Isa::Amx>::apply(load(sums[s][p - p0]), scales[s], score);
        store(score, scratch.probs.get() + p * TILE);
      }
    }
  }

  // Scores of pairs [first, last), 16 at a time, into scratch.probs: the bf16 queries times decode_keys' keys
  // (scaled to bf16, exact), every product exact, float32 sums.
  template <int D>
  static void scores(const Scratch& scratch, int64_t first, int64_t last) {
    for (int64_t p = first; p < last; p += 16) {
      NVFP4_TILE_ZERO(0);
      for (int c = 0; c < D / 32; ++c) {
        NVFP4_TILE_LOAD(1, scratch.q_bf16.get() + p * D / 2 + 16 * c, 2 * D);
        NVFP4_TILE_LOAD(2, scratch.keys.get() + 16 * c * TILE, 4 * TILE);
        NVFP4_TILE_DOT(0, 1, 2);
      }
      NVFP4_TILE_STORE(0, scratch.probs.get() + p * TILE, 4 * TILE);
    }
  }

  // values[n][r][l]: keys 2r and 2r + 1 (low and high half) at the dimension of column l of block n, blocks in
  // decode_values' order (16 even dimensions of 32, then the 16 odd ones); rows 8-15 repeat rows 0-7, for the low
  // parts of the probabilities. Absent keys are 0: their probabilities are 0, and 0 · NaN would not be.
  template <int D>
  NVFP4_TARGET_AMX static inline void decode_values(const TileTokens& t, uint32_t* values) {
    for (int r = 0; r < TILE / 2; ++r)
      for (int c = 0; c < D / 32; ++c) {
        u16x32 rows[2] = {};
        for (int h = 0; h < 2; ++h)
          if (t.first <= 2 * r + h && 2 * r + h < t.n) rows[h] = Bf16Split::value_row(t, 2 * r + h, c);
        const u16x32 evens =
            __builtin_shufflevector(rows[0], rows[1], 0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39, 8, 40, 9,
                                    41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47);
        const u16x32 odds =
            __builtin_shufflevector(rows[0], rows[1], 16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                    24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63);
        for (int repeat = 0; repeat < 2; ++repeat) {
          std::memcpy(values + (2 * c * TILE + 8 * repeat + r) * 16, &evens, sizeof evens);
          std::memcpy(values + ((2 * c + 1) * TILE + 8 * repeat + r) * 16, &odds, sizeof odds);
        }
      }
  }

  // sums[p] = sums[p] · alpha[p] + Σ_j prob[p][j] · values[j] for pairs [first, last), 16 at a time: each
  // probability as a bf16 high part plus a bf16 low part (together within 2^-16 of it), every product exact,
  // float32 sums.
  template <int D>
  NVFP4_TARGET_AMX static inline void weighted_values(Scratch& scratch, const uint32_t* values, int64_t first,
                                                      int64_t last, float* sums) {
    uint16_t* parts = scratch.prob_parts.get();  // [16][2 * TILE]: high parts, then low parts
    for (int64_t p = first; p < last; p += 16) {
      for (int i = 0; i < 16; ++i) {
        const __m512 prob = __builtin_bit_cast(__m512, load(scratch.probs.get() + (p + i) * TILE));
        const __m256bh h = _mm512_cvtneps_pbh(prob);
        const __m512 rest = _mm512_sub_ps(
            prob, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(__builtin_bit_cast(__m256i, h)), 16)));
        const __m256bh l = _mm512_cvtneps_pbh(rest);
        std::memcpy(parts + 2 * i * TILE, &h, sizeof h);
        std::memcpy(parts + (2 * i + 1) * TILE, &l, sizeof l);
      }
      NVFP4_TILE_LOAD(3, parts, 4 * TILE);
      for (int n = 0; n < D / 16; ++n) {
        NVFP4_TILE_ZERO(5);
        NVFP4_TILE_LOAD(4, values + n * 16 * TILE, 64);
        NVFP4_TILE_DOT(5, 3, 4);
        NVFP4_TILE_STORE(5, scratch.tile_sums.get() + 16 * n, 4 * D);
      }
      for (int64_t i = 0; i < std::min<int64_t>(16, last - p); ++i) {
        float* acc = sums + (p + i) * D;
        const float* tile_sum = scratch.tile_sums.get() + i * D;
        const f32x16 alpha = broadcast(scratch.alpha[p + i]);
        for (int c = 0; c < D / 16; ++c)
          store(Fma<Isa::Amx>::apply(load(acc + 16 * c), alpha, load(tile_sum + 16 * c)), acc + 16 * c);
      }
    }
  }

  // --- head 64: a split at a time, the weighted sums of 16 pairs held in tiles -------------------------------
  // The split's tiles are decoded once (decode_tile), then each group of 16 pairs runs over them with transposed
  // products: scores S^T = K · Q^T (16 keys x 16 pairs, tiles 3 and 1-2 into 0), so that a key's scores of the 16
  // pairs are one vector and the softmax needs no horizontal step, and sums O^T = V^T · P^T (16 dimensions x 16
  // pairs, tiles 3 and 0 into 4-7, which keep them for the whole split). P^T row j holds key j's probability of
  // each pair as a bf16 high part and a bf16 low part, and V^T holds each value twice, so that one product adds
  // both. The group's scores of the whole split are taken first, so that each pair's probabilities are taken
  // against its max over the split and the sums are never rescaled; what a pair gets depends on its own keys only.

  // Tile t of the split as keys [TILE][D] (bf16_row's order) and values [D / 16][16][TILE]: block n, dimension d
  // (decode_values' order), key j twice; absent keys are 0.
  template <int D>
  NVFP4_TARGET_AMX static inline void decode_tile(const TileTokens& t, uint16_t* keys, uint32_t* values) {
    for (int c = 0; c < D / 32; ++c) {
      u32x16 words[2][TILE];  // even and odd dimensions: key j's values, each twice
      for (int j = 0; j < TILE; ++j) {
        u16x32 key = {}, value = {};
        if (t.first <= j && j < t.n) {
          key = Bf16Split::bf16_row(t.key_data[j] + 16 * c, E4M3.value[t.key_scales[j][2 * c]],
                                    E4M3.value[t.key_scales[j][2 * c + 1]]);
          value = Bf16Split::value_row(t, j, c);
        }
        std::memcpy(keys + j * D + 32 * c, &key, sizeof key);
        for (int h = 0; h < 2; ++h) {
          simd::u16x16 half;
          std::memcpy(&half, reinterpret_cast<const uint16_t*>(&value) + 16 * h, sizeof half);
          const u32x16 word = __builtin_convertvector(half, u32x16);
          words[h][j] = word | word << 16;
        }
      }
      for (int h = 0; h < 2; ++h) {
        transpose_words<16>(words[h]);
        std::memcpy(values + (2 * c + h) * 16 * TILE, words[h], sizeof words[h]);
      }
    }
  }

  // Tile 0 = S^T of a tile's 16 keys (keys [TILE][64]) and the 16 pairs of tiles 1 and 2, stored to `scores`.
  NVFP4_TARGET_AMX static inline void tile_scores(const uint16_t* keys, float* scores) {
    NVFP4_TILE_ZERO(0);
    NVFP4_TILE_LOAD(3, keys, 2 * 64);
    NVFP4_TILE_DOT(0, 3, 1);
    NVFP4_TILE_LOAD(3, keys + 32, 2 * 64);
    NVFP4_TILE_DOT(0, 3, 2);
    NVFP4_TILE_STORE(0, scores, 64);
  }
  // Tiles 4-7 += V^T · P^T of a tile: values [4][16][TILE] and P^T rows `probs` [TILE][16].
  NVFP4_TARGET_AMX static inline void tile_sums(const uint32_t* probs, const uint32_t* values) {
    NVFP4_TILE_LOAD(0, probs, 64);
    NVFP4_TILE_LOAD(3, values, 64);
    NVFP4_TILE_DOT(4, 3, 0);
    NVFP4_TILE_LOAD(3, values + 256, 64);
    NVFP4_TILE_DOT(5, 3, 0);
    NVFP4_TILE_LOAD(3, values + 512, 64);
    NVFP4_TILE_DOT(6, 3, 0);
    NVFP4_TILE_LOAD(3, values + 768, 64);
    NVFP4_TILE_DOT(7, 3, 0);
  }

  // One split of one unit for head 64 (attend_split_impl's contract).
  template <int D>
  NVFP4_TARGET_AMX static inline void attend_split(const Batch& b, const Unit& u, int64_t split, Scratch& scratch) {
    static_assert(D == 64, "four tiles of sums hold 64 dimensions");
    const int64_t group = b.group;
    State& st = scratch.split;
    const auto [key_begin, key_end] = start_split(b, u, split, st);
    const int64_t tile_begin = key_begin - key_begin % TILE;
    scratch.allocate_split();
    uint16_t* keys = reinterpret_cast<uint16_t*>(scratch.split_keys.get());
    uint32_t* values = reinterpret_cast<uint32_t*>(scratch.split_values.get());
    for (TileWalk walk(b, u, key_begin, key_end); walk.next();) {
      const int64_t at = (walk.key0() - tile_begin) * D;
      decode_tile<D>(walk.tokens(), keys + at, values + at);
    }
    const float inverse_cap = b.soft_cap > 0.0f ? 1.0f / b.soft_cap : 0.0f;
    const float log2_scale = b.score_scale * LOG2E;
    const int64_t end_pair = u.end_row_seeing(b, key_end - 1) * group;
    for (int64_t p0 = u.first_row_seeing(b, key_begin) * group; p0 < end_pair; p0 += 16) {
      const PairGroup g(b, u, p0, end_pair, key_begin, key_end);
      if (g.empty()) continue;
      const int64_t count = g.count;

      alignas(64) uint32_t queries[D / 2 * 16];
      Bf16Split::transpose_queries<D>(scratch.q.get() + p0 * D, count, queries);
      NVFP4_TILE_LOAD(1, queries, 64);
      NVFP4_TILE_LOAD(2, queries + 16 * 16, 64);
      NVFP4_TILE_ZERO(4);
      NVFP4_TILE_ZERO(5);
      NVFP4_TILE_ZERO(6);
      NVFP4_TILE_ZERO(7);
      // Two passes over the group's tiles, each ordered so that the tile products of one tile could run while the
      // vector units work on another (on the Xeon measured, they overlap little: a pass costs about the sum of both).
      // First the scores (tile t + 2's product, tile t's logits and max, in log2 units); then, against each pair's
      // max over the split, the probabilities of tile t and the sums of tile t - 1. A tile that some lane sees only
      // in part is masked key by key.
      const int64_t key_first = g.key_first(), tiles = g.tiles();
      float* logits = scratch.split_logits.get();  // [tiles][TILE][16], the scores in place
      for (int64_t t = 0; t < std::min<int64_t>(2, tiles); ++t)
        tile_scores(keys + (key_first + t * TILE - tile_begin) * D, logits + t * TILE * 16);
      f32x16 top = broadcast(NEG_INF);  // log2 units
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t key0 = key_first + t * TILE;
        const bool masked = g.masked(key0);
        if (t + 2 < tiles) tile_scores(keys + (key0 + 2 * TILE - tile_begin) * D, logits + (t + 2) * TILE * 16);
        for (int j = 0; j < TILE; ++j) {
          float* row = logits + (t * TILE + j) * 16;
          f32x16 logit;  // in log2 units
          if (b.soft_cap > 0.0f)
            logit = soft_cap<Isa::Amx>(load(row) * b.score_scale, b.soft_cap, inverse_cap) * LOG2E;
          else
            logit = load(row) * log2_scale;
          if (masked)
            logit = simd::as_f32(simd::select(g.sees(key0 + j), simd::as_u32(logit), simd::as_u32(broadcast(NEG_INF))));
          top = simd::max(top, logit);
          store(logit, row);
        }
      }
      alignas(64) uint32_t probs[2][TILE * 16];
      f32x16 total = {};
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t key0 = key_first + t * TILE;
        const bool masked = g.masked(key0);
        // P^T row j: key j's probability of each pair as its bf16 truncation (high half) plus the rest rounded to
        // bf16 (low half), together within 2^-16 of it. Keys a pair does not see (its logit -inf) have 0.
        for (int j = 0; j < TILE; ++j) {
          f32x16 p = Bf16Split::pow2(load(logits + (t * TILE + j) * 16) - top);
          if (masked) p = simd::as_f32(simd::as_u32(p) & g.sees(key0 + j));
          total += p;
          const u32x16 high = simd::as_u32(p) & 0xFFFF0000u;
          const __m256bh low = _mm512_cvtneps_pbh(__builtin_bit_cast(__m512, p - simd::as_f32(high)));
          const u32x16 row = high | __builtin_bit_cast(u32x16, _mm512_cvtepu16_epi32(__builtin_bit_cast(__m256i, low)));
          std::memcpy(probs[t % 2] + 16 * j, &row, sizeof row);
        }
        if (t > 0) tile_sums(probs[(t - 1) % 2], values + (key0 - TILE - tile_begin) * D);
      }
      tile_sums(probs[(tiles - 1) % 2], values + (key_first + (tiles - 1) * TILE - tile_begin) * D);
      alignas(64) float sums[D * 16];
      NVFP4_TILE_STORE(4, sums, 64);
      NVFP4_TILE_STORE(5, sums + 256, 64);
      NVFP4_TILE_STORE(6, sums + 512, 64);
      NVFP4_TILE_STORE(7, sums + 768, 64);
      for (int n = 0; n < D / 16; ++n) {
        u32x16 words[16];
        std::memcpy(words, sums + 256 * n, sizeof words);
        transpose_words<16>(words);
        for (int64_t i = 0; i < count; ++i) std::memcpy(st.acc.get() + (p0 + i) * D + 16 * n, &words[i], 64);
      }
      for (int64_t i = 0; i < count; ++i) {
        st.m[p0 + i] = top[i] * LN2;
        st.l[p0 + i] = total[i];
      }
    }
  }
};
#endif

// One split of one unit: the state of every pair whose row sees the split (the others keep l = 0). TILE_SCORES:
// the AVX512-BF16 code with Amx::group_scores for the scores.
template <Isa I, int D, bool TILE_SCORES = false>
NVFP4_INLINE void attend_split_impl(const Batch& b, const Unit& u, int64_t split, Scratch& scratch) {
  const int64_t group = b.group, pairs = u.rows * group;
  State& st = scratch.split;
  const auto [key_begin, key_end] = start_split(b, u, split, st);
  const int64_t first_row = u.first_row_seeing(b, key_begin);
  std::fill(st.acc.get() + first_row * group * D, st.acc.get() + pairs * D, 0.0f);
  const float inverse_cap = b.soft_cap > 0.0f ? 1.0f / b.soft_cap : 0.0f;
  if constexpr (I >= Isa::Avx512Bf16) {
    // q_bf16[4w + k] = dimensions 8w + k (low half) and 8w + 4 + k of the bf16 query (exact in scratch.q).
    for (int64_t p = 0; p < pairs; ++p)
      for (int w = 0; w < D / 8; ++w)
        for (int k = 0; k < 4; ++k) {
          const float* q = scratch.q.get() + p * D + 8 * w + k;
          scratch.q_bf16[p * D / 2 + 4 * w + k] =
              __builtin_bit_cast(uint32_t, q[0]) >> 16 | (__builtin_bit_cast(uint32_t, q[4]) & 0xFFFF0000u);
        }
  }
  for (TileWalk walk(b, u, key_begin, key_end); walk.next();) {
    const TileTokens& tokens = walk.tokens();
    const int64_t key0 = walk.key0();
    f32x16 key_scales[D / NVFP4_GROUP];
    if (b.layout.fp8_keys())
      decode_fp8_keys<I, D>(tokens, scratch.keys.get(), key_scales);
    else if (b.layout.int8_keys())
      decode_int8_keys<I, D>(tokens, scratch.keys.get(), key_scales);
    else
      decode_keys<I, D>(tokens, scratch.keys.get(), key_scales);
    const int64_t first = u.first_row_seeing(b, key0 + tokens.first) * group;
    const int64_t last = u.end_row_seeing(b, key0 + tokens.n - 1) * group;
#if NVFP4_X86
    if constexpr (I == Isa::Amx)
      Amx::scores<D>(scratch, first, last);
    else if constexpr (TILE_SCORES)
      Amx::group_scores<D>(scratch, key_scales, first, last);
    else
#endif
      tile_scores<I, D>(scratch, key_scales, first, last);
    // Online softmax: each pair's new max, its probabilities (exactly 0 for keys its row does not see) and the
    // factor exp(old max - new max) for its sums; 1 (skipped) when the max did not grow.
    for (int64_t p = first; p < last; ++p) {
      const int64_t row = p / group;
      const int64_t seen_begin = u.visible_begin(b, row) - key0;
      const int64_t seen_end = std::min<int64_t>(u.visible_end(b, row), key_end) - key0;
      const u32x16 mask = LANE_MASKS.mask[std::clamp<int64_t>(seen_end, 0, TILE)] &
                          ~LANE_MASKS.mask[std::clamp<int64_t>(seen_begin, 0, TILE)];
      float* prob = scratch.probs.get() + p * TILE;
      f32x16 logits = load(prob) * b.score_scale;
      if (b.soft_cap > 0.0f) logits = soft_cap<I>(logits, b.soft_cap, inverse_cap);
      const f32x16 scores = simd::as_f32(simd::select(mask, simd::as_u32(logits), simd::as_u32(broadcast(NEG_INF))));
      const float m = std::max(st.m[p], lanes_max(scores));
      float alpha = 1.0f;
      if (m > st.m[p]) {
        alpha = exp_nonpositive<I>(st.m[p] - m);
        st.m[p] = m;
      }
      const f32x16 probs = simd::as_f32(simd::as_u32(exp_nonpositive<I>(scores - m)) & mask);
      st.l[p] = st.l[p] * alpha + lanes_sum(probs);
      store(probs, prob);
      scratch.alpha[p] = alpha;
    }
#if NVFP4_X86
    if constexpr (I == Isa::Amx) {
      uint32_t* values = reinterpret_cast<uint32_t*>(scratch.values.get());
      Amx::decode_values<D>(tokens, values);
      Amx::weighted_values<D>(scratch, values, first, last, st.acc.get());
      continue;
    }
#endif
    tile_values<I, D>(tokens, scratch.probs.get(), scratch.alpha.get(), first, last, scratch.values.get(),
                      st.acc.get());
  }
}

using AttendSplit = void (*)(const Batch&, const Unit&, int64_t, Scratch&);

// Each variant is one function with everything inlined into it (flatten), so that the vector helpers are
// compiled for its instruction set.
#define NVFP4_ATTEND_SPLIT(ISA, TARGET, VARIANT)                                                        \
  template <int D>                                                                                      \
  TARGET __attribute__((flatten)) void attend_split_##VARIANT(const Batch& b, const Unit& u, int64_t s, \
                                                              Scratch& scratch) {                       \
    attend_split_impl<ISA, D>(b, u, s, scratch);                                                        \
  }
NVFP4_ATTEND_SPLIT(Isa::Baseline, , baseline)
#if NVFP4_X86
NVFP4_ATTEND_SPLIT(Isa::Avx512, NVFP4_TARGET_AVX512, avx512)
NVFP4_ATTEND_SPLIT(Isa::Avx512Bf16, NVFP4_TARGET_AVX512_BF16, avx512bf16)
#endif
#undef NVFP4_ATTEND_SPLIT

#if NVFP4_X86
// attend_split_impl's contract, a tile at a time in Avx2's halves.
template <int D>
NVFP4_TARGET_AVX2 __attribute__((flatten)) void attend_split_avx2(const Batch& b, const Unit& u, int64_t split,
                                                                  Scratch& scratch) {
  State& st = scratch.split;
  const auto [key_begin, key_end] = start_split(b, u, split, st);
  std::fill(st.acc.get() + u.first_row_seeing(b, key_begin) * b.group * D, st.acc.get() + u.rows * b.group * D, 0.0f);
  for (TileWalk walk(b, u, key_begin, key_end); walk.next();)
    Avx2::tile<D>(b, u, walk.tokens(), walk.key0(), key_end, scratch, st);
}
#endif

#if NVFP4_X86
// The AMX variant configures the tiles for the split and hands them back after it, so that a thread that is not
// in an attention call keeps no tile state for the kernel to save on a context switch.
template <int D>
NVFP4_TARGET_AMX __attribute__((flatten)) void attend_split_amx(const Batch& b, const Unit& u, int64_t s,
                                                                Scratch& scratch) {
  Amx::configure();
  if constexpr (D == 64)
    Amx::attend_split<D>(b, u, s, scratch);
  else
    attend_split_impl<Isa::Amx, D>(b, u, s, scratch);
  Amx::release();
}

// Decode where the CPU has AMX: the AVX512-BF16 code, its scores tile products (Amx::group_scores).
template <int D>
NVFP4_TARGET_AMX __attribute__((flatten)) void attend_split_amx_scores(const Batch& b, const Unit& u, int64_t s,
                                                                       Scratch& scratch) {
  Amx::configure_scores(u.rows * b.group);
  attend_split_impl<Isa::Avx512Bf16, D, true>(b, u, s, scratch);
  Amx::release();
}

template <int D>
NVFP4_TARGET_AVX512_BF16 __attribute__((flatten)) void attend_split_avx512bf16_prefill(const Batch& b, const Unit& u,
                                                                                       int64_t s, Scratch& scratch) {
  Bf16Split::attend_split<D>(b, u, s, scratch);
}
#endif

// bf16_scores: the queries are bf16 and the keys NVFP4, so AMX tile products or AVX512-BF16 dot products give the
// scores, prefill units' in their own code (Amx, Bf16Split).
template <int D>
AttendSplit attend_split_for_cpu(bool bf16_scores, bool prefill) {
#if NVFP4_X86
  if (bf16_scores && cpu_isa() == Isa::Amx) return prefill ? attend_split_amx<D> : attend_split_amx_scores<D>;
  if (bf16_scores && cpu_isa() >= Isa::Avx512Bf16)
    return prefill ? attend_split_avx512bf16_prefill<D> : attend_split_avx512bf16<D>;
  if (cpu_isa() >= Isa::Avx512) return attend_split_avx512<D>;
  if (cpu_isa() == Isa::Avx2) return attend_split_avx2<D>;
#endif
  return attend_split_baseline<D>;
}

AttendSplit attend_split_for(int64_t head_size, bool bf16_scores, bool prefill) {
  switch (head_size) {
    case 64:
      return attend_split_for_cpu<64>(bf16_scores, prefill);
    case 128:
      return attend_split_for_cpu<128>(bf16_scores, prefill);
    default:
      return attend_split_for_cpu<256>(bf16_scores, prefill);  // the argument checks allow 64, 128 and 256
  }
}

// --- merging splits and writing rows ----------------------------------------------------------------------

// Merges one split's state of a pair (max m, sum l, sums acc) into `total`'s; the one order and formula both
// plans use. A split the pair does not see (l == 0) changes nothing.
void merge_pair(State& total, int64_t p, float m, float l, const float* acc, int64_t head_size) {
  if (l == 0.0f) return;
  float* sums = total.acc.get() + p * head_size;
  if (total.l[p] == 0.0f) {
    total.m[p] = m;
    total.l[p] = l;
    std::memcpy(sums, acc, head_size * sizeof(float));
    return;
  }
  const float top = std::max(total.m[p], m);
  const float a = exp_nonpositive<Isa::Baseline>(total.m[p] - top), b = exp_nonpositive<Isa::Baseline>(m - top);
  total.m[p] = top;
  total.l[p] = total.l[p] * a + l * b;
  for (int64_t d = 0; d < head_size; d += 16) store(load(sums + d) * a + load(acc + d) * b, sums + d);
}

template <typename T>
void write_rows(const Batch& b, const Unit& u, const State& total, int64_t head_size, T* out, int64_t token_stride,
                int64_t head_stride) {
  const int64_t group = b.group;
  for (int64_t p = 0; p < u.rows * group; ++p) {
    const int64_t row = u.row0 + p / group, head = u.kv_head * group + p % group;
    float inverse = b.v_global / total.l[p];
    if (b.sinks != nullptr) {
      // The head's sink is one more logit of the denominator, with no value: with top = max(m, sink), the row is
      // sums · exp(m - top) / (l · exp(m - top) + exp(sink - top)).
      const float sink = b.sinks[head], top = std::max(total.m[p], sink);
      const float a = exp_nonpositive<Isa::Baseline>(total.m[p] - top);
      inverse = b.v_global * a / (total.l[p] * a + exp_nonpositive<Isa::Baseline>(sink - top));
    }
    const float* sums = total.acc.get() + p * head_size;
    T* o = out + row * token_stride + head * head_stride;
    for (int64_t d = 0; d < head_size; d += 32) {  // the even dimensions, then the odd ones (decode_values)
      const f32x16 even = load(sums + d) * inverse, odd = load(sums + d + 16) * inverse;
      simd::store16(__builtin_shufflevector(even, odd, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23), o + d);
      simd::store16(__builtin_shufflevector(even, odd, 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31),
                    o + d + 16);
    }
  }
}

template <typename T>
void load_queries(const Unit& u, int64_t group, int64_t head_size, const T* query, int64_t token_stride,
                  int64_t head_stride, float* q) {
  for (int64_t p = 0; p < u.rows * group; ++p) {
    const T* row = query + (u.row0 + p / group) * token_stride + (u.kv_head * group + p % group) * head_stride;
    for (int64_t d = 0; d < head_size; d += 16) store(simd::load16(row + d), q + p * head_size + d);
  }
}

// --- the op ---------------------------------------------------------------------------------------------

template <typename Fn>
void dispatch_float_types(ScalarType type, Fn&& fn) {
  switch (type) {
    case ScalarType::BFloat16:
      fn(c10::BFloat16{});
      break;
    case ScalarType::Half:
      fn(c10::Half{});
      break;
    default:
      fn(float{});
      break;  // the argument checks allow these three
  }
}

void nvfp4_paged_attention_cpu(const Tensor& query, const Tensor& key_cache, const Tensor& value_cache,
                               const Tensor& block_table, const Tensor& query_start_loc, const Tensor& seq_lens,
                               const Tensor& k_scale, const Tensor& v_scale, double scale, bool causal,
                               bool swizzle_v_scales, int64_t max_query_len, int64_t max_seq_len, Tensor& out,
                               int64_t sliding_window, double logits_soft_cap, const std::optional<Tensor>& sinks) {
  const char* op = "nvfp4_paged_attention";
  const NVFP4PageLayout layout =
      check_nvfp4_paged_attention(query, key_cache, value_cache, block_table, query_start_loc, seq_lens, k_scale,
                                  v_scale, swizzle_v_scales, max_query_len, max_seq_len, out);
  check_attention_features(sliding_window, logits_soft_cap, sinks, query);
  const int64_t num_reqs = seq_lens.size(0), head_size = layout.head_size;
  const int32_t* starts = query_start_loc.const_data_ptr<int32_t>();
  const int32_t* lens = seq_lens.const_data_ptr<int32_t>();
  check_paged_attention_ranges(op, starts, lens, num_reqs, query.size(0), max_query_len, max_seq_len,
                               block_table.const_data_ptr<int32_t>(), block_table.stride(0), block_table.size(1),
                               layout.block_size, key_cache.size(0));

  Batch b{layout,
          query.size(1) / layout.num_heads,
          static_cast<const uint8_t*>(key_cache.const_data_ptr()),
          static_cast<const uint8_t*>(value_cache.const_data_ptr()),
          key_cache.stride(0),
          value_cache.stride(0),
          block_table.const_data_ptr<int32_t>(),
          block_table.stride(0),
          static_cast<float>(scale) * *k_scale.const_data_ptr<float>(),
          *v_scale.const_data_ptr<float>(),
          causal,
          std::min(sliding_window, max_seq_len),  // as wide as any context: no window, and no overflow below
          static_cast<float>(logits_soft_cap),
          sinks.has_value() ? sinks->const_data_ptr<float>() : nullptr,
          {}};
  for (int64_t r = 0; r < 4; ++r)
    for (int64_t s = 0; s < layout.scale_dim(); ++s)
      b.v_scale_delta[r][s] = layout.scale_offset(r, 0, s, swizzle_v_scales) - layout.scale_offset(0, 0, 0, false);

  // The plan: units, row blocks from the last (the longest under a causal mask) to the first.
  const int64_t group = b.group;
  std::vector<Unit> units;
  int64_t scores = 0, max_pairs = 1;
  for (int64_t r = 0; r < num_reqs; ++r) {
    const int64_t n = starts[r + 1] - starts[r], c = lens[r];
    const int64_t rows_per_unit =
        std::max<int64_t>(1, (n >= PREFILL_MIN_ROWS ? PREFILL_UNIT_PAIRS : UNIT_PAIRS) / group);
    max_pairs = std::max(max_pairs, std::min(rows_per_unit, n) * group);
    for (int64_t block = (n + rows_per_unit - 1) / rows_per_unit - 1; block >= 0; --block) {
      const int64_t row = block * rows_per_unit, rows = std::min(rows_per_unit, n - row);
      const int64_t pos0 = c - n + row, key_end = causal ? pos0 + rows : c;
      const int64_t key_begin = b.window > 0 ? std::max<int64_t>(0, pos0 - b.window + 1) : 0;
      for (int64_t h = 0; h < layout.num_heads; ++h)
        units.push_back({r, h, starts[r] + row, rows, pos0, c, key_begin, key_end, -1, n >= PREFILL_MIN_ROWS});
      scores += layout.num_heads * rows * group * (key_end - key_begin);
    }
  }
  if (units.empty()) return;
  struct Task {
    int64_t unit, split;  // split -1: every split of the unit
  };
  std::vector<Task> tasks;
  std::vector<int64_t> split_units;
  int64_t partial_floats = 0;
  const int64_t partial_stride = head_size + 2;  // m, l, acc of one pair in one split
  for (int64_t i = 0; i < static_cast<int64_t>(units.size()); ++i) {
    Unit& u = units[i];
    const int64_t floats = u.num_splits() * u.rows * group * partial_stride;
    if (units.size() < SPLIT_BATCH_UNITS && u.rows <= SPLIT_UNIT_ROWS && u.num_splits() > 1 &&
        partial_floats + floats <= PARTIAL_FLOATS_MAX) {
      u.partials = partial_floats;
      partial_floats += floats;
      split_units.push_back(i);
      for (int64_t s = u.split_begin(); s < u.split_end(); ++s) tasks.push_back({i, s});
    } else {
      tasks.push_back({i, -1});
    }
  }
  std::vector<float> partials(partial_floats);

  const bool bf16_scores = query.scalar_type() == ScalarType::BFloat16 && layout.key_format == KeyFormat::Nvfp4;
  const AttendSplit attend_rows = attend_split_for(head_size, bf16_scores, false);
  const AttendSplit attend_prefill = attend_split_for(head_size, bf16_scores, true);
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());
  dispatch_float_types(query.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* q = static_cast<const T*>(query.const_data_ptr());
    T* o = static_cast<T*>(out.mutable_data_ptr());
    const int64_t q_token = query.stride(0), q_head = query.stride(1);
    const int64_t o_token = out.stride(0), o_head = out.stride(1);
#pragma omp parallel if (scores >= PARALLEL_MIN_SCORES)
    {
      const FlushDenormals flush;
      Scratch scratch(max_pairs, head_size);
#pragma omp for schedule(dynamic)
      for (int64_t i = 0; i < num_tasks; ++i) {
        const Task task = tasks[i];
        const Unit& u = units[task.unit];
        const AttendSplit attend_split = u.prefill ? attend_prefill : attend_rows;
        const int64_t pairs = u.rows * group;
        load_queries(u, group, head_size, q, q_token, q_head, scratch.q.get());
        if (task.split >= 0) {  // this split's state goes to the unit's partials
          attend_split(b, u, task.split, scratch);
          float* part = partials.data() + u.partials + (task.split - u.split_begin()) * pairs * partial_stride;
          for (int64_t p = 0; p < pairs; ++p, part += partial_stride) {
            part[0] = scratch.split.m[p];
            part[1] = scratch.split.l[p];
            if (scratch.split.l[p] != 0.0f)
              std::memcpy(part + 2, scratch.split.acc.get() + p * head_size, head_size * sizeof(float));
          }
          continue;
        }
        std::fill(scratch.total.l.get(), scratch.total.l.get() + pairs, 0.0f);
        for (int64_t s = u.split_begin(); s < u.split_end(); ++s) {
          attend_split(b, u, s, scratch);
          for (int64_t p = 0; p < pairs; ++p)
            merge_pair(scratch.total, p, scratch.split.m[p], scratch.split.l[p],
                       scratch.split.acc.get() + p * head_size, head_size);
        }
        write_rows(b, u, scratch.total, head_size, o, o_token, o_head);
      }
      // The split units' partials, merged in split order.
#pragma omp for schedule(dynamic)
      for (int64_t i = 0; i < static_cast<int64_t>(split_units.size()); ++i) {
        const Unit& u = units[split_units[i]];
        const int64_t pairs = u.rows * group;
        std::fill(scratch.total.l.get(), scratch.total.l.get() + pairs, 0.0f);
        for (int64_t s = 0; s < u.num_splits(); ++s) {
          const float* part = partials.data() + u.partials + s * pairs * partial_stride;
          for (int64_t p = 0; p < pairs; ++p, part += partial_stride)
            merge_pair(scratch.total, p, part[0], part[1], part + 2, head_size);
        }
        write_rows(b, u, scratch.total, head_size, o, o_token, o_head);
      }
    }
  });
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(vllm_nvfp4, CPU, m) {
  m.impl("nvfp4_paged_attention", TORCH_BOX(&nvfp4_paged_attention_cpu));
}

}  // namespace vllm_nvfp4
