// CUDA kernels of the sparse indexer's FP8 MQA logits (what DeepGEMM's fp8_mqa_logits and
// fp8_paged_mqa_logits compute):  logit[row, key] = Σ_h w[row, h] · relu(Σ_b s[key, b] · q[row, h, block b] · k[key, block b]).
//
// Tensor cores through `mma.sync m16n8k16` fp16 → float32 (E4M3 values are exact in fp16). On SM90 the FP8
// form of mma.sync (m16n8k32 e4m3) is no hardware instruction: ptxas emulates it with fp16 HMMAs, converting
// both operands at every MMA, which is issue-bound (~230 TFLOP/s measured on an H200). Here each operand is
// converted once: the query as it enters registers, a key tile once for all heads. Per query row, a tile of 16
// keys is the M dimension (A), 8 heads the N dimension (B), head_dim 128 eight k-steps of 16. A dot product's
// order is free, so each lane owns a fixed quarter of every 128-byte row (its "piece": per quant block of qbs
// bytes, the qbs/4 contiguous bytes from qbs·b + qbs/4·t) for q and k alike: one or two 16-byte loads fill its
// fragments, and each k-step stays inside one quant block. Two warps share a query row, each holding its half
// of up to 64 heads as fp16 in registers (8 KB); the epilogue (per-block scales, relu, head weights) sums a
// lane's heads, then the quad's 4 lanes with shuffles, then the two halves through shared memory.
// Both kernels stage 64-key stages of keys in shared memory by cp.async (3 deep).
// - indexer_mqa_logits (a prefill chunk's gathered keys): a CTA of 4 warp pairs, a pair a query row; the CTA
//   stages the union of its 4 rows' ranges. Only 16-key tiles that meet a row's [ks, ke) are computed; the rest
//   of the row is -inf.
// - indexer_paged_mqa_logits (decode): a CTA of one warp pair owns one query row and a span of its columns (7
//   CTAs an SM by shared memory: 14 stages in flight); the stage loads look each key's block up in the block
//   table.
// More than 64 heads: one launch per group of 64, each adding its heads' sum to the logits of the first.
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>

#include <algorithm>
#include <type_traits>

#include "checks.h"
#include "common.cuh"
#include "layout.h"

namespace vllm_nvfp4::cuda {
namespace {

constexpr int HEAD_DIM = 128;   // bytes of one FP8 row: eight k-steps of 16
constexpr int TILE_KEYS = 16;   // keys of one MMA (its M dimension)
constexpr int HEAD_GROUP = 64;  // heads one launch keeps in registers: 4 n8 tiles a warp, two warps a row
constexpr float NEG_INF = -__builtin_huge_valf();

template <int N>
using Int = std::integral_constant<int, N>;

// d += a · b for a 16 x 16 fp16 A (row-major), a 16 x 8 fp16 B (column-major) and a 16 x 8 float32 d.
__device__ __forceinline__ void mma_f16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                        uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
  __trap();  // the host refuses devices below SM80
#endif
}

// NaN stays NaN, as in torch's relu and the reference (fmaxf would turn it into 0).
__device__ __forceinline__ float relu(float x) { return x < 0.0f ? 0.0f : x; }

// The two E4M3 values in the low 16 bits as an fp16 pair (exact: fp16 holds every E4M3 value).
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t bytes) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(bytes & 0xFFFFu), __NV_E4M3);
  return static_cast<uint32_t>(h.x) | static_cast<uint32_t>(h.y) << 16;
}

// Byte offset of lane t's piece of quant block b inside a 128-byte row.
template <int kBlocks>
__device__ __forceinline__ int piece_offset(int b, int t) {
  constexpr int kBlockBytes = HEAD_DIM / kBlocks;
  return kBlockBytes * b + kBlockBytes / 4 * t;
}

// Lane t's piece of a 128-byte row as 8 words: word s feeds k-step s, in quant block s / (8 / kBlocks).
// `vector`: the row is 16-byte aligned (global memory; shared rows always are), else byte loads.
template <int kBlocks, bool kGlobal>
__device__ __forceinline__ void load_piece(const uint8_t* row, int t, bool vector, uint32_t (&w)[8]) {
  constexpr int kWords = 8 / kBlocks;  // of one block
#pragma unroll
  for (int b = 0; b < kBlocks; ++b) {
    const uint8_t* src = row + piece_offset<kBlocks>(b, t);
    uint32_t* dst = w + b * kWords;
    if (vector) {
      if constexpr (kWords == 2) {
        const uint2 v = kGlobal ? __ldg(reinterpret_cast<const uint2*>(src)) : *reinterpret_cast<const uint2*>(src);
        dst[0] = v.x, dst[1] = v.y;
      } else {
#pragma unroll
        for (int i = 0; i < kWords / 4; ++i) {
          const uint4 v = kGlobal ? __ldg(reinterpret_cast<const uint4*>(src) + i)
                                  : reinterpret_cast<const uint4*>(src)[i];
          dst[4 * i] = v.x, dst[4 * i + 1] = v.y, dst[4 * i + 2] = v.z, dst[4 * i + 3] = v.w;
        }
      }
    } else {
#pragma unroll
      for (int i = 0; i < kWords; ++i) {
        uint32_t word = 0;
#pragma unroll
        for (int j = 0; j < 4; ++j) word |= static_cast<uint32_t>(src[4 * i + j]) << (8 * j);
        dst[i] = word;
      }
    }
  }
}

// One query row's heads of this warp (a head half: 8·kHeadTiles heads) in registers, as fp16: lane (g, t) =
// (lane / 4, lane % 4) holds head 8j + g's piece for each n8 tile j (the B fragments: word s of the FP8 piece,
// converted, gives registers 2s and 2s + 1, k-step s) and the weights of heads 8j + 2t and 8j + 2t + 1 (its
// accumulator columns); heads past `heads` are zero in both.
template <int kHeadTiles>
struct QueryRow {
  uint32_t q[kHeadTiles][16];
  float w[kHeadTiles][2];
};

// `q` and `weights` point at the warp's first head; `heads` of them exist (may be <= 0).
template <int kHeadTiles, int kBlocks>
__device__ __forceinline__ void load_query(const uint8_t* q, const float* weights, int heads, bool vector,
                                           QueryRow<kHeadTiles>& row) {
  const int lane = threadIdx.x % WARP, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int j = 0; j < kHeadTiles; ++j) {
    uint32_t piece[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    if (8 * j + g < heads) load_piece<kBlocks, true>(q + (8 * j + g) * HEAD_DIM, t, vector, piece);
#pragma unroll
    for (int s = 0; s < 8; ++s) {
      row.q[j][2 * s] = e4m3x2_to_f16x2(piece[s]);
      row.q[j][2 * s + 1] = e4m3x2_to_f16x2(piece[s] >> 16);
    }
#pragma unroll
    for (int c = 0; c < 2; ++c) row.w[j][c] = 8 * j + 2 * t + c < heads ? __ldg(weights + 8 * j + 2 * t + c) : 0.0f;
  }
}

// Keys g and g + 8 of a 16-key tile (the A fragments' rows: FP8 pieces) and their per-block scales.
template <int kBlocks>
struct KeyTile {
  uint32_t k[2][8];
  float s[2][kBlocks];
};

// The tile's logits over this warp's heads: lanes with t == 0 return key g's, t == 2 key (g + 8)'s; t == 1
// and 3 return partial sums. Every lane of the warp must call it. k-step s (16 wide) takes word s of each
// piece: the same 4 bytes of q and of k, so each dot product covers every byte once, in an order of its own.
template <int kHeadTiles, int kBlocks>
__device__ __forceinline__ float tile_logits(const QueryRow<kHeadTiles>& row, const KeyTile<kBlocks>& tile) {
  constexpr int kSteps = 8 / kBlocks;  // k-steps of one quant block
  uint32_t a[8][4];                     // the keys as fp16 A fragments, converted once for all head tiles
#pragma unroll
  for (int s = 0; s < 8; ++s) {
    a[s][0] = e4m3x2_to_f16x2(tile.k[0][s]);
    a[s][1] = e4m3x2_to_f16x2(tile.k[1][s]);
    a[s][2] = e4m3x2_to_f16x2(tile.k[0][s] >> 16);
    a[s][3] = e4m3x2_to_f16x2(tile.k[1][s] >> 16);
  }
  float sum[2] = {0.0f, 0.0f};  // keys g and g + 8, over this lane's heads
#pragma unroll
  for (int j = 0; j < kHeadTiles; ++j) {
    float score[4];  // c0, c1: key g, heads 8j + 2t, 8j + 2t + 1; c2, c3: key g + 8
#pragma unroll
    for (int b = 0; b < kBlocks; ++b) {
      float dot[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
      for (int u = 0; u < kSteps; ++u) {
        const int s = b * kSteps + u;
        mma_f16(dot, a[s][0], a[s][1], a[s][2], a[s][3], row.q[j][2 * s], row.q[j][2 * s + 1]);
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) score[i] = b == 0 ? tile.s[i / 2][0] * dot[i] : fmaf(tile.s[i / 2][b], dot[i], score[i]);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) sum[i / 2] = fmaf(row.w[j][i % 2], relu(score[i]), sum[i / 2]);
  }
  // Over the quad: lanes t = 0, 1 gather key g, t = 2, 3 key g + 8 (3 shuffles, not 4).
  const int t = threadIdx.x % 4;
  const bool high = t & 2;
  float mine = high ? sum[1] : sum[0];
  mine += __shfl_xor_sync(0xFFFFFFFFu, high ? sum[0] : sum[1], 2);
  return mine + __shfl_xor_sync(0xFFFFFFFFu, mine, 1);
}

// The key of the tile whose logit this lane returns, or -1 for t odd.
__device__ __forceinline__ int tile_key_of_lane() {
  const int lane = threadIdx.x % WARP, t = lane % 4;
  return t & 1 ? -1 : lane / 4 + (t & 2 ? 8 : 0);
}

// Stores a computed logit: `visible` ones as they are (or added to the first head group's), the others -inf
// (left alone by the later head groups).
__device__ __forceinline__ void store_logit(float* out, float value, bool visible, bool accumulate) {
  if (!accumulate) *out = visible ? value : NEG_INF;
  else if (visible) *out += value;
}

// --- key stages in shared memory (both kernels) ---------------------------------------------------------

// A warp pair shares a query row, its two warps taking the two head halves.
constexpr int PREFILL_PAIRS = 4;  // a CTA's rows: the stages serve 4 rows
constexpr int DECODE_WARPS = 2;   // a decode CTA is one pair (one row): small CTAs keep more stages in flight an SM
constexpr int STAGE_KEYS = 64;            // keys a shared-memory stage: 4 tiles
constexpr int STAGES = 3;                 // cp.async pipeline depth
constexpr int KEY_PITCH = HEAD_DIM + 16;  // shared row stride: the 8 lanes of a 16-byte load phase hit 8 bank groups

__device__ __forceinline__ void cp_async(void* smem, const void* src, int bytes, int src_bytes) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  if (bytes == 16)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes));
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(kPending)); }

template <int kBlocks>
struct KeyStage {
  alignas(16) uint8_t values[STAGE_KEYS * KEY_PITCH];
  float scales[STAGE_KEYS * kBlocks];
};

// 16 bytes of a key row into shared memory: cp.async (zeros when `src` is null), or byte loads when unaligned.
__device__ __forceinline__ void stage_chunk(uint8_t* dst, const uint8_t* src, bool vector, const void* any) {
  if (vector) {
    cp_async(dst, src ? src : any, 16, src ? 16 : 0);
  } else {
    uint32_t words[4] = {0, 0, 0, 0};
    if (src)
      for (int i = 0; i < 16; ++i) words[i / 4] |= static_cast<uint32_t>(src[i]) << (8 * (i % 4));
    *reinterpret_cast<uint4*>(dst) = make_uint4(words[0], words[1], words[2], words[3]);
  }
}

// A float32 scale into shared memory: cp.async when 4-byte aligned (zero when `src` is null), else byte loads.
__device__ __forceinline__ void stage_scale(float* dst, const uint8_t* src, bool vector, const void* any) {
  if (vector) {
    cp_async(dst, src ? src : any, 4, src ? 4 : 0);
  } else {
    uint32_t bits = 0;
    if (src)
      for (int j = 0; j < 4; ++j) bits |= static_cast<uint32_t>(src[j]) << (8 * j);
    *dst = __uint_as_float(bits);
  }
}

// Tile `sub` of a stage: this lane's pieces of keys g and g + 8 and their scales.
template <int kBlocks>
__device__ __forceinline__ void read_stage_tile(const KeyStage<kBlocks>& stage, int sub, KeyTile<kBlocks>& tile) {
  const int lane = threadIdx.x % WARP, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = sub * TILE_KEYS + g + 8 * h;
    load_piece<kBlocks, false>(stage.values + r * KEY_PITCH, t, true, tile.k[h]);
#pragma unroll
    for (int b = 0; b < kBlocks; ++b) tile.s[h][b] = stage.scales[r * kBlocks + b];
  }
}

// Whether the 16-key tile from `first` meets [lo, hi).
__device__ __forceinline__ bool tile_meets(int first, int lo, int hi) { return first + TILE_KEYS > lo && first < hi; }

// The cp.async pipeline of both kernels: stage i + STAGES - 1 loads while stage i is scored, into the buffer every
// warp finished reading at i - 1. `load_stage(buffer, i)` stages stage i's keys; `tile_on(i, sub)` says whether
// tile `sub` of stage i is computed (uniform in the warp; with kPrefix no later tile of the stage is either); this
// warp writes its sums to sums[i % 2][slot], and `store_stage(i)` stores stage i's after the next barrier (they
// are rewritten at i + 2).
template <bool kPrefix, int kHeadTiles, int kBlocks, int kSlots, typename LoadStage, typename TileOn,
          typename StoreStage>
__device__ __forceinline__ void score_stages(KeyStage<kBlocks> (&stages)[STAGES], float (&sums)[2][kSlots][STAGE_KEYS],
                                             int slot, const QueryRow<kHeadTiles>& query, int num_stages,
                                             LoadStage load_stage, TileOn tile_on, StoreStage store_stage) {
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < num_stages) load_stage(stages[s], s);
    cp_async_commit();
  }
  const int lane_key = tile_key_of_lane();
  for (int i = 0; i < num_stages; ++i) {
    const int next = i + STAGES - 1;
    if (next < num_stages) load_stage(stages[next % STAGES], next);
    cp_async_commit();
    cp_async_wait<STAGES - 1>();
    __syncthreads();
    if (i > 0) store_stage(i - 1);
#pragma unroll
    for (int sub = 0; sub < STAGE_KEYS / TILE_KEYS; ++sub) {
      if (!tile_on(i, sub)) {
        if constexpr (kPrefix) break;  // (a break keeps the decode kernel's registers: `continue` spills there)
        else continue;
      }
      KeyTile<kBlocks> tile;
      read_stage_tile(stages[i % STAGES], sub, tile);
      const float value = tile_logits(query, tile);
      if (lane_key >= 0) sums[i % 2][slot][sub * TILE_KEYS + lane_key] = value;
    }
    __syncthreads();
  }
  store_stage(num_stages - 1);
}

// --- prefill: indexer_mqa_logits ------------------------------------------------------------------------

// Stages contiguous keys [first, first + STAGE_KEYS) (zeros past `keys`); the scales are 4-byte aligned
// (checked on the host).
template <int kBlocks>
__device__ __forceinline__ void stage_keys(KeyStage<kBlocks>& stage, const uint8_t* __restrict__ k, int64_t k_stride,
                                           const float* __restrict__ k_scale, int64_t scale_stride, int first,
                                           int keys, bool vector_k) {
  for (int c = threadIdx.x; c < STAGE_KEYS * HEAD_DIM / 16; c += blockDim.x) {
    const int r = c / (HEAD_DIM / 16), part = c % (HEAD_DIM / 16), key = first + r;
    stage_chunk(stage.values + r * KEY_PITCH + part * 16,
                key < keys ? k + static_cast<int64_t>(key) * k_stride + part * 16 : nullptr, vector_k, k);
  }
  for (int c = threadIdx.x; c < STAGE_KEYS * kBlocks; c += blockDim.x) {
    const int key = first + c / kBlocks;
    const float* src = k_scale + static_cast<int64_t>(key) * scale_stride + c % kBlocks;
    stage_scale(stage.scales + c, key < keys ? reinterpret_cast<const uint8_t*>(src) : nullptr, true, k_scale);
  }
}

// A CTA owns PREFILL_PAIRS query rows, a warp pair each; it stages the union of their key ranges.
template <int kHeadTiles, int kBlocks>
__global__ void __launch_bounds__(2 * PREFILL_PAIRS * WARP, 2) indexer_mqa_logits_kernel(
    const uint8_t* __restrict__ q, int64_t q_row_stride, const float* __restrict__ weights, int64_t w_row_stride,
    int heads, bool vector_q, const uint8_t* __restrict__ k, int64_t k_stride, bool vector_k,
    const float* __restrict__ k_scale, int64_t scale_stride, const int32_t* __restrict__ ks,
    const int32_t* __restrict__ ke, float* __restrict__ logits, int64_t logits_stride, int rows, int keys,
    bool accumulate) {
  __shared__ KeyStage<kBlocks> stages[STAGES];
  __shared__ float partial[2][2 * PREFILL_PAIRS][STAGE_KEYS];  // [stage parity][warp][key]: each half's sums
  const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP, half = warp % 2;
  const int first_row = blockIdx.x * PREFILL_PAIRS, row = first_row + warp / 2;
  int span_lo = keys, span_hi = 0, lo = 0, hi = 0;  // clamped to [0, keys)
  for (int r = 0; r < PREFILL_PAIRS && first_row + r < rows; ++r) {
    const int r_lo = max(__ldg(ks + first_row + r), 0), r_hi = min(__ldg(ke + first_row + r), keys);
    if (r == warp / 2) lo = r_lo, hi = r_hi;
    if (r_lo < r_hi) span_lo = min(span_lo, r_lo), span_hi = max(span_hi, r_hi);
  }
  const bool has_row = row < rows, has_keys = has_row && lo < hi;
  float* out = logits + static_cast<int64_t>(row) * logits_stride;
  // The row's 16-key tiles that meet [lo, hi) are computed below; the columns outside them are -inf.
  if (has_row && half == 0 && !accumulate) {
    const int tiles_lo = has_keys ? lo & ~(TILE_KEYS - 1) : keys;
    const int tiles_hi = has_keys ? min(keys, (hi + TILE_KEYS - 1) & ~(TILE_KEYS - 1)) : keys;
    for (int c = lane; c < tiles_lo; c += WARP) out[c] = NEG_INF;
    for (int c = tiles_hi + lane; c < keys; c += WARP) out[c] = NEG_INF;
  }
  if (span_lo >= span_hi) return;  // the same for the whole CTA

  const int half_heads = 8 * kHeadTiles;
  QueryRow<kHeadTiles> query;
  if (has_keys)
    load_query<kHeadTiles, kBlocks>(q + row * q_row_stride + half * half_heads * HEAD_DIM,
                                    weights + row * w_row_stride + half * half_heads, heads - half * half_heads,
                                    vector_q, query);
  const int base = span_lo & ~(TILE_KEYS - 1);
  const int num_stages = (span_hi - base + STAGE_KEYS - 1) / STAGE_KEYS;
  // The first half's warp adds both halves' sums of stage i and stores them.
  auto store_stage = [&](int i) {
    if (!has_keys || half != 0) return;
#pragma unroll
    for (int x = 0; x < STAGE_KEYS / WARP; ++x) {
      const int c = x * WARP + lane, key = base + i * STAGE_KEYS + c;
      if (!tile_meets(key & ~(TILE_KEYS - 1), lo, hi) || key >= keys) continue;
      store_logit(out + key, partial[i % 2][warp][c] + partial[i % 2][warp + 1][c], key >= lo && key < hi, accumulate);
    }
  };
  score_stages<false>(
      stages, partial, warp, query, num_stages,
      [&](KeyStage<kBlocks>& stage, int i) {
        stage_keys(stage, k, k_stride, k_scale, scale_stride, base + i * STAGE_KEYS, keys, vector_k);
      },
      [&](int i, int sub) { return has_keys && tile_meets(base + i * STAGE_KEYS + sub * TILE_KEYS, lo, hi); },
      store_stage);
}

// --- decode: indexer_paged_mqa_logits -------------------------------------------------------------------

// Cache geometry of the paged kernel (block_size a power of two takes shifts).
struct PagedCache {
  const uint8_t* __restrict__ data;
  int64_t block_stride;
  int block_size, block_shift;  // block_shift < 0: block_size is no power of two
  bool vector;                  // value rows 16-byte aligned (scales 4-byte), else byte loads
};

// Stages keys [first, first + STAGE_KEYS) of one request from the paged cache, zeros (and no block-table read)
// at or past `visible`.
template <int kBlocks>
__device__ __forceinline__ void stage_paged_keys(KeyStage<kBlocks>& stage, const PagedCache& cache,
                                                 const int32_t* __restrict__ table_row, int first, int visible) {
  auto block_of = [&](int key, int& offset) {
    int page;
    if (cache.block_shift >= 0) page = key >> cache.block_shift, offset = key & (cache.block_size - 1);
    else page = key / cache.block_size, offset = key - page * cache.block_size;
    return cache.data + static_cast<int64_t>(__ldg(table_row + page)) * cache.block_stride;
  };
  for (int c = threadIdx.x; c < STAGE_KEYS * HEAD_DIM / 16; c += blockDim.x) {
    const int r = c / (HEAD_DIM / 16), part = c % (HEAD_DIM / 16), key = first + r;
    const uint8_t* src = nullptr;
    if (key < visible) {
      int offset;
      const uint8_t* block = block_of(key, offset);
      src = block + offset * HEAD_DIM + part * 16;
    }
    stage_chunk(stage.values + r * KEY_PITCH + part * 16, src, cache.vector, cache.data);
  }
  for (int c = threadIdx.x; c < STAGE_KEYS * kBlocks; c += blockDim.x) {
    const int key = first + c / kBlocks;
    const uint8_t* src = nullptr;
    if (key < visible) {
      int offset;
      const uint8_t* block = block_of(key, offset);
      src = block + cache.block_size * HEAD_DIM + (offset * kBlocks + c % kBlocks) * 4;
    }
    stage_scale(stage.scales + c, src, cache.vector, cache.data);
  }
}

// A CTA owns one query row and a span of its columns: one warp pair computing every tile of each stage.
template <int kHeadTiles, int kBlocks>
__global__ void __launch_bounds__(DECODE_WARPS * WARP, 8) indexer_paged_mqa_logits_kernel(
    const uint8_t* __restrict__ q, int64_t q_row_stride, const float* __restrict__ weights, int64_t w_row_stride,
    int heads, bool vector_q, PagedCache cache, const int32_t* __restrict__ context_lens,
    const int32_t* __restrict__ block_table, int64_t table_stride, int next_n, float* __restrict__ logits,
    int64_t logits_stride, int columns, int span, bool accumulate) {
  __shared__ KeyStage<kBlocks> stages[STAGES];
  __shared__ float partial[2][2][STAGE_KEYS];  // [stage parity][warp][key]: each half's sums
  const int row = blockIdx.x, half = threadIdx.x / WARP, lane = threadIdx.x % WARP;
  const int begin = blockIdx.y * span, end = min(columns, begin + span);  // a request's next_n rows run side by side
  const int visible = min(max(__ldg(context_lens + row), 0), columns);
  const int computed_end = min(end, visible);
  const int num_tiles = computed_end > begin ? (computed_end - begin + TILE_KEYS - 1) / TILE_KEYS : 0;
  float* out = logits + static_cast<int64_t>(row) * logits_stride;
  if (!accumulate)
    for (int c = begin + num_tiles * TILE_KEYS + threadIdx.x; c < end; c += blockDim.x) out[c] = NEG_INF;
  if (num_tiles == 0) return;

  const int half_heads = 8 * kHeadTiles;
  QueryRow<kHeadTiles> query;
  load_query<kHeadTiles, kBlocks>(q + row * q_row_stride + half * half_heads * HEAD_DIM,
                                  weights + row * w_row_stride + half * half_heads, heads - half * half_heads,
                                  vector_q, query);
  const int32_t* table_row = block_table + static_cast<int64_t>(row / next_n) * table_stride;
  constexpr int kTilesPerStage = STAGE_KEYS / TILE_KEYS;
  const int num_stages = (num_tiles + kTilesPerStage - 1) / kTilesPerStage;
  auto store_stage = [&](int i) {  // the first half's warp adds both halves' sums of the stage's tiles
    if (half != 0) return;
#pragma unroll
    for (int x = 0; x < STAGE_KEYS / WARP; ++x) {
      const int c = x * WARP + lane, key = begin + i * STAGE_KEYS + c;
      if (key < begin + num_tiles * TILE_KEYS && key < end)
        store_logit(out + key, partial[i % 2][0][c] + partial[i % 2][1][c], key < visible, accumulate);
    }
  };
  score_stages<true>(
      stages, partial, half, query, num_stages,
      [&](KeyStage<kBlocks>& stage, int i) {
        stage_paged_keys(stage, cache, table_row, begin + i * STAGE_KEYS, visible);
      },
      [&](int i, int sub) { return i * kTilesPerStage + sub < num_tiles; }, store_stage);
}

// --- host -----------------------------------------------------------------------------------------------

// Head dim 128 (vLLM's index_head_dim) and quant blocks of 32, 64 or 128 (the pieces' layout), on SM80 or newer
// (fp16 MMA).
void check_cuda_support(const char* op, int64_t head_dim, int64_t quant_block_size, const Tensor& q) {
  NVFP4_CHECK(head_dim == HEAD_DIM, op, ": q: the CUDA kernel needs head_dim ", HEAD_DIM, ", got ", head_dim);
  NVFP4_CHECK(quant_block_size == 32 || quant_block_size == 64 || quant_block_size == 128, op,
              ": quant_block_size: the CUDA kernel needs 32, 64 or 128, got ", quant_block_size);
  int major = 0, minor = 0;
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, q.get_device_index());
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, q.get_device_index());
  NVFP4_CHECK(major >= 8, op, ": the CUDA kernel needs tensor-core MMA (SM80 or newer), device ",
              q.get_device_index(), " is SM", major, minor);
}

// Calls fn(Int<n8 head tiles a warp>, Int<quant blocks>) for a launch of `heads` heads (at most HEAD_GROUP,
// two warps a row).
template <typename Fn>
void dispatch_tiles(int heads, int64_t quant_block_size, Fn&& fn) {
  auto with_blocks = [&](auto tiles) {
    switch (HEAD_DIM / quant_block_size) {
      case 1: fn(tiles, Int<1>{}); break;
      case 2: fn(tiles, Int<2>{}); break;
      default: fn(tiles, Int<4>{}); break;
    }
  };
  if (heads <= 16) with_blocks(Int<1>{});
  else if (heads <= 32) with_blocks(Int<2>{});
  else with_blocks(Int<4>{});
}

void indexer_mqa_logits_cuda(const Tensor& q, const Tensor& k, const Tensor& k_scale, const Tensor& weights,
                             const Tensor& ks, const Tensor& ke, Tensor& logits) {
  const char* op = "indexer_mqa_logits";
  const MqaLogitsShape shape = check_indexer_mqa_logits(q, k, k_scale, weights, ks, ke, logits);
  check_cuda_support(op, shape.head_dim, shape.quant_block_size, q);
  if (shape.rows == 0 || shape.keys == 0) return;
  const torch::stable::accelerator::DeviceGuard guard(q.get_device_index());
  const cudaStream_t stream = current_stream(q);
  const auto* q_bytes = static_cast<const uint8_t*>(q.const_data_ptr());
  const auto* k_bytes = static_cast<const uint8_t*>(k.const_data_ptr());
  const bool vector_q = aligned(q_bytes, 16);
  const bool vector_k = aligned(k_bytes, 16) && k.stride(0) % 16 == 0;
  const int64_t scale_stride = k_scale.stride(0) * k_scale.element_size() / 4;  // in floats
  const dim3 grid(static_cast<unsigned>((shape.rows + PREFILL_PAIRS - 1) / PREFILL_PAIRS));
  for (int64_t h0 = 0; h0 < shape.heads; h0 += HEAD_GROUP) {
    const int heads = static_cast<int>(std::min<int64_t>(HEAD_GROUP, shape.heads - h0));
    dispatch_tiles(heads, shape.quant_block_size, [&](auto tiles, auto blocks) {
      indexer_mqa_logits_kernel<decltype(tiles)::value, decltype(blocks)::value><<<grid, 2 * PREFILL_PAIRS * WARP, 0, stream>>>(
          q_bytes + h0 * HEAD_DIM, shape.heads * HEAD_DIM, weights.const_data_ptr<float>() + h0, shape.heads, heads,
          vector_q, k_bytes, k.stride(0), vector_k, static_cast<const float*>(k_scale.const_data_ptr()), scale_stride,
          ks.const_data_ptr<int32_t>(), ke.const_data_ptr<int32_t>(), logits.mutable_data_ptr<float>(),
          logits.stride(0), static_cast<int>(shape.rows), static_cast<int>(shape.keys), h0 > 0);
    });
    check_launch(op);
  }
}

void indexer_paged_mqa_logits_cuda(const Tensor& q, const Tensor& kv_cache, const Tensor& weights,
                                   const Tensor& context_lens, const Tensor& block_table, int64_t quant_block_size,
                                   Tensor& logits) {
  const char* op = "indexer_paged_mqa_logits";
  const PagedMqaLogitsShape shape =
      check_indexer_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, quant_block_size, logits);
  check_cuda_support(op, shape.layout.head_dim, quant_block_size, q);
  const int64_t rows = shape.batch * shape.next_n;
  if (rows == 0 || shape.columns == 0) return;
  const torch::stable::accelerator::DeviceGuard guard(q.get_device_index());
  const cudaStream_t stream = current_stream(q);
  const auto* q_bytes = static_cast<const uint8_t*>(q.const_data_ptr());
  const int block_size = static_cast<int>(shape.layout.block_size);
  const auto* cache_bytes = static_cast<const uint8_t*>(kv_cache.const_data_ptr());
  const PagedCache cache{cache_bytes, kv_cache.stride(0), block_size,
                         (block_size & (block_size - 1)) == 0 ? __builtin_ctz(block_size) : -1,
                         aligned(cache_bytes, 16) && kv_cache.stride(0) % 16 == 0};
  // Columns split so that about 32 CTAs an SM cover the rows (4–5 waves of the 7 that fit; at least 256 columns).
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, q.get_device_index());
  const int64_t splits = std::max<int64_t>(1, (32 * static_cast<int64_t>(sms) + rows - 1) / rows);
  const int64_t quantum = STAGE_KEYS;
  const int64_t span = std::max<int64_t>(256, (shape.columns + splits - 1) / splits + quantum - 1) / quantum * quantum;
  const dim3 grid(static_cast<unsigned>(rows), static_cast<unsigned>((shape.columns + span - 1) / span));
  for (int64_t h0 = 0; h0 < shape.heads; h0 += HEAD_GROUP) {
    const int heads = static_cast<int>(std::min<int64_t>(HEAD_GROUP, shape.heads - h0));
    dispatch_tiles(heads, quant_block_size, [&](auto tiles, auto blocks) {
      indexer_paged_mqa_logits_kernel<decltype(tiles)::value, decltype(blocks)::value>
          <<<grid, DECODE_WARPS * WARP, 0, stream>>>(
              q_bytes + h0 * HEAD_DIM, shape.heads * HEAD_DIM, weights.const_data_ptr<float>() + h0, shape.heads,
              heads, aligned(q_bytes, 16), cache, context_lens.const_data_ptr<int32_t>(),
              block_table.const_data_ptr<int32_t>(), block_table.stride(0), static_cast<int>(shape.next_n),
              logits.mutable_data_ptr<float>(), logits.stride(0), static_cast<int>(shape.columns),
              static_cast<int>(span), h0 > 0);
    });
    check_launch(op);
  }
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(vllm_nvfp4, CUDA, m) {
  m.impl("indexer_mqa_logits", TORCH_BOX(&indexer_mqa_logits_cuda));
  m.impl("indexer_paged_mqa_logits", TORCH_BOX(&indexer_paged_mqa_logits_cuda));
}

}  // namespace vllm_nvfp4::cuda
