// CPU kernels of the four ops: OpenMP over tokens, software E2M1/E4M3 (quant.h), offsets from layout.h.
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Exception.h>
#include <torch/headeronly/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "checks.h"
#include "layout.h"
#include "quant.h"

namespace vllm_nvfp4 {
namespace {

using torch::headeronly::ScalarType;

constexpr float ONE_SIXTH = 1.0f / 6.0f;  // float32, as the reference's f32(1) / f32(6)

template <typename Fn>
void dispatch_float_types(ScalarType type, Fn&& fn) {
  switch (type) {
    case ScalarType::BFloat16: fn(c10::BFloat16{}); break;
    case ScalarType::Half: fn(c10::Half{}); break;
    case ScalarType::Float: fn(float{}); break;
    default: STD_TORCH_CHECK(false, "unsupported dtype ", type);  // the argument checks rule this out
  }
}

uint8_t* bytes_of(const Tensor& t) { return static_cast<uint8_t*>(t.mutable_data_ptr()); }

float global_scale(const Tensor& scale) { return *scale.const_data_ptr<float>(); }

// Quantizes one (token, head) of head_size elements into `side`, one side of one block (FORMATS.md §1).
template <typename T>
void store_entry(const T* x, float global, float inv_global, const NVFP4PageLayout& layout, int64_t token,
                 int64_t head, bool swizzled, uint8_t* side) {
  uint8_t* data = side + layout.data_offset(token, head);
  for (int64_t s = 0; s < layout.scale_dim(); ++s) {
    float v[NVFP4_GROUP];
    float amax = 0.0f;
    for (int i = 0; i < NVFP4_GROUP; ++i) {
      v[i] = static_cast<float>(x[s * NVFP4_GROUP + i]);
      amax = std::max(amax, std::fabs(v[i]));
    }
    const uint8_t sf = e4m3_encode(amax * ONE_SIXTH * inv_global);
    const float sf_value = e4m3_decode(sf);
    const float out_scale = sf_value == 0.0f ? 0.0f : 1.0f / (sf_value * global);
    for (int j = 0; j < NVFP4_GROUP / 2; ++j)  // low nibble = even element
      data[s * NVFP4_GROUP / 2 + j] = e2m1_encode(v[2 * j] * out_scale) | (e2m1_encode(v[2 * j + 1] * out_scale) << 4);
    side[layout.scale_offset(token, head, s, swizzled)] = sf;
  }
}

// Dequantizes one (token, head) of `side` into head_size elements: (e2m1 · SF) · global, then cast.
template <typename T>
void load_entry(const uint8_t* side, const NVFP4PageLayout& layout, int64_t token, int64_t head, bool swizzled,
                float global, T* out) {
  const uint8_t* data = side + layout.data_offset(token, head);
  for (int64_t s = 0; s < layout.scale_dim(); ++s) {
    const float sf = e4m3_decode(side[layout.scale_offset(token, head, s, swizzled)]);
    for (int j = 0; j < NVFP4_GROUP / 2; ++j) {
      const uint8_t byte = data[s * NVFP4_GROUP / 2 + j];
      out[s * NVFP4_GROUP + 2 * j] = static_cast<T>(e2m1_decode(byte & 0xF) * sf * global);
      out[s * NVFP4_GROUP + 2 * j + 1] = static_cast<T>(e2m1_decode(byte >> 4) * sf * global);
    }
  }
}

// Sequence of output row `row`: the b with cu_seq_lens[b] <= row < cu_seq_lens[b + 1].
int64_t sequence_of(const int32_t* cu_seq_lens, int64_t batch, int64_t row) {
  return std::upper_bound(cu_seq_lens + 1, cu_seq_lens + batch + 1, row) - (cu_seq_lens + 1);
}

void reshape_and_cache_nvfp4_cpu(const Tensor& key, const Tensor& value, Tensor& key_cache, Tensor& value_cache,
                                 const Tensor& slot_mapping, const Tensor& k_scale, const Tensor& v_scale,
                                 bool swizzle_v_scales) {
  const NVFP4PageLayout layout = check_reshape_and_cache_nvfp4(key, value, key_cache, value_cache, slot_mapping,
                                                               k_scale, v_scale, swizzle_v_scales);
  const int64_t num_tokens = slot_mapping.size(0);
  const int64_t* slots = slot_mapping.const_data_ptr<int64_t>();
  check_slot_range("reshape_and_cache_nvfp4", slots, num_tokens, key_cache.size(0) * layout.block_size);
  const float kg = global_scale(k_scale), vg = global_scale(v_scale);
  const float inv_kg = 1.0f / kg, inv_vg = 1.0f / vg;
  uint8_t* k_base = bytes_of(key_cache);
  uint8_t* v_base = bytes_of(value_cache);
  const int64_t block_stride = key_cache.stride(0);
  dispatch_float_types(key.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* k = static_cast<const T*>(key.const_data_ptr());
    const T* v = static_cast<const T*>(value.const_data_ptr());
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < num_tokens; ++i) {
      const int64_t slot = slots[i];
      if (slot < 0) continue;  // padding token
      const int64_t block = slot / layout.block_size, offset = slot % layout.block_size;
      for (int64_t h = 0; h < layout.num_heads; ++h) {
        store_entry(k + i * key.stride(0) + h * key.stride(1), kg, inv_kg, layout, offset, h, false,
                    k_base + block * block_stride);
        store_entry(v + i * value.stride(0) + h * value.stride(1), vg, inv_vg, layout, offset, h, swizzle_v_scales,
                    v_base + block * block_stride);
      }
    }
  });
}

void gather_nvfp4_kv_cache_cpu(const Tensor& key_cache, const Tensor& value_cache, const Tensor& block_table,
                               const Tensor& cu_seq_lens, const Tensor& k_scale, const Tensor& v_scale,
                               bool swizzle_v_scales, Tensor& out_key, Tensor& out_value) {
  const NVFP4PageLayout layout = check_gather_nvfp4_kv_cache(key_cache, value_cache, block_table, cu_seq_lens, k_scale,
                                                             v_scale, swizzle_v_scales, out_key, out_value);
  const int64_t batch = block_table.size(0), table_stride = block_table.stride(0);
  const int32_t* table = block_table.const_data_ptr<int32_t>();
  const int32_t* cu = cu_seq_lens.const_data_ptr<int32_t>();
  check_gather_ranges("gather_nvfp4_kv_cache", table, table_stride, block_table.size(1), cu, batch,
                      layout.block_size, key_cache.size(0), out_key.size(0));
  const float kg = global_scale(k_scale), vg = global_scale(v_scale);
  const uint8_t* k_base = bytes_of(key_cache);
  const uint8_t* v_base = bytes_of(value_cache);
  const int64_t block_stride = key_cache.stride(0), num_rows = cu[batch];
  auto gather_side = [&](const uint8_t* base, float global, bool swizzled, Tensor& out) {
    dispatch_float_types(out.scalar_type(), [&](auto tag) {
      using T = decltype(tag);
      T* o = static_cast<T*>(out.mutable_data_ptr());
#pragma omp parallel for schedule(static)
      for (int64_t row = 0; row < num_rows; ++row) {
        const int64_t b = sequence_of(cu, batch, row), p = row - cu[b];
        const uint8_t* side = base + table[b * table_stride + p / layout.block_size] * block_stride;
        for (int64_t h = 0; h < layout.num_heads; ++h)
          load_entry(side, layout, p % layout.block_size, h, swizzled, global, o + row * out.stride(0) + h * out.stride(1));
      }
    });
  };
  gather_side(k_base, kg, false, out_key);
  gather_side(v_base, vg, swizzle_v_scales, out_value);
}

void indexer_k_quant_and_cache_cpu(const Tensor& k, Tensor& kv_cache, const Tensor& slot_mapping,
                                   int64_t quant_block_size, std::string scale_fmt) {
  const ScaleFormat fmt = parse_scale_fmt(scale_fmt);
  const IndexerCacheLayout layout = check_indexer_k_quant_and_cache(k, kv_cache, slot_mapping, quant_block_size);
  const int64_t num_tokens = slot_mapping.size(0);
  const int64_t* slots = slot_mapping.const_data_ptr<int64_t>();
  check_slot_range("indexer_k_quant_and_cache", slots, num_tokens, kv_cache.size(0) * layout.block_size);
  uint8_t* cache = bytes_of(kv_cache);
  const int64_t block_stride = kv_cache.stride(0);
  dispatch_float_types(k.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* x_base = static_cast<const T*>(k.const_data_ptr());
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < num_tokens; ++i) {
      const int64_t slot = slots[i];
      if (slot < 0) continue;
      const int64_t offset = slot % layout.block_size;
      uint8_t* block = cache + slot / layout.block_size * block_stride;
      const T* x = x_base + i * k.stride(0);
      for (int64_t j = 0; j < layout.num_scales(); ++j) {
        const T* xj = x + j * quant_block_size;
        float amax = 0.0f;
        for (int64_t e = 0; e < quant_block_size; ++e) amax = std::max(amax, std::fabs(static_cast<float>(xj[e])));
        float scale = std::max(amax, 1e-4f) / E4M3_MAX;
        int exponent = 0;
        if (fmt != ScaleFormat::Float32) {  // round up to a power of two: 2^ceil(log2 scale)
          const float mantissa = std::frexp(scale, &exponent);  // scale = mantissa · 2^exponent, mantissa in [0.5, 1)
          if (mantissa == 0.5f) exponent -= 1;
          scale = std::ldexp(1.0f, exponent);
        }
        uint8_t* values = block + layout.value_offset(offset) + j * quant_block_size;
        for (int64_t e = 0; e < quant_block_size; ++e) values[e] = e4m3_encode(static_cast<float>(xj[e]) / scale);
        uint8_t* scale_out = block + layout.scale_offset(offset, j);
        if (fmt == ScaleFormat::MXFP8)
          std::memset(scale_out, exponent + 127, 4);  // the UE8M0 exponent byte, four times
        else
          std::memcpy(scale_out, &scale, 4);
      }
    }
  });
}

void cp_gather_indexer_k_quant_cache_cpu(const Tensor& kv_cache, Tensor& dst_k, Tensor& dst_scale,
                                         const Tensor& block_table, const Tensor& cu_seq_lens) {
  const IndexerCacheLayout layout =
      check_cp_gather_indexer_k_quant_cache(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens);
  const int64_t batch = block_table.size(0), table_stride = block_table.stride(0);
  const int32_t* table = block_table.const_data_ptr<int32_t>();
  const int32_t* cu = cu_seq_lens.const_data_ptr<int32_t>();
  check_gather_ranges("cp_gather_indexer_k_quant_cache", table, table_stride, block_table.size(1), cu, batch,
                      layout.block_size, kv_cache.size(0), dst_k.size(0));
  const uint8_t* cache = bytes_of(kv_cache);
  uint8_t* k_out = bytes_of(dst_k);
  uint8_t* scale_out = bytes_of(dst_scale);
  const int64_t block_stride = kv_cache.stride(0), k_row_stride = dst_k.stride(0);
  const int64_t scale_row_stride = dst_scale.stride(0) * dst_scale.element_size(), num_rows = cu[batch];
#pragma omp parallel for schedule(static)
  for (int64_t row = 0; row < num_rows; ++row) {
    const int64_t b = sequence_of(cu, batch, row), p = row - cu[b];
    const uint8_t* block = cache + table[b * table_stride + p / layout.block_size] * block_stride;
    const int64_t offset = p % layout.block_size;
    std::memcpy(k_out + row * k_row_stride, block + layout.value_offset(offset), layout.head_dim);
    std::memcpy(scale_out + row * scale_row_stride, block + layout.scale_offset(offset), layout.scale_bytes());
  }
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(vllm_nvfp4, CPU, m) {
  m.impl("reshape_and_cache_nvfp4", TORCH_BOX(&reshape_and_cache_nvfp4_cpu));
  m.impl("gather_nvfp4_kv_cache", TORCH_BOX(&gather_nvfp4_kv_cache_cpu));
  m.impl("indexer_k_quant_and_cache", TORCH_BOX(&indexer_k_quant_and_cache_cpu));
  m.impl("cp_gather_indexer_k_quant_cache", TORCH_BOX(&cp_gather_indexer_k_quant_cache_cpu));
}

}  // namespace vllm_nvfp4
