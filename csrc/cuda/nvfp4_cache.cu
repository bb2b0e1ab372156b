// CUDA kernels of the NVFP4 KV-cache ops (FORMATS.md §1): the store (quantize into slots) and the
// gather (dequantize each sequence's cached tokens into contiguous rows).
//
// Store: one thread owns one 16-element group of one (token, head) for both K and V; it issues its four
// 16-byte activation loads before it waits for the token's slot, so the two latencies overlap. (Four
// tokens a thread, software-pipelined, measured slower on the H200: 88 registers cut the occupancy.)
// Gather: one thread owns half a group (8 outputs, one 16-byte store, so a warp's stores are contiguous)
// of ROWS rows of one head, K and V; it finds the rows' sequences once, then loads all their codes before
// decoding.
// Blocks are (groups, heads, tokens) for the store and (2 x groups, heads, row sets) for the gather.
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>

#include <algorithm>

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
  STD_TORCH_CHECK(layout.scale_dim() * 2 <= THREADS, op, ": key_cache: head size ", layout.head_size,
                  " is above the CUDA kernels' ", THREADS * NVFP4_GROUP / 2);
}

// Quantizes one 16-element group into its 8 code bytes and 1 scale byte (FORMATS.md §1 steps 1-4).
template <bool kVector, typename T>
__device__ __forceinline__ void store_group(const Elements<GROUP, T>& x, float global, float inv_global,
                                            uint8_t* data, uint8_t* scale) {
  float v[GROUP];
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < GROUP; ++i) {
    v[i] = to_float(x.x[i]);
    amax = fmaxf(amax, fabsf(v[i]));
  }
  const uint8_t sf = e4m3_byte(amax * ONE_SIXTH * inv_global);
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
    *reinterpret_cast<uint2*>(data) = make_uint2(codes_lo, codes_hi);
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      data[i] = static_cast<uint8_t>(codes_lo >> (8 * i));
      data[4 + i] = static_cast<uint8_t>(codes_hi >> (8 * i));
    }
  }
  *scale = sf;
}

template <bool kVector, typename T>
__global__ void __launch_bounds__(THREADS) reshape_and_cache_nvfp4_kernel(
    const T* __restrict__ key, const T* __restrict__ value, int64_t key_token_stride, int64_t key_head_stride,
    int64_t value_token_stride, int64_t value_head_stride, uint8_t* __restrict__ key_cache,
    uint8_t* __restrict__ value_cache, int64_t block_stride, int64_t num_blocks,
    const int64_t* __restrict__ slot_mapping, int64_t num_tokens, const float* __restrict__ k_scale,
    const float* __restrict__ v_scale, NVFP4PageLayout layout) {
  const int64_t token = static_cast<int64_t>(blockIdx.x) * blockDim.z + threadIdx.z;
  if (token >= num_tokens) return;
  const int64_t slot = __ldg(slot_mapping + token);
  const float kg = __ldg(k_scale), vg = __ldg(v_scale);
  const int g = threadIdx.x;
  for (int64_t head = threadIdx.y; head < layout.num_heads; head += blockDim.y) {
    // Loaded while the slot is still in flight.
    const auto k = load_elements<GROUP, kVector>(key + token * key_token_stride + head * key_head_stride + g * GROUP);
    const auto v =
        load_elements<GROUP, kVector>(value + token * value_token_stride + head * value_head_stride + g * GROUP);
    // A negative slot is a padding token; a slot past the cache is skipped too (checking it on the host
    // would need a sync; the CPU op raises).
    if (slot < 0 || slot >= num_blocks * layout.block_size) return;
    const int64_t block = slot / layout.block_size, offset = slot - block * layout.block_size;
    uint8_t* k_side = key_cache + block * block_stride;
    uint8_t* v_side = value_cache + block * block_stride;
    const int64_t data = layout.data_offset(offset, head) + g * (GROUP / 2);
    store_group<kVector>(k, kg, 1.0f / kg, k_side + data, k_side + layout.scale_offset(offset, head, g, false));
    store_group<kVector>(v, vg, 1.0f / vg, v_side + data,
                         v_side + layout.scale_offset(offset, head, g, layout.swizzle_v_scales));
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

template <bool kVector, typename T>
__global__ void __launch_bounds__(THREADS) gather_nvfp4_kv_cache_kernel(
    const uint8_t* __restrict__ key_cache, const uint8_t* __restrict__ value_cache, int64_t block_stride,
    int64_t num_blocks, const int32_t* __restrict__ block_table, int64_t table_stride,
    const int32_t* __restrict__ cu_seq_lens, int batch, const float* __restrict__ k_scale,
    const float* __restrict__ v_scale, NVFP4PageLayout layout, T* __restrict__ out_key, int64_t key_row_stride,
    int64_t key_head_stride, T* __restrict__ out_value, int64_t value_row_stride, int64_t value_head_stride,
    int64_t num_rows) {
  __shared__ float lut[16];
  const int tid = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  if (tid < 16) lut[tid] = E2M1_VALUES[tid];
  __syncthreads();

  // Rows past cu_seq_lens[batch] stay untouched, and their (garbage) block-table entries unread.
  const int64_t rows_end = min(num_rows, static_cast<int64_t>(__ldg(cu_seq_lens + batch)));
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.z * ROWS + threadIdx.z;
  if (first >= rows_end) return;
  // This thread's rows: first + u * blockDim.z. They only grow, so one binary search finds the first
  // row's sequence and the others step forward from it.
  int64_t sides[ROWS];  // byte offset of the row's block side in the caches, or -1: nothing to gather
  int offsets[ROWS];    // the row's token offset inside its block
  int b = sequence_of(cu_seq_lens, batch, first);
#pragma unroll
  for (int u = 0; u < ROWS; ++u) {
    const int64_t row = first + u * blockDim.z;
    sides[u] = -1;
    if (row >= rows_end) continue;
    while (__ldg(cu_seq_lens + b + 1) <= row) ++b;
    const int pos = static_cast<int>(row - __ldg(cu_seq_lens + b));
    const int64_t block = __ldg(block_table + b * table_stride + pos / layout.block_size);
    offsets[u] = pos % static_cast<int>(layout.block_size);
    if (block >= 0 && block < num_blocks) sides[u] = block * block_stride;  // else: the CPU op raises
  }
  const int g = threadIdx.x >> 1, half = threadIdx.x & 1;
  const float kg = __ldg(k_scale), vg = __ldg(v_scale);
  for (int64_t head = threadIdx.y; head < layout.num_heads; head += blockDim.y) {
    uint32_t k_codes[ROWS], v_codes[ROWS];
    uint8_t k_sf[ROWS], v_sf[ROWS];
#pragma unroll
    for (int u = 0; u < ROWS; ++u) {  // every load first, then the decodes
      if (sides[u] < 0) continue;
      const uint8_t* k_side = key_cache + sides[u];
      const uint8_t* v_side = value_cache + sides[u];
      const int64_t data = layout.data_offset(offsets[u], head) + g * (GROUP / 2) + half * 4;
      k_codes[u] = load_codes<kVector>(k_side + data);
      v_codes[u] = load_codes<kVector>(v_side + data);
      k_sf[u] = __ldg(k_side + layout.scale_offset(offsets[u], head, g, false));
      v_sf[u] = __ldg(v_side + layout.scale_offset(offsets[u], head, g, layout.swizzle_v_scales));
    }
#pragma unroll
    for (int u = 0; u < ROWS; ++u) {
      if (sides[u] < 0) continue;
      const int64_t row = first + u * blockDim.z, column = g * GROUP + half * 8;
      store_decoded<kVector>(k_codes[u], k_sf[u], kg, lut, out_key + row * key_row_stride + head * key_head_stride + column);
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
         key_cache.stride(0) % 8 == 0;
}

void reshape_and_cache_nvfp4_cuda(const Tensor& key, const Tensor& value, Tensor& key_cache, Tensor& value_cache,
                                  const Tensor& slot_mapping, const Tensor& k_scale, const Tensor& v_scale,
                                  bool swizzle_v_scales) {
  const char* op = "reshape_and_cache_nvfp4";
  const NVFP4PageLayout layout = check_reshape_and_cache_nvfp4(key, value, key_cache, value_cache, slot_mapping,
                                                               k_scale, v_scale, swizzle_v_scales);
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
          static_cast<uint8_t*>(value_cache.mutable_data_ptr()), key_cache.stride(0), key_cache.size(0),
          slot_mapping.const_data_ptr<int64_t>(), num_tokens, k_scale.const_data_ptr<float>(),
          v_scale.const_data_ptr<float>(), layout);
    };
    const bool vector =
        activations_aligned<T>(key) && activations_aligned<T>(value) && cache_aligned(key_cache, value_cache);
    if (vector)
      launch(reshape_and_cache_nvfp4_kernel<true, T>);
    else
      launch(reshape_and_cache_nvfp4_kernel<false, T>);
  });
  check_launch(op);
}

void gather_nvfp4_kv_cache_cuda(const Tensor& key_cache, const Tensor& value_cache, const Tensor& block_table,
                                const Tensor& cu_seq_lens, const Tensor& k_scale, const Tensor& v_scale,
                                bool swizzle_v_scales, Tensor& out_key, Tensor& out_value) {
  const char* op = "gather_nvfp4_kv_cache";
  const NVFP4PageLayout layout = check_gather_nvfp4_kv_cache(key_cache, value_cache, block_table, cu_seq_lens,
                                                             k_scale, v_scale, swizzle_v_scales, out_key, out_value);
  STD_TORCH_CHECK(out_key.scalar_type() == out_value.scalar_type(), op, ": out_value: must have out_key's dtype ",
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
      kernel<<<grid, block, 0, stream>>>(
          static_cast<const uint8_t*>(key_cache.const_data_ptr()),
          static_cast<const uint8_t*>(value_cache.const_data_ptr()), key_cache.stride(0), key_cache.size(0),
          block_table.const_data_ptr<int32_t>(), block_table.stride(0), cu_seq_lens.const_data_ptr<int32_t>(),
          static_cast<int>(batch), k_scale.const_data_ptr<float>(), v_scale.const_data_ptr<float>(), layout,
          static_cast<T*>(out_key.mutable_data_ptr()), out_key.stride(0), out_key.stride(1),
          static_cast<T*>(out_value.mutable_data_ptr()), out_value.stride(0), out_value.stride(1), num_rows);
    };
    if (activations_aligned<T>(out_key) && activations_aligned<T>(out_value) && cache_aligned(key_cache, value_cache))
      launch(gather_nvfp4_kv_cache_kernel<true, T>);
    else
      launch(gather_nvfp4_kv_cache_kernel<false, T>);
  });
  check_launch(op);
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(vllm_nvfp4, CUDA, m) {
  m.impl("reshape_and_cache_nvfp4", TORCH_BOX(&reshape_and_cache_nvfp4_cuda));
  m.impl("gather_nvfp4_kv_cache", TORCH_BOX(&gather_nvfp4_kv_cache_cuda));
}

}  // namespace vllm_nvfp4::cuda
