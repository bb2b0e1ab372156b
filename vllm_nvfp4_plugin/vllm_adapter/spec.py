"""How vLLM's KV-cache spec and allocation map onto the NVFP4 page of docs/FORMATS.md §1.

vLLM sizes a layer's page from its `AttentionSpec` and hands the layer a view `[num_blocks, H, N, C]`
of it (H head slots, N = block_size, C bytes), in the physical order of the resolved `KVCacheLayout`.
For NVFP4 the backend publishes H = 2·num_kv_heads and C = head/2 + head/16 (`customize_nvfp4_spec`),
so a page has exactly the bytes of `NVFP4PageLayout.page_bytes`; `page_view` then reads those bytes as
`[K side | V side]`, each `[DATA | SCALES]`, token-major (NHD) or head-major (HND) as the layout says.
With FP8 or INT8 keys the sides differ in size: H = num_kv_heads and C = key_dim + head/2 + head/16 (K's FP8 bytes, or
its int8 codes and fp16 scale, and V's NVFP4 bytes of one token and head), and `page_view` returns the (key_cache,
value_cache) pair over the same bytes.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout

from ..attention.core import SUPPORTED_HEAD_SIZES
from ..layout import INT8_KEY_SCALE_BYTES, NVFP4PageLayout

NVFP4_KV_CACHE_DTYPE = "nvfp4"
# vLLM's NVFP4 variant whose groups take the max/6 or the max/4 block scale: same page, same read path.
NVFP4_4OVER6_KV_CACHE_DTYPE = "nvfp4_4over6"
# FP8 E4M3 keys and NVFP4 values: a name the plugin registers where vLLM has `register_kv_cache_dtype` (0.33); on
# 0.32 the same page is "nvfp4" with the key_format option.
FP8_KEYS_KV_CACHE_DTYPE = "nvfp4_k8v4"
# INT8 keys (one fp16 scale per token and head) and NVFP4 values, the same way.
INT8_KEYS_KV_CACHE_DTYPE = "nvfp4_ki8v4"
# The key format each plugin-registered name fixes.
KEY_FORMAT_OF_KV_CACHE_DTYPE = {FP8_KEYS_KV_CACHE_DTYPE: "fp8", INT8_KEYS_KV_CACHE_DTYPE: "int8"}
NVFP4_KV_CACHE_DTYPES = (NVFP4_KV_CACHE_DTYPE, NVFP4_4OVER6_KV_CACHE_DTYPE, FP8_KEYS_KV_CACHE_DTYPE,
                         INT8_KEYS_KV_CACHE_DTYPE)
# Layouts in which each block's [H, N, C] bytes are one run: head-major (HND) or token-major (NHD) interiors.
HND_LAYOUTS = (KVCacheLayout.LBHNC, KVCacheLayout.BLHNC)
NHD_LAYOUTS = (KVCacheLayout.LBNHC, KVCacheLayout.BLNHC)


def check_nvfp4_kv_cache_dtype(kv_cache_dtype: str) -> None:
    """The plugin serves vLLM's "nvfp4" and "nvfp4_4over6", and its own "nvfp4_k8v4" and "nvfp4_ki8v4"; other NVFP4
    variants are refused."""
    if kv_cache_dtype.startswith("nvfp4") and kv_cache_dtype not in NVFP4_KV_CACHE_DTYPES:
        raise NotImplementedError(f"kv_cache_dtype={kv_cache_dtype!r} is not supported by vllm_nvfp4_plugin; "
                                  f"use one of {NVFP4_KV_CACHE_DTYPES}")


def customize_nvfp4_spec(spec: AttentionSpec, key_format: str = "nvfp4") -> AttentionSpec:
    """`spec` with the NVFP4 page packing of `key_format` (FP8 or INT8 keys: one head slot per KV head holding both
    sides' bytes); specs of other dtypes (or already packed) come back unchanged."""
    if not spec.kv_quant_mode.is_nvfp4 or spec.state_content_bytes is not None:
        return spec
    if spec.head_size_v != spec.head_size:
        raise NotImplementedError(f"NVFP4 KV cache needs equal K and V head sizes, got head_size={spec.head_size} "
                                  f"and head_size_v={spec.head_size_v}")
    if spec.head_size not in SUPPORTED_HEAD_SIZES:
        raise ValueError(f"NVFP4 KV cache supports head_size in {SUPPORTED_HEAD_SIZES}, got {spec.head_size}")
    if spec.dtype.itemsize != 1:
        raise ValueError(f"NVFP4 KV cache spec must have a 1-byte dtype (uint8), got {spec.dtype}")
    layout = NVFP4PageLayout(spec.head_size, spec.block_size, spec.num_kv_heads, key_format=key_format)
    if key_format != "nvfp4":
        return replace(spec, num_head_slots=spec.num_kv_heads, state_content_bytes=layout.key_dim + layout.full_dim)
    return replace(spec, num_head_slots=2 * spec.num_kv_heads, state_content_bytes=layout.full_dim)


def spec_has_fp8_keys(spec: AttentionSpec) -> bool:
    """Whether `customize_nvfp4_spec` packed `spec` as the FP8-key page (one head slot per KV head of head · 25/16
    bytes)."""
    return (spec.state_content_bytes is not None and spec.num_head_slots == spec.num_kv_heads
            and spec.state_content_bytes * 16 == spec.head_size * 25)


def spec_key_format(spec: AttentionSpec) -> str:
    """The key format `customize_nvfp4_spec` packed `spec` with: "fp8", "int8" (one head slot per KV head of head ·
    25/16 + 2 bytes) or "nvfp4"."""
    if spec_has_fp8_keys(spec):
        return "fp8"
    if (spec.state_content_bytes is not None and spec.num_head_slots == spec.num_kv_heads
            and (spec.state_content_bytes - INT8_KEY_SCALE_BYTES) * 16 == spec.head_size * 25):
        return "int8"
    return "nvfp4"


def page_view(kv_cache: torch.Tensor, num_kv_heads: int):
    """vLLM's layer view `[num_blocks, 2·num_kv_heads, block_size, full_dim]` (NHD or HND layouts above) as
    the `[num_blocks, 2, block_size, num_kv_heads, full_dim]` cache of docs/FORMATS.md, over the same bytes; an FP8- or
    INT8-key view `[num_blocks, num_kv_heads, block_size, key_dim + full_dim]` as its (key_cache, value_cache) pair."""
    if kv_cache.dtype == torch.uint8 and kv_cache.dim() == 4 and kv_cache.size(1) == num_kv_heads:
        return _byte_key_sides(kv_cache, num_kv_heads)
    if kv_cache.dtype != torch.uint8 or kv_cache.dim() != 4 or kv_cache.size(1) != 2 * num_kv_heads:
        raise ValueError(f"NVFP4 kv_cache must be uint8 [num_blocks, 2*num_kv_heads={2 * num_kv_heads}, block_size, "
                         f"full_dim], got {kv_cache.dtype} of shape {tuple(kv_cache.shape)}")
    num_blocks, num_slots, block_size, full_dim = kv_cache.shape
    strides = kv_cache.stride()
    if strides[1:] == (block_size * full_dim, full_dim, 1):  # [H, N, C]: head-major
        token_stride, head_stride = full_dim, block_size * full_dim
    elif strides[1:] == (full_dim, num_slots * full_dim, 1):  # [N, H, C]: token-major
        token_stride, head_stride = num_kv_heads * full_dim, full_dim
    else:
        raise ValueError(f"NVFP4 kv_cache pages must be dense [H, N, C] (HND) or [N, H, C] (NHD), got strides "
                         f"{strides} for shape {tuple(kv_cache.shape)}")
    side_bytes = num_kv_heads * block_size * full_dim
    return kv_cache.as_strided((num_blocks, 2, block_size, num_kv_heads, full_dim),
                               (strides[0], side_bytes, token_stride, head_stride, 1), kv_cache.storage_offset())


def _byte_key_sides(kv_cache: torch.Tensor, num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    num_blocks, _, block_size, entry = kv_cache.shape
    # entry = head + head/2 + head/16 (FP8 keys) or that + 2 (INT8 keys): 32 is no multiple of 25, so one fits
    key_format = "fp8" if entry * 16 % 25 == 0 else "int8"
    head_size, rem = divmod((entry - (key_format == "int8") * INT8_KEY_SCALE_BYTES) * 16, 25)
    strides = kv_cache.stride()
    hnd = strides[1:] == (block_size * entry, entry, 1)
    if rem or not (hnd or strides[1:] == (entry, num_kv_heads * entry, 1)):
        raise ValueError(f"FP8- and INT8-key kv_cache pages must be dense [H, N, C] (HND) or [N, H, C] (NHD) with C = "
                         f"head_size * 25/16 (+ 2 for INT8 keys), got shape {tuple(kv_cache.shape)} and strides "
                         f"{strides}")
    layout = NVFP4PageLayout(head_size, block_size, num_kv_heads, hnd, key_format=key_format)
    pages = kv_cache.as_strided((num_blocks, layout.page_bytes), (strides[0], 1), kv_cache.storage_offset())
    return layout.side_views(pages)
