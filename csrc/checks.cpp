#include "checks.h"

#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>
#include "error.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <string>

namespace vllm_nvfp4 {
namespace {

using torch::headeronly::ScalarType;

std::string device_name(const Tensor& t) {
  if (t.is_cpu()) return "cpu";
  if (t.is_cuda()) return "cuda:" + std::to_string(t.get_device_index());
  return "a non-CPU/CUDA device";
}

std::string shape_of(const Tensor& t) {
  std::string s = "[";
  for (int64_t d = 0; d < t.dim(); ++d) s += (d ? ", " : "") + std::to_string(t.size(d));
  return s + "]";
}

std::string shape_of_sizes(std::initializer_list<int64_t> sizes) {
  std::string s = "[";
  for (int64_t size : sizes) s += (s.size() > 1 ? ", " : "") + std::to_string(size);
  return s + "]";
}

void check_dtype(const char* op, const char* name, const Tensor& t, std::initializer_list<ScalarType> allowed,
                 const char* allowed_text) {
  for (ScalarType a : allowed)
    if (t.scalar_type() == a) return;
  NVFP4_CHECK(false, op, ": ", name, ": dtype must be ", allowed_text, ", got ", t.scalar_type());
}

void check_dim(const char* op, const char* name, const Tensor& t, int64_t dim, const char* shape_text) {
  NVFP4_CHECK(t.dim() == dim, op, ": ", name, ": must be ", dim, "-D ", shape_text, ", got shape ",
                  shape_of(t));
}

void check_same_device(const char* op, const char* name, const Tensor& t, const Tensor& ref, const char* ref_name) {
  NVFP4_CHECK(t.device() == ref.device(), op, ": ", name, ": must be on ", ref_name, "'s device (",
                  device_name(ref), "), got ", device_name(t));
}

void check_global_scale(const char* op, const char* name, const Tensor& scale, const Tensor& cache) {
  check_dtype(op, name, scale, {ScalarType::Float}, "float32");
  NVFP4_CHECK(scale.numel() == 1, op, ": ", name, ": must hold one float32 (the layer's global scale), got ",
                  scale.numel(), " elements");
  check_same_device(op, name, scale, cache, "key_cache");
}

const char* key_format_name(KeyFormat key_format) { return key_format == KeyFormat::Int8 ? "INT8" : "FP8"; }

// The K side of an FP8- or INT8-key page: value_cache's geometry with key_dim bytes per entry, in its entry order.
void check_byte_key_cache(const char* op, const Tensor& key_cache, const NVFP4PageLayout& layout) {
  const int inner = layout.hnd ? 1 : 2, outer = layout.hnd ? 2 : 1;
  const int64_t dim = layout.key_dim();
  NVFP4_CHECK(key_cache.stride(3) == 1 && (key_cache.size(inner) == 1 || key_cache.stride(inner) == dim) &&
                      (key_cache.size(outer) == 1 || key_cache.stride(outer) == dim * key_cache.size(inner)) &&
                      (key_cache.size(0) <= 1 || key_cache.stride(0) >= layout.key_side_bytes()),
                  op, ": key_cache: ", key_format_name(layout.key_format),
                  " key block sides must be contiguous bytes in value_cache's order, got shape ",
                  shape_of(key_cache), " strides [", key_cache.stride(0), ", ", key_cache.stride(1), ", ",
                  key_cache.stride(2), ", ", key_cache.stride(3), "]");
}

// docs/FORMATS.md §1 on `[num_blocks, block_size, num_heads, full_dim]` views, as layout.py's from_caches: NVFP4
// keys when both sides share one shape, FP8 keys when key_cache's last dim is value_cache's head size, INT8 keys when
// it is that plus 2. INT8 keys have CPU kernels only: a CUDA cache of them is refused here, for every op.
NVFP4PageLayout side_cache_layout(const char* op, const Tensor& key_cache, const Tensor& value_cache,
                                  bool swizzle_v_scales) {
  check_dim(op, "key_cache", key_cache, 4, "[num_blocks, block_size, num_heads, full_dim]");
  check_dtype(op, "key_cache", key_cache, {ScalarType::Byte}, "uint8");
  KeyFormat key_format = KeyFormat::Nvfp4;
  if (value_cache.dim() == 4 && value_cache.size(3) > 0 && value_cache.size(3) % 9 == 0 &&
      key_cache.size(3) != value_cache.size(3)) {
    const int64_t value_head_size = value_cache.size(3) / 9 * 16;
    if (key_cache.size(3) == value_head_size) key_format = KeyFormat::Fp8;
    if (key_cache.size(3) == value_head_size + INT8_KEY_SCALE_BYTES) key_format = KeyFormat::Int8;
  }
  const bool byte_keys = key_format != KeyFormat::Nvfp4;
  const Tensor& side = byte_keys ? value_cache : key_cache;  // an NVFP4 side
  const char* side_name = byte_keys ? "value_cache" : "key_cache";
  const int64_t block_size = side.size(1), num_heads = side.size(2), full_dim = side.size(3);
  NVFP4_CHECK(full_dim > 0 && full_dim % 9 == 0, op, ": key_cache: last dim ", full_dim,
                  " is not head_size/2 + head_size/16 (a positive multiple of 9, NVFP4 keys) or value_cache's ",
                  "head size (FP8 keys) or head size + 2 (INT8 keys)");
  NVFP4_CHECK(block_size > 0 && num_heads > 0, op, ": ", side_name, ": block size and head count must be positive, ",
                  "got shape ", shape_of(side));
  const bool hnd = side.stride(2) > side.stride(1);
  const NVFP4PageLayout layout{full_dim / 9 * 16, block_size, num_heads, hnd, swizzle_v_scales, key_format};
  const int inner = hnd ? 1 : 2, outer = hnd ? 2 : 1;
  // A dim of size 1 may carry any stride.
  NVFP4_CHECK(side.stride(3) == 1 && (side.size(inner) == 1 || side.stride(inner) == full_dim) &&
                      (side.size(outer) == 1 || side.stride(outer) == full_dim * side.size(inner)) &&
                      (side.size(0) <= 1 || side.stride(0) >= layout.side_bytes()),
                  op, ": ", side_name, ": each block side must be contiguous NHD or HND bytes, got shape ",
                  shape_of(side), " strides [", side.stride(0), ", ", side.stride(1), ", ",
                  side.stride(2), ", ", side.stride(3), "]");
  if (swizzle_v_scales) {
    NVFP4_CHECK(block_size % 4 == 0, op, ": key_cache: block size ", block_size,
                    " is not a multiple of 4, which swizzle_v_scales needs");
    NVFP4_CHECK(layout.scale_dim() % 4 == 0, op, ": key_cache: head size ", layout.head_size,
                    " is not a multiple of 64, which swizzle_v_scales needs");
  }
  check_dtype(op, "value_cache", value_cache, {ScalarType::Byte}, "uint8");
  if (byte_keys) {
    NVFP4_CHECK(key_cache.size(0) == value_cache.size(0) && key_cache.size(1) == block_size &&
                    key_cache.size(2) == num_heads,
                op, ": key_cache: ", key_format_name(key_format), " keys must have value_cache's blocks, block size ",
                "and heads ", shape_of(value_cache), ", got shape ", shape_of(key_cache));
    check_byte_key_cache(op, key_cache, layout);
  } else {
    bool same_geometry = value_cache.dim() == 4;
    for (int64_t d = 0; same_geometry && d < 4; ++d)
      same_geometry = value_cache.size(d) == key_cache.size(d) && value_cache.stride(d) == key_cache.stride(d);
    NVFP4_CHECK(same_geometry, op, ": value_cache: must have key_cache's shape ", shape_of(key_cache),
                    " and strides, got shape ", shape_of(value_cache));
  }
  check_same_device(op, "value_cache", value_cache, key_cache, "key_cache");
  return layout;
}

// `[num_tokens, num_heads, head_size]` activations (store input or gather output) matching the cache.
void check_heads_tensor(const char* op, const char* name, const Tensor& t, const NVFP4PageLayout& layout,
                        const Tensor& key_cache) {
  check_dim(op, name, t, 3, "[num_tokens, num_heads, head_size]");
  check_dtype(op, name, t, {ScalarType::BFloat16, ScalarType::Half, ScalarType::Float}, "bfloat16, float16 or float32");
  NVFP4_CHECK(t.size(2) % NVFP4_GROUP == 0, op, ": ", name, ": head size ", t.size(2),
                  " is not a multiple of 16");
  NVFP4_CHECK(t.size(1) == layout.num_heads && t.size(2) == layout.head_size, op, ": ", name, ": shape ",
                  shape_of(t), " does not match key_cache's ", layout.num_heads, " heads of size ", layout.head_size);
  NVFP4_CHECK(t.stride(2) == 1, op, ": ", name, ": the head dim must be contiguous (stride 1), got stride ",
                  t.stride(2));
  check_same_device(op, name, t, key_cache, "key_cache");
}

void check_slot_mapping(const char* op, const Tensor& slot_mapping, int64_t num_tokens, const Tensor& cache,
                        const char* cache_name) {
  check_dtype(op, "slot_mapping", slot_mapping, {ScalarType::Long}, "int64");
  check_dim(op, "slot_mapping", slot_mapping, 1, "[num_tokens]");
  NVFP4_CHECK(slot_mapping.size(0) <= num_tokens, op, ": slot_mapping: ", slot_mapping.size(0),
                  " slots for only ", num_tokens, " tokens");
  check_same_device(op, "slot_mapping", slot_mapping, cache, cache_name);
}

void check_block_table(const char* op, const Tensor& block_table, const Tensor& cu_seq_lens, const Tensor& cache,
                       const char* cache_name) {
  check_dtype(op, "block_table", block_table, {ScalarType::Int}, "int32");
  check_dim(op, "block_table", block_table, 2, "[batch, max_blocks]");
  NVFP4_CHECK(block_table.stride(1) == 1, op, ": block_table: rows must be contiguous, got stride ",
                  block_table.stride(1));
  check_dtype(op, "cu_seq_lens", cu_seq_lens, {ScalarType::Int}, "int32");
  check_dim(op, "cu_seq_lens", cu_seq_lens, 1, "[batch + 1]");
  NVFP4_CHECK(cu_seq_lens.size(0) == block_table.size(0) + 1, op, ": cu_seq_lens: must have batch + 1 = ",
                  block_table.size(0) + 1, " entries (block_table has ", block_table.size(0), " rows), got ",
                  cu_seq_lens.size(0));
  NVFP4_CHECK(cu_seq_lens.stride(0) == 1, op, ": cu_seq_lens: must be contiguous");
  check_same_device(op, "block_table", block_table, cache, cache_name);
  check_same_device(op, "cu_seq_lens", cu_seq_lens, cache, cache_name);
}

// Indexer cache `[num_blocks, block_size, head_dim + head_dim/quant_block_size*4]`, as layout.py's from_cache.
IndexerCacheLayout indexer_cache_layout(const char* op, const Tensor& kv_cache, int64_t head_dim,
                                        int64_t quant_block_size) {
  const IndexerCacheLayout layout{head_dim, kv_cache.size(1), quant_block_size};
  NVFP4_CHECK(kv_cache.size(2) == layout.row_bytes(), op, ": kv_cache: last dim ", kv_cache.size(2),
                  " is not head_dim + head_dim/quant_block_size*4 = ", layout.row_bytes(), " for head_dim ",
                  head_dim, " and quant_block_size ", quant_block_size);
  NVFP4_CHECK(kv_cache.stride(2) == 1 && kv_cache.stride(1) == layout.row_bytes() &&
                      kv_cache.stride(0) >= layout.block_bytes(),
                  op, ": kv_cache: blocks must be contiguous rows of ", layout.row_bytes(), " bytes, got strides [",
                  kv_cache.stride(0), ", ", kv_cache.stride(1), ", ", kv_cache.stride(2), "]");
  return layout;
}

void check_indexer_cache_basics(const char* op, const Tensor& kv_cache) {
  check_dim(op, "kv_cache", kv_cache, 3, "[num_blocks, block_size, head_dim + scale bytes]");
  check_dtype(op, "kv_cache", kv_cache, {ScalarType::Byte}, "uint8");
  NVFP4_CHECK(kv_cache.size(1) > 0, op, ": kv_cache: block size must be positive");
}

}  // namespace

NVFP4PageLayout check_reshape_and_cache_nvfp4(const Tensor& key, const Tensor& value, const Tensor& key_cache,
                                              const Tensor& value_cache, const Tensor& slot_mapping,
                                              const Tensor& k_scale, const Tensor& v_scale, bool swizzle_v_scales,
                                              const char* op) {
  const NVFP4PageLayout layout = side_cache_layout(op, key_cache, value_cache, swizzle_v_scales);
  check_heads_tensor(op, "key", key, layout, key_cache);
  check_heads_tensor(op, "value", value, layout, key_cache);
  NVFP4_CHECK(value.size(0) == key.size(0) && value.scalar_type() == key.scalar_type(), op,
                  ": value: must have key's shape ", shape_of(key), " and dtype, got ", shape_of(value), " ",
                  value.scalar_type());
  check_slot_mapping(op, slot_mapping, key.size(0), key_cache, "key_cache");
  check_global_scale(op, "k_scale", k_scale, key_cache);
  check_global_scale(op, "v_scale", v_scale, key_cache);
  return layout;
}

NVFP4PageLayout check_gather_nvfp4_kv_cache(const Tensor& key_cache, const Tensor& value_cache,
                                            const Tensor& block_table, const Tensor& cu_seq_lens,
                                            const Tensor& k_scale, const Tensor& v_scale, bool swizzle_v_scales,
                                            const Tensor& out_key, const Tensor& out_value) {
  const char* op = "gather_nvfp4_kv_cache";
  const NVFP4PageLayout layout = side_cache_layout(op, key_cache, value_cache, swizzle_v_scales);
  check_block_table(op, block_table, cu_seq_lens, key_cache, "key_cache");
  check_global_scale(op, "k_scale", k_scale, key_cache);
  check_global_scale(op, "v_scale", v_scale, key_cache);
  check_heads_tensor(op, "out_key", out_key, layout, key_cache);
  check_heads_tensor(op, "out_value", out_value, layout, key_cache);
  NVFP4_CHECK(out_value.size(0) == out_key.size(0), op, ": out_value: must have out_key's ", out_key.size(0),
                  " rows, got ", out_value.size(0));
  return layout;
}

// `[rows, ...]` int32/float32 metadata: dtype, exact shape, contiguous, on the reference tensor's device.
void check_metadata(const char* op, const char* name, const Tensor& t, ScalarType dtype, const char* dtype_text,
                    std::initializer_list<int64_t> shape, const char* shape_text, const Tensor& ref,
                    const char* ref_name) {
  check_dtype(op, name, t, {dtype}, dtype_text);
  check_dim(op, name, t, static_cast<int64_t>(shape.size()), shape_text);
  int64_t d = 0;
  for (int64_t size : shape) {
    NVFP4_CHECK(t.size(d) == size, op, ": ", name, ": must have shape ", shape_text, " = ", shape_of_sizes(shape),
                ", got ", shape_of(t));
    ++d;
  }
  NVFP4_CHECK(t.is_contiguous(), op, ": ", name, ": must be contiguous");
  check_same_device(op, name, t, ref, ref_name);
}

// FP8 queries `[..., heads, head_dim]`, contiguous, with float32 weights of the same leading shape.
void check_queries(const char* op, const Tensor& q, int64_t dim, const char* shape_text) {
  check_dim(op, "q", q, dim, shape_text);
  check_dtype(op, "q", q, {ScalarType::Float8_e4m3fn}, "float8_e4m3fn");
  NVFP4_CHECK(q.is_contiguous(), op, ": q: must be contiguous");
  NVFP4_CHECK(q.size(dim - 2) > 0 && q.size(dim - 1) > 0, op, ": q: heads and head_dim must be positive, got shape ",
              shape_of(q));
}

// float32 `[rows, columns]` with contiguous, non-overlapping rows; each op checks its own column count.
void check_logits(const char* op, const Tensor& logits, int64_t rows, const Tensor& q) {
  check_dtype(op, "logits", logits, {ScalarType::Float}, "float32");
  check_dim(op, "logits", logits, 2, "[rows, columns]");
  NVFP4_CHECK(logits.size(0) == rows, op, ": logits: must have ", rows, " rows (one per query token), got shape ",
              shape_of(logits));
  NVFP4_CHECK(logits.stride(1) == 1 && (rows <= 1 || logits.stride(0) >= logits.size(1)), op,
              ": logits: rows must be contiguous and must not overlap, got strides [", logits.stride(0), ", ",
              logits.stride(1), "]");
  check_same_device(op, "logits", logits, q, "q");
}

ScaleFormat parse_scale_fmt(const std::string& scale_fmt) {
  if (scale_fmt.empty()) return ScaleFormat::Float32;
  if (scale_fmt == "ue8m0") return ScaleFormat::UE8M0;
  if (scale_fmt == "mxfp8") return ScaleFormat::MXFP8;
  NVFP4_CHECK(false, "indexer_k_quant_and_cache: scale_fmt: must be \"\", \"ue8m0\" or \"mxfp8\", got \"",
                  scale_fmt, "\"");
}

IndexerCacheLayout check_indexer_k_quant_and_cache(const Tensor& k, const Tensor& kv_cache,
                                                   const Tensor& slot_mapping, int64_t quant_block_size) {
  const char* op = "indexer_k_quant_and_cache";
  check_indexer_cache_basics(op, kv_cache);
  check_dim(op, "k", k, 2, "[num_tokens, head_dim]");
  check_dtype(op, "k", k, {ScalarType::BFloat16, ScalarType::Half, ScalarType::Float}, "bfloat16, float16 or float32");
  NVFP4_CHECK(k.stride(1) == 1, op, ": k: rows must be contiguous, got stride ", k.stride(1));
  check_same_device(op, "k", k, kv_cache, "kv_cache");
  NVFP4_CHECK(quant_block_size > 0 && k.size(1) > 0 && k.size(1) % quant_block_size == 0, op,
                  ": quant_block_size: head_dim ", k.size(1), " must be a positive multiple of quant_block_size ",
                  quant_block_size);
  const IndexerCacheLayout layout = indexer_cache_layout(op, kv_cache, k.size(1), quant_block_size);
  check_slot_mapping(op, slot_mapping, k.size(0), kv_cache, "kv_cache");
  return layout;
}

IndexerCacheLayout check_cp_gather_indexer_k_quant_cache(const Tensor& kv_cache, const Tensor& dst_k,
                                                         const Tensor& dst_scale, const Tensor& block_table,
                                                         const Tensor& cu_seq_lens) {
  const char* op = "cp_gather_indexer_k_quant_cache";
  check_indexer_cache_basics(op, kv_cache);
  check_dim(op, "dst_k", dst_k, 2, "[num_tokens, head_dim]");
  check_dtype(op, "dst_k", dst_k, {ScalarType::Byte, ScalarType::Float8_e4m3fn}, "uint8 or float8_e4m3fn");
  NVFP4_CHECK(dst_k.stride(1) == 1, op, ": dst_k: rows must be contiguous, got stride ", dst_k.stride(1));
  check_dim(op, "dst_scale", dst_scale, 2, "[num_tokens, scale bytes or scales]");
  check_dtype(op, "dst_scale", dst_scale, {ScalarType::Byte, ScalarType::Float}, "uint8 or float32");
  NVFP4_CHECK(dst_scale.stride(1) == 1, op, ": dst_scale: rows must be contiguous, got stride ",
                  dst_scale.stride(1));
  NVFP4_CHECK(dst_scale.size(0) == dst_k.size(0), op, ": dst_scale: must have dst_k's ", dst_k.size(0),
                  " rows, got ", dst_scale.size(0));
  check_same_device(op, "dst_k", dst_k, kv_cache, "kv_cache");
  check_same_device(op, "dst_scale", dst_scale, kv_cache, "kv_cache");
  // The cache row is head_dim value bytes plus 4 scale bytes per quant block.
  const int64_t head_dim = dst_k.size(1), scale_bytes = dst_scale.size(1) * dst_scale.element_size();
  NVFP4_CHECK(head_dim > 0 && scale_bytes > 0 && scale_bytes % 4 == 0 && head_dim % (scale_bytes / 4) == 0, op,
                  ": dst_scale: ", scale_bytes, " scale bytes a row do not split head_dim ", head_dim,
                  " into float32-scaled quant blocks");
  const IndexerCacheLayout layout = indexer_cache_layout(op, kv_cache, head_dim, head_dim / (scale_bytes / 4));
  check_block_table(op, block_table, cu_seq_lens, kv_cache, "kv_cache");
  return layout;
}

void check_slot_range(const char* op, const int64_t* slots, int64_t num_tokens, int64_t num_slots) {
  for (int64_t i = 0; i < num_tokens; ++i)
    NVFP4_CHECK(slots[i] < num_slots, op, ": slot_mapping: slot ", slots[i], " of token ", i,
                    " is beyond the cache's ", num_slots, " slots");
}

void check_gather_ranges(const char* op, const int32_t* block_table, int64_t table_row_stride,
                         int64_t table_cols, const int32_t* cu_seq_lens, int64_t batch, int64_t block_size,
                         int64_t num_blocks, int64_t out_rows) {
  NVFP4_CHECK(batch == 0 || cu_seq_lens[0] == 0, op, ": cu_seq_lens: must start at 0, got ", cu_seq_lens[0]);
  NVFP4_CHECK(cu_seq_lens[batch] <= out_rows, op, ": cu_seq_lens: ", cu_seq_lens[batch],
                  " tokens do not fit the output's ", out_rows, " rows");
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t len = cu_seq_lens[b + 1] - cu_seq_lens[b];
    NVFP4_CHECK(len >= 0, op, ": cu_seq_lens: must be non-decreasing, entry ", b + 1, " is ",
                    cu_seq_lens[b + 1], " after ", cu_seq_lens[b]);
    const int64_t blocks_used = (len + block_size - 1) / block_size;
    NVFP4_CHECK(blocks_used <= table_cols, op, ": block_table: sequence ", b, " of ", len, " tokens needs ",
                    blocks_used, " blocks, but block_table has ", table_cols, " columns");
    for (int64_t j = 0; j < blocks_used; ++j) {
      const int32_t block = block_table[b * table_row_stride + j];
      NVFP4_CHECK(block >= 0 && block < num_blocks, op, ": block_table: entry [", b, ", ", j, "] = ", block,
                      " is not a block of the cache (", num_blocks, " blocks)");
    }
  }
}

MqaLogitsShape check_indexer_mqa_logits(const Tensor& q, const Tensor& k, const Tensor& k_scale,
                                        const Tensor& weights, const Tensor& ks, const Tensor& ke,
                                        const Tensor& logits) {
  const char* op = "indexer_mqa_logits";
  check_queries(op, q, 3, "[rows, heads, head_dim]");
  const int64_t rows = q.size(0), heads = q.size(1), head_dim = q.size(2);
  check_dim(op, "k", k, 2, "[keys, head_dim]");
  check_dtype(op, "k", k, {ScalarType::Byte, ScalarType::Float8_e4m3fn}, "uint8 or float8_e4m3fn");
  NVFP4_CHECK(k.size(1) == head_dim, op, ": k: head_dim ", k.size(1), " does not match q's ", head_dim);
  NVFP4_CHECK(k.stride(1) == 1, op, ": k: rows must be contiguous, got stride ", k.stride(1));
  check_same_device(op, "k", k, q, "q");
  const int64_t keys = k.size(0);
  check_dim(op, "k_scale", k_scale, 2, "[keys, scale bytes or scales]");
  check_dtype(op, "k_scale", k_scale, {ScalarType::Byte, ScalarType::Float}, "uint8 or float32");
  NVFP4_CHECK(k_scale.size(0) == keys, op, ": k_scale: must have k's ", keys, " rows, got ", k_scale.size(0));
  NVFP4_CHECK(k_scale.stride(1) == 1, op, ": k_scale: rows must be contiguous, got stride ", k_scale.stride(1));
  check_same_device(op, "k_scale", k_scale, q, "q");
  const int64_t scale_bytes = k_scale.size(1) * k_scale.element_size();
  NVFP4_CHECK(scale_bytes > 0 && scale_bytes % 4 == 0 && head_dim % (scale_bytes / 4) == 0, op, ": k_scale: ",
              scale_bytes, " scale bytes a key do not split head_dim ", head_dim, " into float32-scaled quant blocks");
  // uint8 scale bytes are read as float32: each row must start 4-byte aligned.
  NVFP4_CHECK(reinterpret_cast<uintptr_t>(k_scale.const_data_ptr()) % 4 == 0 &&
                  k_scale.stride(0) * static_cast<int64_t>(k_scale.element_size()) % 4 == 0,
              op, ": k_scale: rows of float32 scales must be 4-byte aligned");
  check_metadata(op, "weights", weights, ScalarType::Float, "float32", {rows, heads}, "[rows, heads]", q, "q");
  check_metadata(op, "ks", ks, ScalarType::Int, "int32", {rows}, "[rows]", q, "q");
  check_metadata(op, "ke", ke, ScalarType::Int, "int32", {rows}, "[rows]", q, "q");
  check_logits(op, logits, rows, q);
  NVFP4_CHECK(logits.size(1) == keys, op, ": logits: must have one column per key (", keys, "), got shape ",
              shape_of(logits));
  return {rows, heads, head_dim, keys, head_dim / (scale_bytes / 4)};
}

PagedMqaLogitsShape check_indexer_paged_mqa_logits(const Tensor& q, const Tensor& kv_cache, const Tensor& weights,
                                                   const Tensor& context_lens, const Tensor& block_table,
                                                   int64_t quant_block_size, const Tensor& logits) {
  const char* op = "indexer_paged_mqa_logits";
  check_queries(op, q, 4, "[batch, next_n, heads, head_dim]");
  const int64_t batch = q.size(0), next_n = q.size(1), heads = q.size(2), head_dim = q.size(3);
  check_indexer_cache_basics(op, kv_cache);
  check_same_device(op, "kv_cache", kv_cache, q, "q");
  NVFP4_CHECK(quant_block_size > 0 && head_dim % quant_block_size == 0, op, ": quant_block_size: head_dim ",
              head_dim, " must be a positive multiple of quant_block_size ", quant_block_size);
  const IndexerCacheLayout layout = indexer_cache_layout(op, kv_cache, head_dim, quant_block_size);
  check_metadata(op, "weights", weights, ScalarType::Float, "float32", {batch, next_n, heads},
                 "[batch, next_n, heads]", q, "q");
  check_metadata(op, "context_lens", context_lens, ScalarType::Int, "int32", {batch, next_n}, "[batch, next_n]", q,
                 "q");
  check_dtype(op, "block_table", block_table, {ScalarType::Int}, "int32");
  check_dim(op, "block_table", block_table, 2, "[batch, max_blocks]");
  NVFP4_CHECK(block_table.size(0) == batch, op, ": block_table: must have one row per request (", batch,
              "), got shape ", shape_of(block_table));
  NVFP4_CHECK(block_table.stride(1) == 1, op, ": block_table: rows must be contiguous, got stride ",
              block_table.stride(1));
  check_same_device(op, "block_table", block_table, q, "q");
  check_logits(op, logits, batch * next_n, q);
  const int64_t max_columns = block_table.size(1) * layout.block_size;
  NVFP4_CHECK(logits.size(1) <= max_columns, op, ": logits: at most block_table's ", block_table.size(1),
              " blocks × ", layout.block_size, " = ", max_columns, " columns, got shape ", shape_of(logits));
  return {batch, next_n, heads, logits.size(1), layout};
}

void check_paged_block_ids(const char* op, const int32_t* block_table, int64_t table_row_stride,
                           const int32_t* context_lens, int64_t batch, int64_t next_n, int64_t columns,
                           int64_t block_size, int64_t num_blocks) {
  for (int64_t b = 0; b < batch; ++b) {
    int64_t visible = 0;
    for (int64_t j = 0; j < next_n; ++j)
      visible = std::max<int64_t>(visible, std::min<int64_t>(context_lens[b * next_n + j], columns));
    for (int64_t p = 0; p * block_size < visible; ++p) {
      const int32_t block = block_table[b * table_row_stride + p];
      NVFP4_CHECK(block >= 0 && block < num_blocks, op, ": block_table: entry [", b, ", ", p, "] = ", block,
                  " is not a block of the cache (", num_blocks, " blocks)");
    }
  }
}


NVFP4PageLayout check_nvfp4_paged_attention(const Tensor& query, const Tensor& key_cache, const Tensor& value_cache,
                                            const Tensor& block_table, const Tensor& query_start_loc,
                                            const Tensor& seq_lens, const Tensor& k_scale, const Tensor& v_scale,
                                            bool swizzle_v_scales, int64_t max_query_len, int64_t max_seq_len,
                                            const Tensor& out) {
  const char* op = "nvfp4_paged_attention";
  const NVFP4PageLayout layout = side_cache_layout(op, key_cache, value_cache, swizzle_v_scales);
  NVFP4_CHECK(layout.head_size == 64 || layout.head_size == 128 || layout.head_size == 256, op,
              ": key_cache: head size ", layout.head_size, " is not 64, 128 or 256");
  check_dim(op, "query", query, 3, "[num_tokens, num_heads, head_size]");
  check_dtype(op, "query", query, {ScalarType::BFloat16, ScalarType::Half, ScalarType::Float},
              "bfloat16, float16 or float32");
  NVFP4_CHECK(query.size(2) == layout.head_size, op, ": query: head size ", query.size(2),
              " does not match key_cache's ", layout.head_size);
  NVFP4_CHECK(query.size(1) > 0 && query.size(1) % layout.num_heads == 0, op, ": query: ", query.size(1),
              " heads are not a positive multiple of key_cache's ", layout.num_heads, " KV heads");
  NVFP4_CHECK(query.stride(2) == 1, op, ": query: the head dim must be contiguous (stride 1), got stride ",
              query.stride(2));
  check_same_device(op, "query", query, key_cache, "key_cache");
  check_dim(op, "out", out, 3, "[num_tokens, num_heads, head_size]");
  NVFP4_CHECK(out.scalar_type() == query.scalar_type(), op, ": out: dtype must be query's ", query.scalar_type(),
              ", got ", out.scalar_type());
  NVFP4_CHECK(out.size(0) == query.size(0) && out.size(1) == query.size(1) && out.size(2) == query.size(2), op,
              ": out: must have query's shape ", shape_of(query), ", got ", shape_of(out));
  NVFP4_CHECK(out.stride(2) == 1, op, ": out: the head dim must be contiguous (stride 1), got stride ",
              out.stride(2));
  check_same_device(op, "out", out, key_cache, "key_cache");
  check_dim(op, "seq_lens", seq_lens, 1, "[num_reqs]");
  const int64_t num_reqs = seq_lens.size(0);
  check_metadata(op, "seq_lens", seq_lens, ScalarType::Int, "int32", {num_reqs}, "[num_reqs]", key_cache,
                 "key_cache");
  check_metadata(op, "query_start_loc", query_start_loc, ScalarType::Int, "int32", {num_reqs + 1},
                 "[num_reqs + 1]", key_cache, "key_cache");
  check_dtype(op, "block_table", block_table, {ScalarType::Int}, "int32");
  check_dim(op, "block_table", block_table, 2, "[num_reqs, max_blocks]");
  NVFP4_CHECK(block_table.size(0) >= num_reqs, op, ": block_table: needs a row for each of the ", num_reqs,
              " requests, got shape ", shape_of(block_table));
  NVFP4_CHECK(block_table.stride(1) == 1, op, ": block_table: rows must be contiguous, got stride ",
              block_table.stride(1));
  check_same_device(op, "block_table", block_table, key_cache, "key_cache");
  check_global_scale(op, "k_scale", k_scale, key_cache);
  check_global_scale(op, "v_scale", v_scale, key_cache);
  NVFP4_CHECK(max_query_len >= 0, op, ": max_query_len: must be non-negative, got ", max_query_len);
  NVFP4_CHECK(max_seq_len >= 0, op, ": max_seq_len: must be non-negative, got ", max_seq_len);
  return layout;
}

void check_attention_features(int64_t sliding_window, double logits_soft_cap, const std::optional<Tensor>& sinks,
                              const Tensor& query) {
  const char* op = "nvfp4_paged_attention";
  NVFP4_CHECK(sliding_window >= 0, op, ": sliding_window: must be >= 0 (0: no window), got ", sliding_window);
  NVFP4_CHECK(std::isfinite(logits_soft_cap) && logits_soft_cap >= 0.0, op,
              ": logits_soft_cap: must be finite and >= 0 (0: no soft-cap), got ", logits_soft_cap);
  if (!sinks.has_value()) return;
  check_dtype(op, "sinks", *sinks, {ScalarType::Float}, "float32");
  NVFP4_CHECK(sinks->dim() == 1 && sinks->size(0) == query.size(1) && (sinks->size(0) <= 1 || sinks->stride(0) == 1),
              op, ": sinks: must be a contiguous [num_q_heads] = [", query.size(1), "] tensor, got shape ",
              shape_of(*sinks), sinks->dim() == 1 ? " with stride " + std::to_string(sinks->stride(0)) : "");
  check_same_device(op, "sinks", *sinks, query, "query");
}

void check_paged_attention_ranges(const char* op, const int32_t* query_start_loc, const int32_t* seq_lens,
                                  int64_t num_reqs, int64_t query_rows, int64_t max_query_len, int64_t max_seq_len,
                                  const int32_t* block_table, int64_t table_row_stride, int64_t table_cols,
                                  int64_t block_size, int64_t num_blocks) {
  NVFP4_CHECK(query_start_loc[0] == 0, op, ": query_start_loc: must start at 0, got ", query_start_loc[0]);
  NVFP4_CHECK(query_start_loc[num_reqs] <= query_rows, op, ": query_start_loc: ", query_start_loc[num_reqs],
              " query tokens do not fit query's ", query_rows, " rows");
  for (int64_t r = 0; r < num_reqs; ++r) {
    const int64_t query_len = int64_t{query_start_loc[r + 1]} - query_start_loc[r], seq_len = seq_lens[r];
    NVFP4_CHECK(query_len >= 0, op, ": query_start_loc: must be non-decreasing, entry ", r + 1, " is ",
                query_start_loc[r + 1], " after ", query_start_loc[r]);
    NVFP4_CHECK(seq_len >= query_len, op, ": seq_lens: request ", r, " has ", query_len,
                " query tokens but seq_len ", seq_len, " (the context must include the query tokens)");
    NVFP4_CHECK(query_len <= max_query_len, op, ": max_query_len: request ", r, " has ", query_len,
                " query tokens, more than max_query_len = ", max_query_len);
    NVFP4_CHECK(seq_len <= max_seq_len, op, ": max_seq_len: request ", r, " has seq_len ", seq_len,
                ", more than max_seq_len = ", max_seq_len);
    const int64_t blocks_used = (seq_len + block_size - 1) / block_size;
    NVFP4_CHECK(blocks_used <= table_cols, op, ": block_table: request ", r, " of ", seq_len, " tokens needs ",
                blocks_used, " blocks, but block_table has ", table_cols, " columns");
    if (query_len == 0) continue;  // its pages are not read
    for (int64_t j = 0; j < blocks_used; ++j) {
      const int32_t block = block_table[r * table_row_stride + j];
      NVFP4_CHECK(block >= 0 && block < num_blocks, op, ": block_table: entry [", r, ", ", j, "] = ", block,
                  " is not a block of the cache (", num_blocks, " blocks)");
    }
  }
}

}  // namespace vllm_nvfp4
