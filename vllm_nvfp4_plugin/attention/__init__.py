"""Attention over the NVFP4 paged KV cache, independent of vLLM (the backends adapt vLLM to it)."""

from .core import (MODEL_FEATURES, SUPPORTED_HEAD_SIZES, DequantWorkspace, cache_layout, cache_sides, check_supported,
                   paged_attention, store_kv)
from .metadata import NVFP4AttentionMetadata

__all__ = ["MODEL_FEATURES", "SUPPORTED_HEAD_SIZES", "DequantWorkspace", "NVFP4AttentionMetadata", "cache_layout",
           "cache_sides", "check_supported", "paged_attention", "store_kv"]
