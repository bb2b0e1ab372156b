// Argument checks shared by the CPU and CUDA entry points of the seven ops.
//
// Each check_<op> validates dtypes, shapes, strides and devices, and returns the cache layout the
// kernel needs. Errors read "<op>: <argument>: <rule>". The data-dependent checks (slot and block
// table ranges) read host memory, so only the CPU kernels call them.
#pragma once

#include <torch/csrc/stable/tensor.h>

#include <cstdint>
#include <optional>
#include <string>

#include "layout.h"

namespace vllm_nvfp4 {

using torch::stable::Tensor;

NVFP4PageLayout check_reshape_and_cache_nvfp4(const Tensor& key, const Tensor& value, const Tensor& key_cache,
                                              const Tensor& value_cache, const Tensor& slot_mapping,
                                              const Tensor& k_scale, const Tensor& v_scale, bool swizzle_v_scales,
                                              const char* op = "reshape_and_cache_nvfp4");

NVFP4PageLayout check_gather_nvfp4_kv_cache(const Tensor& key_cache, const Tensor& value_cache,
                                            const Tensor& block_table, const Tensor& cu_seq_lens,
                                            const Tensor& k_scale, const Tensor& v_scale, bool swizzle_v_scales,
                                            const Tensor& out_key, const Tensor& out_value);

// How the indexer store writes a quant block's scale (docs/FORMATS.md §2).
enum class ScaleFormat { Float32, UE8M0, MXFP8 };

ScaleFormat parse_scale_fmt(const std::string& scale_fmt);

IndexerCacheLayout check_indexer_k_quant_and_cache(const Tensor& k, const Tensor& kv_cache,
                                                   const Tensor& slot_mapping, int64_t quant_block_size);

IndexerCacheLayout check_cp_gather_indexer_k_quant_cache(const Tensor& kv_cache, const Tensor& dst_k,
                                                         const Tensor& dst_scale, const Tensor& block_table,
                                                         const Tensor& cu_seq_lens);

// What the indexer logits kernels loop over; quant_block_size is D / (a key's float32 scales).
struct MqaLogitsShape {
  int64_t rows, heads, head_dim, keys, quant_block_size;
};

MqaLogitsShape check_indexer_mqa_logits(const Tensor& q, const Tensor& k, const Tensor& k_scale,
                                        const Tensor& weights, const Tensor& ks, const Tensor& ke,
                                        const Tensor& logits);

struct PagedMqaLogitsShape {
  int64_t batch, next_n, heads, columns;
  IndexerCacheLayout layout;
};

PagedMqaLogitsShape check_indexer_paged_mqa_logits(const Tensor& q, const Tensor& kv_cache, const Tensor& weights,
                                                   const Tensor& context_lens, const Tensor& block_table,
                                                   int64_t quant_block_size, const Tensor& logits);

// The block-table entries of every visible column (c < min(context_lens[b, j], columns)) must name a block of
// the cache; the entries past a request's context are never read and may hold anything.
void check_paged_block_ids(const char* op, const int32_t* block_table, int64_t table_row_stride,
                           const int32_t* context_lens, int64_t batch, int64_t next_n, int64_t columns,
                           int64_t block_size, int64_t num_blocks);

// nvfp4_paged_attention: query and out `[tokens, heads, head_size]` of one float dtype, heads a multiple of the
// cache's KV heads, head size 64, 128 or 256; int32 metadata; returns the cache layout.
NVFP4PageLayout check_nvfp4_paged_attention(const Tensor& query, const Tensor& key_cache, const Tensor& value_cache,
                                            const Tensor& block_table, const Tensor& query_start_loc,
                                            const Tensor& seq_lens, const Tensor& k_scale, const Tensor& v_scale,
                                            bool swizzle_v_scales, int64_t max_query_len, int64_t max_seq_len,
                                            const Tensor& out);

// nvfp4_paged_attention's model features: sliding_window >= 0 (0: none), logits_soft_cap finite and >= 0 (0: none),
// sinks (when given) float32 `[num_q_heads]` on query's device.
void check_attention_features(int64_t sliding_window, double logits_soft_cap, const std::optional<Tensor>& sinks,
                              const Tensor& query);

// The batch's lengths read on the host: query_start_loc non-decreasing from 0 up to at most query_rows, every
// request's query inside its seq_lens, both within the host-side bounds, and every block its context uses a
// block_table column that names a block of the cache.
void check_paged_attention_ranges(const char* op, const int32_t* query_start_loc, const int32_t* seq_lens,
                                  int64_t num_reqs, int64_t query_rows, int64_t max_query_len, int64_t max_seq_len,
                                  const int32_t* block_table, int64_t table_row_stride, int64_t table_cols,
                                  int64_t block_size, int64_t num_blocks);

// Every non-negative slot must lie in the cache's num_slots.
void check_slot_range(const char* op, const int64_t* slots, int64_t num_tokens, int64_t num_slots);

// cu_seq_lens must be non-decreasing from 0 up to at most out_rows, and every block a sequence uses
// must be a block_table column that names a block of the cache.
void check_gather_ranges(const char* op, const int32_t* block_table, int64_t table_row_stride,
                         int64_t table_cols, const int32_t* cu_seq_lens, int64_t batch, int64_t block_size,
                         int64_t num_blocks, int64_t out_rows);

}  // namespace vllm_nvfp4
