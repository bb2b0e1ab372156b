// CUDA kernels of the DeepSeek-V3.2 indexer K-cache ops (docs/FORMATS.md §2): the FP8 store and the gather of
// each sequence's cached keys into contiguous rows.
//
// Store: one thread owns 16 elements (8 when the quant block is 8): two 16-byte bf16 loads, one 16-byte FP8
// store; the quant block's threads are adjacent lanes of one warp and reduce its amax with shuffles. The scale
// format is a template parameter, so ue8m0 and mxfp8 compile without the float32 format's divisions. (Measured
// on an H200: 8 elements a thread of two tokens, so that every warp access is contiguous, doubles the per-token
// work a thread does and ran 50% slower; 32 elements a thread ran no faster, at 62.5% occupancy.)
// Gather: one thread copies one 16-byte chunk of the values of ROWS rows (the first chunk's thread also their
// scales), so a warp moves whole rows with all its loads in flight at once; each row's source (sequence by a
// binary search over cu_seq_lens, then its block) is found once per CTA, by one thread, into shared memory.
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>

#include <string>
#include <type_traits>

#include "checks.h"
#include "common.cuh"
#include "layout.h"

namespace vllm_nvfp4::cuda {
namespace {

constexpr int THREADS = 256;
constexpr int MIN_ELEMS = 8;  // elements of k per store thread; 16 when the quant block is 16 or more
constexpr int CHUNK = 16;  // value bytes per gather thread
constexpr float E4M3_MAX = 448.0f;

// scale = max(amax, 1e-4) / 448, for ue8m0/mxfp8 rounded up to a power of two; returns its 4 cache bytes.
// A block holding inf or NaN gets the power-of-two scale 1, as in the reference (frexp's exponent 0 for them).
template <ScaleFormat kFmt>
__device__ __forceinline__ float quant_scale(float amax, uint32_t* scale_word) {
  float scale = max_magnitude(amax, 1e-4f) / E4M3_MAX;  // NaN kept, as torch.maximum keeps it
  if constexpr (kFmt == ScaleFormat::Float32) {
    *scale_word = __float_as_uint(scale);
    return scale;
  }
  uint32_t bits = __float_as_uint(scale);  // a positive normal float, inf or NaN
  if (bits >= 0x7F800000u) bits = 0x3F800000u;
  else if (bits & 0x7FFFFFu) bits = (bits & 0x7F800000u) + 0x800000u;  // 2^ceil(log2 scale)
  *scale_word = kFmt == ScaleFormat::MXFP8 ? (bits >> 23) * 0x01010101u : bits;  // UE8M0 byte, four times
  return __uint_as_float(bits);
}

// Quantizes one thread's kElems elements of one token and stores them, with the quant block's scale (from the
// lane whose elements start the block). Every lane calls it: the amax reduction shuffles across the block.
template <int kElems, bool kVector, ScaleFormat kFmt, typename T>
__device__ __forceinline__ void store_token(const Elements<kElems, T>& x, int64_t slot, bool active, int chunk,
                                            unsigned warp_lanes, uint8_t* __restrict__ kv_cache, int64_t block_stride,
                                            IndexerCacheLayout layout) {
  float amax = max_abs<kElems, T, true>(x);
  const int quant_block = static_cast<int>(layout.quant_block_size);
  for (int mask = quant_block / kElems / 2; mask > 0; mask /= 2)  // the block's lanes: a power of two <= 32
    amax = max_magnitude(amax, __shfl_xor_sync(warp_lanes, amax, mask));
  if (!active) return;

  uint32_t scale_word;
  const float scale = quant_scale<kFmt>(amax, &scale_word);
  // A power-of-two scale divides exactly as a multiply by its inverse 2^-e, made from 2^e's bits: exact for
  // e <= 126 (scale <= max float / 448 < 2^120); +inf gives 0, as 1/inf does. The float32 format divides.
  float inv_scale = 0.0f;
  if constexpr (kFmt != ScaleFormat::Float32) {
    const uint32_t bits = __float_as_uint(scale);
    inv_scale = bits < 0x7F000000u ? __uint_as_float(0x7F000000u - bits) : 0.0f;
  }
  uint32_t words[kElems / 4];  // FP8 bytes, element 4w + i in byte i of words[w]
#pragma unroll
  for (int w = 0; w < kElems / 4; ++w) {
    float q[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float v = to_float(x.x[4 * w + i]);
      q[i] = kFmt == ScaleFormat::Float32 ? v / scale : v * inv_scale;
    }
    words[w] = e4m3_pair(q[0], q[1]) | (e4m3_pair(q[2], q[3]) << 16);
  }
  if (__float_as_uint(amax) > 0x7F800000u) {  // a NaN in the block: the hardware's NaN code is 0x7F, the
#pragma unroll                                 // reference's keeps the input's sign (the input's own bits:
    for (int i = 0; i < kElems; ++i)           // converting a float16 NaN to float may drop it)
      if (isnan(to_float(x.x[i]))) words[i / 4] |= sign_bit(x.x[i]) << (8 * (i % 4) + 7);
  }
  // 32-bit: a cache on one GPU has fewer than 2^32 slots (each takes at least 8 bytes).
  const uint32_t slot32 = static_cast<uint32_t>(slot), block_size = static_cast<uint32_t>(layout.block_size);
  const uint32_t block = slot32 / block_size, offset = slot32 - block * block_size;
  uint8_t* base = kv_cache + block * block_stride;
  const int first_element = chunk * kElems;
  uint8_t* values = base + layout.value_offset(offset) + first_element;
  // The quant block is a power of two: the scale's place by shifts (layout.scale_offset divides in 64 bits).
  const int shift = __ffs(quant_block) - 1;
  const int64_t num_scales = layout.head_dim >> shift;
  uint8_t* scale_out =
      (first_element & (quant_block - 1)) == 0
          ? base + layout.block_size * layout.head_dim + (offset * num_scales + (first_element >> shift)) * 4
          : nullptr;
  if constexpr (kVector) {  // one kElems-byte store
    if constexpr (kElems == 16) *reinterpret_cast<uint4*>(values) = make_uint4(words[0], words[1], words[2], words[3]);
    else *reinterpret_cast<uint2*>(values) = make_uint2(words[0], words[1]);
    if (scale_out) *reinterpret_cast<uint32_t*>(scale_out) = scale_word;
  } else {
    for (int i = 0; i < kElems; ++i) values[i] = static_cast<uint8_t>(words[i / 4] >> (8 * (i % 4)));
    if (scale_out)
      for (int i = 0; i < 4; ++i) scale_out[i] = static_cast<uint8_t>(scale_word >> (8 * i));
  }
}

template <int kElems, bool kVector, ScaleFormat kFmt, typename T>
__global__ void __launch_bounds__(THREADS) indexer_k_quant_and_cache_kernel(
    const T* __restrict__ k, int64_t k_row_stride, uint8_t* __restrict__ kv_cache, int64_t block_stride,
    int64_t num_blocks, const int64_t* __restrict__ slot_mapping, int64_t num_tokens, IndexerCacheLayout layout) {
  const int64_t token = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  const int chunk = threadIdx.x;  // elements [chunk * kElems, chunk * kElems + kElems) of the token
  // The block (chunks x rows threads) may end in a partial warp: shuffle among the lanes that exist. A quant
  // block's lanes are adjacent and never straddle warps. No lane returns early: all join the shuffles.
  const int tid = threadIdx.y * blockDim.x + threadIdx.x, warp_start = tid & ~(WARP - 1);
  const int lanes_here = min(WARP, static_cast<int>(blockDim.x * blockDim.y) - warp_start);
  const unsigned warp_lanes = lanes_here == WARP ? 0xFFFFFFFFu : (1u << lanes_here) - 1;
  Elements<kElems, T> x = {};
  int64_t slot = -1;
  if (token < num_tokens) {  // the activations load while the slot is still in flight
    slot = __ldg(slot_mapping + token);
    x = load_elements<kElems, kVector>(k + token * k_row_stride + chunk * kElems);
  }
  const bool active = slot >= 0 && slot < num_blocks * layout.block_size;
  store_token<kElems, kVector, kFmt>(x, slot, active, chunk, warp_lanes, kv_cache, block_stride, layout);
}

constexpr int ROWS = 8;  // rows per gather thread

// Copies `n` bytes (a multiple of 16 when kVector, with both pointers 16-byte aligned) by this thread's part:
// 16-byte chunks, or single bytes, strided by the row's `threads`.
template <bool kVector>
__device__ __forceinline__ void copy_part(const uint8_t* src, uint8_t* dst, int64_t n, int lane, int threads) {
  if constexpr (kVector) {
    for (int64_t c = lane * CHUNK; c < n; c += threads * CHUNK)
      *reinterpret_cast<uint4*>(dst + c) = __ldg(reinterpret_cast<const uint4*>(src + c));
  } else {
    for (int64_t c = lane; c < n; c += threads) dst[c] = src[c];
  }
}

template <bool kVector>
__global__ void __launch_bounds__(THREADS) cp_gather_indexer_k_quant_cache_kernel(
    const uint8_t* __restrict__ kv_cache, int64_t block_stride, int64_t num_blocks, uint8_t* __restrict__ dst_k,
    int64_t k_row_stride, uint8_t* __restrict__ dst_scale, int64_t scale_row_stride,
    const int32_t* __restrict__ block_table, int64_t table_stride, const int32_t* __restrict__ cu_seq_lens,
    int batch, IndexerCacheLayout layout, int64_t num_rows) {
  extern __shared__ RowSource rows[];  // this CTA's blockDim.y * ROWS rows
  const int rows_here = blockDim.y * ROWS;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * rows_here;
  find_row_sources(rows, rows_here, first, cu_seq_lens, batch, block_table, table_stride,
                   static_cast<int>(layout.block_size), num_blocks, block_stride, num_rows);
  // This thread's rows: threadIdx.y + u * blockDim.y of the CTA's (a warp's lanes cover consecutive rows).
  RowSource sources[ROWS];
#pragma unroll
  for (int u = 0; u < ROWS; ++u) sources[u] = rows[threadIdx.y + u * blockDim.y];
  if constexpr (kVector) {
    if (layout.head_dim == blockDim.x * CHUNK && layout.scale_bytes() == 4) {
      // vLLM's 128 values + one float32 scale: every 16-byte load of the rows issued before any store.
      uint4 chunk[ROWS];
      uint32_t scale[ROWS];
#pragma unroll
      for (int u = 0; u < ROWS; ++u) {
        if (sources[u].block_byte < 0) continue;
        const uint8_t* base = kv_cache + sources[u].block_byte;
        chunk[u] = __ldg(reinterpret_cast<const uint4*>(base + layout.value_offset(sources[u].offset)) + threadIdx.x);
        if (threadIdx.x == 0)
          scale[u] = __ldg(reinterpret_cast<const uint32_t*>(base + layout.scale_offset(sources[u].offset)));
      }
#pragma unroll
      for (int u = 0; u < ROWS; ++u) {
        if (sources[u].block_byte < 0) continue;
        const int64_t row = first + threadIdx.y + u * blockDim.y;
        reinterpret_cast<uint4*>(dst_k + row * k_row_stride)[threadIdx.x] = chunk[u];
        if (threadIdx.x == 0) *reinterpret_cast<uint32_t*>(dst_scale + row * scale_row_stride) = scale[u];
      }
      return;
    }
  }
#pragma unroll
  for (int u = 0; u < ROWS; ++u) {
    if (sources[u].block_byte < 0) continue;
    const int64_t row = first + threadIdx.y + u * blockDim.y;
    const uint8_t* base = kv_cache + sources[u].block_byte;
    copy_part<kVector>(base + layout.value_offset(sources[u].offset), dst_k + row * k_row_stride, layout.head_dim,
                       threadIdx.x, blockDim.x);
    copy_part<false>(base + layout.scale_offset(sources[u].offset), dst_scale + row * scale_row_stride,
                     layout.scale_bytes(), threadIdx.x, blockDim.x);
  }
}

void indexer_k_quant_and_cache_cuda(const Tensor& k, Tensor& kv_cache, const Tensor& slot_mapping,
                                    int64_t quant_block_size, std::string scale_fmt) {
  const char* op = "indexer_k_quant_and_cache";
  const ScaleFormat fmt = parse_scale_fmt(scale_fmt);
  const IndexerCacheLayout layout = check_indexer_k_quant_and_cache(k, kv_cache, slot_mapping, quant_block_size);
  NVFP4_CHECK(quant_block_size >= MIN_ELEMS && quant_block_size <= WARP * MIN_ELEMS &&
                      (quant_block_size & (quant_block_size - 1)) == 0,
                  op, ": quant_block_size: the CUDA kernel needs a power of two from 8 to 256, got ",
                  quant_block_size);
  const int64_t num_tokens = slot_mapping.size(0);
  if (num_tokens == 0) return;
  const torch::stable::accelerator::DeviceGuard guard(kv_cache.get_device_index());
  // 16 elements a thread halve the per-thread work per byte (slot, address, scale, shuffles); a quant block of
  // 8 (head_dim is a multiple of it) keeps 8.
  const int elems = quant_block_size >= 16 ? 16 : MIN_ELEMS;
  const int chunks = static_cast<int>(layout.head_dim / elems);
  NVFP4_CHECK(chunks <= THREADS, op, ": k: head_dim ", layout.head_dim, " is above the CUDA kernel's ",
                  THREADS * elems);
  const dim3 block(chunks, THREADS / chunks);
  const dim3 grid(static_cast<unsigned>((num_tokens + block.y - 1) / block.y));
  const cudaStream_t stream = current_stream(kv_cache);
  // The vector kernels store each thread's `elems` FP8 bytes at once: the cache must keep them so aligned.
  const bool cache_aligned = aligned(kv_cache.const_data_ptr(), elems) && kv_cache.stride(0) % elems == 0;
  dispatch_float_types(op, k.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const bool vector = cache_aligned && aligned(k.const_data_ptr(), 16) && (k.stride(0) * sizeof(T)) % 16 == 0;
    auto launch = [&](auto elems_tag, auto format_tag) {
      constexpr int kElems = decltype(elems_tag)::value;
      constexpr ScaleFormat kFmt = decltype(format_tag)::value;
      auto kernel = vector ? indexer_k_quant_and_cache_kernel<kElems, true, kFmt, T>
                           : indexer_k_quant_and_cache_kernel<kElems, false, kFmt, T>;
      kernel<<<grid, block, 0, stream>>>(static_cast<const T*>(k.const_data_ptr()), k.stride(0),
                                         static_cast<uint8_t*>(kv_cache.mutable_data_ptr()), kv_cache.stride(0),
                                         kv_cache.size(0), slot_mapping.const_data_ptr<int64_t>(), num_tokens, layout);
    };
    auto launch_format = [&](auto elems_tag) {
      using Fmt = ScaleFormat;
      switch (fmt) {
        case Fmt::Float32: launch(elems_tag, std::integral_constant<Fmt, Fmt::Float32>{}); break;
        case Fmt::UE8M0: launch(elems_tag, std::integral_constant<Fmt, Fmt::UE8M0>{}); break;
        case Fmt::MXFP8: launch(elems_tag, std::integral_constant<Fmt, Fmt::MXFP8>{}); break;
      }
    };
    if (elems == 16)
      launch_format(std::integral_constant<int, 16>{});
    else
      launch_format(std::integral_constant<int, MIN_ELEMS>{});
  });
  check_launch(op);
}

void cp_gather_indexer_k_quant_cache_cuda(const Tensor& kv_cache, Tensor& dst_k, Tensor& dst_scale,
                                          const Tensor& block_table, const Tensor& cu_seq_lens) {
  const char* op = "cp_gather_indexer_k_quant_cache";
  const IndexerCacheLayout layout =
      check_cp_gather_indexer_k_quant_cache(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens);
  const int64_t num_rows = dst_k.size(0), batch = block_table.size(0);
  if (num_rows == 0 || batch == 0) return;
  const torch::stable::accelerator::DeviceGuard guard(kv_cache.get_device_index());
  const int64_t k_row_stride = dst_k.stride(0) * dst_k.element_size();
  const int64_t scale_row_stride = dst_scale.stride(0) * dst_scale.element_size();
  // 16-byte value chunks and 4-byte scales: aligned for vLLM's blocks of 64 x 132 bytes; a padded block
  // stride or an odd row stride takes the byte path.
  const bool vector = layout.head_dim % CHUNK == 0 && aligned(kv_cache.const_data_ptr(), 16) &&
                      kv_cache.stride(0) % 16 == 0 && aligned(dst_k.const_data_ptr(), 16) &&
                      k_row_stride % 16 == 0 && aligned(dst_scale.const_data_ptr(), 4) && scale_row_stride % 4 == 0;
  const int chunks = static_cast<int>(std::min<int64_t>(WARP, (layout.head_dim + CHUNK - 1) / CHUNK));
  const dim3 block(chunks, THREADS / chunks);
  const int64_t rows_per_block = static_cast<int64_t>(block.y) * ROWS;
  const dim3 grid(static_cast<unsigned>((num_rows + rows_per_block - 1) / rows_per_block));
  const cudaStream_t stream = current_stream(kv_cache);
  auto launch = [&](auto kernel) {
    kernel<<<grid, block, rows_per_block * sizeof(RowSource), stream>>>(
        static_cast<const uint8_t*>(kv_cache.const_data_ptr()), kv_cache.stride(0), kv_cache.size(0),
        static_cast<uint8_t*>(dst_k.mutable_data_ptr()), k_row_stride,
        static_cast<uint8_t*>(dst_scale.mutable_data_ptr()), scale_row_stride, block_table.const_data_ptr<int32_t>(),
        block_table.stride(0), cu_seq_lens.const_data_ptr<int32_t>(), static_cast<int>(batch), layout, num_rows);
  };
  if (vector)
    launch(cp_gather_indexer_k_quant_cache_kernel<true>);
  else
    launch(cp_gather_indexer_k_quant_cache_kernel<false>);
  check_launch(op);
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(vllm_nvfp4, CUDA, m) {
  m.impl("indexer_k_quant_and_cache", TORCH_BOX(&indexer_k_quant_and_cache_cuda));
  m.impl("cp_gather_indexer_k_quant_cache", TORCH_BOX(&cp_gather_indexer_k_quant_cache_cuda));
}

}  // namespace vllm_nvfp4::cuda
