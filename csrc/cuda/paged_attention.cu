// CUDA kernels of `nvfp4_paged_attention`: attention read straight from the NVFP4 pages (docs/FORMATS.md §1), for
// decode, prefill, chunked prefill and mixed batches in one launch (plus a combine pass when split-KV), with an
// optional sliding window (keys before it are never read), logit soft-cap and per-head sinks. Batches of at most
// 16 query rows a request over pages of a multiple of 16 keys run the decode kernel (further down); the others run
// the fused kernel described here.
//
// One CTA of 4 warps owns one (request, KV head, tile of query rows, KV split). A query row is a (query token,
// query head of the KV head's GQA group) pair, so every query head of a group and every token of a multi-token
// request share each dequantized KV tile. The CTA streams its KV range in tiles of TILE tokens: the raw page
// bytes (E2M1 codes and E4M3 scales) are copied by cp.async into a ring of shared-memory stages, and each warp
// decodes its part of a tile straight into mma.sync fragments in registers. Warps split a tile's query rows
// (WARPS_M = 4 for more than 32 rows) or, with 17–32 rows, two pairs of warps split its tokens (WARPS_N = 2,
// merged through shared memory at the end).
//
// Exact tensor-core inputs: a code is turned into the float16 of (its E2M1 value · 2^-14) by two shifts and a
// mask (E2M1 is float16's sign, low two exponent bits and top mantissa bit), then multiplied by its E4M3 block
// scale in float16; the product has at most 6 significant bits and lies in [2^-24, 0.17], so it is exact
// (subnormals included). The 2^14 and the layer's global scales are applied in float32: to the logits for K, to
// the output for V. Queries are scaled per row by a power of two into float16's range (exact: bf16 has fewer
// mantissa bits) and the power is undone on the logits. Softmax and accumulation are float32.
//
// Fragment order: a dot product may run over the head dim in any order, so each lane decodes whole 32-bit words
// of codes and the query is loaded in the matching permuted order; S columns map to tokens so that the P·V
// step's k-pairs are 4 consecutive tokens of one lane; V's output columns come out permuted and are placed
// right when stored.
//
// FP8 keys (an fp8_keys page, template flag KEYS): the K pages hold E4M3 bytes, copied and loaded like the codes
// (twice as many bytes) and converted in registers to their exact float16 values, in the pairs the code decode
// makes; k_scale alone scales the logits (no 2^14), the V side is unchanged. INT8 keys: the same with int8 codes
// (exact in float16), and each key's fp16 scale, copied with its bytes, multiplies its logit in float32 after the
// MMA (scaling the codes in float16 could overflow: 127 · 65504).
//
// Split-KV: when (requests × KV heads × query tiles) would leave SMs idle, the KV range is cut into splits
// planned from the host-side max_seq_len bound (never from device values, so a captured CUDA graph stays
// valid for any lengths within the bound); each CTA loops only over its request's real length and writes a
// float32 partial output and log-sum-exp, which the combine kernel merges.
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>

#include "checks.h"
#include "common.cuh"
#include "layout.h"

namespace vllm_nvfp4::cuda {
namespace {

constexpr int ATTN_THREADS = 128;
constexpr int ATTN_WARPS = ATTN_THREADS / WARP;
constexpr int TILE = 64;                 // KV tokens per pipeline stage
constexpr int STEP = 16;                 // tokens per warp step: two n8 blocks of S, one k16 block of P·V
constexpr int STAGE_BUDGET = 36864;      // bytes of shared memory for the stage ring (under the 48 KB default)
constexpr int FP8_STAGE_BUDGET = 49152;  // FP8 and INT8 keys: 3 / 7 stages at head 128 / 64 (head 256: two, 50 KB,
                                         // opted in)
constexpr float LOG2E = 1.4426950408889634f;
constexpr float CODE_UNIT = 16384.0f;  // 2^14: a decoded code is its E2M1 value / 2^14

template <int D, KeyFormat KEYS>
struct Tiles {
  static constexpr bool BYTE_KEYS = KEYS != KeyFormat::Nvfp4;  // FP8 or INT8 keys: a byte an element
  static constexpr int DATA = D / 2;                           // code bytes of one (token, head)
  static constexpr int SCALES = D / 16;                        // scale bytes of one (token, head)
  static constexpr int K_ROW = BYTE_KEYS ? D : DATA;           // K bytes of one (token, head): key bytes or codes
  // K scale bytes of one token: its block scales (NVFP4), none (FP8), the aligned word holding its fp16 scale (INT8)
  static constexpr int K_SCALE_ROW = KEYS == KeyFormat::Nvfp4 ? SCALES : KEYS == KeyFormat::Int8 ? 4 : 0;
  static constexpr int K_DATA = 0, V_DATA = TILE * K_ROW, K_SCALES = V_DATA + TILE * DATA;
  static constexpr int V_SCALES = K_SCALES + TILE * K_SCALE_ROW;
  static constexpr int STAGE_BYTES = V_SCALES + TILE * SCALES;
  static constexpr int BUDGET = BYTE_KEYS ? FP8_STAGE_BUDGET : STAGE_BUDGET;
  static constexpr int STAGES =
      BUDGET / STAGE_BYTES > 2 ? BUDGET / STAGE_BYTES : 2;  // NVFP4: 8 / 4 / 2 (head 64 / 128 / 256)
  static constexpr int Q_CHUNK = D / 4;                     // query elements (K codes) of one lane's quarter of a row
  static constexpr int K_WORDS = D / 32;                    // 8-element groups of that quarter (a code word each)
  static constexpr int V_WORDS = D / 64;                    // code words of one lane's eighth of a V row
  static constexpr int KSTEPS = D / 16;                     // k16 steps of Q·K^T
  static constexpr int VBLOCKS = D / 8;                     // n8 blocks of the output
  static_assert(STAGES >= 2, "the stage ring needs two stages");
};

// --- small device helpers -------------------------------------------------------------------------------

__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Copies BYTES (4, 8 or 16) from global to shared memory asynchronously; `valid` false writes zeros instead.
template <int BYTES>
__device__ __forceinline__ void copy_async(void* dst, const void* src, bool valid) {
  const int src_bytes = valid ? BYTES : 0;
  if constexpr (BYTES == 16)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_address(dst)), "l"(src), "r"(src_bytes)
                 : "memory");
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(smem_address(dst)), "l"(src), "n"(BYTES),
                 "r"(src_bytes)
                 : "memory");
}

__device__ __forceinline__ void copy_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int PENDING>
__device__ __forceinline__ void copy_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING) : "memory");
}

__device__ __forceinline__ uint32_t half2_bits(__half2 h) { return *reinterpret_cast<uint32_t*>(&h); }

__device__ __forceinline__ uint32_t hmul2(uint32_t a, uint32_t b) {
  return half2_bits(__hmul2(*reinterpret_cast<__half2*>(&a), *reinterpret_cast<__half2*>(&b)));
}

// The float16 pairs h[I] = (code I, code I + 4), I = 0..3, of the eight E2M1 codes in `w` (code k in nibble k),
// each its value / 2^14: a code's sign goes to bit 15 and its exponent and mantissa bits to bits 11..9 of its half,
// so the half's high byte is sign << 7 | magnitude << 1 and its low byte is zero. The high bytes of the even and of
// the odd codes are made four at a time; byte permutes pair them with zero low bytes (11 instructions, not 16).
__device__ __forceinline__ void code_pairs(uint32_t w, uint32_t (&h)[4]) {
  const uint32_t even = ((w << 1) & 0x0E0E0E0Eu) | ((w << 4) & 0x80808080u);  // byte j: code 2j
  const uint32_t odd = ((w >> 3) & 0x0E0E0E0Eu) | (w & 0x80808080u);          // byte j: code 2j + 1
  h[0] = __byte_perm(even, 0, 0x2404);
  h[1] = __byte_perm(odd, 0, 0x2404);
  h[2] = __byte_perm(even, 0, 0x3414);
  h[3] = __byte_perm(odd, 0, 0x3414);
}

// Two E4M3 scale bytes (low byte first) as a float16 pair.
__device__ __forceinline__ uint32_t scale_pair(uint32_t two_bytes) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two_bytes), __NV_E4M3);
  return static_cast<uint32_t>(h.x) | (static_cast<uint32_t>(h.y) << 16);
}

__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) { return half2_bits(__floats2half2_rn(lo, hi)); }

// Four E4M3 bytes as the exact float16 pairs (byte 0, byte 1) and (byte 2, byte 3).
__device__ __forceinline__ void e4m3x4_to_half2(uint32_t x, uint32_t& lo, uint32_t& hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  asm("{\n.reg .b16 a, b;\nmov.b32 {a, b}, %2;\ncvt.rn.f16x2.e4m3x2 %0, a;\ncvt.rn.f16x2.e4m3x2 %1, b;\n}"
      : "=r"(lo), "=r"(hi)
      : "r"(x));
#else
  // No FP8 conversion before SM89: a byte's sign moved to bit 15 and its exponent and mantissa to bits 13..7 is a
  // float16 of its value · 2^-8 (the biases differ by 8, subnormals land on subnormals); · 2^8 is exact. (An E4M3
  // NaN becomes 480; the stores never write one from finite keys.)
  const uint32_t a = __byte_perm(x, 0, 0x1404), b = __byte_perm(x, 0, 0x3424);  // bytes to the high half-bytes
  lo = hmul2((a & 0x80008000u) | ((a >> 1) & 0x3F803F80u), 0x5C005C00u);
  hi = hmul2((b & 0x80008000u) | ((b >> 1) & 0x3F803F80u), 0x5C005C00u);
#endif
}

// Four E4M3 scale bytes as the float16 pairs (byte 0, byte 1) and (byte 2, byte 3), as scale_pair makes them (NaN
// included); from SM89 the conversion reads the high half in place, so it needs no shift.
__device__ __forceinline__ void scale_pairs(uint32_t four_bytes, uint32_t& lo, uint32_t& hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  e4m3x4_to_half2(four_bytes, lo, hi);
#else
  lo = scale_pair(four_bytes & 0xFFFFu);
  hi = scale_pair(four_bytes >> 16);
#endif
}

// Four int8 bytes as the exact float16 pairs (byte 0, byte 1) and (byte 2, byte 3): a byte with its sign bit flipped
// (its value + 128) as the low byte of 0x64.. is the float16 1024 + value + 128, and subtracting 1152 is exact.
__device__ __forceinline__ void int8x4_to_half2(uint32_t x, uint32_t& lo, uint32_t& hi) {
  const uint32_t biased = x ^ 0x80808080u;
  const __half2 offset = __halves2half2(__ushort_as_half(0x6480), __ushort_as_half(0x6480));  // 1152
  uint32_t a = __byte_perm(biased, 0x64646464u, 0x4140), b = __byte_perm(biased, 0x64646464u, 0x4342);
  lo = half2_bits(__hsub2(*reinterpret_cast<__half2*>(&a), offset));
  hi = half2_bits(__hsub2(*reinterpret_cast<__half2*>(&b), offset));
}

// Eight key bytes of one 8-element group (`lo`: elements 0..3, `hi`: 4..7), FP8 E4M3 or INT8, as the float16 pairs
// code_pairs makes of a code word: h[I] = (element I, element I + 4).
template <KeyFormat KEYS>
__device__ __forceinline__ void key_pairs(uint32_t lo, uint32_t hi, uint32_t (&h)[4]) {
  if constexpr (KEYS == KeyFormat::Int8) {
    int8x4_to_half2(__byte_perm(lo, hi, 0x5140), h[0], h[1]);
    int8x4_to_half2(__byte_perm(lo, hi, 0x7362), h[2], h[3]);
  } else {
    e4m3x4_to_half2(__byte_perm(lo, hi, 0x5140), h[0], h[1]);
    e4m3x4_to_half2(__byte_perm(lo, hi, 0x7362), h[2], h[3]);
  }
}

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// c += a · b, m16n8k16, float16 inputs, float32 accumulators.
__device__ __forceinline__ void mma_f16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// A sink logit (natural units) joins a row's softmax denominator: (sum, acc), kept relative to max m (log2
// domain), move to the new max and the sink's term is added to the sum.
__device__ __forceinline__ void add_sink(float sink, float m, float& sum, float& acc) {
  const float sink2 = sink * LOG2E, m_new = fmaxf(m, sink2), keep = fast_exp2(m - m_new);
  sum = sum * keep + fast_exp2(sink2 - m_new);
  acc *= keep;
}

struct Params {
  const void* query;
  int64_t q_token_stride, q_head_stride;
  const uint8_t* key_cache;
  const uint8_t* value_cache;
  int64_t key_block_stride, value_block_stride, num_blocks;  // FP8 keys: the sides' strides may differ
  const int32_t* block_table;
  int64_t table_stride;
  const int32_t* query_start_loc;
  const int32_t* seq_lens;
  const float* k_scale;
  const float* v_scale;
  float logit_scale;  // scale · log2(e)
  bool causal;
  int sliding_window;   // keys a query sees, 0: all
  float soft_cap_log2;  // logits_soft_cap · log2(e), 0: no soft-cap
  const float* sinks;   // [q_heads] sink logits, or null
  NVFP4PageLayout layout;
  int block_shift;        // log2(block_size) when a power of two, else -1
  int group;              // query heads per KV head
  int tiles_per_split;    // the fused kernel's split length, in tiles
  int num_splits;         // the grid's splits
  int decode_max_splits;  // the decode kernel's splits of a request at most (decode_splits); 0 in the fused kernel
  void* out;
  int64_t out_token_stride, out_head_stride;
  float* partial_out;  // [num_splits, tokens, q_heads, D] when num_splits > 1
  float* partial_lse;  // [num_splits, tokens, q_heads], log2 domain
  int64_t num_tokens;
};

// (block-table column, offset in the block) of a token position: shifts for power-of-two blocks.
__device__ __forceinline__ int2 block_position(const Params& p, int pos) {
  if (p.block_shift >= 0) return make_int2(pos >> p.block_shift, pos & ((1 << p.block_shift) - 1));
  const int block_size = static_cast<int>(p.layout.block_size);
  return make_int2(pos / block_size, pos % block_size);
}

// The (key, head) entry of the key at `pos` inside its block, the same on both cache sides.
__device__ __forceinline__ int run_entry(const Params& p, int pos, int head) {
  const int offset = block_position(p, pos).y;
  return p.layout.hnd ? head * static_cast<int>(p.layout.block_size) + offset
                      : offset * static_cast<int>(p.layout.num_heads) + head;
}

// An INT8 key's fp16 scale as a float, from the aligned 4-byte word holding it: the half of the entry's parity.
__device__ __forceinline__ float int8_key_scale(uint32_t word, int entry) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(word >> (16 * (entry & 1)))));
}

// Which tokens of a tile this thread copies: a warp's 16-byte chunks cover whole (token, head) rows, so each copy
// instruction reads contiguous rows. Data: chunk tid % CHUNKS of tokens data_token(j), in K and in V; scales:
// token tid % TILE of side tid / TILE.
template <int D>
struct TileCopy {
  static constexpr int CHUNKS = D / 32;                             // 16-byte chunks of one (token, head) code row
  static constexpr int DATA_TOKENS = TILE * CHUNKS / ATTN_THREADS;  // data tokens of one thread
  static constexpr int TOKEN_STRIDE = ATTN_THREADS / CHUNKS;
  static constexpr int PAGES = DATA_TOKENS + 1;  // the scale token last
  static_assert(TILE * CHUNKS % ATTN_THREADS == 0 && 2 * TILE == ATTN_THREADS, "copy mapping");

  __device__ static int data_token(int j) { return (j * TOKEN_STRIDE + static_cast<int>(threadIdx.x) / CHUNKS) % TILE; }
  __device__ static int scale_token() { return threadIdx.x % TILE; }
};

// The block ids of this thread's tokens in `tile` (-1: nothing to copy), read one tile ahead of their use so the
// copies never wait on the block table. A swizzled V scale row holds scales of all 4 tokens of its group, so it is
// copied whenever one of the group's tokens is in range.
template <int D>
__device__ __forceinline__ void tile_pages(int (&pages)[TileCopy<D>::PAGES], const Params& p, const int32_t* table_row,
                                           int tile, int kv_lo, int kv_end) {
  using C = TileCopy<D>;
  const bool v_side = threadIdx.x >= TILE;
#pragma unroll
  for (int j = 0; j < C::PAGES; ++j) {
    const int pos = tile * TILE + (j < C::DATA_TOKENS ? C::data_token(j) : C::scale_token());
    const bool group_row = j == C::DATA_TOKENS && v_side && p.layout.swizzle_v_scales;
    const int first = group_row ? pos & ~3 : pos, last = group_row ? pos | 3 : pos;
    int block = -1;
    if (tile >= 0 && first < kv_end && last >= kv_lo) {
      block = __ldg(table_row + block_position(p, pos).x);
      if (block < 0 || block >= p.num_blocks) block = -1;
    }
    pages[j] = block;
  }
}

// The KV tile's raw bytes into one stage (zeros where a token has no block). FP8 and INT8 keys: a K row is two code
// rows long, copied as two chunks of the same row; no K block scales. INT8 keys: the aligned 4-byte word holding the
// token's fp16 scale (past an odd last entry, the padding up to the block stride's 16-byte multiple).
template <int D, KeyFormat KEYS>
__device__ __forceinline__ void load_tile(uint8_t* stage, const Params& p, int head, int tile,
                                          const int (&pages)[TileCopy<D>::PAGES]) {
  using G = Tiles<D, KEYS>;
  using C = TileCopy<D>;
  // entry_index(offset, head) = offset · token_step + head_entry (NHD: token-major, HND: head-major)
  const int token_step = static_cast<int>(p.layout.token_step());
  const int head_entry = head * (p.layout.hnd ? static_cast<int>(p.layout.block_size) : 1);
  const int chunk = threadIdx.x % C::CHUNKS;
#pragma unroll
  for (int j = 0; j < C::DATA_TOKENS; ++j) {  // the same rows of K and V
    const int token = C::data_token(j), block = pages[j];
    const int entry = block_position(p, tile * TILE + token).y * token_step + head_entry;
    const int64_t k_offset = static_cast<int64_t>(max(block, 0)) * p.key_block_stride + entry * G::K_ROW + 16 * chunk;
    const int64_t v_offset = static_cast<int64_t>(max(block, 0)) * p.value_block_stride + entry * G::DATA + 16 * chunk;
    copy_async<16>(stage + G::K_DATA + token * G::K_ROW + 16 * chunk, p.key_cache + k_offset, block >= 0);
    if constexpr (G::BYTE_KEYS)
      copy_async<16>(stage + G::K_DATA + token * G::K_ROW + G::DATA + 16 * chunk, p.key_cache + k_offset + G::DATA,
                     block >= 0);
    copy_async<16>(stage + G::V_DATA + token * G::DATA + 16 * chunk, p.value_cache + v_offset, block >= 0);
  }
  const int side = threadIdx.x / TILE, token = C::scale_token(), block = pages[C::DATA_TOKENS];
  if (KEYS == KeyFormat::Fp8 && side == 0) return;  // no K scales
  const int entry = block_position(p, tile * TILE + token).y * token_step + head_entry;
  if (KEYS == KeyFormat::Int8 && side == 0) {
    const uint8_t* word = p.key_cache + static_cast<int64_t>(max(block, 0)) * p.key_block_stride +
                          static_cast<int>(p.layout.entries()) * D + ((2 * entry) & ~3);
    copy_async<4>(stage + G::K_SCALES + token * 4, word, block >= 0);
    return;
  }
  const int64_t stride = side ? p.value_block_stride : p.key_block_stride;
  const uint8_t* src = (side ? p.value_cache : p.key_cache) + static_cast<int64_t>(max(block, 0)) * stride +
                       static_cast<int>(p.layout.data_region_bytes()) + entry * G::SCALES;
  copy_async<G::SCALES>(stage + (side ? G::V_SCALES : G::K_SCALES) + token * G::SCALES, src, block >= 0);
}

template <int D, int WARPS_M, KeyFormat KEYS, typename T>
__global__ void __launch_bounds__(ATTN_THREADS) nvfp4_paged_attention_kernel(Params p) {
  using G = Tiles<D, KEYS>;
  constexpr int WARPS_N = ATTN_WARPS / WARPS_M;
  constexpr int ROWS = 16 * WARPS_M;
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ float merge_m[WARPS_N][ROWS], merge_l[WARPS_N][ROWS];

  const int kv_heads = static_cast<int>(p.layout.num_heads);
  const int request = blockIdx.z, split = blockIdx.y;
  const int head = blockIdx.x % kv_heads, row_tile = blockIdx.x / kv_heads;
  const int q_start = __ldg(p.query_start_loc + request);
  const int num_q = __ldg(p.query_start_loc + request + 1) - q_start;
  const int seq_len = __ldg(p.seq_lens + request);
  const int num_rows = num_q * p.group;
  const int row0 = row_tile * ROWS;
  if (row0 >= num_rows) return;

  // The KV range of this CTA: its split's tiles, cut at the last key its rows can see.
  const int last_token = (min(row0 + ROWS, num_rows) - 1) / p.group;
  const int kv_end = max(0, p.causal ? min(seq_len, seq_len - num_q + last_token + 1) : seq_len);
  const int kv_lo = p.sliding_window > 0 ? max(0, seq_len - num_q + row0 / p.group - p.sliding_window + 1) : 0;
  const int tiles = (kv_end + TILE - 1) / TILE;
  const int tile_begin = kv_lo / TILE + split * p.tiles_per_split;
  const int tile_end = split == p.num_splits - 1 ? tiles : min(tiles, tile_begin + p.tiles_per_split);
  const int num_tiles = max(0, tile_end - tile_begin);

  const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
  const int wm = warp % WARPS_M, wn = warp / WARPS_M;
  const int g = lane >> 2, t = lane & 3;

  const int32_t* table_row = p.block_table + static_cast<int64_t>(request) * p.table_stride;
  int pages[TileCopy<D>::PAGES];
  for (int s = 0; s < G::STAGES - 1; ++s) {
    if (s < num_tiles) {
      tile_pages<D>(pages, p, table_row, tile_begin + s, kv_lo, kv_end);
      load_tile<D, KEYS>(smem + s * G::STAGE_BYTES, p, head, tile_begin + s, pages);
    }
    copy_commit();
  }
  // Block ids of the next tile to copy, fetched an iteration before the copy.
  tile_pages<D>(pages, p, table_row, G::STAGES - 1 < num_tiles ? tile_begin + G::STAGES - 1 : -1, kv_lo, kv_end);

  // This lane's two rows (g and g + 8 of the warp's 16): their query tokens, visible key ends and logit scales;
  // their query quarters as float16 A fragments, in the order code_pairs decodes K.
  int row_limit[2], row_start[2];
  float row_scale[2];
  uint32_t qa[G::KSTEPS][4];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row0 + wm * 16 + g + 8 * r;
    const bool valid = row < num_rows;
    const int token = valid ? row / p.group : 0;
    const int q_head = head * p.group + (valid ? row % p.group : 0);
    row_limit[r] = !valid ? 0 : p.causal ? seq_len - num_q + token + 1 : seq_len;
    row_start[r] = p.sliding_window > 0 ? seq_len - num_q + token - p.sliding_window + 1 : 0;
    float q[G::Q_CHUNK];
    const T* src = static_cast<const T*>(p.query) + (q_start + token) * p.q_token_stride + q_head * p.q_head_stride +
                   t * G::Q_CHUNK;
    const auto loaded = load_elements<G::Q_CHUNK, true>(src);
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < G::Q_CHUNK; ++i) {
      q[i] = valid ? to_float(loaded.x[i]) : 0.0f;
      amax = fmaxf(amax, fabsf(q[i]));
    }
    amax = quad_max(amax);
    int exponent = 0;
    if (amax > 0.0f) frexpf(amax, &exponent);   // amax < 2^exponent
    const int shift = min(127, 15 - exponent);  // max |q| · 2^shift in [2^14, 2^15)
    const float up = ldexpf(1.0f, shift);
    row_scale[r] = p.logit_scale * __ldg(p.k_scale) * (G::BYTE_KEYS ? 1.0f : CODE_UNIT) * ldexpf(1.0f, -shift);
#pragma unroll
    for (int j = 0; j < G::KSTEPS; ++j) {
      const int base = 8 * (j >> 1) + 2 * (j & 1);
      qa[j][r] = pack_half2(q[base] * up, q[base + 4] * up);
      qa[j][2 + r] = pack_half2(q[base + 1] * up, q[base + 5] * up);
    }
  }

  float o[G::VBLOCKS][4];
#pragma unroll
  for (int c = 0; c < G::VBLOCKS; ++c) o[c][0] = o[c][1] = o[c][2] = o[c][3] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  const bool warp_has_rows = row0 + wm * 16 < num_rows;
  const bool swizzled = p.layout.swizzle_v_scales;

  for (int it = 0; it < num_tiles; ++it) {
    copy_wait<G::STAGES - 2>();
    __syncthreads();
    {
      const int next = it + G::STAGES - 1;
      if (next < num_tiles)
        load_tile<D, KEYS>(smem + (next % G::STAGES) * G::STAGE_BYTES, p, head, tile_begin + next, pages);
      copy_commit();
      tile_pages<D>(pages, p, table_row, next + 1 < num_tiles ? tile_begin + next + 1 : -1, kv_lo, kv_end);
    }
    if (!warp_has_rows) continue;
    const uint8_t* stage = smem + (it % G::STAGES) * G::STAGE_BYTES;
    const int tile_start = (tile_begin + it) * TILE;
#pragma unroll
    for (int st = wn; st < TILE / STEP; st += WARPS_N) {
      const int step_start = tile_start + st * STEP;
      if (step_start >= kv_end) break;
      // S = Q · K^T over 16 tokens: n-block nb, column g is token 4 (g / 2) + 2 nb + g % 2 of the step.
      float s[2][4];
#pragma unroll
      for (int nb = 0; nb < 2; ++nb) {
        s[nb][0] = s[nb][1] = s[nb][2] = s[nb][3] = 0.0f;
        const int token = st * STEP + 4 * (g >> 1) + 2 * nb + (g & 1);
        if constexpr (G::BYTE_KEYS) {
          const uint8_t* keys = stage + G::K_DATA + token * G::K_ROW + t * (G::K_ROW / 4);
#pragma unroll
          for (int u = 0; u < G::K_WORDS; ++u) {
            const uint2 pair = *reinterpret_cast<const uint2*>(keys + 8 * u);
            uint32_t h[4];
            key_pairs<KEYS>(pair.x, pair.y, h);
            mma_f16(s[nb], qa[2 * u], h[0], h[1]);
            mma_f16(s[nb], qa[2 * u + 1], h[2], h[3]);
          }
          continue;
        }
        const uint8_t* codes = stage + G::K_DATA + token * G::DATA + t * (G::DATA / 4);
        const uint8_t* scales = stage + G::K_SCALES + token * G::SCALES + t * (G::SCALES / 4);
        uint32_t words[G::K_WORDS];
#pragma unroll
        for (int u = 0; u < G::K_WORDS; u += 2) {
          const uint2 pair = *reinterpret_cast<const uint2*>(codes + 4 * u);
          words[u] = pair.x;
          words[u + 1] = pair.y;
        }
#pragma unroll
        for (int u = 0; u < G::K_WORDS; ++u) {
          const uint32_t sf_byte = scales[u >> 1];
          const uint32_t sf = scale_pair(sf_byte | (sf_byte << 8));
          const uint32_t w = words[u];
          uint32_t h[4];
          code_pairs(w, h);
          mma_f16(s[nb], qa[2 * u], hmul2(h[0], sf), hmul2(h[1], sf));
          mma_f16(s[nb], qa[2 * u + 1], hmul2(h[2], sf), hmul2(h[3], sf));
        }
      }
      // Online softmax in the log2 domain; element (nb, e) of row r is token 4t + 2nb + e of the step.
      float key_scale[2][2];  // INT8 keys: element (nb, e)'s key scale, applied to the float32 logit
      if constexpr (KEYS == KeyFormat::Int8) {
#pragma unroll
        for (int nb = 0; nb < 2; ++nb)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int token = st * STEP + 4 * t + 2 * nb + e;
            key_scale[nb][e] = int8_key_scale(*reinterpret_cast<const uint32_t*>(stage + G::K_SCALES + token * 4),
                                              run_entry(p, tile_start + token, head));
          }
      }
      float alpha[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float row_max = -INFINITY;
#pragma unroll
        for (int nb = 0; nb < 2; ++nb)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int pos = step_start + 4 * t + 2 * nb + e;
            float x = s[nb][2 * r + e] * row_scale[r];
            if constexpr (KEYS == KeyFormat::Int8) x *= key_scale[nb][e];
            if (p.soft_cap_log2 > 0.0f) x = p.soft_cap_log2 * tanhf(x / p.soft_cap_log2);
            x = pos >= row_start[r] && pos < row_limit[r] ? x : -INFINITY;
            s[nb][2 * r + e] = x;
            row_max = fmaxf(row_max, x);
          }
        const float m_new = fmaxf(m[r], quad_max(row_max));
        const float base = m_new == -INFINITY ? 0.0f : m_new;
        alpha[r] = fast_exp2(m[r] - base);
        m[r] = m_new;
        float sum = 0.0f;
#pragma unroll
        for (int nb = 0; nb < 2; ++nb)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float pexp = fast_exp2(s[nb][2 * r + e] - base);
            s[nb][2 * r + e] = pexp;
            sum += pexp;
          }
        l[r] = l[r] * alpha[r] + sum;
      }
      if (__any_sync(0xffffffffu, alpha[0] != 1.0f || alpha[1] != 1.0f)) {  // a row max moved in this warp
#pragma unroll
        for (int c = 0; c < G::VBLOCKS; ++c) {
          o[c][0] *= alpha[0];
          o[c][1] *= alpha[0];
          o[c][2] *= alpha[1];
          o[c][3] *= alpha[1];
        }
      }
      const uint32_t pa[4] = {pack_half2(s[0][0], s[0][1]), pack_half2(s[0][2], s[0][3]), pack_half2(s[1][0], s[1][1]),
                              pack_half2(s[1][2], s[1][3])};
      // O += P · V: this lane's k rows are tokens 4t .. 4t + 3 of the step; its V columns are the eighth g of
      // each token's row, code c of that eighth feeding n-block c.
      const int v_token = st * STEP + 4 * t;
      uint32_t vw[4][G::V_WORDS];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const uint8_t* codes = stage + G::V_DATA + (v_token + k) * G::DATA + g * (G::DATA / 8);
        if constexpr (G::V_WORDS == 1) {
          vw[k][0] = *reinterpret_cast<const uint32_t*>(codes);
        } else {
#pragma unroll
          for (int u = 0; u < G::V_WORDS; u += 2) {
            const uint2 pair = *reinterpret_cast<const uint2*>(codes + 4 * u);
            vw[k][u] = pair.x;
            vw[k][u + 1] = pair.y;
          }
        }
      }
#pragma unroll
      for (int u = 0; u < G::V_WORDS; ++u) {
        // The 16 codes of word u share one block scale per token (group (D / 8 · g + 8 u) / 16).
        const int group = (G::VBLOCKS * g + 8 * u) / 16;
        uint32_t sf_bytes[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const int token = v_token + k;
          int entry = token, byte = group;
          if (swizzled) {
            const int quarter = G::SCALES / 4;
            entry = (token & ~3) + group / quarter;
            byte = (group % quarter) * 4 + (token & 3);
          }
          // A token outside the range has zero codes but, in a swizzled group, a copied scale byte that may be
          // anything (a NaN times its zero probability is NaN): its scale is zero.
          const int pos = tile_start + token;
          sf_bytes[k] = pos >= kv_lo && pos < kv_end ? stage[G::V_SCALES + entry * G::SCALES + byte] : 0u;
        }
        const uint32_t sf01 = scale_pair(sf_bytes[0] | (sf_bytes[1] << 8));
        const uint32_t sf23 = scale_pair(sf_bytes[2] | (sf_bytes[3] << 8));
        const uint32_t lo01 = __byte_perm(vw[0][u], vw[1][u], 0x5410), hi01 = __byte_perm(vw[0][u], vw[1][u], 0x7632);
        const uint32_t lo23 = __byte_perm(vw[2][u], vw[3][u], 0x5410), hi23 = __byte_perm(vw[2][u], vw[3][u], 0x7632);
        uint32_t l01[4], l23[4], h01[4], h23[4];
        code_pairs(lo01, l01);
        code_pairs(lo23, l23);
        code_pairs(hi01, h01);
        code_pairs(hi23, h23);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          mma_f16(o[8 * u + i], pa, hmul2(l01[i], sf01), hmul2(l23[i], sf23));
          mma_f16(o[8 * u + 4 + i], pa, hmul2(h01[i], sf01), hmul2(h23[i], sf23));
        }
      }
    }
  }
  copy_wait<0>();

  const float out_scale = __ldg(p.v_scale) * CODE_UNIT;
  l[0] = quad_sum(l[0]);
  l[1] = quad_sum(l[1]);

  // Row `row` of the tile (its output column d) gets `value` (already normalized) and log-sum-exp `lse`.
  auto store = [&](int row, int d, float value) {
    const int token = q_start + (row0 + row) / p.group;
    const int q_head = head * p.group + (row0 + row) % p.group;
    if (p.num_splits == 1) {
      from_float(value * out_scale,
                 static_cast<T*>(p.out) + token * p.out_token_stride + q_head * p.out_head_stride + d);
    } else {
      p.partial_out[((static_cast<int64_t>(split) * p.num_tokens + token) * kv_heads * p.group + q_head) * D + d] =
          value * out_scale;
    }
  };
  auto store_lse = [&](int row, float lse) {
    if (p.num_splits == 1) return;
    const int token = q_start + (row0 + row) / p.group;
    const int q_head = head * p.group + (row0 + row) % p.group;
    p.partial_lse[(static_cast<int64_t>(split) * p.num_tokens + token) * kv_heads * p.group + q_head] = lse;
  };

  if constexpr (WARPS_N == 1) {
    // Each warp owns its rows: write them from the fragments (column of element e of n-block c: D/8 (2t+e) + c).
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = wm * 16 + g + 8 * r;
      if (row0 + row >= num_rows) continue;
      float sum = l[r], keep = 1.0f;
      if (p.sinks != nullptr && p.num_splits == 1)
        add_sink(__ldg(p.sinks + head * p.group + (row0 + row) % p.group), m[r], sum, keep);
      const float inv = sum > 0.0f ? keep / sum : 0.0f;
#pragma unroll
      for (int c = 0; c < G::VBLOCKS; ++c)
#pragma unroll
        for (int e = 0; e < 2; ++e) store(row, G::VBLOCKS * (2 * t + e) + c, o[c][2 * r + e] * inv);
      if (t == 0) store_lse(row, l[r] > 0.0f ? m[r] + __log2f(l[r]) : -INFINITY);
    }
  } else {
    // Warps wn hold the same rows over different tokens: merge them through shared memory.
    float* merged = reinterpret_cast<float*>(smem);  // [ROWS][D]
    static_assert(ROWS * D * sizeof(float) <= G::STAGES * G::STAGE_BYTES, "the merge buffer reuses the stage ring");
    if (t == 0) {
      merge_m[wn][wm * 16 + g] = m[0];
      merge_m[wn][wm * 16 + g + 8] = m[1];
      merge_l[wn][wm * 16 + g] = l[0];
      merge_l[wn][wm * 16 + g + 8] = l[1];
    }
    __syncthreads();  // every warp is past its last read of the stages
    for (int i = threadIdx.x; i < ROWS * D; i += ATTN_THREADS) merged[i] = 0.0f;
    __syncthreads();
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = wm * 16 + g + 8 * r;
      float m_all = -INFINITY;
#pragma unroll
      for (int w = 0; w < WARPS_N; ++w) m_all = fmaxf(m_all, merge_m[w][row]);
      const float factor = m[r] == -INFINITY ? 0.0f : fast_exp2(m[r] - m_all);
#pragma unroll
      for (int c = 0; c < G::VBLOCKS; ++c)
#pragma unroll
        for (int e = 0; e < 2; ++e)
          atomicAdd(merged + row * D + G::VBLOCKS * (2 * t + e) + c, o[c][2 * r + e] * factor);
    }
    __syncthreads();
    for (int row = warp; row < ROWS; row += ATTN_WARPS) {
      if (row0 + row >= num_rows) continue;
      float m_all = -INFINITY, l_all = 0.0f;
#pragma unroll
      for (int w = 0; w < WARPS_N; ++w) m_all = fmaxf(m_all, merge_m[w][row]);
#pragma unroll
      for (int w = 0; w < WARPS_N; ++w)
        if (merge_m[w][row] != -INFINITY) l_all += merge_l[w][row] * fast_exp2(merge_m[w][row] - m_all);
      float sum = l_all, keep = 1.0f;
      if (p.sinks != nullptr && p.num_splits == 1)
        add_sink(__ldg(p.sinks + head * p.group + (row0 + row) % p.group), m_all, sum, keep);
      const float inv = sum > 0.0f ? keep / sum : 0.0f;
      for (int d = lane; d < D; d += WARP) store(row, d, merged[row * D + d] * inv);
      if (lane == 0) store_lse(row, l_all > 0.0f ? m_all + __log2f(l_all) : -INFINITY);
    }
  }
}

// --- decode kernel ------------------------------------------------------------------------------------
//
// For batches whose requests have at most 16 query rows (query tokens × the GQA group), over pages of a multiple of
// 16 keys (so a 16-key run of a chunk lies in one block), the tokens take the MMA's
// M side: S^T = K · Q^T (m16 = 16 keys, n8 = 8 query rows, k16 = 16 channels) and O^T = V^T · P^T (m16 = 16
// channels, k16 = 16 keys), so no tensor-core row is spent on the few query rows, and every lane decodes each
// code it loads exactly once. A warp copies chunks of 32 keys with cp.async into a ring of two slots of shared
// memory, one chunk ahead of its use; each lane reads back only the bytes it copied, so no barrier is needed (head
// 64: the bytes its warp copied, behind a __syncwarp; DecodeSlot::SHARED), and the registers a chunk would hold go to
// a fourth CTA an SM. The four warps of a CTA take interleaved chunks of
// the CTA's KV range, and they merge through shared memory at the end. S^T's fragments become P^T's with `movmatrix` (a
// transpose of 8 × 8 half blocks in registers).
//
// Lane (g, t) of a warp: for K it loads a quarter of the channels of keys σ(g) and σ(g) + 2 of each 16-key block,
// σ(g) = 2g - g % 2 (so that after the transpose its V keys are 4t .. 4t + 3, four consecutive keys whose
// swizzled V scales share one 32-bit word): its pieces of at most 16 bytes of the K row, pieces 4p + t
// (DecodeSlot::piece_offset); for V it loads the channel eighth g of keys 4t .. 4t + 3. Channel orders inside a
// piece or an eighth are permuted as the decode of a 32-bit code word comes out; the query is loaded in the
// matching order and the output written back in channel order. INT8 keys: the four lanes of a g share its four keys
// (σ(g), σ(g) + 2 of both runs); lane t copies the aligned word holding key t's fp16 scale and shuffles the scale to
// the other three (a word a key each would cost the fourth CTA an SM at head 128).
constexpr int DECODE_WARPS = 4;
constexpr int DECODE_THREADS = DECODE_WARPS * WARP;
constexpr int DECODE_CHUNK = 32;  // keys of one warp iteration: two 16-key blocks

template <int D, KeyFormat KEYS>
struct DecodeShape {
  static constexpr bool BYTE_KEYS = KEYS != KeyFormat::Nvfp4;  // FP8 or INT8 keys: a byte an element
  static constexpr int K_ROW = BYTE_KEYS ? D : D / 2;          // K bytes of one (key, head)
  static constexpr int K_BYTES = K_ROW / 4;                    // one lane's quarter of a K row
  static constexpr int K_WORDS = K_BYTES / 4;
  static constexpr int V_BYTES = D / 16;  // one lane's eighth of a V row
  static constexpr int V_WORDS = D / 64;
  static constexpr int V_GROUPS = D >= 256 ? D / 128 : 1;  // block-scale groups of that eighth
  static constexpr int KSTEPS = D / 16;                    // k16 steps of S^T
  static constexpr int MBLOCKS = D / 16;                   // m16 blocks of O^T
};

// One warp's bytes of one chunk in shared memory. Each lane reads back only the bytes it copied itself, so no
// barrier stands between a copy and its use; the bytes are kept lane-minor so that every access is conflict-free.
template <int D, KeyFormat KEYS>
struct DecodeSlot {
  using S = DecodeShape<D, KEYS>;
  static constexpr int K_PIECE = S::K_BYTES < 16 ? S::K_BYTES : 16;  // bytes of one copy of a K quarter
  static constexpr int K_PIECES = S::K_BYTES / K_PIECE;
  static constexpr int PIECE_CHANNELS = S::BYTE_KEYS ? K_PIECE : 2 * K_PIECE;
  // Where lane t's piece p of a K row starts: the four lanes of a key take its pieces in turn, so that each copy
  // instruction reads whole 32-byte sectors. A lane's own 32 bytes in two copies had each instruction read half of
  // every sector it touched, so every sector twice: FP8 keys at head 128 had their busiest memory unit at 82% for 47%
  // of DRAM bandwidth, and decode took 0.19 ms instead of 0.15. An NVFP4 piece's block scales start at
  // byte piece_offset / 8 of the key's scale row (a scale byte for each 8 bytes of codes).
  __host__ __device__ static constexpr int piece_offset(int t, int p) { return (4 * p + t) * K_PIECE; }
  // Head 64 (NVFP4): a (key, head)'s codes are 32 bytes a side and its block scales 4, so a lane's own bytes took 18
  // copies of 4 and 8 bytes a chunk, whose address arithmetic was on the critical path. SHARED: the lanes copy whole
  // rows instead, 16-byte halves of code rows and whole scale rows (6 copies a lane), each into the place its
  // readers load from, and read each other's bytes behind a __syncwarp.
  static constexpr bool SHARED = D == 64 && KEYS == KeyFormat::Nvfp4;
  static constexpr int K_DATA = 0;  // [16-key run][key r][piece][lane] (SHARED: [run][r][g][row], the same bytes)
  static constexpr int K_SCALES = K_DATA + 4 * K_PIECES * WARP * K_PIECE;  // [run][key r][word][lane]: the 4-byte
                                                                           // words holding the key's scale bytes
  // K scale bytes of one lane: a word per piece of each of its 4 keys (NVFP4), none (FP8), one word (INT8: [lane]).
  // SHARED: [run][32 scale rows], K key σ(g) + 2r at row 2g + r, V key k at row 16 + k.
  static constexpr int K_SCALE_BYTES = SHARED                     ? 8
                                       : KEYS == KeyFormat::Nvfp4 ? 4 * K_PIECES * 4
                                       : KEYS == KeyFormat::Int8  ? 4
                                                                  : 0;
  static constexpr int V_DATA = K_SCALES + K_SCALE_BYTES * WARP;   // [run][key 4t + i][lane] (SHARED: [run][i][t][row])
  static constexpr int V_SCALES = V_DATA + 8 * WARP * S::V_BYTES;  // [run][group][lane]: a 4-byte word
  static constexpr int BYTES = V_SCALES + (SHARED ? 0 : 2 * S::V_GROUPS * WARP * 4);
};

// c += a · (a B fragment read from shared memory now: a volatile load, so that it is not hoisted into registers).
__device__ __forceinline__ void mma_query(float (&c)[4], const uint32_t (&a)[4], const uint2& frag) {
  uint32_t b0, b1;
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n" : "=r"(b0), "=r"(b1) : "r"(smem_address(&frag)));
  mma_f16(c, a, b0, b1);
}

__device__ __forceinline__ uint32_t transpose_8x8(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

// SHARED (DecodeSlot): the keys of a 16-key run whose rows this lane copies, (K codes, V codes, scales). It copies
// half lane % 2 of one K code row and of one V code row into bytes 16 lane .. of the run's rows, which hold K key
// σ(g) + 2r at row 8r + g and V key 4t + i at row 4i + t, and the scale row lane of the run's, K key σ(g) + 2r at
// row 2g + r and V key k at row 16 + k.
__device__ __forceinline__ int3 shared_row_keys() {
  const int lane = threadIdx.x % WARP, g = lane / 2 % 8, sigma = 2 * g - (g & 1);
  return make_int3(sigma + 2 * (lane / 16), 4 * (lane / 2 % 4) + lane / 8,
                   lane < 16 ? sigma + 2 * (lane & 1) : lane - 16);
}

// This lane's byte offsets inside a 16-key run of one block (from the run's first (key, head) entry), in either
// cache side: its first K key's code quarter and the 4-byte word of its scale bytes (a scale row is a multiple of
// 4 bytes; its second K key lies 2 token_step entries further),
// its first V key's code eighth (the next three follow a token_step apart) and the 32-bit words of V scales it
// loads. Swizzled: the word holding its four keys' bytes of each of its groups. Linear: word (g / 4 + 2q) mod
// (D / 64) of key 4t + g % 4's scale row, for q < V_GROUPS; the eight lanes of a t load every word that holds a
// byte they need, and shuffle the bytes to their owners (join_v_scales).
template <int D, bool SWIZZLE, KeyFormat KEYS>
struct LaneOffsets {
  using S = DecodeShape<D, KEYS>;
  int k_data, k_scales, v_data, v_scales[S::V_GROUPS];

  __device__ LaneOffsets(const Params& p) {
    const int lane = threadIdx.x % WARP, g = lane >> 2, t = lane & 3, sigma = 2 * g - (g & 1);
    const int step = static_cast<int>(p.layout.token_step());
    if constexpr (DecodeSlot<D, KEYS>::SHARED) {  // the rows it copies (shared_row_keys), on either side
      const int3 keys = shared_row_keys();
      k_data = keys.x * step * (D / 2) + 16 * (lane & 1);
      v_data = keys.y * step * (D / 2) + 16 * (lane & 1);
      k_scales = keys.z * step * (D / 16);
      v_scales[0] = 0;
      return;
    }
    k_data = sigma * step * S::K_ROW + DecodeSlot<D, KEYS>::piece_offset(t, 0);
    k_scales = (sigma * step * (D / 16) + DecodeSlot<D, KEYS>::piece_offset(t, 0) / 8) & ~3;  // the aligned word
    v_data = 4 * t * step * (D / 2) + S::V_BYTES * g;
#pragma unroll
    for (int q = 0; q < S::V_GROUPS; ++q) {
      const int group = S::V_BYTES * 2 * g / 16 + q;
      constexpr int QUARTER = D / 64;  // swizzled: key k's byte of group G is in row (k & ~3) + G / quarter, at
                                       // byte (G % quarter) · 4 + k % 4
      v_scales[q] = SWIZZLE ? (4 * t + group / QUARTER) * step * (D / 16) + (group % QUARTER) * 4
                            : (4 * t + g % 4) * step * (D / 16) + 4 * ((g / 4 + 2 * q) % (D / 64));
    }
  }
};

// The blocks of a chunk's two 16-key runs (block sizes a multiple of 16; -1: nothing to read there).
__device__ __forceinline__ int2 chunk_blocks(const Params& p, const int32_t* table_row, int chunk_start, int hi) {
  int blocks[2];
#pragma unroll
  for (int b = 0; b < 2; ++b) {
    const int pos = chunk_start + 16 * b;
    const int block = pos < hi ? __ldg(table_row + block_position(p, pos).x) : -1;
    blocks[b] = block >= 0 && block < p.num_blocks ? block : -1;
  }
  return make_int2(blocks[0], blocks[1]);
}

// `BYTES` of this lane's own bytes in shared memory as 32-bit words.
template <int BYTES>
__device__ __forceinline__ void read_own(uint32_t* dst, const uint8_t* src) {
  if constexpr (BYTES == 4) {
    dst[0] = *reinterpret_cast<const uint32_t*>(src);
  } else if constexpr (BYTES == 8) {
    const uint2 v = *reinterpret_cast<const uint2*>(src);
    dst[0] = v.x, dst[1] = v.y;
  } else {
    const uint4 v = *reinterpret_cast<const uint4*>(src);
    dst[0] = v.x, dst[1] = v.y, dst[2] = v.z, dst[3] = v.w;
  }
}

// Copies this lane's bytes of the chunk at `chunk_start`, whose two 16-key runs lie in `blocks`, into `slot` (keys
// outside [lo, hi) or without a block are zero-filled, their addresses never read). K scales: per piece, the aligned
// word holding its scale bytes (INT8 keys: the word holding key t's fp16 scale, see below). Swizzled V scales: the word
// of the four keys' bytes if any of them is read (attend zeroes the bytes of unread keys); linear: the word LaneOffsets
// names, if its key is read. WHOLE: every key of the chunk is read (most chunks), so no copy needs a test.
template <bool WHOLE, int D, bool SWIZZLE, KeyFormat KEYS>
__device__ __forceinline__ void copy_chunk_keys(uint8_t* slot, const Params& p,
                                                const LaneOffsets<D, SWIZZLE, KEYS>& lane, int2 blocks, int head,
                                                int chunk_start, int lo, int hi) {
  using S = DecodeShape<D, KEYS>;
  using L = DecodeSlot<D, KEYS>;
  const int lane_id = threadIdx.x % WARP, g = lane_id >> 2, t = lane_id & 3, sigma = 2 * g - (g & 1);
  const int data_bytes = static_cast<int>(p.layout.data_region_bytes());
  const int step = static_cast<int>(p.layout.token_step());  // uniform, recomputed here rather than kept in registers
#pragma unroll
  for (int b = 0; b < 2; ++b) {
    const int run = chunk_start + 16 * b;
    const int block = b ? blocks.y : blocks.x;
    // A run without a block reads nothing: its addresses are formed from block 0 and never used. Offsets inside a
    // block are non-negative: added as unsigned 32-bit values, they need no sign extension.
    const int entry = run_entry(p, run, head);
    const uint32_t block_index = max(block, 0);
    const uint8_t* k_block = p.key_cache + block_index * p.key_block_stride;
    const uint8_t* v_block = p.value_cache + block_index * p.value_block_stride;
    const uint8_t* k_data = k_block + static_cast<uint32_t>(entry * S::K_ROW + lane.k_data);
    const uint8_t* k_scales = k_block + static_cast<uint32_t>(data_bytes + entry * (D / 16) + lane.k_scales);
    const uint8_t* v_data = v_block + static_cast<uint32_t>(entry * (D / 2) + lane.v_data);
    const uint8_t* v_scales = v_block + static_cast<uint32_t>(data_bytes + entry * (D / 16));
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int pos = run + sigma + 2 * r;
      const bool read = WHOLE || (block >= 0 && pos >= lo && pos < hi);
      const uint8_t* src = read ? k_data + static_cast<uint32_t>(2 * r * step * S::K_ROW) : p.key_cache;
#pragma unroll
      for (int piece = 0; piece < L::K_PIECES; ++piece)
        copy_async<L::K_PIECE>(slot + L::K_DATA + (((2 * b + r) * L::K_PIECES + piece) * WARP + lane_id) * L::K_PIECE,
                               src + L::piece_offset(0, piece), read);
      if constexpr (KEYS == KeyFormat::Nvfp4)
#pragma unroll
        for (int piece = 0; piece < L::K_PIECES; ++piece)
          copy_async<4>(slot + L::K_SCALES + (((2 * b + r) * L::K_PIECES + piece) * WARP + lane_id) * 4,
                        read ? k_scales + static_cast<uint32_t>(2 * r * step * (D / 16) + L::piece_offset(0, piece) / 8)
                             : p.key_cache,
                        read);
    }
    uint32_t valid = 0;  // bit i: key run + 4t + i is read
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int pos = run + 4 * t + i;
      const bool read = WHOLE || (block >= 0 && pos >= lo && pos < hi);
      valid |= static_cast<uint32_t>(read) << i;
      copy_async<S::V_BYTES>(slot + L::V_DATA + ((4 * b + i) * WARP + lane_id) * S::V_BYTES,
                             read ? v_data + static_cast<uint32_t>(i * step * (D / 2)) : p.value_cache, read);
    }
    const bool scales_read = WHOLE || (SWIZZLE ? valid != 0 : (valid >> (g % 4) & 1u) != 0);
#pragma unroll
    for (int q = 0; q < S::V_GROUPS; ++q)
      copy_async<4>(slot + L::V_SCALES + ((b * S::V_GROUPS + q) * WARP + lane_id) * 4,
                    scales_read ? v_scales + static_cast<uint32_t>(lane.v_scales[q]) : p.value_cache, scales_read);
  }
  if constexpr (KEYS == KeyFormat::Int8) {  // key t of the lane's g: key r = t % 2 of run b = t / 2
    const int b = t >> 1, r = t & 1, run = chunk_start + 16 * b, block = b ? blocks.y : blocks.x;
    const int pos = run + sigma + 2 * r;
    const bool read = WHOLE || (block >= 0 && pos >= lo && pos < hi);
    // The scales follow every entry's D code bytes (2 · data_bytes).
    const uint32_t word = 2 * data_bytes + ((2 * (run_entry(p, run, head) + (sigma + 2 * r) * step)) & ~3);
    const uint32_t block_index = max(block, 0);
    copy_async<4>(slot + L::K_SCALES + lane_id * 4,
                  read ? p.key_cache + block_index * p.key_block_stride + word : p.key_cache, read);
  }
}

// SHARED (DecodeSlot): this lane's rows of the chunk (shared_row_keys), zero-filled as copy_chunk_keys does: a row
// of a key outside [lo, hi) or without a block, a swizzled V scale row when none of its four keys is read.
template <bool WHOLE, int D, bool SWIZZLE, KeyFormat KEYS>
__device__ __forceinline__ void copy_chunk_rows(uint8_t* slot, const Params& p,
                                                const LaneOffsets<D, SWIZZLE, KEYS>& lane, int2 blocks, int head,
                                                int chunk_start, int lo, int hi) {
  using L = DecodeSlot<D, KEYS>;
  const int lane_id = threadIdx.x % WARP;
  const int data_bytes = static_cast<int>(p.layout.data_region_bytes());
  const int3 keys = shared_row_keys();
  const bool v_scale = lane_id >= 16;
#pragma unroll
  for (int b = 0; b < 2; ++b) {
    const int run = chunk_start + 16 * b;
    const int block = b ? blocks.y : blocks.x;
    const auto read = [&](int first, int last) {
      return WHOLE || (block >= 0 && run + last >= lo && run + first < hi);
    };
    const bool k_read = read(keys.x, keys.x), v_read = read(keys.y, keys.y);
    const bool scale_read = SWIZZLE && v_scale ? read(keys.z & ~3, keys.z | 3) : read(keys.z, keys.z);
    const int entry = run_entry(p, run, head);
    const uint32_t block_index = max(block, 0);
    const uint8_t* k_block = p.key_cache + block_index * p.key_block_stride;
    const uint8_t* v_block = p.value_cache + block_index * p.value_block_stride;
    const uint32_t codes = entry * (D / 2);
    copy_async<16>(slot + L::K_DATA + 512 * b + 16 * lane_id,
                   k_read ? k_block + static_cast<uint32_t>(codes + lane.k_data) : p.key_cache, k_read);
    copy_async<16>(slot + L::V_DATA + 512 * b + 16 * lane_id,
                   v_read ? v_block + static_cast<uint32_t>(codes + lane.v_data) : p.value_cache, v_read);
    const uint8_t* scale_row =
        (v_scale ? v_block : k_block) + static_cast<uint32_t>(data_bytes + entry * (D / 16) + lane.k_scales);
    copy_async<4>(slot + L::K_SCALES + 128 * b + 4 * lane_id, scale_read ? scale_row : p.key_cache, scale_read);
  }
}

template <int D, bool SWIZZLE, KeyFormat KEYS>
__device__ __forceinline__ void copy_chunk(uint8_t* slot, const Params& p, const LaneOffsets<D, SWIZZLE, KEYS>& lane,
                                           int2 blocks, int head, int chunk_start, int lo, int hi) {
  const bool whole = blocks.x >= 0 && blocks.y >= 0 && chunk_start >= lo && chunk_start + DECODE_CHUNK <= hi;
  if constexpr (DecodeSlot<D, KEYS>::SHARED) {
    if (whole)
      copy_chunk_rows<true>(slot, p, lane, blocks, head, chunk_start, lo, hi);
    else
      copy_chunk_rows<false>(slot, p, lane, blocks, head, chunk_start, lo, hi);
  } else if (whole) {
    copy_chunk_keys<true>(slot, p, lane, blocks, head, chunk_start, lo, hi);
  } else {
    copy_chunk_keys<false>(slot, p, lane, blocks, head, chunk_start, lo, hi);
  }
}

// This lane's V scale bytes of run b, byte i for key 4t + i, per group q, from the words it copied. Swizzled: the
// bytes of keys outside [lo, hi) are zeroed (their codes are zero, but a scale byte may be NaN, and NaN · 0 is NaN).
// Linear: gathered from the words its t's lanes copied: key 4t + i's word w is held by lane g = i + 4 (w % 2), as
// its copy w / 2. SHARED: one group, g / 2, read from the run's V scale rows (rows 16 .. of its scale rows).
template <int D, bool SWIZZLE, KeyFormat KEYS>
__device__ __forceinline__ void read_v_scales(uint32_t (&v_scales)[DecodeShape<D, KEYS>::V_GROUPS], const uint8_t* slot,
                                              int b, int run, int lo, int hi) {
  using S = DecodeShape<D, KEYS>;
  using L = DecodeSlot<D, KEYS>;
  const int lane_id = threadIdx.x % WARP, g = lane_id >> 2, t = lane_id & 3;
  const uint8_t* v_rows = slot + L::K_SCALES + 128 * b + 4 * 16;  // SHARED
  if constexpr (SWIZZLE) {
    uint32_t words[S::V_GROUPS];
    if constexpr (L::SHARED)  // row 4t + g / 2: the group's bytes of keys 4t .. 4t + 3
      words[0] = *reinterpret_cast<const uint32_t*>(v_rows + 4 * (4 * t + g / 2));
    else
#pragma unroll
      for (int q = 0; q < S::V_GROUPS; ++q)
        read_own<4>(&words[q], slot + L::V_SCALES + ((b * S::V_GROUPS + q) * WARP + lane_id) * 4);
    const int first = run + 4 * t;
    uint32_t keep = 0xFFFFFFFFu;
    if (first < lo || first + 4 > hi) {
      keep = 0;
#pragma unroll
      for (int i = 0; i < 4; ++i)
        if (first + i >= lo && first + i < hi) keep |= 0xFFu << (8 * i);
    }
#pragma unroll
    for (int q = 0; q < S::V_GROUPS; ++q) v_scales[q] = words[q] & keep;
  } else if constexpr (L::SHARED) {  // byte g / 2 of rows 4t .. 4t + 3
    const uint4 w = *reinterpret_cast<const uint4*>(v_rows + 16 * t);
    const uint32_t byte = g / 2 | (g / 2 + 4) << 4;
    v_scales[0] = __byte_perm(__byte_perm(w.x, w.y, byte), __byte_perm(w.z, w.w, byte), 0x5410);
  } else {
    uint32_t words[S::V_GROUPS];
#pragma unroll
    for (int q = 0; q < S::V_GROUPS; ++q)
      read_own<4>(&words[q], slot + L::V_SCALES + ((b * S::V_GROUPS + q) * WARP + lane_id) * 4);
    const int group = S::V_BYTES * 2 * g / 16, word = group / 4;  // all of a lane's groups share one word
    uint32_t got[4][S::V_GROUPS];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int l = 0; l < S::V_GROUPS; ++l)
        got[i][l] = __shfl_sync(0xffffffffu, words[l], 4 * (i + 4 * (word % 2)) + t);
#pragma unroll
    for (int q = 0; q < S::V_GROUPS; ++q) {
      const int byte = 4 * (word / 2) + (group + q) % 4;  // in the pair (copy 0, copy V_GROUPS - 1)
      uint32_t x[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) x[i] = __byte_perm(got[i][0], got[i][S::V_GROUPS - 1], byte);
      v_scales[q] = __byte_perm(__byte_perm(x[0], x[1], 0x0040), __byte_perm(x[2], x[3], 0x0040), 0x5410);
    }
  }
}

// This lane's K block scales of key r of run b, in the order of its code words (one scale a 16 codes), each as a
// float16 pair (scale j, scale j) in sf[j]: one byte permute picks a word's scale bytes and doubles them, and the
// conversions of its two halves make the pairs.
template <int D, KeyFormat KEYS>
__device__ __forceinline__ void k_scale_splats(const uint8_t* slot, int b, int r, uint32_t (&sf)[4]) {
  using L = DecodeSlot<D, KEYS>;
  const int lane = threadIdx.x % WARP, t = lane & 3;
  uint32_t words[L::K_PIECES];  // per piece, the aligned word holding its scale bytes
  if constexpr (L::SHARED)      // the key's scale row: row 2g + r of the run's
    words[0] = *reinterpret_cast<const uint32_t*>(slot + L::K_SCALES + 128 * b + 4 * (2 * (lane >> 2) + r));
  else
#pragma unroll
    for (int piece = 0; piece < L::K_PIECES; ++piece)
      read_own<4>(&words[piece], slot + L::K_SCALES + (((2 * b + r) * L::K_PIECES + piece) * WARP + lane) * 4);
  const uint32_t first = (L::piece_offset(t, 0) / 8) & 3;  // the first piece's first scale byte in its word
  const uint32_t doubled = 0x1100u + 0x1111u * first;      // bytes first, first, first + 1, first + 1
#pragma unroll
  for (int piece = 0; piece < L::K_PIECES; ++piece)  // head 256: two bytes of each piece's word
    scale_pairs(__byte_perm(words[piece], 0, doubled), sf[2 * piece], sf[2 * piece + 1]);
}

// The first key a decode request's rows see: its window's start, or 0.
__device__ __forceinline__ int decode_kv_lo(int seq_len, int num_q, int sliding_window) {
  return sliding_window > 0 ? max(0, seq_len - num_q - sliding_window + 1) : 0;
}

// A decode request's split-KV partition, (chunks a split, splits): its own chunks in at most `max_splits` runs of
// at least 8 chunks. It depends on the request's length alone, not on the batch's host-side bound, so vLLM's eager
// steps and its CUDA graphs (captured for max_model_len) split a request alike and compute the same bits.
__device__ __forceinline__ int2 decode_splits(int chunks, int max_splits) {
  const int wanted = max(1, min(max_splits, chunks / 8));
  const int per_split = max(1, (chunks + wanted - 1) / wanted);
  return make_int2(per_split, max(1, (chunks + per_split - 1) / per_split));
}

// CTAs an SM as the registers allow (a chunk's bytes wait in shared memory, so the output accumulators dominate):
// four (128 registers a thread) up to head 128 with 8 query rows, two for the wide cases (head 256, or 16 rows).
constexpr int decode_ctas_per_sm(int d, int nb) { return d * nb <= 128 ? 4 : 2; }

template <int D, int NB, bool SWIZZLE, KeyFormat KEYS, typename T>
__global__ void __launch_bounds__(DECODE_THREADS, decode_ctas_per_sm(D, NB)) nvfp4_paged_decode_kernel(Params p) {
  using S = DecodeShape<D, KEYS>;
  constexpr int QROWS = 8 * NB;
  __shared__ float merge_m[DECODE_WARPS][QROWS], merge_l[DECODE_WARPS][QROWS];
  __shared__ uint2 query_frags[NB][S::KSTEPS][WARP];       // the B fragments, the same in every warp
  extern __shared__ __align__(16) uint8_t decode_smem[];   // per warp a ring of two DecodeSlots; then merge_o
  float* merge_o = reinterpret_cast<float*>(decode_smem);  // [DECODE_WARPS][QROWS][D]

  const int head = blockIdx.x, split = blockIdx.y, request = blockIdx.z;
  const int q_start = __ldg(p.query_start_loc + request);
  const int num_q = __ldg(p.query_start_loc + request + 1) - q_start;
  const int seq_len = __ldg(p.seq_lens + request);
  const int num_rows = num_q * p.group;
  if (num_rows == 0) return;
  const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
  const int g = lane >> 2, t = lane & 3;

  // The CTA's keys: its split of the request's chunks, from the first key its rows' windows reach (whole chunks)
  // to the context's end.
  const int first_query_pos = seq_len - num_q;
  const int kv_lo = decode_kv_lo(seq_len, num_q, p.sliding_window);
  const int chunk0 = kv_lo / DECODE_CHUNK;
  const int chunks = max(0, (seq_len + DECODE_CHUNK - 1) / DECODE_CHUNK - chunk0);
  const int2 splits = decode_splits(chunks, min(p.decode_max_splits, static_cast<int>(gridDim.y)));
  if (split >= splits.y) return;
  const int chunk_begin = split * splits.x;
  const int chunk_end = min(chunks, chunk_begin + splits.x);

  // Query rows as B fragments (row g of each n8 block, this lane's channel quarter t), scaled per row by a power
  // of two into float16's range; the logit scale of the two rows (2t, 2t + 1) whose S^T columns this lane holds.
  // The fragments wait in shared memory and are read at each use: in registers they would push the chunks' bytes
  // into local memory.
  float row_scale[NB][2];
#pragma unroll
  for (int nb = 0; nb < NB; ++nb) {
    const int row = nb * 8 + g;
    const bool valid = row < num_rows;
    const int token = valid ? row / p.group : 0;
    const int q_head = head * p.group + (valid ? row % p.group : 0);
    const T* src = static_cast<const T*>(p.query) + (q_start + token) * p.q_token_stride + q_head * p.q_head_stride;
    // The lane's channels in the order of its K bytes: its pieces.
    using L = DecodeSlot<D, KEYS>;
    constexpr int PIECE = L::PIECE_CHANNELS;
    float q[D / 4], amax = 0.0f;
#pragma unroll
    for (int piece = 0; piece < L::K_PIECES; ++piece) {
      const auto loaded = load_elements<PIECE, true>(src + L::piece_offset(t, piece) / L::K_PIECE * PIECE);
#pragma unroll
      for (int i = 0; i < PIECE; ++i) {
        q[piece * PIECE + i] = valid ? to_float(loaded.x[i]) : 0.0f;
        amax = fmaxf(amax, fabsf(q[piece * PIECE + i]));
      }
    }
    amax = quad_max(amax);
    int exponent = 0;
    if (amax > 0.0f) frexpf(amax, &exponent);
    const int shift = min(127, 15 - exponent);
    const float up = ldexpf(1.0f, shift);
    const float own_scale = p.logit_scale * __ldg(p.k_scale) * (S::BYTE_KEYS ? 1.0f : CODE_UNIT) * ldexpf(1.0f, -shift);
#pragma unroll
    for (int j = 0; j < S::KSTEPS; ++j) {
      const int base = 8 * (j >> 1) + 2 * (j & 1);
      if (warp == 0)
        query_frags[nb][j][lane] =
            make_uint2(pack_half2(q[base] * up, q[base + 4] * up), pack_half2(q[base + 1] * up, q[base + 5] * up));
    }
#pragma unroll
    for (int e = 0; e < 2; ++e) row_scale[nb][e] = __shfl_sync(0xffffffffu, own_scale, 4 * (2 * t + e));
  }
  __syncthreads();  // query_frags

  float o[NB][S::MBLOCKS][4];
#pragma unroll
  for (int nb = 0; nb < NB; ++nb)
#pragma unroll
    for (int mb = 0; mb < S::MBLOCKS; ++mb) o[nb][mb][0] = o[nb][mb][1] = o[nb][mb][2] = o[nb][mb][3] = 0.0f;
  float m[NB][2], l[NB][2];
#pragma unroll
  for (int nb = 0; nb < NB; ++nb) m[nb][0] = m[nb][1] = -INFINITY, l[nb][0] = l[nb][1] = 0.0f;
  const int sigma = 2 * g - (g & 1);
  // Keys every row of the request sees: from the last query's window start to the first query's position.
  const int all_lo = p.sliding_window > 0 ? seq_len - p.sliding_window : 0;
  const int all_hi = p.causal ? first_query_pos + 1 : seq_len;
  // INT8 keys: an entry of the parity of this lane's keys, which picks the half of each copied scale word (the entries
  // of keys σ(g) + 2r of runs at even block offsets differ by even numbers).
  const int scale_entry = run_entry(p, sigma, head);

  using L = DecodeSlot<D, KEYS>;
  auto attend = [&](const uint8_t* slot, int chunk_start) {
    float s[2][NB][4];
#pragma unroll
    for (int b = 0; b < 2; ++b) {
#pragma unroll
      for (int nb = 0; nb < NB; ++nb) s[b][nb][0] = s[b][nb][1] = s[b][nb][2] = s[b][nb][3] = 0.0f;
      uint32_t k[2][S::K_WORDS];  // keys σ(g), σ(g) + 2
#pragma unroll
      for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int piece = 0; piece < L::K_PIECES; ++piece)
          read_own<L::K_PIECE>(&k[r][piece * L::K_PIECE / 4],
                               slot + L::K_DATA + (((2 * b + r) * L::K_PIECES + piece) * WARP + lane) * L::K_PIECE);
      if constexpr (S::BYTE_KEYS) {
#pragma unroll
        for (int u = 0; u < S::K_WORDS / 2; ++u) {  // 8 elements: two words
          uint32_t h0[4], h1[4];                    // keys σ(g), σ(g) + 2
          key_pairs<KEYS>(k[0][2 * u], k[0][2 * u + 1], h0);
          key_pairs<KEYS>(k[1][2 * u], k[1][2 * u + 1], h1);
          const uint32_t a0[4] = {h0[0], h1[0], h0[1], h1[1]}, a1[4] = {h0[2], h1[2], h0[3], h1[3]};
#pragma unroll
          for (int nb = 0; nb < NB; ++nb) {
            mma_query(s[b][nb], a0, query_frags[nb][2 * u][lane]);
            mma_query(s[b][nb], a1, query_frags[nb][2 * u + 1][lane]);
          }
        }
      } else {
        uint32_t sf[2][4];  // [key][scale byte], splatted
#pragma unroll
        for (int r = 0; r < 2; ++r) k_scale_splats<D, KEYS>(slot, b, r, sf[r]);
#pragma unroll
        for (int u = 0; u < S::K_WORDS; ++u) {
          const uint32_t w0 = k[0][u], w1 = k[1][u];
          const uint32_t f0 = sf[0][u >> 1], f1 = sf[1][u >> 1];
          uint32_t h0[4], h1[4];
          code_pairs(w0, h0);
          code_pairs(w1, h1);
          const uint32_t a0[4] = {hmul2(h0[0], f0), hmul2(h1[0], f1), hmul2(h0[1], f0), hmul2(h1[1], f1)};
          const uint32_t a1[4] = {hmul2(h0[2], f0), hmul2(h1[2], f1), hmul2(h0[3], f0), hmul2(h1[3], f1)};
#pragma unroll
          for (int nb = 0; nb < NB; ++nb) {
            mma_query(s[b][nb], a0, query_frags[nb][2 * u][lane]);
            mma_query(s[b][nb], a1, query_frags[nb][2 * u + 1][lane]);
          }
        }
      }
    }
    // Online softmax (log2 domain) of rows 2t + e: this lane's keys σ(g) and σ(g) + 2 of both 16-key blocks. Only a
    // chunk that reaches outside some row's visible keys is masked (rows past the batch see zeros: never stored).
    const bool edge = chunk_start < all_lo || chunk_start + DECODE_CHUNK > all_hi;
    float key_scale[4];  // INT8 keys: logit k's key scale (key r = k % 2 of run b = k / 2), applied in float32
    if constexpr (KEYS == KeyFormat::Int8) {
      uint32_t word;  // key t's, copied by this lane; its quad's lanes hold the others
      read_own<4>(&word, slot + L::K_SCALES + lane * 4);
      const float own = int8_key_scale(word, scale_entry);
#pragma unroll
      for (int k = 0; k < 4; ++k) key_scale[k] = __shfl_sync(0xffffffffu, own, (lane & ~3) | k);
    }
    bool rescale = false;
    float alpha[NB][2];
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        // Each step over the row's four logits is a loop of its own, so that the rare ones stay out of the way.
        float* row_logits[4] = {&s[0][nb][e], &s[0][nb][2 + e], &s[1][nb][e], &s[1][nb][2 + e]};
#pragma unroll
        for (int k = 0; k < 4; ++k) *row_logits[k] *= row_scale[nb][e];
        if constexpr (KEYS == KeyFormat::Int8) {
#pragma unroll
          for (int k = 0; k < 4; ++k) *row_logits[k] *= key_scale[k];
        }
        if (p.soft_cap_log2 > 0.0f) {
#pragma unroll
          for (int k = 0; k < 4; ++k) *row_logits[k] = p.soft_cap_log2 * tanhf(*row_logits[k] / p.soft_cap_log2);
        }
        if (edge) {  // keys outside the row's view (rows past the batch see none)
          const int col = nb * 8 + 2 * t + e, query_pos = first_query_pos + col / p.group;
          const int hi = col >= num_rows ? 0 : p.causal ? query_pos + 1 : seq_len;
          const int lo = p.sliding_window > 0 ? query_pos - p.sliding_window + 1 : 0;
#pragma unroll
          for (int k = 0; k < 4; ++k) {  // logit k: key 16 (k / 2) + σ(g) + 2 (k % 2) of the chunk
            const int pos = chunk_start + 16 * (k / 2) + sigma + 2 * (k % 2);
            if (pos < lo || pos >= hi) *row_logits[k] = -INFINITY;
          }
        }
        float chunk_max = -INFINITY;
#pragma unroll
        for (int k = 0; k < 4; ++k) chunk_max = fmaxf(chunk_max, *row_logits[k]);
#pragma unroll
        for (int lanes = 4; lanes < WARP; lanes *= 2)
          chunk_max = fmaxf(chunk_max, __shfl_xor_sync(0xffffffffu, chunk_max, lanes));
        const float m_new = fmaxf(m[nb][e], chunk_max);
        const float base = m_new == -INFINITY ? 0.0f : m_new;
        alpha[nb][e] = fast_exp2(m[nb][e] - base);
        rescale |= alpha[nb][e] != 1.0f;
        m[nb][e] = m_new;
        float sum = 0.0f;
#pragma unroll
        for (int b = 0; b < 2; ++b)
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const float pr = fast_exp2(s[b][nb][2 * r + e] - base);
            s[b][nb][2 * r + e] = pr;
            sum += pr;
          }
        l[nb][e] = l[nb][e] * alpha[nb][e] + sum;
      }
    if (__any_sync(0xffffffffu, rescale)) {
#pragma unroll
      for (int nb = 0; nb < NB; ++nb)
#pragma unroll
        for (int mb = 0; mb < S::MBLOCKS; ++mb) {
          o[nb][mb][0] *= alpha[nb][0];
          o[nb][mb][1] *= alpha[nb][1];
          o[nb][mb][2] *= alpha[nb][0];
          o[nb][mb][3] *= alpha[nb][1];
        }
    }
    // O^T += V^T · P^T per 16-key block: P^T's fragments are S^T's transposed; V^T's k pairs are keys
    // (4t, 4t + 1) and (4t + 2, 4t + 3), interleaved from two keys' code words by byte permutes.
#pragma unroll
    for (int b = 0; b < 2; ++b) {
      uint32_t v[4][S::V_WORDS], v_scales[S::V_GROUPS];  // keys 4t + i
#pragma unroll
      for (int i = 0; i < 4; ++i)
        read_own<S::V_BYTES>(
            v[i], slot + L::V_DATA +
                      (L::SHARED ? 512 * b + 128 * i + 32 * t + 4 * g : ((4 * b + i) * WARP + lane) * S::V_BYTES));
      read_v_scales<D, SWIZZLE, KEYS>(v_scales, slot, b, chunk_start + 16 * b, kv_lo, seq_len);
      uint32_t pb[NB][2];
#pragma unroll
      for (int nb = 0; nb < NB; ++nb) {
        pb[nb][0] = transpose_8x8(pack_half2(s[b][nb][0], s[b][nb][1]));
        pb[nb][1] = transpose_8x8(pack_half2(s[b][nb][2], s[b][nb][3]));
      }
#pragma unroll
      for (int u = 0; u < S::V_WORDS; ++u) {
        const uint32_t scales = v_scales[u >> 1];
        uint32_t sf01, sf23;
        scale_pairs(scales, sf01, sf23);
        const uint32_t halves[2][2] = {{__byte_perm(v[0][u], v[1][u], 0x5410), __byte_perm(v[2][u], v[3][u], 0x5410)},
                                       {__byte_perm(v[0][u], v[1][u], 0x7632), __byte_perm(v[2][u], v[3][u], 0x7632)}};
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const uint32_t x01 = halves[h][0], x23 = halves[h][1];
          // Codes 8u + 4h + I of the eighth: m-block 4u + 2h + I / 2, row g + 8 (I % 2).
          uint32_t h01[4], h23[4];
          code_pairs(x01, h01);
          code_pairs(x23, h23);
          const uint32_t a0[4] = {hmul2(h01[0], sf01), hmul2(h01[1], sf01), hmul2(h23[0], sf23), hmul2(h23[1], sf23)};
          const uint32_t a1[4] = {hmul2(h01[2], sf01), hmul2(h01[3], sf01), hmul2(h23[2], sf23), hmul2(h23[3], sf23)};
#pragma unroll
          for (int nb = 0; nb < NB; ++nb) {
            mma_f16(o[nb][4 * u + 2 * h], a0, pb[nb][0], pb[nb][1]);
            mma_f16(o[nb][4 * u + 2 * h + 1], a1, pb[nb][0], pb[nb][1]);
          }
        }
      }
    }
  };

  // Each warp: its chunks' bytes copied into its ring of two slots one chunk ahead of their use, their blocks read
  // two chunks ahead.
  const int32_t* table_row = p.block_table + static_cast<int64_t>(request) * p.table_stride;
  const LaneOffsets<D, SWIZZLE, KEYS> offsets(p);
  const int mine =
      chunk_begin + warp < chunk_end ? (chunk_end - chunk_begin - warp + DECODE_WARPS - 1) / DECODE_WARPS : 0;
  auto chunk_start = [&](int i) { return (chunk0 + chunk_begin + warp + i * DECODE_WARPS) * DECODE_CHUNK; };
  auto blocks_of = [&](int i) {
    return i < mine ? chunk_blocks(p, table_row, chunk_start(i), seq_len) : make_int2(-1, -1);
  };
  uint8_t* ring = decode_smem + warp * 2 * L::BYTES;
  if (mine > 0) copy_chunk<D, SWIZZLE, KEYS>(ring, p, offsets, blocks_of(0), head, chunk_start(0), kv_lo, seq_len);
  copy_commit();
  int2 next_blocks = blocks_of(1);
  for (int i = 0; i < mine; ++i) {
    const int2 later = blocks_of(i + 2);
    if constexpr (L::SHARED) __syncwarp();  // every lane is done reading the slot copied into next
    if (i + 1 < mine)
      copy_chunk<D, SWIZZLE, KEYS>(ring + ((i + 1) & 1) * L::BYTES, p, offsets, next_blocks, head, chunk_start(i + 1),
                                   kv_lo, seq_len);
    copy_commit();
    next_blocks = later;
    copy_wait<1>();                         // chunk i's copies are done
    if constexpr (L::SHARED) __syncwarp();  // and those of the other lanes too
    attend(ring + (i & 1) * L::BYTES, chunk_start(i));
  }
  __syncthreads();  // the rings become merge_o

  // Merge the four warps: each publishes its rows' max, sum and unnormalized output (channel (D/8) g + c holds
  // code c of the lane's eighth: c = 2 mb + 1 for the fragment's rows g + 8).
#pragma unroll
  for (int nb = 0; nb < NB; ++nb)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
#pragma unroll
      for (int lanes = 4; lanes < WARP; lanes *= 2) l[nb][e] += __shfl_xor_sync(0xffffffffu, l[nb][e], lanes);
      const int row = nb * 8 + 2 * t + e;
      if (g == 0) merge_m[warp][row] = m[nb][e], merge_l[warp][row] = l[nb][e];
      float* dst = merge_o + (warp * QROWS + row) * D + (D / 8) * g;
#pragma unroll
      for (int mb = 0; mb < S::MBLOCKS; ++mb) dst[2 * mb] = o[nb][mb][e], dst[2 * mb + 1] = o[nb][mb][2 + e];
    }
  __syncthreads();
  const float out_scale = __ldg(p.v_scale) * CODE_UNIT;
  for (int i = threadIdx.x; i < QROWS * D; i += DECODE_THREADS) {
    const int row = i / D, d = i % D;
    if (row >= num_rows) break;
    float m_all = -INFINITY;
#pragma unroll
    for (int w = 0; w < DECODE_WARPS; ++w) m_all = fmaxf(m_all, merge_m[w][row]);
    const int token = q_start + row / p.group, q_head = head * p.group + row % p.group;
    float sum = 0.0f, acc = 0.0f;
    if (m_all != -INFINITY) {
#pragma unroll
      for (int w = 0; w < DECODE_WARPS; ++w) {
        const float weight = fast_exp2(merge_m[w][row] - m_all);
        sum += merge_l[w][row] * weight;
        acc += merge_o[(w * QROWS + row) * D + d] * weight;
      }
    }
    if (splits.y == 1) {
      if (p.sinks != nullptr) add_sink(__ldg(p.sinks + q_head), m_all, sum, acc);
      from_float(sum > 0.0f ? acc / sum * out_scale : 0.0f,
                 static_cast<T*>(p.out) + token * p.out_token_stride + q_head * p.out_head_stride + d);
    } else {
      const int64_t at = (static_cast<int64_t>(split) * p.num_tokens + token) * p.layout.num_heads * p.group + q_head;
      p.partial_out[at * D + d] = sum > 0.0f ? acc / sum * out_scale : 0.0f;
      if (d == 0) p.partial_lse[at] = sum > 0.0f ? m_all + __log2f(sum) : -INFINITY;
    }
  }
}

// Merges the splits' partial outputs: one warp per (query token, query head); lanes share the splits' log-sum-exps,
// then each lane sums its columns over the splits. After the decode kernel (p.decode_max_splits > 0), a token's
// request has its own splits (decode_splits), and one of a single split wrote its output itself.
template <int D, typename T>
__global__ void __launch_bounds__(ATTN_THREADS) combine_splits_kernel(Params p, int num_reqs, int q_heads) {
  const int64_t pair = static_cast<int64_t>(blockIdx.x) * ATTN_WARPS + threadIdx.x / WARP;
  const int lane = threadIdx.x % WARP;
  const int64_t token = pair / q_heads;
  const int head = static_cast<int>(pair % q_heads);
  const int32_t* query_start_loc = p.query_start_loc;
  if (token >= min(p.num_tokens, static_cast<int64_t>(__ldg(query_start_loc + num_reqs)))) return;
  int num_splits = p.num_splits;
  if (p.decode_max_splits > 0) {
    int request = 0, last = num_reqs - 1;  // the last request starting at or before the token: the token's
    while (request < last) {
      const int mid = (request + last + 1) / 2;
      if (__ldg(query_start_loc + mid) <= token)
        request = mid;
      else
        last = mid - 1;
    }
    const int num_q = __ldg(query_start_loc + request + 1) - __ldg(query_start_loc + request);
    const int seq_len = __ldg(p.seq_lens + request);
    const int chunk0 = decode_kv_lo(seq_len, num_q, p.sliding_window) / DECODE_CHUNK;
    const int chunks = max(0, (seq_len + DECODE_CHUNK - 1) / DECODE_CHUNK - chunk0);
    num_splits = decode_splits(chunks, min(p.decode_max_splits, p.num_splits)).y;
    if (num_splits == 1) return;
  }
  const float* __restrict__ partial_out = p.partial_out;
  const float* __restrict__ partial_lse = p.partial_lse;
  const int64_t num_tokens = p.num_tokens;
  const int64_t split_stride = num_tokens * q_heads;
  const float* lse = partial_lse + token * q_heads + head;
  float lse_max = -INFINITY;
  for (int s = lane; s < num_splits; s += WARP) lse_max = fmaxf(lse_max, __ldg(lse + s * split_stride));
#pragma unroll
  for (int o = WARP / 2; o > 0; o /= 2) lse_max = fmaxf(lse_max, __shfl_xor_sync(0xffffffffu, lse_max, o));
  constexpr int COLS = D / WARP;
  float acc[COLS] = {}, weight = 0.0f;
  if (lse_max != -INFINITY) {
    const float* src = partial_out + (token * q_heads + head) * D + lane * COLS;
#pragma unroll 4
    for (int s = 0; s < num_splits; ++s) {
      const float l = __ldg(lse + s * split_stride);
      const float w = l == -INFINITY ? 0.0f : fast_exp2(l - lse_max);
      weight += w;
#pragma unroll
      for (int c = 0; c < COLS; ++c) acc[c] += w * __ldg(src + s * split_stride * D + c);
    }
  }
  float keep = 1.0f;
  if (p.sinks != nullptr) add_sink(__ldg(p.sinks + head), lse_max, weight, keep);
  const float inv = weight > 0.0f ? keep / weight : 0.0f;
  T* dst = static_cast<T*>(p.out) + token * p.out_token_stride + head * p.out_head_stride + lane * COLS;
#pragma unroll
  for (int c = 0; c < COLS; ++c) from_float(acc[c] * inv, dst + c);
}

// --- host side ----------------------------------------------------------------------------------------

// The shared argument checks (checks.h) plus what the CUDA kernels add: 16-bit queries and 16-byte alignment.
NVFP4PageLayout check_cuda_paged_attention(const Tensor& query, const Tensor& key_cache, const Tensor& value_cache,
                                           const Tensor& block_table, const Tensor& query_start_loc,
                                           const Tensor& seq_lens, const Tensor& k_scale, const Tensor& v_scale,
                                           bool swizzle_v_scales, int64_t max_query_len, int64_t max_seq_len,
                                           const Tensor& out, int64_t sliding_window, double logits_soft_cap,
                                           const std::optional<Tensor>& sinks) {
  const char* op = "nvfp4_paged_attention";
  const NVFP4PageLayout layout =
      check_nvfp4_paged_attention(query, key_cache, value_cache, block_table, query_start_loc, seq_lens, k_scale,
                                  v_scale, swizzle_v_scales, max_query_len, max_seq_len, out);
  check_attention_features(sliding_window, logits_soft_cap, sinks, query);
  NVFP4_CHECK(query.scalar_type() == ScalarType::BFloat16 || query.scalar_type() == ScalarType::Half, op,
              ": query: dtype must be bfloat16 or float16 on CUDA, got ", query.scalar_type());
  NVFP4_CHECK(aligned(key_cache.const_data_ptr(), 16) && aligned(value_cache.const_data_ptr(), 16) &&
                  (key_cache.size(0) <= 1 || (key_cache.stride(0) % 16 == 0 && value_cache.stride(0) % 16 == 0)),
              op, ": key_cache: block sides must start on 16-byte boundaries (pointer and block stride)");
  NVFP4_CHECK(aligned(query.const_data_ptr(), 16) && (query.stride(0) * 2) % 16 == 0 && (query.stride(1) * 2) % 16 == 0,
              op, ": query: data pointer and strides must be 16-byte aligned");
  return layout;
}

int multiprocessors(int device) {
  static int count[64] = {};
  if (device < 0 || device >= 64) device = 0;
  if (count[device] == 0)
    NVFP4_CHECK(cudaDeviceGetAttribute(&count[device], cudaDevAttrMultiProcessorCount, device) == cudaSuccess,
                "nvfp4_paged_attention: cannot read the multiprocessor count");
  return count[device];
}

// The most keys one request's rows can see: its context, or its query span plus the window.
int64_t visible_keys_bound(const Params& p, int64_t max_query_len, int64_t max_seq_len) {
  return p.sliding_window > 0 ? std::min(max_seq_len, max_query_len + p.sliding_window - 1) : max_seq_len;
}

// Allocates the split-KV partials when there is more than one split.
void plan_partials(Params& p, int64_t splits, const Tensor& query, Tensor& partial_out, Tensor& partial_lse, int d) {
  p.num_splits = static_cast<int>(splits);
  if (splits == 1) return;
  const int64_t q_heads = query.size(1);
  partial_out = torch::stable::new_empty(query, {splits, p.num_tokens, q_heads, d}, ScalarType::Float);
  partial_lse = torch::stable::new_empty(query, {splits, p.num_tokens, q_heads}, ScalarType::Float);
  p.partial_out = partial_out.mutable_data_ptr<float>();
  p.partial_lse = partial_lse.mutable_data_ptr<float>();
}

template <int D, typename T>
void launch_combine(const Params& p, int64_t num_reqs, int64_t q_heads, cudaStream_t stream) {
  const int64_t pairs = p.num_tokens * q_heads;
  combine_splits_kernel<D, T>
      <<<static_cast<unsigned>((pairs + ATTN_WARPS - 1) / ATTN_WARPS), ATTN_THREADS, 0, stream>>>(
          p, static_cast<int>(num_reqs), static_cast<int>(q_heads));
  check_launch("nvfp4_paged_attention (combine)");
}

// Splits of each CTA's KV range: from half to twice as many as fill the GPU twice over (at most `most`), the count
// whose CTAs best fill their last wave of `resident` (fewest splits within 4% of the best): a wave left mostly
// empty would cost as much as a full one.
int64_t wave_filling_splits(int64_t ctas, int64_t resident, int64_t most) {
  const int64_t twice_over = std::clamp<int64_t>((2 * resident + ctas - 1) / ctas, 1, most);
  auto waste = [&](int64_t splits) {  // full-wave time over busy time
    const double waves = static_cast<double>(ctas * splits) / resident;
    return std::ceil(waves) / waves;
  };
  int64_t best = twice_over;
  for (int64_t splits = std::max<int64_t>(1, twice_over / 2); splits <= std::min(most, 2 * twice_over); ++splits)
    if (waste(splits) < waste(best)) best = splits;
  for (int64_t splits = std::max<int64_t>(1, twice_over / 2); splits <= best; ++splits)
    if (waste(splits) <= waste(best) * 1.04) return splits;
  return best;
}

// The decode kernel: one CTA per (KV head, split, request). A request's splits (decode_splits) are capped by what
// fills the GPU for this many requests, counted as the next power of two: vLLM pads a CUDA graph's batch to a
// capture size, and its capture sizes hold every power of two, so a padded batch plans as its eager batch does.
template <int D, int NB, bool SWIZZLE, KeyFormat KEYS, typename T>
void launch_decode(Params& p, int64_t num_reqs, int64_t max_query_len, int64_t max_seq_len, const Tensor& query,
                   cudaStream_t stream) {
  auto kernel = nvfp4_paged_decode_kernel<D, NB, SWIZZLE, KEYS, T>;
  const int smem_bytes = std::max(DECODE_WARPS * 2 * DecodeSlot<D, KEYS>::BYTES,  // the rings, then merge_o
                                  DECODE_WARPS * 8 * NB * D * static_cast<int>(sizeof(float)));
  static const bool smem_set =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes) == cudaSuccess;
  NVFP4_CHECK(smem_set, "nvfp4_paged_attention: cannot reserve the decode kernel's shared memory");
  int per_sm = 0;
  NVFP4_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, DECODE_THREADS, smem_bytes) == cudaSuccess,
              "nvfp4_paged_attention: occupancy query failed");
  const int64_t resident = std::max(1, per_sm) * static_cast<int64_t>(multiprocessors(query.get_device_index()));
  int64_t padded_reqs = 1;
  while (padded_reqs < num_reqs) padded_reqs *= 2;
  p.decode_max_splits = static_cast<int>(wave_filling_splits(padded_reqs * p.layout.num_heads, resident, 65535));
  const int64_t chunk_bound =
      std::max<int64_t>(1, (visible_keys_bound(p, max_query_len, max_seq_len) + DECODE_CHUNK - 1) / DECODE_CHUNK + 1);
  const int64_t splits = std::min<int64_t>(p.decode_max_splits, std::max<int64_t>(1, chunk_bound / 8));
  Tensor partial_out, partial_lse;
  plan_partials(p, splits, query, partial_out, partial_lse, D);
  NVFP4_CHECK(num_reqs <= 65535 && splits <= 65535, "nvfp4_paged_attention: ", num_reqs,
              " requests exceed the launch grid (at most 65535)");
  const dim3 grid(static_cast<unsigned>(p.layout.num_heads), static_cast<unsigned>(splits),
                  static_cast<unsigned>(num_reqs));
  kernel<<<grid, DECODE_THREADS, smem_bytes, stream>>>(p);
  check_launch("nvfp4_paged_attention (decode)");
  if (splits > 1) launch_combine<D, T>(p, num_reqs, query.size(1), stream);
}

template <int D, int WARPS_M, KeyFormat KEYS, typename T>
void launch(Params& p, int64_t num_reqs, int64_t max_query_len, int64_t max_seq_len, const Tensor& query,
            cudaStream_t stream) {
  using G = Tiles<D, KEYS>;
  auto kernel = nvfp4_paged_attention_kernel<D, WARPS_M, KEYS, T>;
  const int smem_bytes = G::STAGES * G::STAGE_BYTES;
  if (smem_bytes > 48 * 1024) {  // FP8 and INT8 keys at head 256
    static const bool smem_set =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes) == cudaSuccess;
    NVFP4_CHECK(smem_set, "nvfp4_paged_attention: cannot reserve the kernel's shared memory");
  }
  const int64_t row_tiles = std::max<int64_t>(1, (max_query_len * p.group + 16 * WARPS_M - 1) / (16 * WARPS_M));
  const int64_t ctas = num_reqs * p.layout.num_heads * row_tiles;
  const int64_t tile_bound =
      std::max<int64_t>(1, (visible_keys_bound(p, max_query_len, max_seq_len) + TILE - 1) / TILE + 1);
  int per_sm = 0;
  NVFP4_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, ATTN_THREADS, smem_bytes) == cudaSuccess,
              "nvfp4_paged_attention: occupancy query failed");
  const int64_t resident = std::max(1, per_sm) * static_cast<int64_t>(multiprocessors(query.get_device_index()));
  // Splits to fill the GPU twice over, each at least 4 tiles long.
  int64_t splits = std::clamp<int64_t>((2 * resident + ctas - 1) / ctas, 1, std::max<int64_t>(1, tile_bound / 4));
  p.tiles_per_split = static_cast<int>((tile_bound + splits - 1) / splits);
  splits = (tile_bound + p.tiles_per_split - 1) / p.tiles_per_split;
  Tensor partial_out, partial_lse;
  plan_partials(p, splits, query, partial_out, partial_lse, D);
  NVFP4_CHECK(num_reqs <= 65535 && row_tiles * p.layout.num_heads <= INT32_MAX, "nvfp4_paged_attention: ", num_reqs,
              " requests exceed the launch grid (at most 65535)");
  const dim3 grid(static_cast<unsigned>(row_tiles * p.layout.num_heads), static_cast<unsigned>(splits),
                  static_cast<unsigned>(num_reqs));
  kernel<<<grid, ATTN_THREADS, smem_bytes, stream>>>(p);
  check_launch("nvfp4_paged_attention");
  if (splits > 1) launch_combine<D, T>(p, num_reqs, query.size(1), stream);
}

// The decode kernel reads 16-key runs that never cross a block, so block sizes that are not a multiple of 16 run
// the fused kernel.
template <int D, KeyFormat KEYS, typename T>
void dispatch_rows(Params& p, int64_t num_reqs, int64_t max_query_len, int64_t max_seq_len, const Tensor& query,
                   cudaStream_t stream) {
  const int64_t rows = max_query_len * p.group;
  const bool swizzle = p.layout.swizzle_v_scales;
  if (p.layout.block_size % 16 == 0) {
    if (rows <= 8)
      return swizzle ? launch_decode<D, 1, true, KEYS, T>(p, num_reqs, max_query_len, max_seq_len, query, stream)
                     : launch_decode<D, 1, false, KEYS, T>(p, num_reqs, max_query_len, max_seq_len, query, stream);
    if (rows <= 16)
      return swizzle ? launch_decode<D, 2, true, KEYS, T>(p, num_reqs, max_query_len, max_seq_len, query, stream)
                     : launch_decode<D, 2, false, KEYS, T>(p, num_reqs, max_query_len, max_seq_len, query, stream);
  }
  if (rows <= 32)
    launch<D, 2, KEYS, T>(p, num_reqs, max_query_len, max_seq_len, query, stream);
  else
    launch<D, 4, KEYS, T>(p, num_reqs, max_query_len, max_seq_len, query, stream);
}

void nvfp4_paged_attention_cuda(const Tensor& query, const Tensor& key_cache, const Tensor& value_cache,
                                const Tensor& block_table, const Tensor& query_start_loc, const Tensor& seq_lens,
                                const Tensor& k_scale, const Tensor& v_scale, double scale, bool causal,
                                bool swizzle_v_scales, int64_t max_query_len, int64_t max_seq_len, Tensor& out,
                                int64_t sliding_window, double logits_soft_cap, const std::optional<Tensor>& sinks) {
  const NVFP4PageLayout layout = check_cuda_paged_attention(query, key_cache, value_cache, block_table, query_start_loc,
                                                            seq_lens, k_scale, v_scale, swizzle_v_scales, max_query_len,
                                                            max_seq_len, out, sliding_window, logits_soft_cap, sinks);
  const int64_t num_reqs = seq_lens.size(0);
  if (num_reqs == 0 || query.size(0) == 0 || max_query_len == 0) return;
  const torch::stable::accelerator::DeviceGuard guard(query.get_device_index());
  Params p{};
  p.query = query.const_data_ptr();
  p.q_token_stride = query.stride(0);
  p.q_head_stride = query.stride(1);
  p.key_cache = static_cast<const uint8_t*>(key_cache.const_data_ptr());
  p.value_cache = static_cast<const uint8_t*>(value_cache.const_data_ptr());
  p.key_block_stride = key_cache.stride(0);
  p.value_block_stride = value_cache.stride(0);
  p.num_blocks = key_cache.size(0);
  p.block_table = block_table.const_data_ptr<int32_t>();
  p.table_stride = block_table.stride(0);
  p.query_start_loc = query_start_loc.const_data_ptr<int32_t>();
  p.seq_lens = seq_lens.const_data_ptr<int32_t>();
  p.k_scale = k_scale.const_data_ptr<float>();
  p.v_scale = v_scale.const_data_ptr<float>();
  p.logit_scale = static_cast<float>(scale) * LOG2E;
  p.causal = causal;
  p.sliding_window = static_cast<int>(std::min<int64_t>(sliding_window, INT32_MAX));
  p.soft_cap_log2 = static_cast<float>(logits_soft_cap) * LOG2E;
  p.sinks = sinks.has_value() ? sinks->const_data_ptr<float>() : nullptr;
  p.layout = layout;
  p.block_shift = -1;
  for (int shift = 0; shift < 31; ++shift)
    if ((int64_t{1} << shift) == layout.block_size) p.block_shift = shift;
  p.group = static_cast<int>(query.size(1) / layout.num_heads);
  p.out = out.mutable_data_ptr();
  p.out_token_stride = out.stride(0);
  p.out_head_stride = out.stride(1);
  p.num_tokens = query.size(0);
  const cudaStream_t stream = current_stream(query);
  auto by_type = [&](auto tag, auto keys) {
    using T = decltype(tag);
    constexpr KeyFormat KEYS = decltype(keys)::value;
    switch (layout.head_size) {
      case 64:
        dispatch_rows<64, KEYS, T>(p, num_reqs, max_query_len, max_seq_len, query, stream);
        break;
      case 128:
        dispatch_rows<128, KEYS, T>(p, num_reqs, max_query_len, max_seq_len, query, stream);
        break;
      default:
        dispatch_rows<256, KEYS, T>(p, num_reqs, max_query_len, max_seq_len, query, stream);
    }
  };
  auto by_keys = [&](auto tag) {
    if (layout.fp8_keys())
      by_type(tag, std::integral_constant<KeyFormat, KeyFormat::Fp8>{});
    else if (layout.int8_keys())
      by_type(tag, std::integral_constant<KeyFormat, KeyFormat::Int8>{});
    else
      by_type(tag, std::integral_constant<KeyFormat, KeyFormat::Nvfp4>{});
  };
  if (query.scalar_type() == ScalarType::BFloat16)
    by_keys(__nv_bfloat16{});
  else
    by_keys(__half{});
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(vllm_nvfp4, CUDA, m) {
  m.impl("nvfp4_paged_attention", TORCH_BOX(&nvfp4_paged_attention_cuda));
}

}  // namespace vllm_nvfp4::cuda
