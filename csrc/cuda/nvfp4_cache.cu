// CUDA kernels of the NVFP4 KV-cache ops (docs/FORMATS.md §1): the store (quantize into slots) and the
// gather (dequantize each sequence's cached tokens into contiguous rows).
//
// Store: one thread owns one 16-element group of one (token, head) for both K and V; its four 16-byte activation
// loads are in flight with the token's slot (its stores are predicated on the slot, not branched around: the
// compiler sinks loads below such a branch). Measured slower on an H200: four tokens a thread, software-pipelined
// (88 registers cut the occupancy); a lane pair a group, each lane loading half of K and of V so that every warp
// load is contiguous, then swapping halves by shuffles (the per-thread overhead doubles: 400 -> 516 us).
// Gather: one thread owns half a group (8 outputs, one 16-byte store, so a warp's stores are contiguous) of
// ROWS rows of one head, K and V; each row's source (sequence by a binary search over cu_seq_lens, then its
// block) is found once per CTA, by one thread, into shared memory; a thread loads all its rows' codes before
// decoding.
// Blocks are (groups, heads, tokens) for the store and (2 x groups, heads, row sets) for the gather.
// fp8_keys pages (kKeys Fp8): the same threads store and gather 16 (8) FP8 E4M3 key bytes where the NVFP4 path has a
// group's codes and scale; the V side is unchanged. K and V sides have their own block strides. INT8-key pages (Int8):
// the same threads store and gather 16 (8) int8 codes; each reads its (token, head)'s fp16 scale (the store finds it
// from the whole key row).
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>

#include <algorithm>
#include <type_traits>

#include "checks.h"
#include "common.cuh"
#include "layout.h"

namespace vllm_nvfp4::cuda {
namespace {

constexpr int GROUP = NVFP4_GROUP;
constexpr float ONE_SIXTH = 1.0f / 6.0f;  // float32, as the reference's f32(1) / f32(6)
constexpr int THREADS = 128;

// Blocks of about THREADS threads: (threads_per_group x groups, heads, rows), heads looped when there are more.
dim3 block_shape(const NVFP4PageLayout& layout, int threads_per_group) {
  const int x = static_cast<int>(layout.scale_dim()) * threads_per_group;
  const int heads = static_cast<int>(std::min<int64_t>(layout.num_heads, std::max(1, THREADS / x)));
  return dim3(x, heads, std::clamp(THREADS / (x * heads), 1, 64));  // blockDim.z is at most 64
}

void check_head_size(const char* op, const NVFP4PageLayout& layout) {
  NVFP4_CHECK(layout.scale_dim() * 2 <= THREADS, op, ": key_cache: head size ", layout.head_size,
                  " is above the CUDA kernels' ", THREADS * NVFP4_GROUP / 2);
}

// Byte offsets inside one block side of a head's entries and of one group's scales, as 32-bit affine functions
// of the token offset, set up once a thread so that the per-row work is a multiply-add. The formulas are
// layout.h's (entry_index, data_offset, scale_offset) regrouped: an entry is token * token_step + head *
// head_step; swizzled V scales move in steps of 4 tokens like the others and by 1 inside such a step.
struct EntryOffsets {
  int data, data_step, k_scale, scale_step, v_scale, v_scale_unit;

  __device__ EntryOffsets(const NVFP4PageLayout& layout, int head, int group) {
    const int block_size = static_cast<int>(layout.block_size), scale_dim = static_cast<int>(layout.scale_dim());
    const int data_dim = static_cast<int>(layout.data_dim()), region = static_cast<int>(layout.data_region_bytes());
    const int token_step = static_cast<int>(layout.token_step());
    const int head_entry = head * (layout.hnd ? block_size : 1);
    data = head_entry * data_dim + group * (GROUP / 2);
    data_step = token_step * data_dim;
    k_scale = region + head_entry * scale_dim + group;
    scale_step = token_step * scale_dim;
    if (layout.swizzle_v_scales) {  // group s of token t sits at token (t / 4) * 4 + s / quarter, scale (s % quarter) * 4 + t % 4
      const unsigned quarter = static_cast<unsigned>(scale_dim) / 4, s = static_cast<unsigned>(group);
      v_scale = region + (static_cast<int>(s / quarter) * token_step + head_entry) * scale_dim + static_cast<int>(s % quarter) * 4;
      v_scale_unit = 1;
    } else {
      v_scale = k_scale;
      v_scale_unit = scale_step;
    }
  }

  __device__ int data_at(int token) const { return data + token * data_step; }
  __device__ int k_scale_at(int token) const { return k_scale + token * scale_step; }
  __device__ int v_scale_at(int token) const { return v_scale + (token & ~3) * scale_step + (token & 3) * v_scale_unit; }
};

// The 16 key bytes of one group (byte i of word i / 4 is element i) at `dst` when `valid`.
template <bool kVector>
__device__ __forceinline__ void store_key_bytes(const uint32_t (&w)[4], bool valid, uint8_t* dst) {
  if constexpr (kVector) {
    // Predicated like store_group; two 8-byte stores (the caches are 8-byte aligned on this path).
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %0, 0;\n@p st.global.v2.u32 [%1], {%2, %3};\n"
        "@p st.global.v2.u32 [%1+8], {%4, %5};\n}"
        :
        : "r"(static_cast<int>(valid)), "l"(dst), "r"(w[0]), "r"(w[1]), "r"(w[2]), "r"(w[3])
        : "memory");
  } else {
    if (!valid) return;
#pragma unroll
    for (int i = 0; i < GROUP; ++i) dst[i] = static_cast<uint8_t>(w[i / 4] >> (8 * (i % 4)));
  }
}

// One 16-element group of an FP8 key: e4m3(x / global), byte i = element i (division, as the reference).
template <bool kVector, typename T>
__device__ __forceinline__ void store_fp8_key_group(const Elements<GROUP, T>& x, float global, bool valid,
                                                    uint8_t* dst) {
  uint32_t w[4];
#pragma unroll
  for (int j = 0; j < 4; ++j)
    w[j] = e4m3_pair(to_float(x.x[4 * j]) / global, to_float(x.x[4 * j + 1]) / global) |
           e4m3_pair(to_float(x.x[4 * j + 2]) / global, to_float(x.x[4 * j + 3]) / global) << 16;
  store_key_bytes<kVector>(w, valid, dst);
}

// One 16-element group `x` of the INT8 key `row` (the CPU op's store_int8_key): v = k / global, scale = fp16(min(max
// |v| / 127, 65504)) to nearest even, codes round-half-even(v / scale) clamped to ±127 (0 where the scale is 0); a NaN
// in the row stores the fp16 NaN 0x7E00 and zero codes. Every thread of the (token, head) reads the whole row for its
// max (in L1 after the first), so none waits on another; `scale_dst` (the first group's thread) gets the scale.
template <bool kVector, typename T>
__device__ __forceinline__ void store_int8_key_group(const Elements<GROUP, T>& x, const T* row, int head_size,
                                                     float global, bool valid, uint8_t* dst, uint8_t* scale_dst) {
  float amax = 0.0f;
  for (int j = 0; j < head_size; j += GROUP) {
    const auto y = load_elements<GROUP, kVector>(row + j);
#pragma unroll
    for (int i = 0; i < GROUP; ++i) {
      const float a = fabsf(to_float(y.x[i]) / global);  // per element, as the reference (k_scale 0 included)
      amax = a > amax || a != a ? a : amax;              // a NaN sticks, as torch's amax
    }
  }
  const bool nan = amax != amax;
  const __half scale = __float2half_rn(nan ? 0.0f : fminf(amax / 127.0f, 65504.0f));
  const float scale_value = __half2float(scale);
  uint32_t w[4] = {0, 0, 0, 0};
  if (scale_value != 0.0f) {
#pragma unroll
    for (int i = 0; i < GROUP; ++i) {
      const float q = fmaxf(fminf(rintf(to_float(x.x[i]) / global / scale_value), 127.0f), -127.0f);
      w[i / 4] |= static_cast<uint32_t>(static_cast<uint8_t>(static_cast<int8_t>(q))) << (8 * (i % 4));
    }
  }
  store_key_bytes<kVector>(w, valid, dst);
  if (scale_dst != nullptr && valid) {
    const uint16_t scale_bits = nan ? 0x7E00 : __half_as_ushort(scale);
    scale_dst[0] = static_cast<uint8_t>(scale_bits & 0xFF);
    scale_dst[1] = static_cast<uint8_t>(scale_bits >> 8);
  }
}

// Quantizes one 16-element group into its 8 code bytes and 1 scale byte (docs/FORMATS.md §1 steps 1-4).
template <bool kVector, typename T>
__device__ __forceinline__ void store_group(const Elements<GROUP, T>& x, float global, float inv_global, bool valid,
                                            uint8_t* data, uint8_t* scale) {
  float v[GROUP];
#pragma unroll
  for (int i = 0; i < GROUP; ++i) v[i] = to_float(x.x[i]);
  const uint8_t sf = e4m3_byte(max_abs(x) * ONE_SIXTH * inv_global);
  const float sf_value = e4m3_value(sf);
  const float out_scale = sf_value == 0.0f ? 0.0f : 1.0f / (sf_value * global);
  float lo[8], hi[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    lo[i] = v[i] * out_scale;
    hi[i] = v[8 + i] * out_scale;
  }
  const uint32_t codes_lo = e2m1_pack8(lo), codes_hi = e2m1_pack8(hi);
  if constexpr (kVector) {
    // Predicated stores, no branch (see the kernel): 8 code bytes, then the scale byte.
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %0, 0;\n@p st.global.v2.u32 [%1], {%2, %3};\n@p st.global.u8 [%4], %5;\n}"
        :
        : "r"(static_cast<int>(valid)), "l"(data), "r"(codes_lo), "r"(codes_hi), "l"(scale), "r"(static_cast<uint32_t>(sf))
        : "memory");
  } else {
    if (!valid) return;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      data[i] = static_cast<uint8_t>(codes_lo >> (8 * i));
      data[4 + i] = static_cast<uint8_t>(codes_hi >> (8 * i));
    }
    *scale = sf;
  }
}

// At least 10 CTAs an SM: 48 registers instead of 62, 62.5% occupancy instead of 50%. ptxas keeps the
// loop-invariant global scales and their reciprocals in local memory (stored once, reloaded once a head). On an
// H200 (docs/KERNELS.md): 400 -> 385 us for 262,144 tokens; capped at 40 registers it spills inside the loop: 497 us.
template <bool kVector, KeyFormat kKeys, typename T>
__global__ void __launch_bounds__(THREADS, 10) reshape_and_cache_nvfp4_kernel(
    const T* __restrict__ key, const T* __restrict__ value, int64_t key_token_stride, int64_t key_head_stride,
    int64_t value_token_stride, int64_t value_head_stride, uint8_t* __restrict__ key_cache,
    uint8_t* __restrict__ value_cache, int64_t key_block_stride, int64_t value_block_stride, int64_t num_blocks,
    const int64_t* __restrict__ slot_mapping, int64_t num_tokens, const float* __restrict__ k_scale,
    const float* __restrict__ v_scale, NVFP4PageLayout layout) {
  const int64_t token = static_cast<int64_t>(blockIdx.x) * blockDim.z + threadIdx.z;
  if (token >= num_tokens) return;
  const int64_t slot = __ldg(slot_mapping + token);
  const float kg = __ldg(k_scale), vg = __ldg(v_scale);
  const int g = threadIdx.x;
  for (int64_t head = threadIdx.y; head < layout.num_heads; head += blockDim.y) {
    const T* key_row = key + token * key_token_stride + head * key_head_stride;
    const auto k = load_elements<GROUP, kVector>(key_row + g * GROUP);
    const auto v =
        load_elements<GROUP, kVector>(value + token * value_token_stride + head * value_head_stride + g * GROUP);
    // A negative slot is a padding token; a slot past the cache is skipped too (checking it on the host
    // would need a sync; the CPU op raises). Not by a branch: the compiler would sink the loads above below
    // it, so they would wait for the slot instead of loading while it is in flight.
    const bool valid = slot >= 0 && slot < num_blocks * layout.block_size;
    const int64_t block = slot / layout.block_size;
    const int offset = static_cast<int>(slot - block * layout.block_size);
    uint8_t* k_side = key_cache + block * key_block_stride;
    uint8_t* v_side = value_cache + block * value_block_stride;
    const EntryOffsets at(layout, static_cast<int>(head), g);
    const int data = at.data_at(offset);
    if constexpr (kKeys == KeyFormat::Fp8)
      store_fp8_key_group<kVector>(k, kg, valid, k_side + layout.fp8_key_offset(offset, head) + g * GROUP);
    else if constexpr (kKeys == KeyFormat::Int8)
      store_int8_key_group<kVector>(k, key_row, static_cast<int>(layout.head_size), kg, valid,
                                    k_side + layout.int8_key_offset(offset, head) + g * GROUP,
                                    g == 0 ? k_side + layout.int8_key_scale_offset(offset, head) : nullptr);
    else
      store_group<kVector>(k, kg, 1.0f / kg, valid, k_side + data, k_side + at.k_scale_at(offset));
    store_group<kVector>(v, vg, 1.0f / vg, valid, v_side + data, v_side + at.v_scale_at(offset));
  }
}

// vLLM's "nvfp4_4over6" store: one thread a 16-element group of one (token, head), K then V, through quant.h's
// nvfp4_4over6_group (the CPU op's and the reference's arithmetic; -fmad=false keeps it unfused). Scalar loads and
// stores: each group is quantized twice, so the store is compute-bound rather than load-bound.
template <typename T>
__global__ void __launch_bounds__(THREADS) reshape_and_cache_nvfp4_4over6_kernel(
    const T* __restrict__ key, const T* __restrict__ value, int64_t key_token_stride, int64_t key_head_stride,
    int64_t value_token_stride, int64_t value_head_stride, uint8_t* __restrict__ key_cache,
    uint8_t* __restrict__ value_cache, int64_t key_block_stride, int64_t value_block_stride, int64_t num_blocks,
    const int64_t* __restrict__ slot_mapping, int64_t num_tokens, const float* __restrict__ k_scale,
    const float* __restrict__ v_scale, NVFP4PageLayout layout) {
  const int64_t token = static_cast<int64_t>(blockIdx.x) * blockDim.z + threadIdx.z;
  if (token >= num_tokens) return;
  const int64_t slot = slot_mapping[token];
  if (slot < 0 || slot >= num_blocks * layout.block_size) return;  // padding, or past the cache (see above)
  const float kg = k_scale[0], vg = v_scale[0];
  const int64_t block = slot / layout.block_size, offset = slot - block * layout.block_size;
  const int g = threadIdx.x;
  for (int64_t head = threadIdx.y; head < layout.num_heads; head += blockDim.y) {
    float x[GROUP];
    const T* key_row = key + token * key_token_stride + head * key_head_stride;
    const T* k = key_row + g * GROUP;
#pragma unroll
    for (int i = 0; i < GROUP; ++i) x[i] = to_float(k[i]);
    uint8_t* side = key_cache + block * key_block_stride;
    if (layout.fp8_keys()) {  // FP8 keys take no 4over6 choice: e4m3(k / k_scale)
      uint8_t* dst = side + layout.fp8_key_offset(offset, head) + g * GROUP;
#pragma unroll
      for (int i = 0; i < GROUP; ++i) dst[i] = e4m3_byte(x[i] / kg);
    } else if (layout.int8_keys()) {  // INT8 keys neither
      store_int8_key_group<false>(load_elements<GROUP, false>(k), key_row, static_cast<int>(layout.head_size), kg,
                                  true, side + layout.int8_key_offset(offset, head) + g * GROUP,
                                  g == 0 ? side + layout.int8_key_scale_offset(offset, head) : nullptr);
    } else {
      side[layout.scale_offset(offset, head, g, false)] =
          nvfp4_4over6_group(x, kg, 1.0f / kg, side + layout.data_offset(offset, head) + g * GROUP / 2);
    }
    const T* v = value + token * value_token_stride + head * value_head_stride + g * GROUP;
#pragma unroll
    for (int i = 0; i < GROUP; ++i) x[i] = to_float(v[i]);
    side = value_cache + block * value_block_stride;
    side[layout.scale_offset(offset, head, g, layout.swizzle_v_scales)] =
        nvfp4_4over6_group(x, vg, 1.0f / vg, side + layout.data_offset(offset, head) + g * GROUP / 2);
  }
}

// E2M1 value of each 4-bit code, signed. Each block copies it to shared memory, where a warp's 32 lookups
// hit distinct banks or broadcast (constant memory would serialize divergent indices).
__constant__ float E2M1_VALUES[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                      -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

constexpr int ROWS = 4;  // output rows per gather thread

// Codes of half a group: 4 bytes (8 E2M1 codes), at an 8-byte aligned group when kVector.
template <bool kVector>
__device__ __forceinline__ uint32_t load_codes(const uint8_t* data) {
  if constexpr (kVector) return __ldg(reinterpret_cast<const uint32_t*>(data));
  uint32_t codes = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) codes |= static_cast<uint32_t>(data[i]) << (8 * i);
  return codes;
}

// Dequantizes 8 codes: (e2m1 · SF) · global in float32 (the first product is exact), then casts to T.
template <bool kVector, typename T>
__device__ __forceinline__ void store_decoded(uint32_t codes, uint8_t scale, float global,
                                              const float* __restrict__ lut, T* out) {
  const float sf = e4m3_value(scale);
  float v[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) v[i] = lut[(codes >> (4 * i)) & 0xF] * sf * global;
  store_floats<8, kVector>(v, out);
}

// At least 8 CTAs an SM: 64 registers instead of 80, 50% occupancy instead of 37.5%, no spills.
// FP8 keys: the thread's 8 key bytes, e4m3 · k_scale, where the NVFP4 path has 8 codes; INT8 keys: its 8 codes and
// the entry's fp16 scale, code · scale · k_scale (left to right, as the reference).
template <bool kVector, KeyFormat kKeys, typename T>
__global__ void __launch_bounds__(THREADS, 8) gather_nvfp4_kv_cache_kernel(
    const uint8_t* __restrict__ key_cache, const uint8_t* __restrict__ value_cache, int64_t key_block_stride,
    int64_t value_block_stride, int64_t num_blocks, const int32_t* __restrict__ block_table, int64_t table_stride,
    const int32_t* __restrict__ cu_seq_lens, int batch, const float* __restrict__ k_scale,
    const float* __restrict__ v_scale, NVFP4PageLayout layout, T* __restrict__ out_key, int64_t key_row_stride,
    int64_t key_head_stride, T* __restrict__ out_value, int64_t value_row_stride, int64_t value_head_stride,
    int64_t num_rows) {
  __shared__ float lut[16];
  extern __shared__ RowSource rows[];  // this CTA's blockDim.z * ROWS rows
  const int tid = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  if (tid < 16) lut[tid] = E2M1_VALUES[tid];
  const int rows_here = blockDim.z * ROWS;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * rows_here;
  // block_byte is the block index here (a stride of 1): K and V sides have their own strides.
  find_row_sources(rows, rows_here, first, cu_seq_lens, batch, block_table, table_stride,
                   static_cast<int>(layout.block_size), num_blocks, 1, num_rows);
  // This thread's rows: threadIdx.z + u * blockDim.z of the CTA's.
  RowSource sources[ROWS];
#pragma unroll
  for (int u = 0; u < ROWS; ++u) sources[u] = rows[threadIdx.z + u * blockDim.z];
  const int g = threadIdx.x >> 1, half = threadIdx.x & 1;
  const float kg = __ldg(k_scale), vg = __ldg(v_scale);
  for (int64_t head = threadIdx.y; head < layout.num_heads; head += blockDim.y) {
    const EntryOffsets at(layout, static_cast<int>(head), g);
    constexpr bool kByteKeys = kKeys != KeyFormat::Nvfp4;
    uint32_t k_codes[ROWS][kByteKeys ? 2 : 1], v_codes[ROWS];
    uint8_t k_sf[ROWS], v_sf[ROWS];
    uint16_t k_int8_scale[ROWS];
#pragma unroll
    for (int u = 0; u < ROWS; ++u) {  // every load first, then the decodes
      if (sources[u].block_byte < 0) continue;
      const uint8_t* k_side = key_cache + sources[u].block_byte * key_block_stride;
      const uint8_t* v_side = value_cache + sources[u].block_byte * value_block_stride;
      const int data = at.data_at(sources[u].offset) + half * 4;
      if constexpr (kByteKeys) {  // fp8_key_offset == int8_key_offset
        const uint8_t* bytes = k_side + layout.fp8_key_offset(sources[u].offset, head) + g * GROUP + half * 8;
        k_codes[u][0] = load_codes<kVector>(bytes);
        k_codes[u][1] = load_codes<kVector>(bytes + 4);
        if constexpr (kKeys == KeyFormat::Int8) {
          const uint8_t* scale = k_side + layout.int8_key_scale_offset(sources[u].offset, head);
          k_int8_scale[u] = static_cast<uint16_t>(__ldg(scale) | __ldg(scale + 1) << 8);
        }
      } else {
        k_codes[u][0] = load_codes<kVector>(k_side + data);
        k_sf[u] = __ldg(k_side + at.k_scale_at(sources[u].offset));
      }
      v_codes[u] = load_codes<kVector>(v_side + data);
      v_sf[u] = __ldg(v_side + at.v_scale_at(sources[u].offset));
    }
#pragma unroll
    for (int u = 0; u < ROWS; ++u) {
      if (sources[u].block_byte < 0) continue;
      const int64_t row = first + threadIdx.z + u * blockDim.z, column = g * GROUP + half * 8;
      T* key_out = out_key + row * key_row_stride + head * key_head_stride + column;
      if constexpr (kKeys == KeyFormat::Fp8) {
        float k[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) k[i] = e4m3_value(static_cast<uint8_t>(k_codes[u][i / 4] >> (8 * (i % 4)))) * kg;
        store_floats<8, kVector>(k, key_out);
      } else if constexpr (kKeys == KeyFormat::Int8) {
        const float scale = __half2float(__ushort_as_half(k_int8_scale[u]));
        float k[8];
#pragma unroll
        for (int i = 0; i < 8; ++i)
          k[i] = static_cast<float>(static_cast<int8_t>(k_codes[u][i / 4] >> (8 * (i % 4)))) * scale * kg;
        store_floats<8, kVector>(k, key_out);
      } else {
        store_decoded<kVector>(k_codes[u][0], k_sf[u], kg, lut, key_out);
      }
      store_decoded<kVector>(v_codes[u], v_sf[u], vg, lut,
                             out_value + row * value_row_stride + head * value_head_stride + column);
    }
  }
}

// kVector kernels move activations in 16-byte and cache codes in 8-byte accesses: safe when the pointers
// and strides keep every group on such a boundary (vLLM's caches and activations do); else byte by byte.
template <typename T>
bool activations_aligned(const Tensor& t) {
  return aligned(t.const_data_ptr(), 16) && (t.stride(0) * sizeof(T)) % 16 == 0 && (t.stride(1) * sizeof(T)) % 16 == 0;
}

bool cache_aligned(const Tensor& key_cache, const Tensor& value_cache) {
  return aligned(key_cache.const_data_ptr(), 8) && aligned(value_cache.const_data_ptr(), 8) &&
         key_cache.stride(0) % 8 == 0 && value_cache.stride(0) % 8 == 0;
}

// Both stores share one launcher: the plain rule (a vector or a scalar kernel, NVFP4, FP8 or INT8 keys) or vLLM's
// 4over6 choice.
void store_cuda(const char* op, bool four_over_six, const Tensor& key, const Tensor& value, Tensor& key_cache,
                Tensor& value_cache, const Tensor& slot_mapping, const Tensor& k_scale, const Tensor& v_scale,
                bool swizzle_v_scales) {
  const NVFP4PageLayout layout = check_reshape_and_cache_nvfp4(key, value, key_cache, value_cache, slot_mapping,
                                                               k_scale, v_scale, swizzle_v_scales, op);
  const int64_t num_tokens = slot_mapping.size(0);
  if (num_tokens == 0) return;
  const torch::stable::accelerator::DeviceGuard guard(key_cache.get_device_index());
  check_head_size(op, layout);
  const dim3 block = block_shape(layout, 1);
  const dim3 grid(static_cast<unsigned>((num_tokens + block.z - 1) / block.z));
  const cudaStream_t stream = current_stream(key_cache);
  dispatch_float_types(op, key.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    auto launch = [&](auto kernel) {
      kernel<<<grid, block, 0, stream>>>(
          static_cast<const T*>(key.const_data_ptr()), static_cast<const T*>(value.const_data_ptr()), key.stride(0),
          key.stride(1), value.stride(0), value.stride(1), static_cast<uint8_t*>(key_cache.mutable_data_ptr()),
          static_cast<uint8_t*>(value_cache.mutable_data_ptr()), key_cache.stride(0), value_cache.stride(0),
          key_cache.size(0), slot_mapping.const_data_ptr<int64_t>(), num_tokens, k_scale.const_data_ptr<float>(),
          v_scale.const_data_ptr<float>(), layout);
    };
    const bool vector =
        activations_aligned<T>(key) && activations_aligned<T>(value) && cache_aligned(key_cache, value_cache);
    if (four_over_six)
      launch(reshape_and_cache_nvfp4_4over6_kernel<T>);
    else if (layout.fp8_keys())
      launch(vector ? reshape_and_cache_nvfp4_kernel<true, KeyFormat::Fp8, T>
                    : reshape_and_cache_nvfp4_kernel<false, KeyFormat::Fp8, T>);
    else if (layout.int8_keys())
      launch(vector ? reshape_and_cache_nvfp4_kernel<true, KeyFormat::Int8, T>
                    : reshape_and_cache_nvfp4_kernel<false, KeyFormat::Int8, T>);
    else
      launch(vector ? reshape_and_cache_nvfp4_kernel<true, KeyFormat::Nvfp4, T>
                    : reshape_and_cache_nvfp4_kernel<false, KeyFormat::Nvfp4, T>);
  });
  check_launch(op);
}

void reshape_and_cache_nvfp4_cuda(const Tensor& key, const Tensor& value, Tensor& key_cache, Tensor& value_cache,
                                  const Tensor& slot_mapping, const Tensor& k_scale, const Tensor& v_scale,
                                  bool swizzle_v_scales) {
  store_cuda("reshape_and_cache_nvfp4", false, key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale,
             swizzle_v_scales);
}

void reshape_and_cache_nvfp4_4over6_cuda(const Tensor& key, const Tensor& value, Tensor& key_cache,
                                         Tensor& value_cache, const Tensor& slot_mapping, const Tensor& k_scale,
                                         const Tensor& v_scale, bool swizzle_v_scales) {
  store_cuda("reshape_and_cache_nvfp4_4over6", true, key, value, key_cache, value_cache, slot_mapping, k_scale,
             v_scale, swizzle_v_scales);
}

void gather_nvfp4_kv_cache_cuda(const Tensor& key_cache, const Tensor& value_cache, const Tensor& block_table,
                                const Tensor& cu_seq_lens, const Tensor& k_scale, const Tensor& v_scale,
                                bool swizzle_v_scales, Tensor& out_key, Tensor& out_value) {
  const char* op = "gather_nvfp4_kv_cache";
  const NVFP4PageLayout layout = check_gather_nvfp4_kv_cache(key_cache, value_cache, block_table, cu_seq_lens,
                                                             k_scale, v_scale, swizzle_v_scales, out_key, out_value);
  NVFP4_CHECK(out_key.scalar_type() == out_value.scalar_type(), op, ": out_value: must have out_key's dtype ",
                  out_key.scalar_type(), ", got ", out_value.scalar_type());
  const int64_t num_rows = out_key.size(0), batch = block_table.size(0);
  if (num_rows == 0 || batch == 0) return;
  const torch::stable::accelerator::DeviceGuard guard(key_cache.get_device_index());
  check_head_size(op, layout);
  const dim3 block = block_shape(layout, 2);
  const int64_t rows_per_block = static_cast<int64_t>(block.z) * ROWS;
  const dim3 grid(static_cast<unsigned>((num_rows + rows_per_block - 1) / rows_per_block));
  const cudaStream_t stream = current_stream(key_cache);
  dispatch_float_types(op, out_key.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    auto launch = [&](auto kernel) {
      kernel<<<grid, block, rows_per_block * sizeof(RowSource), stream>>>(
          static_cast<const uint8_t*>(key_cache.const_data_ptr()),
          static_cast<const uint8_t*>(value_cache.const_data_ptr()), key_cache.stride(0), value_cache.stride(0),
          key_cache.size(0), block_table.const_data_ptr<int32_t>(), block_table.stride(0), cu_seq_lens.const_data_ptr<int32_t>(),
          static_cast<int>(batch), k_scale.const_data_ptr<float>(), v_scale.const_data_ptr<float>(), layout,
          static_cast<T*>(out_key.mutable_data_ptr()), out_key.stride(0), out_key.stride(1),
          static_cast<T*>(out_value.mutable_data_ptr()), out_value.stride(0), out_value.stride(1), num_rows);
    };
    const bool vector =
        activations_aligned<T>(out_key) && activations_aligned<T>(out_value) && cache_aligned(key_cache, value_cache);
    if (layout.fp8_keys())
      launch(vector ? gather_nvfp4_kv_cache_kernel<true, KeyFormat::Fp8, T>
                    : gather_nvfp4_kv_cache_kernel<false, KeyFormat::Fp8, T>);
    else if (layout.int8_keys())
      launch(vector ? gather_nvfp4_kv_cache_kernel<true, KeyFormat::Int8, T>
                    : gather_nvfp4_kv_cache_kernel<false, KeyFormat::Int8, T>);
    else
      launch(vector ? gather_nvfp4_kv_cache_kernel<true, KeyFormat::Nvfp4, T>
                    : gather_nvfp4_kv_cache_kernel<false, KeyFormat::Nvfp4, T>);
  });
  check_launch(op);
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(vllm_nvfp4, CUDA, m) {
  m.impl("reshape_and_cache_nvfp4", TORCH_BOX(&reshape_and_cache_nvfp4_cuda));
  m.impl("reshape_and_cache_nvfp4_4over6", TORCH_BOX(&reshape_and_cache_nvfp4_4over6_cuda));
  m.impl("gather_nvfp4_kv_cache", TORCH_BOX(&gather_nvfp4_kv_cache_cuda));
}

}  // namespace vllm_nvfp4::cuda
