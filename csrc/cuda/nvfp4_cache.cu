// CUDA kernels of the NVFP4 KV-cache ops (FORMATS.md §1): the store (quantize into slots) and the
// gather (dequantize each sequence's cached tokens into contiguous rows).
//
// One thread owns one 16-element group of one (token, head) for both K and V: it moves 2 x 32 bytes of
// bf16 and 2 x 9 bytes of cache, so a warp reads or writes contiguous runs and every thread has two
// independent memory streams in flight. The block is (groups, heads, tokens).
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

// Block shape (groups, heads, tokens) for a layout: about THREADS threads, heads looped when there are more.
dim3 block_shape(const NVFP4PageLayout& layout) {
  const int groups = static_cast<int>(layout.scale_dim());
  const int heads = static_cast<int>(std::min<int64_t>(layout.num_heads, std::max(1, THREADS / groups)));
  return dim3(groups, heads, std::max(1, THREADS / (groups * heads)));
}

// The cache side's bytes of `block`, or null for a slot/block id outside the cache (skipped: checking it on
// the host would need a sync; the CPU op raises instead).
__device__ __forceinline__ uint8_t* block_bytes(uint8_t* base, int64_t block, int64_t num_blocks, int64_t stride) {
  return block >= 0 && block < num_blocks ? base + block * stride : nullptr;
}

// Quantizes one 16-element group into its 8 code bytes and 1 scale byte (FORMATS.md §1 steps 1-4).
template <bool kVector, typename T>
__device__ __forceinline__ void store_group(const T* x, float global, float inv_global, uint8_t* data,
                                            uint8_t* scale) {
  float v[GROUP];
  load_floats<GROUP, kVector>(x, v);
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < GROUP; ++i) amax = fmaxf(amax, fabsf(v[i]));
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
  const int64_t slot = slot_mapping[token];
  if (slot < 0) return;  // padding token
  const int64_t block = slot / layout.block_size, offset = slot % layout.block_size;
  uint8_t* k_side = block_bytes(key_cache, block, num_blocks, block_stride);
  uint8_t* v_side = block_bytes(value_cache, block, num_blocks, block_stride);
  if (k_side == nullptr) return;
  const float kg = __ldg(k_scale), vg = __ldg(v_scale);
  const float inv_kg = 1.0f / kg, inv_vg = 1.0f / vg;
  const int g = threadIdx.x;
  for (int64_t head = threadIdx.y; head < layout.num_heads; head += blockDim.y) {
    const int64_t data = layout.data_offset(offset, head) + g * (GROUP / 2);
    store_group<kVector>(key + token * key_token_stride + head * key_head_stride + g * GROUP, kg, inv_kg,
                         k_side + data, k_side + layout.scale_offset(offset, head, g, false));
    store_group<kVector>(value + token * value_token_stride + head * value_head_stride + g * GROUP, vg, inv_vg,
                         v_side + data, v_side + layout.scale_offset(offset, head, g, layout.swizzle_v_scales));
  }
}

// E2M1 value of each 4-bit code, signed. Each block copies it to shared memory, where a warp's 32 lookups
// hit distinct banks or broadcast (constant memory would serialize divergent indices).
__constant__ float E2M1_VALUES[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                      -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

// Dequantizes one group: (e2m1 · SF) · global in float32 (the first product is exact), then cast to T.
template <bool kVector, typename T>
__device__ __forceinline__ void load_group(const uint8_t* data, uint8_t scale, float global,
                                           const float* __restrict__ lut, T* out) {
  uint2 codes;
  if constexpr (kVector) {
    codes = *reinterpret_cast<const uint2*>(data);
  } else {
    codes = make_uint2(0, 0);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      codes.x |= static_cast<uint32_t>(data[i]) << (8 * i);
      codes.y |= static_cast<uint32_t>(data[4 + i]) << (8 * i);
    }
  }
  const float sf = e4m3_value(scale);
  float v[GROUP];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    v[i] = lut[(codes.x >> (4 * i)) & 0xF] * sf * global;
    v[8 + i] = lut[(codes.y >> (4 * i)) & 0xF] * sf * global;
  }
  store_floats<GROUP, kVector>(v, out);
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

  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.z + threadIdx.z;
  // Rows past cu_seq_lens[batch] stay untouched, and their (garbage) block-table entries unread.
  if (row >= num_rows || row >= __ldg(cu_seq_lens + batch)) return;
  const int b = sequence_of(cu_seq_lens, batch, row);
  const int64_t pos = row - __ldg(cu_seq_lens + b);
  const int64_t block = __ldg(block_table + b * table_stride + pos / layout.block_size);
  const int64_t offset = pos % layout.block_size;
  if (block < 0 || block >= num_blocks) return;  // not a block of the cache (the CPU op raises)
  const uint8_t* k_side = key_cache + block * block_stride;
  const uint8_t* v_side = value_cache + block * block_stride;
  const float kg = __ldg(k_scale), vg = __ldg(v_scale);
  const int g = threadIdx.x;
  for (int64_t head = threadIdx.y; head < layout.num_heads; head += blockDim.y) {
    const int64_t data = layout.data_offset(offset, head) + g * (GROUP / 2);
    load_group<kVector>(k_side + data, k_side[layout.scale_offset(offset, head, g, false)], kg, lut,
                        out_key + row * key_row_stride + head * key_head_stride + g * GROUP);
    load_group<kVector>(v_side + data, v_side[layout.scale_offset(offset, head, g, layout.swizzle_v_scales)], vg,
                        lut, out_value + row * value_row_stride + head * value_head_stride + g * GROUP);
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
  const dim3 block = block_shape(layout);
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
    if (activations_aligned<T>(key) && activations_aligned<T>(value) && cache_aligned(key_cache, value_cache))
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
  const dim3 block = block_shape(layout);
  const dim3 grid(static_cast<unsigned>((num_rows + block.z - 1) / block.z));
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
