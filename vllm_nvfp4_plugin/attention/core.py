"""Attention over the NVFP4 paged KV cache, independent of vLLM.

A step stores its keys and values into the cache, then every query reads its keys and values through the
quantized cache, whether it is a decode step, a prefill chunk over a cached prefix, or a whole prompt.

`paged_attention` runs a whole batch in one call of the plugin's `nvfp4_paged_attention` op on CPU tensors (it
reads the NVFP4 pages directly). `paged_attention_reference` is the same contract in plain ops: it gathers and
dequantizes every request's context into a float32 workspace and attends with torch's SDPA, each request on its
own slice (a decode step unmasked, a whole prompt with SDPA's causal mask, a chunk after cached context with a
causal mask whose diagonal is offset by the context before it). It serves the other devices and is the tests'
second reference.
"""

from __future__ import annotations

from collections.abc import Collection

import torch
import torch.nn.functional as F

from .. import ops as kv_ops
from ..layout import NVFP4PageLayout
from .metadata import NVFP4AttentionMetadata

SUPPORTED_HEAD_SIZES = (64, 128, 256)
COMPUTE_DTYPE = torch.float32  # dequantized K/V and the softmax; AVX2 CPUs multiply fp32 fastest
# The model features `nvfp4_paged_attention` serves on CPU; a backend names the ones its kernels serve.
MODEL_FEATURES = ("sliding_window", "logits_soft_cap", "sinks")


def check_supported(head_size: int, num_heads: int, num_kv_heads: int, *, sliding_window: int | None = None,
                    logits_soft_cap: float | None = None, alibi_slopes=None, sinks=None,
                    supported_features: Collection[str] = ()) -> None:
    """Raise naming the first argument this attention cannot honour (checked once, at engine start).

    `supported_features` are the MODEL_FEATURES the calling backend serves; the others are refused, and ALiBi
    always is."""
    if head_size not in SUPPORTED_HEAD_SIZES:
        raise ValueError(f"NVFP4 KV cache attention supports head_size in {SUPPORTED_HEAD_SIZES}, got {head_size}")
    if num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a positive multiple of num_kv_heads ({num_kv_heads})")
    unknown = set(supported_features) - set(MODEL_FEATURES)
    if unknown:
        raise ValueError(f"supported_features must be among {MODEL_FEATURES}, got {sorted(unknown)}")
    if sliding_window is not None and sliding_window != -1:
        if "sliding_window" not in supported_features:
            raise NotImplementedError(f"NVFP4 KV cache attention does not support sliding window "
                                      f"(sliding_window={sliding_window})")
        if sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive (None or -1: no window), got {sliding_window}")
    if logits_soft_cap and "logits_soft_cap" not in supported_features:
        raise NotImplementedError(f"NVFP4 KV cache attention does not support logits soft-cap "
                                  f"(logits_soft_cap={logits_soft_cap})")
    if alibi_slopes is not None:
        raise NotImplementedError("NVFP4 KV cache attention does not support ALiBi (alibi_slopes given)")
    if sinks is not None:
        if "sinks" not in supported_features:
            raise NotImplementedError("NVFP4 KV cache attention does not support attention sinks (sinks given)")
        if tuple(sinks.shape) != (num_heads,):
            raise ValueError(f"sinks must have one value per query head, shape ({num_heads},), "
                             f"got {tuple(sinks.shape)}")


# A layer's cache: `[num_blocks, 2, block_size, num_heads, full_dim]` uint8 (NVFP4 keys), or the pair
# (key_cache, value_cache) of `[num_blocks, block_size, num_heads, ·]` views that every key format has.
KVCache = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


def cache_sides(kv_cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
    """(key_cache, value_cache) of either form; raises naming the rule a malformed cache breaks."""
    if isinstance(kv_cache, tuple):
        key_cache, value_cache = kv_cache
        if key_cache.dtype != torch.uint8 or value_cache.dtype != torch.uint8:
            raise ValueError(f"key_cache and value_cache must be uint8, got {key_cache.dtype} and {value_cache.dtype}")
        return key_cache, value_cache
    if kv_cache.dtype != torch.uint8 or kv_cache.dim() != 5 or kv_cache.size(1) != 2:
        raise ValueError(f"kv_cache must be uint8 [num_blocks, 2, block_size, num_heads, full_dim], "
                         f"got {kv_cache.dtype} of shape {tuple(kv_cache.shape)}")
    return kv_cache[:, 0], kv_cache[:, 1]


def cache_layout(kv_cache: KVCache, swizzle_v_scales: bool = False) -> NVFP4PageLayout:
    """Layout of a cache (NHD or HND; NVFP4 or FP8 keys)."""
    return NVFP4PageLayout.from_caches(*cache_sides(kv_cache), swizzle_v_scales)


def store_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: KVCache, slot_mapping: torch.Tensor,
             k_scale: torch.Tensor, v_scale: torch.Tensor, swizzle_v_scales: bool = False,
             four_over_six: bool = False) -> None:
    """Quantize the first `len(slot_mapping)` tokens of `key`/`value` `[n, kv_heads, head]` into their slots;
    `four_over_six` takes vLLM's "nvfp4_4over6" block scales."""
    sides = cache_sides(kv_cache)
    NVFP4PageLayout.from_caches(*sides, swizzle_v_scales)  # raises naming the rule a malformed cache breaks
    store = kv_ops.reshape_and_cache_nvfp4_4over6 if four_over_six else kv_ops.reshape_and_cache_nvfp4
    store(key, value, *sides, slot_mapping, k_scale, v_scale, swizzle_v_scales)


class DequantWorkspace:
    """Float32 buffers for one batch's dequantized K and V, grown on demand and reused across layers
    (layers run one after another, so one workspace per process is enough)."""

    def __init__(self):
        self._key = self._value = None

    def get(self, num_tokens: int, num_heads: int, head_size: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (num_tokens, num_heads, head_size)
        numel = num_tokens * num_heads * head_size
        if self._key is None or self._key.numel() < numel or self._key.device != torch.device(device):
            self._key = torch.empty(numel, dtype=COMPUTE_DTYPE, device=device)
            self._value = torch.empty(numel, dtype=COMPUTE_DTYPE, device=device)
        return self._key[:numel].view(shape), self._value[:numel].view(shape)


def _check_batch(query: torch.Tensor, layout: NVFP4PageLayout, metadata: NVFP4AttentionMetadata,
                 out: torch.Tensor) -> tuple[list[int], list[int]]:
    """(query_start_loc, seq_lens) as lists; raises naming the rule a batch breaks."""
    num_tokens, num_heads, head_size = query.shape
    if head_size != layout.head_size or num_heads % layout.num_heads:
        raise ValueError(f"query [tokens, heads, head] = {tuple(query.shape)} does not fit the cache's "
                         f"{layout.num_heads} KV heads of size {layout.head_size}")
    if out.shape != query.shape:
        raise ValueError(f"out must have the query's shape {tuple(query.shape)}, got {tuple(out.shape)}")
    query_start = metadata.query_start_loc.tolist()
    seq_lens = metadata.seq_lens.tolist()
    if query_start[-1] > num_tokens:
        raise ValueError(f"query_start_loc[-1] = {query_start[-1]} exceeds the {num_tokens} query tokens")
    query_lens = [query_start[r + 1] - query_start[r] for r in range(metadata.num_reqs)]
    if any(q > s for q, s in zip(query_lens, seq_lens)):
        raise ValueError(f"each request's seq_lens must include its query tokens, got query lens {query_lens} "
                         f"and seq_lens {seq_lens}")
    return query_start, seq_lens


def paged_attention(query: torch.Tensor, kv_cache: KVCache, metadata: NVFP4AttentionMetadata, scale: float,
                    k_scale: torch.Tensor, v_scale: torch.Tensor, out: torch.Tensor, *,
                    swizzle_v_scales: bool = False, workspace: DequantWorkspace | None = None,
                    sliding_window: int = 0, logits_soft_cap: float = 0.0,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of `query` `[num_tokens, num_heads, head]` over the NVFP4 cache into `out` (same shape).

    Rows past `metadata.num_query_tokens` (padding) are left untouched. `k_scale`/`v_scale` are the
    float32 global dequant scales the cache was written with. CPU tensors take the plugin's kernel, with the
    metadata's host-side length bounds where set and the batch's own lengths otherwise; other devices take
    `paged_attention_reference` (with `workspace`). The model features (`nvfp4_paged_attention`'s
    `sliding_window`, `logits_soft_cap`, float32 `sinks`) are the kernel's: other devices refuse them.
    """
    if not query.is_cpu:
        if sliding_window or logits_soft_cap or sinks is not None:
            raise NotImplementedError(f"paged_attention on {query.device.type}: sliding window, soft-cap and sinks "
                                      "are served by the CPU kernel only")
        return paged_attention_reference(query, kv_cache, metadata, scale, k_scale, v_scale, out,
                                         swizzle_v_scales=swizzle_v_scales, workspace=workspace)
    sides = cache_sides(kv_cache)
    layout = NVFP4PageLayout.from_caches(*sides, swizzle_v_scales)
    query_start, seq_lens = _check_batch(query, layout, metadata, out)
    max_query_len = metadata.max_query_len or max((e - s for s, e in zip(query_start, query_start[1:])), default=0)
    max_seq_len = metadata.max_seq_len or max(seq_lens, default=0)
    kv_ops.nvfp4_paged_attention(query, *sides, metadata.block_table,
                                 metadata.query_start_loc, metadata.seq_lens, k_scale, v_scale, scale,
                                 metadata.causal, swizzle_v_scales, max_query_len, max_seq_len, out, sliding_window,
                                 logits_soft_cap, sinks)
    return out


def paged_attention_reference(query: torch.Tensor, kv_cache: KVCache, metadata: NVFP4AttentionMetadata,
                              scale: float, k_scale: torch.Tensor, v_scale: torch.Tensor, out: torch.Tensor, *,
                              swizzle_v_scales: bool = False,
                              workspace: DequantWorkspace | None = None) -> torch.Tensor:
    """`paged_attention` by gathering each request's context into a float32 workspace and torch's SDPA."""
    layout = cache_layout(kv_cache, swizzle_v_scales)
    query_start, seq_lens = _check_batch(query, layout, metadata, out)
    context_start = [0]
    for s in seq_lens:
        context_start.append(context_start[-1] + s)
    workspace = workspace or DequantWorkspace()
    key, value = workspace.get(context_start[-1], layout.num_heads, layout.head_size, query.device)
    cu_seq_lens = torch.tensor(context_start, dtype=torch.int32).to(query.device)
    kv_ops.gather_nvfp4_kv_cache(*cache_sides(kv_cache), metadata.block_table, cu_seq_lens,
                                 k_scale, v_scale, swizzle_v_scales, key, value)

    for r in range(metadata.num_reqs):
        if query_start[r + 1] > query_start[r]:
            q_slice = slice(query_start[r], query_start[r + 1])
            kv_slice = slice(context_start[r], context_start[r + 1])
            out[q_slice] = _attend(query[q_slice], key[kv_slice], value[kv_slice], scale, metadata.causal)
    return out


def _attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, causal: bool):
    """One request: `query` `[n, heads, head]` are the last n of the `[c, kv_heads, head]` context."""
    n, c = query.size(0), key.size(0)
    mask = None
    if causal and 1 < n < c:  # query i sits at context position c - n + i and sees keys up to it
        mask = torch.arange(c, device=query.device) <= torch.arange(n, device=query.device)[:, None] + (c - n)
    # 4-D inputs take torch's fused CPU kernel (3-D ones fall back to the unfused math path).
    o = F.scaled_dot_product_attention(query.transpose(0, 1).to(COMPUTE_DTYPE)[None], key.transpose(0, 1)[None],
                                       value.transpose(0, 1)[None], attn_mask=mask, is_causal=causal and n == c > 1,
                                       scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)
