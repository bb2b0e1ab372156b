// CUDA kernel of `nvfp4_paged_attention`: attention read straight from the NVFP4 pages (docs/FORMATS.md §1), for
// decode, prefill, chunked prefill and mixed batches in one launch (plus a combine pass when split-KV).
//
// One CTA of 4 warps owns one (request, KV head, tile of query rows, KV split). A query row is a (query token,
// query head of the KV head's GQA group) pair, so every query head of a group and every token of a multi-token
// request share each dequantized KV tile. The CTA streams its KV range in tiles of TILE tokens: the raw page
// bytes (E2M1 codes and E4M3 scales) are copied by cp.async into a ring of shared-memory stages, and each warp
// decodes its part of a tile straight into mma.sync fragments in registers. Warps split a tile's query rows
// (prefill: WARPS_M = 4) or its tokens (decode: WARPS_N = 4, merged through shared memory at the end).
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
// Split-KV: when (requests × KV heads × query tiles) would leave SMs idle, the KV range is cut into splits
// planned from the host-side max_seq_len bound (never from device values, so a captured CUDA graph stays
// valid for any lengths within the bound); each CTA loops only over its request's real length and writes a
// float32 partial output and log-sum-exp, which the combine kernel merges.
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "checks.h"
#include "common.cuh"
#include "layout.h"

namespace vllm_nvfp4::cuda {
namespace {

constexpr int ATTN_THREADS = 128;
constexpr int ATTN_WARPS = ATTN_THREADS / WARP;
constexpr int TILE = 64;             // KV tokens per pipeline stage
constexpr int STEP = 16;             // tokens per warp step: two n8 blocks of S, one k16 block of P·V
constexpr int STAGE_BUDGET = 36864;  // bytes of shared memory for the stage ring (under the 48 KB default)
constexpr float LOG2E = 1.4426950408889634f;
constexpr float CODE_UNIT = 16384.0f;  // 2^14: a decoded code is its E2M1 value / 2^14

template <int D>
struct Tiles {
  static constexpr int DATA = D / 2;     // code bytes of one (token, head)
  static constexpr int SCALES = D / 16;  // scale bytes of one (token, head)
  static constexpr int K_DATA = 0, V_DATA = TILE * DATA, K_SCALES = 2 * TILE * DATA;
  static constexpr int V_SCALES = K_SCALES + TILE * SCALES;
  static constexpr int STAGE_BYTES = 2 * TILE * (DATA + SCALES);
  static constexpr int STAGES = STAGE_BUDGET / STAGE_BYTES;  // 8 / 4 / 2 for head 64 / 128 / 256
  static constexpr int Q_CHUNK = D / 4;                      // query elements (K codes) of one lane's quarter of a row
  static constexpr int K_WORDS = D / 32;                     // 32-bit code words of that quarter
  static constexpr int V_WORDS = D / 64;                     // code words of one lane's eighth of a V row
  static constexpr int KSTEPS = D / 16;                      // k16 steps of Q·K^T
  static constexpr int VBLOCKS = D / 8;                      // n8 blocks of the output
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
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_address(dst)), "l"(src), "r"(src_bytes));
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(smem_address(dst)), "l"(src), "n"(BYTES),
                 "r"(src_bytes));
}

__device__ __forceinline__ void copy_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int PENDING>
__device__ __forceinline__ void copy_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING));
}

__device__ __forceinline__ uint32_t half2_bits(__half2 h) { return *reinterpret_cast<uint32_t*>(&h); }

__device__ __forceinline__ uint32_t hmul2(uint32_t a, uint32_t b) {
  return half2_bits(__hmul2(*reinterpret_cast<__half2*>(&a), *reinterpret_cast<__half2*>(&b)));
}

// float16 pair (code I, code I + 4) of the eight E2M1 codes in `w` (code k in nibble k), each its value / 2^14:
// the code's sign goes to bit 15 and its exponent and mantissa bits to bits 11..9 of its half.
template <int I>
__device__ __forceinline__ uint32_t code_pair(uint32_t w) {
  constexpr int SIGN = 12 - 4 * I, MAGNITUDE = 9 - 4 * I;
  const uint32_t sign = (SIGN >= 0 ? w << SIGN : w >> -SIGN) & 0x80008000u;
  const uint32_t magnitude = (MAGNITUDE >= 0 ? w << MAGNITUDE : w >> -MAGNITUDE) & 0x0E000E00u;
  return sign | magnitude;
}

// Two E4M3 scale bytes (low byte first) as a float16 pair.
__device__ __forceinline__ uint32_t scale_pair(uint32_t two_bytes) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two_bytes), __NV_E4M3);
  return static_cast<uint32_t>(h.x) | (static_cast<uint32_t>(h.y) << 16);
}

__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) { return half2_bits(__floats2half2_rn(lo, hi)); }

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

struct Params {
  const void* query;
  int64_t q_token_stride, q_head_stride;
  const uint8_t* key_cache;
  const uint8_t* value_cache;
  int64_t block_stride, num_blocks;
  const int32_t* block_table;
  int64_t table_stride;
  const int32_t* query_start_loc;
  const int32_t* seq_lens;
  const float* k_scale;
  const float* v_scale;
  float logit_scale;  // scale · log2(e)
  bool causal;
  NVFP4PageLayout layout;
  int block_shift;  // log2(block_size) when a power of two, else -1
  int group;        // query heads per KV head
  int tiles_per_split;
  int num_splits;
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
// copied whenever the group's first token is in range.
template <int D>
__device__ __forceinline__ void tile_pages(int (&pages)[TileCopy<D>::PAGES], const Params& p, const int32_t* table_row,
                                           int tile, int kv_end) {
  using C = TileCopy<D>;
  const bool v_side = threadIdx.x >= TILE;
#pragma unroll
  for (int j = 0; j < C::PAGES; ++j) {
    const int pos = tile * TILE + (j < C::DATA_TOKENS ? C::data_token(j) : C::scale_token());
    const int first = j == C::DATA_TOKENS && v_side && p.layout.swizzle_v_scales ? pos & ~3 : pos;
    int block = -1;
    if (tile >= 0 && first < kv_end) {
      block = __ldg(table_row + block_position(p, pos).x);
      if (block < 0 || block >= p.num_blocks) block = -1;
    }
    pages[j] = block;
  }
}

// The KV tile's raw bytes into one stage (zeros where a token has no block).
template <int D>
__device__ __forceinline__ void load_tile(uint8_t* stage, const Params& p, int head, int tile,
                                          const int (&pages)[TileCopy<D>::PAGES]) {
  using G = Tiles<D>;
  using C = TileCopy<D>;
  // entry_index(offset, head) = offset · token_step + head_entry (NHD: token-major, HND: head-major)
  const int token_step = p.layout.hnd ? 1 : static_cast<int>(p.layout.num_heads);
  const int head_entry = head * (p.layout.hnd ? static_cast<int>(p.layout.block_size) : 1);
  const int chunk = threadIdx.x % C::CHUNKS;
#pragma unroll
  for (int j = 0; j < C::DATA_TOKENS; ++j) {  // the same rows of K and V
    const int token = C::data_token(j), block = pages[j];
    const int entry = block_position(p, tile * TILE + token).y * token_step + head_entry;
    const int64_t offset = static_cast<int64_t>(max(block, 0)) * p.block_stride + entry * G::DATA + 16 * chunk;
    const int dst = token * G::DATA + 16 * chunk;
    copy_async<16>(stage + G::K_DATA + dst, p.key_cache + offset, block >= 0);
    copy_async<16>(stage + G::V_DATA + dst, p.value_cache + offset, block >= 0);
  }
  const int side = threadIdx.x / TILE, token = C::scale_token(), block = pages[C::DATA_TOKENS];
  const int entry = block_position(p, tile * TILE + token).y * token_step + head_entry;
  const uint8_t* src = (side ? p.value_cache : p.key_cache) + static_cast<int64_t>(max(block, 0)) * p.block_stride +
                       static_cast<int>(p.layout.data_region_bytes()) + entry * G::SCALES;
  copy_async<G::SCALES>(stage + (side ? G::V_SCALES : G::K_SCALES) + token * G::SCALES, src, block >= 0);
}

template <int D, int WARPS_M, typename T>
__global__ void __launch_bounds__(ATTN_THREADS) nvfp4_paged_attention_kernel(Params p) {
  using G = Tiles<D>;
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
  const int tiles = (kv_end + TILE - 1) / TILE;
  const int tile_begin = split * p.tiles_per_split;
  const int tile_end = split == p.num_splits - 1 ? tiles : min(tiles, tile_begin + p.tiles_per_split);
  const int num_tiles = max(0, tile_end - tile_begin);

  const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
  const int wm = warp % WARPS_M, wn = warp / WARPS_M;
  const int g = lane >> 2, t = lane & 3;

  const int32_t* table_row = p.block_table + static_cast<int64_t>(request) * p.table_stride;
  int pages[TileCopy<D>::PAGES];
  for (int s = 0; s < G::STAGES - 1; ++s) {
    if (s < num_tiles) {
      tile_pages<D>(pages, p, table_row, tile_begin + s, kv_end);
      load_tile<D>(smem + s * G::STAGE_BYTES, p, head, tile_begin + s, pages);
    }
    copy_commit();
  }
  // Block ids of the next tile to copy, fetched an iteration before the copy.
  tile_pages<D>(pages, p, table_row, G::STAGES - 1 < num_tiles ? tile_begin + G::STAGES - 1 : -1, kv_end);

  // This lane's two rows (g and g + 8 of the warp's 16): their query tokens, visible key ends and logit scales;
  // their query quarters as float16 A fragments, in the order code_pair decodes K.
  int row_limit[2];
  float row_scale[2];
  uint32_t qa[G::KSTEPS][4];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row0 + wm * 16 + g + 8 * r;
    const bool valid = row < num_rows;
    const int token = valid ? row / p.group : 0;
    const int q_head = head * p.group + (valid ? row % p.group : 0);
    row_limit[r] = !valid ? 0 : p.causal ? seq_len - num_q + token + 1 : seq_len;
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
    row_scale[r] = p.logit_scale * __ldg(p.k_scale) * CODE_UNIT * ldexpf(1.0f, -shift);
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
      if (next < num_tiles) load_tile<D>(smem + (next % G::STAGES) * G::STAGE_BYTES, p, head, tile_begin + next, pages);
      copy_commit();
      tile_pages<D>(pages, p, table_row, next + 1 < num_tiles ? tile_begin + next + 1 : -1, kv_end);
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
          mma_f16(s[nb], qa[2 * u], hmul2(code_pair<0>(w), sf), hmul2(code_pair<1>(w), sf));
          mma_f16(s[nb], qa[2 * u + 1], hmul2(code_pair<2>(w), sf), hmul2(code_pair<3>(w), sf));
        }
      }
      // Online softmax in the log2 domain; element (nb, e) of row r is token 4t + 2nb + e of the step.
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
            x = pos < row_limit[r] ? x : -INFINITY;
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
          // A token past the range has zero codes but, in a swizzled group, a copied scale byte that may be
          // anything (a NaN times its zero probability is NaN): its scale is zero.
          sf_bytes[k] = tile_start + token < kv_end ? stage[G::V_SCALES + entry * G::SCALES + byte] : 0u;
        }
        const uint32_t sf01 = scale_pair(sf_bytes[0] | (sf_bytes[1] << 8));
        const uint32_t sf23 = scale_pair(sf_bytes[2] | (sf_bytes[3] << 8));
        const uint32_t lo01 = __byte_perm(vw[0][u], vw[1][u], 0x5410), hi01 = __byte_perm(vw[0][u], vw[1][u], 0x7632);
        const uint32_t lo23 = __byte_perm(vw[2][u], vw[3][u], 0x5410), hi23 = __byte_perm(vw[2][u], vw[3][u], 0x7632);
        mma_f16(o[8 * u + 0], pa, hmul2(code_pair<0>(lo01), sf01), hmul2(code_pair<0>(lo23), sf23));
        mma_f16(o[8 * u + 1], pa, hmul2(code_pair<1>(lo01), sf01), hmul2(code_pair<1>(lo23), sf23));
        mma_f16(o[8 * u + 2], pa, hmul2(code_pair<2>(lo01), sf01), hmul2(code_pair<2>(lo23), sf23));
        mma_f16(o[8 * u + 3], pa, hmul2(code_pair<3>(lo01), sf01), hmul2(code_pair<3>(lo23), sf23));
        mma_f16(o[8 * u + 4], pa, hmul2(code_pair<0>(hi01), sf01), hmul2(code_pair<0>(hi23), sf23));
        mma_f16(o[8 * u + 5], pa, hmul2(code_pair<1>(hi01), sf01), hmul2(code_pair<1>(hi23), sf23));
        mma_f16(o[8 * u + 6], pa, hmul2(code_pair<2>(hi01), sf01), hmul2(code_pair<2>(hi23), sf23));
        mma_f16(o[8 * u + 7], pa, hmul2(code_pair<3>(hi01), sf01), hmul2(code_pair<3>(hi23), sf23));
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
      const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
#pragma unroll
      for (int c = 0; c < G::VBLOCKS; ++c)
#pragma unroll
        for (int e = 0; e < 2; ++e) store(row, G::VBLOCKS * (2 * t + e) + c, o[c][2 * r + e] * inv);
      if (t == 0) store_lse(row, l[r] > 0.0f ? m[r] + __log2f(l[r]) : -INFINITY);
    }
  } else {
    // Warps wn hold the same rows over different tokens: merge them through shared memory.
    float* merged = reinterpret_cast<float*>(smem);  // [ROWS][D]
    static_assert(ROWS * D * sizeof(float) <= STAGE_BUDGET, "the merge buffer reuses the stage ring");
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
      const float inv = l_all > 0.0f ? 1.0f / l_all : 0.0f;
      for (int d = lane; d < D; d += WARP) store(row, d, merged[row * D + d] * inv);
      if (lane == 0) store_lse(row, l_all > 0.0f ? m_all + __log2f(l_all) : -INFINITY);
    }
  }
}

// Merges the splits' partial outputs: one warp per (query token, query head); lanes share the splits' log-sum-exps,
// then each lane sums its columns over the splits.
template <int D, typename T>
__global__ void __launch_bounds__(ATTN_THREADS)
    combine_splits_kernel(const float* __restrict__ partial_out, const float* __restrict__ partial_lse, int num_splits,
                          int64_t num_tokens, int q_heads, const int32_t* __restrict__ query_start_loc, int num_reqs,
                          T* __restrict__ out, int64_t out_token_stride, int64_t out_head_stride) {
  const int64_t pair = static_cast<int64_t>(blockIdx.x) * ATTN_WARPS + threadIdx.x / WARP;
  const int lane = threadIdx.x % WARP;
  const int64_t token = pair / q_heads;
  const int head = static_cast<int>(pair % q_heads);
  if (token >= min(num_tokens, static_cast<int64_t>(__ldg(query_start_loc + num_reqs)))) return;
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
  const float inv = weight > 0.0f ? 1.0f / weight : 0.0f;
  T* dst = out + token * out_token_stride + head * out_head_stride + lane * COLS;
#pragma unroll
  for (int c = 0; c < COLS; ++c) from_float(acc[c] * inv, dst + c);
}

// --- host side ----------------------------------------------------------------------------------------

std::string shape_text(const Tensor& t) {
  std::string s = "[";
  for (int64_t d = 0; d < t.dim(); ++d) s += (d ? ", " : "") + std::to_string(t.size(d));
  return s + "]";
}

void check_on(const char* op, const char* name, const Tensor& t, const Tensor& query) {
  NVFP4_CHECK(t.device() == query.device(), op, ": ", name,
              ": must be on query's device (cuda:", query.get_device_index(), ")");
}

void check_int32_vector(const char* op, const char* name, const Tensor& t, int64_t size, const Tensor& query) {
  NVFP4_CHECK(t.scalar_type() == ScalarType::Int, op, ": ", name, ": dtype must be int32, got ", t.scalar_type());
  NVFP4_CHECK(t.dim() == 1 && t.size(0) == size && (size <= 1 || t.stride(0) == 1), op, ": ", name,
              ": must be a contiguous 1-D tensor of ", size, " elements, got shape ", shape_text(t));
  check_on(op, name, t, query);
}

// Argument checks of the CUDA op; returns the cache layout. Rules as in the op's docstring (ops.py).
NVFP4PageLayout check_paged_attention(const Tensor& query, const Tensor& key_cache, const Tensor& value_cache,
                                      const Tensor& block_table, const Tensor& query_start_loc, const Tensor& seq_lens,
                                      const Tensor& k_scale, const Tensor& v_scale, bool swizzle_v_scales,
                                      int64_t max_query_len, int64_t max_seq_len, const Tensor& out) {
  const char* op = "nvfp4_paged_attention";
  NVFP4_CHECK(query.scalar_type() == ScalarType::BFloat16 || query.scalar_type() == ScalarType::Half, op,
              ": query: dtype must be bfloat16 or float16, got ", query.scalar_type());
  NVFP4_CHECK(query.dim() == 3 && query.stride(2) == 1, op,
              ": query: must be 3-D [num_tokens, num_q_heads, head_size] with a contiguous head dim, got shape ",
              shape_text(query));
  NVFP4_CHECK(key_cache.scalar_type() == ScalarType::Byte && key_cache.dim() == 4, op,
              ": key_cache: must be uint8 [num_blocks, block_size, num_kv_heads, head_size/2 + head_size/16], got ",
              key_cache.scalar_type(), " of shape ", shape_text(key_cache));
  const int64_t block_size = key_cache.size(1), num_heads = key_cache.size(2), full_dim = key_cache.size(3);
  const int64_t head_size = full_dim / 9 * 16;
  NVFP4_CHECK(full_dim % 9 == 0 && (head_size == 64 || head_size == 128 || head_size == 256), op,
              ": key_cache: last dim ", full_dim, " must be head_size/2 + head_size/16 for head_size 64, 128 or 256");
  NVFP4_CHECK(block_size > 0 && num_heads > 0, op, ": key_cache: block size and head count must be positive");
  const bool hnd = key_cache.stride(2) > key_cache.stride(1);
  const NVFP4PageLayout layout{head_size, block_size, num_heads, hnd, swizzle_v_scales};
  const int inner = hnd ? 1 : 2, outer = hnd ? 2 : 1;
  NVFP4_CHECK(key_cache.stride(3) == 1 && (key_cache.size(inner) == 1 || key_cache.stride(inner) == full_dim) &&
                  (key_cache.size(outer) == 1 || key_cache.stride(outer) == full_dim * key_cache.size(inner)) &&
                  (key_cache.size(0) <= 1 || key_cache.stride(0) >= layout.side_bytes()),
              op, ": key_cache: each block side must be contiguous NHD or HND bytes, got shape ",
              shape_text(key_cache));
  NVFP4_CHECK(aligned(key_cache.const_data_ptr(), 16) && aligned(value_cache.const_data_ptr(), 16) &&
                  key_cache.stride(0) % 16 == 0,
              op, ": key_cache: block sides must start on 16-byte boundaries (pointer and block stride)");
  if (swizzle_v_scales)
    NVFP4_CHECK(block_size % 4 == 0, op, ": key_cache: block size ", block_size,
                " is not a multiple of 4, which swizzle_v_scales needs");
  bool same_geometry = value_cache.scalar_type() == ScalarType::Byte && value_cache.dim() == 4;
  for (int64_t d = 0; same_geometry && d < 4; ++d)
    same_geometry = value_cache.size(d) == key_cache.size(d) && value_cache.stride(d) == key_cache.stride(d);
  NVFP4_CHECK(same_geometry, op, ": value_cache: must be uint8 with key_cache's shape ", shape_text(key_cache),
              " and strides, got shape ", shape_text(value_cache));
  NVFP4_CHECK(query.size(2) == head_size && query.size(1) % num_heads == 0 && query.size(1) > 0, op, ": query: shape ",
              shape_text(query), " must be [num_tokens, a multiple of ", num_heads, " heads, ", head_size, "]");
  NVFP4_CHECK(aligned(query.const_data_ptr(), 16) && (query.stride(0) * 2) % 16 == 0 && (query.stride(1) * 2) % 16 == 0,
              op, ": query: data pointer and strides must be 16-byte aligned");
  NVFP4_CHECK(out.scalar_type() == query.scalar_type() && out.dim() == 3 && out.size(0) == query.size(0) &&
                  out.size(1) == query.size(1) && out.size(2) == head_size && out.stride(2) == 1,
              op, ": out: must have query's dtype and shape ", shape_text(query), " with a contiguous head dim, got ",
              out.scalar_type(), " of shape ", shape_text(out));
  const int64_t num_reqs = seq_lens.size(0);
  check_int32_vector(op, "seq_lens", seq_lens, seq_lens.dim() == 1 ? seq_lens.size(0) : -1, query);
  check_int32_vector(op, "query_start_loc", query_start_loc, num_reqs + 1, query);
  NVFP4_CHECK(block_table.scalar_type() == ScalarType::Int && block_table.dim() == 2 &&
                  block_table.size(0) >= num_reqs && (block_table.size(1) <= 1 || block_table.stride(1) == 1),
              op, ": block_table: must be int32 [>= num_reqs, max_blocks] with contiguous rows, got ",
              block_table.scalar_type(), " of shape ", shape_text(block_table));
  check_on(op, "block_table", block_table, query);
  check_on(op, "key_cache", key_cache, query);
  check_on(op, "value_cache", value_cache, query);
  check_on(op, "out", out, query);
  for (const auto& [name, scale] :
       {std::pair<const char*, const Tensor*>{"k_scale", &k_scale}, {"v_scale", &v_scale}}) {
    NVFP4_CHECK(scale->scalar_type() == ScalarType::Float && scale->numel() == 1, op, ": ", name,
                ": must hold one float32 (the layer's global scale)");
    check_on(op, name, *scale, query);
  }
  NVFP4_CHECK(max_query_len >= 0 && max_seq_len >= 0, op, ": max_query_len and max_seq_len must be >= 0, got ",
              max_query_len, " and ", max_seq_len);
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

template <int D, int WARPS_M, typename T>
void launch(Params& p, int64_t num_reqs, int64_t max_query_len, int64_t max_seq_len, const Tensor& query,
            const Tensor& query_start_loc, const Tensor& out, cudaStream_t stream) {
  using G = Tiles<D>;
  auto kernel = nvfp4_paged_attention_kernel<D, WARPS_M, T>;
  const int smem_bytes = G::STAGES * G::STAGE_BYTES;
  const int64_t row_tiles = std::max<int64_t>(1, (max_query_len * p.group + 16 * WARPS_M - 1) / (16 * WARPS_M));
  const int64_t ctas = num_reqs * p.layout.num_heads * row_tiles;
  const int64_t tile_bound = std::max<int64_t>(1, (max_seq_len + TILE - 1) / TILE);
  int per_sm = 0;
  NVFP4_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, ATTN_THREADS, smem_bytes) == cudaSuccess,
              "nvfp4_paged_attention: occupancy query failed");
  const int64_t resident = std::max(1, per_sm) * static_cast<int64_t>(multiprocessors(query.get_device_index()));
  // Splits to fill the GPU twice over, each at least 4 tiles long.
  int64_t splits = std::clamp<int64_t>((2 * resident + ctas - 1) / ctas, 1, std::max<int64_t>(1, tile_bound / 4));
  p.tiles_per_split = static_cast<int>((tile_bound + splits - 1) / splits);
  splits = (tile_bound + p.tiles_per_split - 1) / p.tiles_per_split;
  p.num_splits = static_cast<int>(splits);
  const int64_t q_heads = query.size(1);
  Tensor partial_out, partial_lse;
  if (splits > 1) {
    partial_out = torch::stable::new_empty(query, {splits, p.num_tokens, q_heads, D}, ScalarType::Float);
    partial_lse = torch::stable::new_empty(query, {splits, p.num_tokens, q_heads}, ScalarType::Float);
    p.partial_out = partial_out.mutable_data_ptr<float>();
    p.partial_lse = partial_lse.mutable_data_ptr<float>();
  }
  NVFP4_CHECK(num_reqs <= 65535 && row_tiles * p.layout.num_heads <= INT32_MAX, "nvfp4_paged_attention: ", num_reqs,
              " requests exceed the launch grid (at most 65535)");
  const dim3 grid(static_cast<unsigned>(row_tiles * p.layout.num_heads), static_cast<unsigned>(splits),
                  static_cast<unsigned>(num_reqs));
  kernel<<<grid, ATTN_THREADS, smem_bytes, stream>>>(p);
  check_launch("nvfp4_paged_attention");
  if (splits > 1) {
    const int64_t pairs = p.num_tokens * q_heads;
    combine_splits_kernel<D, T>
        <<<static_cast<unsigned>((pairs + ATTN_WARPS - 1) / ATTN_WARPS), ATTN_THREADS, 0, stream>>>(
            p.partial_out, p.partial_lse, p.num_splits, p.num_tokens, static_cast<int>(q_heads),
            query_start_loc.const_data_ptr<int32_t>(), static_cast<int>(num_reqs), static_cast<T*>(p.out),
            p.out_token_stride, p.out_head_stride);
    check_launch("nvfp4_paged_attention (combine)");
  }
}

template <int D, typename T>
void dispatch_rows(Params& p, int64_t num_reqs, int64_t max_query_len, int64_t max_seq_len, const Tensor& query,
                   const Tensor& query_start_loc, const Tensor& out, cudaStream_t stream) {
  const int64_t rows = max_query_len * p.group;
  if (rows <= 16)
    launch<D, 1, T>(p, num_reqs, max_query_len, max_seq_len, query, query_start_loc, out, stream);
  else if (rows <= 32)
    launch<D, 2, T>(p, num_reqs, max_query_len, max_seq_len, query, query_start_loc, out, stream);
  else
    launch<D, 4, T>(p, num_reqs, max_query_len, max_seq_len, query, query_start_loc, out, stream);
}

void nvfp4_paged_attention_cuda(const Tensor& query, const Tensor& key_cache, const Tensor& value_cache,
                                const Tensor& block_table, const Tensor& query_start_loc, const Tensor& seq_lens,
                                const Tensor& k_scale, const Tensor& v_scale, double scale, bool causal,
                                bool swizzle_v_scales, int64_t max_query_len, int64_t max_seq_len, Tensor& out,
                                int64_t sliding_window, double logits_soft_cap, const std::optional<Tensor>& sinks) {
  const NVFP4PageLayout layout =
      check_paged_attention(query, key_cache, value_cache, block_table, query_start_loc, seq_lens, k_scale, v_scale,
                            swizzle_v_scales, max_query_len, max_seq_len, out);
  check_attention_features(sliding_window, logits_soft_cap, sinks, query);
  NVFP4_CHECK(sliding_window == 0 && logits_soft_cap == 0.0 && !sinks.has_value(),
              "nvfp4_paged_attention: sliding_window, logits_soft_cap and sinks are not implemented on CUDA yet");
  const int64_t num_reqs = seq_lens.size(0);
  if (num_reqs == 0 || query.size(0) == 0 || max_query_len == 0) return;
  const torch::stable::accelerator::DeviceGuard guard(query.get_device_index());
  Params p{};
  p.query = query.const_data_ptr();
  p.q_token_stride = query.stride(0);
  p.q_head_stride = query.stride(1);
  p.key_cache = static_cast<const uint8_t*>(key_cache.const_data_ptr());
  p.value_cache = static_cast<const uint8_t*>(value_cache.const_data_ptr());
  p.block_stride = key_cache.stride(0);
  p.num_blocks = key_cache.size(0);
  p.block_table = block_table.const_data_ptr<int32_t>();
  p.table_stride = block_table.stride(0);
  p.query_start_loc = query_start_loc.const_data_ptr<int32_t>();
  p.seq_lens = seq_lens.const_data_ptr<int32_t>();
  p.k_scale = k_scale.const_data_ptr<float>();
  p.v_scale = v_scale.const_data_ptr<float>();
  p.logit_scale = static_cast<float>(scale) * LOG2E;
  p.causal = causal;
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
  auto by_type = [&](auto tag) {
    using T = decltype(tag);
    switch (layout.head_size) {
      case 64:
        dispatch_rows<64, T>(p, num_reqs, max_query_len, max_seq_len, query, query_start_loc, out, stream);
        break;
      case 128:
        dispatch_rows<128, T>(p, num_reqs, max_query_len, max_seq_len, query, query_start_loc, out, stream);
        break;
      default:
        dispatch_rows<256, T>(p, num_reqs, max_query_len, max_seq_len, query, query_start_loc, out, stream);
    }
  };
  if (query.scalar_type() == ScalarType::BFloat16)
    by_type(__nv_bfloat16{});
  else
    by_type(__half{});
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(vllm_nvfp4, CUDA, m) {
  m.impl("nvfp4_paged_attention", TORCH_BOX(&nvfp4_paged_attention_cuda));
}

}  // namespace vllm_nvfp4::cuda
