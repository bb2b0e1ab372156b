// The `vllm_nvfp4` op library: the op schemas (mirroring vLLM's own ops) and the `_C` Python module
// whose import loads this shared object and so runs the registrations. Kernels register per device in
// cpu_ops.cpp and cuda/.
#include <Python.h>

#include <torch/csrc/stable/library.h>

extern "C" {
// An empty module: importing vllm_nvfp4_plugin._C is only a way to dlopen this library.
PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
}

STABLE_TORCH_LIBRARY(vllm_nvfp4, m) {
  m.def("reshape_and_cache_nvfp4(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
        "Tensor slot_mapping, Tensor k_scale, Tensor v_scale, bool swizzle_v_scales) -> ()");
  // vLLM's "nvfp4_4over6": the same page, each group's block scale from max/6 or max/4, whichever errs less.
  m.def("reshape_and_cache_nvfp4_4over6(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
        "Tensor slot_mapping, Tensor k_scale, Tensor v_scale, bool swizzle_v_scales) -> ()");
  m.def("gather_nvfp4_kv_cache(Tensor key_cache, Tensor value_cache, Tensor block_table, Tensor cu_seq_lens, "
        "Tensor k_scale, Tensor v_scale, bool swizzle_v_scales, Tensor(a!) out_key, Tensor(b!) out_value) -> ()");
  m.def("indexer_k_quant_and_cache(Tensor k, Tensor(a!) kv_cache, Tensor slot_mapping, int quant_block_size, "
        "str scale_fmt) -> ()");
  m.def("cp_gather_indexer_k_quant_cache(Tensor kv_cache, Tensor(a!) dst_k, Tensor(b!) dst_scale, "
        "Tensor block_table, Tensor cu_seq_lens) -> ()");
  // The lightning indexer's FP8 MQA logits, Σ_h w·relu(q_h·k)·scale, over gathered keys and from the pages.
  m.def("indexer_mqa_logits(Tensor q, Tensor k, Tensor k_scale, Tensor weights, Tensor ks, Tensor ke, "
        "Tensor(a!) logits) -> ()");
  m.def("indexer_paged_mqa_logits(Tensor q, Tensor kv_cache, Tensor weights, Tensor context_lens, "
        "Tensor block_table, int quant_block_size, Tensor(a!) logits) -> ()");
  // Paged attention read straight from the NVFP4 cache: decode, prefill and chunked prefill in one call, with an
  // optional sliding window, logit soft-cap and per-head attention sinks.
  m.def("nvfp4_paged_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_table, "
        "Tensor query_start_loc, Tensor seq_lens, Tensor k_scale, Tensor v_scale, float scale, bool causal, "
        "bool swizzle_v_scales, int max_query_len, int max_seq_len, Tensor(a!) out, int sliding_window=0, "
        "float logits_soft_cap=0., Tensor? sinks=None) -> ()");
}
