// Byte offsets of the two caches, mirroring vllm_nvfp4_plugin/layout.py (docs/FORMATS.md §1 and §2).
//
// layout.py is the source of truth: these structs carry the same names and the same formulas, so the
// CPU and CUDA kernels share one offset computation. The bit-exact tests of the ops against
// reference.py (which uses layout.py) over NHD, HND, linear and swizzled V scales prove they agree.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define NVFP4_HD __host__ __device__
#else
#define NVFP4_HD
#endif

namespace vllm_nvfp4 {

constexpr int64_t NVFP4_GROUP = 16;  // head-dim elements that share one FP8 block scale
constexpr int64_t INT8_KEY_SCALE_BYTES = 2;  // one little-endian IEEE fp16 scale per (token, head) of an int8-key page

// How the K side stores a (token, head) key (layout.py's key_format "nvfp4", "fp8", "int8").
enum class KeyFormat : int8_t { Nvfp4, Fp8, Int8 };

// One side (K or V) of one block of the NVFP4 KV cache is [DATA | SCALES]; (token, head) entries sit in
// NHD (token-major) or HND (head-major) order inside each region. With FP8 keys the K side holds FP8 E4M3 keys,
// head_size bytes per entry in the same order, and no block scales; with INT8 keys it is [DATA | SCALES] of head_size
// int8 codes and one fp16 scale per entry, both in the same order.
struct NVFP4PageLayout {
  int64_t head_size;
  int64_t block_size;
  int64_t num_heads;
  bool hnd;
  bool swizzle_v_scales;
  KeyFormat key_format = KeyFormat::Nvfp4;

  NVFP4_HD int64_t data_dim() const { return head_size / 2; }
  NVFP4_HD int64_t scale_dim() const { return head_size / NVFP4_GROUP; }
  NVFP4_HD int64_t full_dim() const { return data_dim() + scale_dim(); }
  NVFP4_HD int64_t entries() const { return block_size * num_heads; }
  NVFP4_HD int64_t data_region_bytes() const { return entries() * data_dim(); }
  NVFP4_HD int64_t side_bytes() const { return entries() * full_dim(); }
  NVFP4_HD bool fp8_keys() const { return key_format == KeyFormat::Fp8; }
  NVFP4_HD bool int8_keys() const { return key_format == KeyFormat::Int8; }
  NVFP4_HD int64_t key_dim() const {
    return key_format == KeyFormat::Nvfp4 ? full_dim() : head_size + (int8_keys() ? INT8_KEY_SCALE_BYTES : 0);
  }
  NVFP4_HD int64_t key_side_bytes() const { return entries() * key_dim(); }
  NVFP4_HD int64_t page_bytes() const { return key_side_bytes() + side_bytes(); }

  NVFP4_HD int64_t entry_index(int64_t token, int64_t head) const {
    return hnd ? head * block_size + token : token * num_heads + head;
  }
  // Entries from one token of a block to the next: entry_index(token + 1, head) - entry_index(token, head).
  NVFP4_HD int64_t token_step() const { return hnd ? 1 : num_heads; }
  NVFP4_HD int64_t data_offset(int64_t token, int64_t head) const {
    return entry_index(token, head) * data_dim();
  }
  NVFP4_HD int64_t fp8_key_offset(int64_t token, int64_t head) const {
    return entry_index(token, head) * head_size;
  }
  NVFP4_HD int64_t int8_key_offset(int64_t token, int64_t head) const {
    return entry_index(token, head) * head_size;
  }
  NVFP4_HD int64_t int8_key_scale_offset(int64_t token, int64_t head) const {
    return entries() * head_size + entry_index(token, head) * INT8_KEY_SCALE_BYTES;
  }
  // `swizzled` applies trtllm-gen's V-scale order inside each head's [block_size x scale_dim] matrix.
  NVFP4_HD int64_t scale_offset(int64_t token, int64_t head, int64_t s, bool swizzled) const {
    if (swizzled) {
      const int64_t quarter = scale_dim() / 4;
      const int64_t t = (token / 4) * 4 + s / quarter;
      s = (s % quarter) * 4 + token % 4;
      token = t;
    }
    return data_region_bytes() + entry_index(token, head) * scale_dim() + s;
  }
};

// DeepSeek-V3.2 indexer K cache block: all tokens' FP8 values, then all their float32 scales.
struct IndexerCacheLayout {
  int64_t head_dim;
  int64_t block_size;
  int64_t quant_block_size;

  NVFP4_HD int64_t num_scales() const { return head_dim / quant_block_size; }
  NVFP4_HD int64_t scale_bytes() const { return num_scales() * 4; }
  NVFP4_HD int64_t row_bytes() const { return head_dim + scale_bytes(); }
  NVFP4_HD int64_t block_bytes() const { return block_size * row_bytes(); }

  NVFP4_HD int64_t value_offset(int64_t token) const { return token * head_dim; }
  NVFP4_HD int64_t scale_offset(int64_t token, int64_t j = 0) const {
    return block_size * head_dim + (token * num_scales() + j) * 4;
  }
};

}  // namespace vllm_nvfp4
