"""The compiled `torch.ops.vllm_nvfp4` ops: loads the extension, registers fake implementations, wraps the ops.

Every op writes into its output arguments and returns nothing, so the fake implementations only check what
a fake (meta) run can check — that all tensors share one device — and return None.
"""

from __future__ import annotations

import torch

from . import _C  # noqa: F401  (importing the extension registers the ops)

_ops = torch.ops.vllm_nvfp4


def _check_same_device(op: str, **tensors: torch.Tensor) -> None:
    (first_name, first), *rest = tensors.items()
    for name, t in rest:
        if t.device != first.device:
            raise RuntimeError(f"{op}: {name}: must be on {first_name}'s device ({first.device}), got {t.device}")


@torch.library.register_fake("vllm_nvfp4::reshape_and_cache_nvfp4")
def _(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale, swizzle_v_scales):
    _check_same_device("reshape_and_cache_nvfp4", key_cache=key_cache, value_cache=value_cache, key=key,
                       value=value, slot_mapping=slot_mapping, k_scale=k_scale, v_scale=v_scale)


@torch.library.register_fake("vllm_nvfp4::reshape_and_cache_nvfp4_4over6")
def _(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale, swizzle_v_scales):
    _check_same_device("reshape_and_cache_nvfp4_4over6", key_cache=key_cache, value_cache=value_cache, key=key,
                       value=value, slot_mapping=slot_mapping, k_scale=k_scale, v_scale=v_scale)


@torch.library.register_fake("vllm_nvfp4::gather_nvfp4_kv_cache")
def _(key_cache, value_cache, block_table, cu_seq_lens, k_scale, v_scale, swizzle_v_scales, out_key, out_value):
    _check_same_device("gather_nvfp4_kv_cache", key_cache=key_cache, value_cache=value_cache,
                       block_table=block_table, cu_seq_lens=cu_seq_lens, k_scale=k_scale, v_scale=v_scale,
                       out_key=out_key, out_value=out_value)


@torch.library.register_fake("vllm_nvfp4::indexer_k_quant_and_cache")
def _(k, kv_cache, slot_mapping, quant_block_size, scale_fmt):
    _check_same_device("indexer_k_quant_and_cache", kv_cache=kv_cache, k=k, slot_mapping=slot_mapping)


@torch.library.register_fake("vllm_nvfp4::cp_gather_indexer_k_quant_cache")
def _(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens):
    _check_same_device("cp_gather_indexer_k_quant_cache", kv_cache=kv_cache, dst_k=dst_k, dst_scale=dst_scale,
                       block_table=block_table, cu_seq_lens=cu_seq_lens)


@torch.library.register_fake("vllm_nvfp4::indexer_mqa_logits")
def _(q, k, k_scale, weights, ks, ke, logits):
    _check_same_device("indexer_mqa_logits", q=q, k=k, k_scale=k_scale, weights=weights, ks=ks, ke=ke, logits=logits)


@torch.library.register_fake("vllm_nvfp4::indexer_paged_mqa_logits")
def _(q, kv_cache, weights, context_lens, block_table, quant_block_size, logits):
    _check_same_device("indexer_paged_mqa_logits", q=q, kv_cache=kv_cache, weights=weights, context_lens=context_lens,
                       block_table=block_table, logits=logits)


@torch.library.register_fake("vllm_nvfp4::nvfp4_paged_attention")
def _(query, key_cache, value_cache, block_table, query_start_loc, seq_lens, k_scale, v_scale, scale, causal,
      swizzle_v_scales, max_query_len, max_seq_len, out, sliding_window=0, logits_soft_cap=0.0, sinks=None):
    _check_same_device("nvfp4_paged_attention", query=query, key_cache=key_cache, value_cache=value_cache,
                       block_table=block_table, query_start_loc=query_start_loc, seq_lens=seq_lens,
                       k_scale=k_scale, v_scale=v_scale, out=out,
                       **({"sinks": sinks} if sinks is not None else {}))


def reshape_and_cache_nvfp4(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                            value_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: torch.Tensor,
                            v_scale: torch.Tensor, swizzle_v_scales: bool) -> None:
    """Quantize `key`/`value` `[n, heads, head_size]` to NVFP4 into their slots (docs/FORMATS.md §1)."""
    _ops.reshape_and_cache_nvfp4(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale,
                                 swizzle_v_scales)


def reshape_and_cache_nvfp4_4over6(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                                   value_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: torch.Tensor,
                                   v_scale: torch.Tensor, swizzle_v_scales: bool) -> None:
    """Like `reshape_and_cache_nvfp4`, each group's block scale from max/6 or max/4, whichever reconstructs it
    with the smaller squared error (vLLM's "nvfp4_4over6"); the page layout and the read path are unchanged."""
    _ops.reshape_and_cache_nvfp4_4over6(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale,
                                        swizzle_v_scales)


def gather_nvfp4_kv_cache(key_cache: torch.Tensor, value_cache: torch.Tensor, block_table: torch.Tensor,
                          cu_seq_lens: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor,
                          swizzle_v_scales: bool, out_key: torch.Tensor, out_value: torch.Tensor) -> None:
    """Dequantize every cached token of each sequence into row `cu_seq_lens[b] + p` of `out_key`/`out_value`."""
    _ops.gather_nvfp4_kv_cache(key_cache, value_cache, block_table, cu_seq_lens, k_scale, v_scale,
                               swizzle_v_scales, out_key, out_value)


def indexer_k_quant_and_cache(k: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                              quant_block_size: int, scale_fmt: str) -> None:
    """Quantize indexer keys `[n, head_dim]` to FP8 with per-block scales into their slots (docs/FORMATS.md §2)."""
    _ops.indexer_k_quant_and_cache(k, kv_cache, slot_mapping, quant_block_size, scale_fmt)


def cp_gather_indexer_k_quant_cache(kv_cache: torch.Tensor, dst_k: torch.Tensor, dst_scale: torch.Tensor,
                                    block_table: torch.Tensor, cu_seq_lens: torch.Tensor) -> None:
    """Copy each sequence's cached FP8 keys and scale bytes into contiguous rows of `dst_k`/`dst_scale`."""
    _ops.cp_gather_indexer_k_quant_cache(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens)


def indexer_mqa_logits(q: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor, weights: torch.Tensor,
                       ks: torch.Tensor, ke: torch.Tensor, logits: torch.Tensor) -> None:
    """`logits[m, n] = Σ_h weights[m,h] · relu(q[m,h] · k[n] · k_scale[n])` for keys `[ks[m], ke[m])`, -inf elsewhere."""
    _ops.indexer_mqa_logits(q, k, k_scale, weights, ks, ke, logits)


def indexer_paged_mqa_logits(q: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor,
                             context_lens: torch.Tensor, block_table: torch.Tensor, quant_block_size: int,
                             logits: torch.Tensor) -> None:
    """The same logits for `q [B, n, H, D]` read from request b's cache pages, -inf from `context_lens[b, j]` on."""
    _ops.indexer_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, quant_block_size, logits)


def nvfp4_paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                          block_table: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                          k_scale: torch.Tensor, v_scale: torch.Tensor, scale: float, causal: bool,
                          swizzle_v_scales: bool, max_query_len: int, max_seq_len: int, out: torch.Tensor,
                          sliding_window: int = 0, logits_soft_cap: float = 0.0,
                          sinks: torch.Tensor | None = None) -> None:
    """Attention of `query [T, Hq, D]` over the NVFP4 pages into `out` (same shape), reading the codes directly.

    Request r owns query rows `query_start_loc[r]:query_start_loc[r+1]`, the last positions of its `seq_lens[r]`
    cached tokens (pages `block_table[r]`); `causal` masks each query to the keys up to its own position. Rows past
    `query_start_loc[-1]` are not written. `max_query_len`/`max_seq_len` are host-side upper bounds of the batch's
    lengths for launch planning (no device read-back); `k_scale`/`v_scale` are the caches' float32 global scales.

    Model features (vLLM's FlashAttention definitions): `sliding_window` w > 0 lets the query at position p see
    only keys at positions > p - w; `logits_soft_cap` c > 0 maps each scaled logit s to c·tanh(s / c); `sinks`
    (float32 `[Hq]`) adds one logit per query head to the softmax's denominator only.
    """
    _ops.nvfp4_paged_attention(query, key_cache, value_cache, block_table, query_start_loc, seq_lens, k_scale,
                               v_scale, scale, causal, swizzle_v_scales, max_query_len, max_seq_len, out,
                               sliding_window, logits_soft_cap, sinks)
