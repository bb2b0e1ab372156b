"""FlashInfer attention variants the CUDA prefill compiles for itself (plain torch and FlashInfer, no extension, so
the benchmark can build them while the extension builds)."""

from __future__ import annotations

import torch


def fa3_sink_jit_args(dtype: torch.dtype, head_size: int, windowed: bool) -> tuple[list, dict]:
    """`jit_args`, `jit_kwargs` of a `BatchPrefillWithRaggedKVCacheWrapper` running FlashInfer's fa3 `AttentionSink`
    variant, where each head's sink logit joins the online softmax. FlashInfer's own sink wrapper is paged-only; this
    is the same module (its name, its build options), so a FlashInfer AOT cache holding it serves it as is. The
    wrapper's `run` then takes `(q, k, v, sinks float32 [num_q_heads], sm_scale)`."""
    from flashinfer.jit.attention.modules import get_batch_prefill_attention_sink_uri
    from flashinfer.jit.attention.variants import attention_sink_decl

    uri = get_batch_prefill_attention_sink_uri("fa3", dtype, dtype, dtype, torch.int32, head_size, head_size, 0,
                                               windowed)
    args = [uri, dtype, dtype, dtype, torch.int32, head_size, head_size, ["sink"], ["float"], ["sm_scale"],
            ["double"], "AttentionSink", attention_sink_decl["fa3"]]
    kwargs = {"pos_encoding_mode": 0, "use_sliding_window": windowed, "paged_kv_stride_mode": "runtime",
              "module_surface": "full"}
    return args, kwargs
