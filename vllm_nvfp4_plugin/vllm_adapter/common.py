"""Adapter pieces both backends share: vLLM's batch metadata and layer arguments → the attention core."""

from __future__ import annotations

import torch
from vllm.v1.attention.backend import AttentionType, CommonAttentionMetadata

from ..attention import NVFP4AttentionMetadata, check_supported
from .spec import check_nvfp4_kv_cache_dtype


def check_nvfp4_layer(kv_cache_dtype: str, attn_type: str, head_size: int, num_heads: int, num_kv_heads: int,
                      *, sliding_window=None, logits_soft_cap=None, alibi_slopes=None, sinks=None) -> None:
    """Raise, at model construction (engine start), naming what an NVFP4-cached layer asks that the core lacks."""
    check_nvfp4_kv_cache_dtype(kv_cache_dtype)
    if attn_type != AttentionType.DECODER:
        raise NotImplementedError(f"NVFP4 KV cache supports decoder attention only, got attn_type={attn_type!r}")
    check_supported(head_size, num_heads, num_kv_heads, sliding_window=sliding_window,
                    logits_soft_cap=logits_soft_cap, alibi_slopes=alibi_slopes, sinks=sinks)


def core_metadata(common: CommonAttentionMetadata) -> NVFP4AttentionMetadata:
    """The core's view of one batch; `num_actual_tokens` bounds the stored slots (the rest is padding)."""
    if isinstance(common.causal, torch.Tensor):
        raise NotImplementedError("NVFP4 KV cache attention takes one causal flag per batch, "
                                  "not per-request causality")
    return NVFP4AttentionMetadata(
        query_start_loc=common.query_start_loc,
        seq_lens=common.seq_lens,
        block_table=common.block_table_tensor,
        slot_mapping=common.slot_mapping[:common.num_actual_tokens],
        causal=bool(common.causal),
        max_query_len=common.max_query_len,
        max_seq_len=common.max_seq_len,
    )
