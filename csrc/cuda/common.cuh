// Device helpers shared by the CUDA kernels: the current stream, element loads/stores, the FP8/FP4
// conversions and the row -> sequence lookup of the gathers.
//
// Rounding must match vllm_nvfp4_plugin/reference.py bit for bit: setup.py builds with -fmad=false and
// without fast math, so every float32 multiply and divide here rounds once, as in the reference.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>
#include "../error.h"

#include <cstdint>
#include <type_traits>

#include "e2m1.h"

namespace vllm_nvfp4::cuda {

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

constexpr int WARP = 32;

// PyTorch's current stream on the tensor's device: the ops never synchronize and are graph-capturable.
inline cudaStream_t current_stream(const Tensor& t) {
  void* stream = nullptr;
  NVFP4_CHECK(aoti_torch_get_current_cuda_stream(t.get_device_index(), &stream) == AOTI_TORCH_SUCCESS,
                  "could not get the current CUDA stream of device ", t.get_device_index());
  return static_cast<cudaStream_t>(stream);
}

inline void check_launch(const char* op) {
  const cudaError_t err = cudaGetLastError();
  NVFP4_CHECK(err == cudaSuccess, op, ": CUDA kernel launch failed: ", cudaGetErrorString(err));
}

inline bool aligned(const void* p, int64_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// Calls fn(T{}) with T the CUDA type of a bf16/fp16/fp32 tensor dtype (the argument checks allow no other).
template <typename Fn>
void dispatch_float_types(const char* op, ScalarType type, Fn&& fn) {
  switch (type) {
    case ScalarType::BFloat16: fn(__nv_bfloat16{}); break;
    case ScalarType::Half: fn(__half{}); break;
    case ScalarType::Float: fn(float{}); break;
    default: NVFP4_CHECK(false, op, ": unsupported dtype ", type);
  }
}

// --- element loads and stores -------------------------------------------------------------------------

__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(float x) { return x; }

__device__ __forceinline__ uint32_t sign_bit(__nv_bfloat16 x) { return __bfloat16_as_ushort(x) >> 15; }
__device__ __forceinline__ uint32_t sign_bit(__half x) { return __half_as_ushort(x) >> 15; }
__device__ __forceinline__ uint32_t sign_bit(float x) { return __float_as_uint(x) >> 31; }

__device__ __forceinline__ void from_float(float x, __nv_bfloat16* out) { *out = __float2bfloat16_rn(x); }
__device__ __forceinline__ void from_float(float x, __half* out) { *out = __float2half_rn(x); }
__device__ __forceinline__ void from_float(float x, float* out) { *out = x; }

// N elements of T as loaded, 16-byte aligned so vector loads can fill them; converted where they are used.
template <int N, typename T>
struct alignas(16) Elements {
  T x[N];
};

// N consecutive elements, in 16-byte loads when kVector (`src` 16-byte aligned, N * sizeof(T) a multiple of 16).
template <int N, bool kVector, typename T>
__device__ __forceinline__ Elements<N, T> load_elements(const T* src) {
  Elements<N, T> e;
  if constexpr (kVector) {
    static_assert((N * sizeof(T)) % 16 == 0, "a vector load covers 16 bytes");
#pragma unroll
    for (int v = 0; v < static_cast<int>(N * sizeof(T) / 16); ++v)
      reinterpret_cast<uint4*>(e.x)[v] = __ldg(reinterpret_cast<const uint4*>(src) + v);
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) e.x[i] = src[i];
  }
  return e;
}

// The larger of two non-negative floats, a positive NaN above all: their bits order them as integers.
__device__ __forceinline__ float max_magnitude(float a, float b) {
  return __uint_as_float(max(__float_as_uint(a), __float_as_uint(b)));
}

// max |x| over N elements: NaNs skipped as fmaxf skips them, or, with kKeepNaN, propagated (NaN above inf, as
// torch's amax). bf16 and fp16 go by pairs: the packed max instructions (three-way on SM90) take half the issue
// slots of one float max per element.
template <int N, typename T, bool kKeepNaN = false>
__device__ __forceinline__ float max_abs(const Elements<N, T>& x) {
  if constexpr (std::is_same_v<T, float>) {
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < N; ++i) amax = kKeepNaN ? max_magnitude(amax, fabsf(x.x[i])) : fmaxf(amax, fabsf(x.x[i]));
    return amax;
  } else {
    using Pair = std::conditional_t<std::is_same_v<T, __half>, __half2, __nv_bfloat162>;
    const Pair* pairs = reinterpret_cast<const Pair*>(x.x);
    Pair amax;  // starts at 0 like the float form: __hmax2 returns the non-NaN operand, so a group of NaNs gives 0
    if constexpr (std::is_same_v<T, __half>) amax = __float2half2_rn(0.0f);
    else amax = __float2bfloat162_rn(0.0f);
#pragma unroll
    for (int i = 0; i < N / 2; ++i)
      amax = kKeepNaN ? __hmax2_nan(amax, __habs2(pairs[i])) : __hmax2(amax, __habs2(pairs[i]));
    const float lo = to_float(amax.x), hi = to_float(amax.y);
    return kKeepNaN ? max_magnitude(lo, hi) : fmaxf(lo, hi);
  }
}

// Stores N float32 values converted to T (round to nearest even), in 16-byte stores when kVector.
template <int N, bool kVector, typename T>
__device__ __forceinline__ void store_floats(const float (&in)[N], T* dst) {
  if constexpr (kVector) {
    constexpr int PER_VEC = 16 / sizeof(T);
    static_assert(N % PER_VEC == 0, "a vector store covers 16 bytes");
#pragma unroll
    for (int v = 0; v < N / PER_VEC; ++v) {
      uint4 raw;
      T* elems = reinterpret_cast<T*>(&raw);
#pragma unroll
      for (int i = 0; i < PER_VEC; ++i) from_float(in[v * PER_VEC + i], elems + i);
      reinterpret_cast<uint4*>(dst)[v] = raw;
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) from_float(in[i], dst + i);
  }
}

// --- FP8 E4M3 -----------------------------------------------------------------------------------------

// Round to nearest even, saturating at ±448: the reference's clamp-then-cast (hardware on SM89+).
__device__ __forceinline__ uint8_t e4m3_byte(float x) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3));
}

// Two values at once, `lo` in the low byte.
__device__ __forceinline__ uint32_t e4m3_pair(float lo, float hi) {
  return static_cast<uint32_t>(__nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, __NV_E4M3));
}

__device__ __forceinline__ float e4m3_value(uint8_t byte) {
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(byte, __NV_E4M3)));
}

// --- FP4 E2M1 -----------------------------------------------------------------------------------------

// `magnitudes` (eight E2M1 magnitude codes, sign bits clear, element 2j in the low nibble of byte j) with the
// signs of x added: byte j of `odd`/`even` is the top byte of x[2j+1]/x[2j], whose bit 7 is the sign; they land on
// bits 8j+7 and 8j+3, the sign bits of nibbles 2j+1 and 2j.
__device__ __forceinline__ uint32_t e2m1_with_signs(uint32_t magnitudes, const float (&x)[8]) {
  uint32_t bits[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) bits[i] = __float_as_uint(x[i]);
  const uint32_t odd = __byte_perm(__byte_perm(bits[1], bits[3], 0x0073), __byte_perm(bits[5], bits[7], 0x7300), 0x7610);
  const uint32_t even = __byte_perm(__byte_perm(bits[0], bits[2], 0x0073), __byte_perm(bits[4], bits[6], 0x7300), 0x7610);
  return magnitudes | (odd & 0x80808080u) | ((even >> 4) & 0x08080808u);
}

// Eight E2M1 codes packed into 32 bits, element 2j in the low nibble of byte j (docs/FORMATS.md §1).
__device__ __forceinline__ uint32_t e2m1_pack8(const float (&x)[8]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1000 && \
    (defined(__CUDA_ARCH_SPECIFIC__) || defined(__CUDA_ARCH_FAMILY_SPECIFIC__))
  // Blackwell converts the magnitudes in hardware (cvt puts its first operand in the high nibble). It is given
  // min(|x|, 6), never a NaN or a -0, whose codes the PTX ISA leaves open: a NaN then gets code 7 and -0 code 8
  // with the signs added, as on the other GPUs; the rest is round to nearest even, as there.
  float m[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) m[i] = fminf(fabsf(x[i]), 6.0f);
  uint32_t packed;
  asm("{\n"
      ".reg .b8 b0, b1, b2, b3;\n"
      "cvt.rn.satfinite.e2m1x2.f32 b0, %2, %1;\n"
      "cvt.rn.satfinite.e2m1x2.f32 b1, %4, %3;\n"
      "cvt.rn.satfinite.e2m1x2.f32 b2, %6, %5;\n"
      "cvt.rn.satfinite.e2m1x2.f32 b3, %8, %7;\n"
      "mov.b32 %0, {b0, b1, b2, b3};\n"
      "}"
      : "=r"(packed)
      : "f"(m[0]), "f"(m[1]), "f"(m[2]), "f"(m[3]), "f"(m[4]), "f"(m[5]), "f"(m[6]), "f"(m[7]));
#else
  // Each funnel shift moves one magnitude code (low nibble, bit 3 clear) in at the top: after eight, x[i]'s is
  // nibble i.
  uint32_t packed = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) packed = __funnelshift_r(packed, e2m1_magnitude_bits(x[i]), 4);
#endif
  return e2m1_with_signs(packed, x);
}

// --- gathers ------------------------------------------------------------------------------------------

// The sequence b holding output row `row`: the last b < batch with cu_seq_lens[b] <= row (empty sequences
// before it are skipped). A binary search: log2(batch) cached loads, not a scan over the batch.
__device__ __forceinline__ int sequence_of(const int32_t* __restrict__ cu_seq_lens, int batch, int64_t row) {
  int lo = 0, hi = batch - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (__ldg(cu_seq_lens + mid) <= row) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// Where a gathered row comes from: its cache block's byte offset (-1: nothing to gather) and its token offset
// inside the block.
struct RowSource {
  int64_t block_byte;
  int offset;
};

// Fills rows[r] for the CTA's `count` output rows from `first`, one row a thread, then syncs the CTA: every
// thread that copies a row reads it here instead of searching cu_seq_lens and the block table itself.
// Rows past cu_seq_lens[batch] stay untouched, and their (garbage) block-table entries unread; a block outside
// the cache is skipped too (the CPU op raises).
__device__ __forceinline__ void find_row_sources(RowSource* rows, int count, int64_t first,
                                                 const int32_t* __restrict__ cu_seq_lens, int batch,
                                                 const int32_t* __restrict__ block_table, int64_t table_stride,
                                                 int block_size, int64_t num_blocks, int64_t block_stride,
                                                 int64_t num_rows) {
  const int tid = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  const int threads = blockDim.x * blockDim.y * blockDim.z;
  const int64_t rows_end = min(num_rows, static_cast<int64_t>(__ldg(cu_seq_lens + batch)));
  for (int r = tid; r < count; r += threads) {
    const int64_t row = first + r;
    RowSource source{-1, 0};
    if (row < rows_end) {
      const int b = sequence_of(cu_seq_lens, batch, row);
      const int pos = static_cast<int>(row - __ldg(cu_seq_lens + b));
      const int64_t block = __ldg(block_table + b * table_stride + pos / block_size);
      source.offset = pos % block_size;
      if (block >= 0 && block < num_blocks) source.block_byte = block * block_stride;
    }
    rows[r] = source;
  }
  __syncthreads();
}

}  // namespace vllm_nvfp4::cuda
