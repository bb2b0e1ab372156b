"""Builders of op inputs shared by the op tests and the fuzz tests.

Each builder makes the same inputs on any device from a seed, so a test can run the compiled op on the
device under test and `vllm_nvfp4_plugin.reference` on the CPU and compare the bytes. Caches sit in a
flat buffer with a guard block on each side and optional padding after every block, so comparing the
whole buffer also proves nothing was written outside the cache's blocks or into the padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_nvfp4_plugin.layout import IndexerCacheLayout, NVFP4PageLayout

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view of a tensor's bytes, so comparisons are bit for bit (NaN, -0 included)."""
    return t.contiguous().view(torch.uint8)


def _log_uniform(g: torch.Generator, shape, lo_exp: float, hi_exp: float) -> torch.Tensor:
    return 2.0 ** (torch.rand(shape, generator=g) * (hi_exp - lo_exp) + lo_exp)


# --- NVFP4 KV cache ------------------------------------------------------------------------------

@dataclass(frozen=True)
class NVFP4Case:
    head_size: int = 128
    num_heads: int = 2
    block_size: int = 16
    num_blocks: int = 6
    num_tokens: int = 40
    dtype: torch.dtype = torch.bfloat16
    hnd: bool = False
    swizzle_v_scales: bool = False
    row_pad: int = 0  # extra elements per key/value row: slices of a fused QKV tensor
    block_pad: int = 0  # bytes of padding after each cache page
    negative_slots: float = 0.1
    seed: int = 0
    key_format: str = "nvfp4"

    @property
    def layout(self) -> NVFP4PageLayout:
        return NVFP4PageLayout(self.head_size, self.block_size, self.num_heads, self.hnd, self.swizzle_v_scales,
                               self.key_format)


def nvfp4_cache(case: NVFP4Case, device, fill: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(whole buffer, kv_cache view `[num_blocks, 2, block_size, num_heads, full_dim]`) between guard pages."""
    layout = case.layout
    page_stride = layout.page_bytes + case.block_pad
    buffer = torch.full(((case.num_blocks + 2) * page_stride,), fill, dtype=torch.uint8, device=device)
    entry = layout.full_dim
    if case.hnd:
        strides = (page_stride, layout.side_bytes, entry, case.block_size * entry, 1)
    else:
        strides = (page_stride, layout.side_bytes, case.num_heads * entry, entry, 1)
    kv_cache = buffer.as_strided(layout.kv_cache_shape(case.num_blocks), strides, page_stride)
    return buffer, kv_cache


def nvfp4_sides(case: NVFP4Case, device, fill: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(whole buffer, key_cache, value_cache) between guard pages, for either key format."""
    layout = case.layout
    page_stride = layout.page_bytes + case.block_pad
    buffer = torch.full(((case.num_blocks + 2) * page_stride,), fill, dtype=torch.uint8, device=device)
    pages = buffer[page_stride:(case.num_blocks + 1) * page_stride].view(case.num_blocks, page_stride)
    return (buffer, *layout.side_views(pages))


def _activations(g: torch.Generator, num_tokens: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """Gaussian rows spread over many magnitudes, with all-zero groups, -0, outliers and big values."""
    top = 5 if dtype == torch.float16 else 12  # keep fp16 outliers finite
    x = torch.randn(num_tokens, width, generator=g) * _log_uniform(g, (num_tokens, 1), -20, top)
    groups = x.view(num_tokens, width // 16, 16)
    groups[torch.rand(groups.shape[:2], generator=g) < 0.05] = 0.0
    groups[torch.rand(groups.shape[:2], generator=g) < 0.02] = -0.0
    outliers = torch.rand(x.shape, generator=g) < 0.005
    x[outliers] *= 100.0
    return x.to(dtype)


def nvfp4_store_inputs(case: NVFP4Case, device, fill: int = 0xA5) -> dict:
    """Arguments of reshape_and_cache_nvfp4 (plus the cache buffer under "buffer")."""
    g = torch.Generator().manual_seed(case.seed)
    heads = case.num_heads * case.head_size
    extra_rows = int(torch.randint(0, 3, (1,), generator=g))  # key may have more rows than slot_mapping
    rows = case.num_tokens + extra_rows
    width = heads + case.row_pad
    qkv = _activations(g, rows, 2 * width, case.dtype).to(device)
    key = qkv[:, :heads].unflatten(1, (case.num_heads, case.head_size))
    value = qkv[:, width:width + heads].unflatten(1, (case.num_heads, case.head_size))
    slots = torch.randperm(case.num_blocks * case.block_size, generator=g)[:case.num_tokens]
    skip = torch.rand(case.num_tokens, generator=g) < case.negative_slots
    slots[skip] = -torch.randint(1, 5, (int(skip.sum()),), generator=g)
    k_scale, v_scale = _log_uniform(g, (2,), -12, 6).float()
    buffer, key_cache, value_cache = nvfp4_sides(case, device, fill)
    return dict(key=key, value=value, key_cache=key_cache, value_cache=value_cache,
                slot_mapping=slots.to(device), k_scale=k_scale.reshape(1).to(device),
                v_scale=v_scale.reshape(1).to(device), swizzle_v_scales=case.swizzle_v_scales, buffer=buffer)


def random_cache_bytes(g: torch.Generator, n: int) -> torch.Tensor:
    """Random bytes for a cache; 0x7F/0xFF (the E4M3 NaNs) become 0x7E/0xFE so every scale is a number."""
    data = torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8)
    return torch.where((data & 0x7F) == 0x7F, data - 1, data)


def gather_tables(g: torch.Generator, seq_lens: list[int], block_size: int, num_blocks: int,
                  garbage: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(block_table int32 with `garbage` in every unused column and a padded row stride, cu_seq_lens int32)."""
    cols = max([(n + block_size - 1) // block_size for n in seq_lens] + [1]) + 1
    wide = torch.full((len(seq_lens), cols + 3), garbage, dtype=torch.int32)
    for b, n in enumerate(seq_lens):
        used = (n + block_size - 1) // block_size
        wide[b, :used] = torch.randint(0, num_blocks, (used,), generator=g, dtype=torch.int32)
    cu = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(seq_lens, dtype=torch.int64).cumsum(0).to(torch.int32)
    return wide[:, :cols], cu


def nvfp4_gather_inputs(case: NVFP4Case, seq_lens: list[int], device, out_dtype=None, extra_rows: int = 5,
                        poison: float = 12345.0) -> dict:
    """Arguments of gather_nvfp4_kv_cache over a cache of random bytes; output rows past the tokens hold `poison`."""
    g = torch.Generator().manual_seed(case.seed)
    buffer, key_cache, value_cache = nvfp4_sides(case, "cpu", 0)
    buffer.copy_(random_cache_bytes(g, buffer.numel()))
    if case.key_format == "int8":  # fp16 key scales of exponent 31 (inf, NaN) made finite, as E4M3 NaNs are above
        high_bytes = case.layout.key_side_bytes_view(key_cache)[:, case.layout.int8_key_scale_offset(0, 0) + 1::2]
        high_bytes[(high_bytes & 0x7C) == 0x7C] ^= 0x40
    buffer = buffer.to(device)
    key_cache, value_cache = (buffer.as_strided(c.shape, c.stride(), c.storage_offset()) for c in (key_cache, value_cache))
    table, cu = gather_tables(g, seq_lens, case.block_size, case.num_blocks, garbage=-7)
    k_scale, v_scale = _log_uniform(g, (2,), -8, 4).float()
    rows = int(cu[-1]) + extra_rows
    dtype = out_dtype or case.dtype
    # row_pad > 0: outputs are strided slices of one buffer; otherwise two contiguous tensors
    out = torch.full((rows, 2, case.num_heads, case.head_size + case.row_pad), poison, dtype=dtype, device=device)
    out_key, out_value = out[:, 0, :, :case.head_size], out[:, 1, :, :case.head_size]
    if not case.row_pad:
        out_key, out_value = out_key.contiguous(), out_value.contiguous()
    return dict(key_cache=key_cache, value_cache=value_cache, block_table=table.to(device),
                cu_seq_lens=cu.to(device), k_scale=k_scale.reshape(1).to(device), v_scale=v_scale.reshape(1).to(device),
                swizzle_v_scales=case.swizzle_v_scales, out_key=out_key, out_value=out_value)


# --- Sparse-indexer K cache -----------------------------------------------------------------------

@dataclass(frozen=True)
class IndexerCase:
    head_dim: int = 128
    quant_block_size: int = 128
    block_size: int = 64
    num_blocks: int = 5
    num_tokens: int = 100
    dtype: torch.dtype = torch.bfloat16
    block_pad: int = 0
    negative_slots: float = 0.1
    seed: int = 0

    @property
    def layout(self) -> IndexerCacheLayout:
        return IndexerCacheLayout(self.head_dim, self.block_size, self.quant_block_size)


def indexer_cache(case: IndexerCase, device, fill: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(whole buffer, kv_cache view `[num_blocks, block_size, row_bytes]`) between guard blocks."""
    layout = case.layout
    stride = layout.block_bytes + case.block_pad
    buffer = torch.full(((case.num_blocks + 2) * stride,), fill, dtype=torch.uint8, device=device)
    kv_cache = buffer.as_strided(layout.kv_cache_shape(case.num_blocks), (stride, layout.row_bytes, 1), stride)
    return buffer, kv_cache


def indexer_store_inputs(case: IndexerCase, scale_fmt: str, device, fill: int = 0xA5) -> dict:
    g = torch.Generator().manual_seed(case.seed)
    x = _activations(g, case.num_tokens, case.head_dim, case.dtype)
    slots = torch.randperm(case.num_blocks * case.block_size, generator=g)[:case.num_tokens]
    skip = torch.rand(case.num_tokens, generator=g) < case.negative_slots
    slots[skip] = -1
    buffer, kv_cache = indexer_cache(case, device, fill)
    return dict(k=x.to(device), kv_cache=kv_cache, slot_mapping=slots.to(device),
                quant_block_size=case.quant_block_size, scale_fmt=scale_fmt, buffer=buffer)


def indexer_gather_inputs(case: IndexerCase, seq_lens: list[int], device, float_scales: bool = False,
                          fp8_k: bool = False, extra_rows: int = 5, poison: int = 0xC3) -> dict:
    g = torch.Generator().manual_seed(case.seed)
    buffer, kv_cache = indexer_cache(case, "cpu", 0)
    buffer.copy_(random_cache_bytes(g, buffer.numel()))
    buffer = buffer.to(device)
    kv_cache = buffer.as_strided(kv_cache.shape, kv_cache.stride(), kv_cache.storage_offset())
    table, cu = gather_tables(g, seq_lens, case.block_size, case.num_blocks, garbage=2**30)
    rows = int(cu[-1]) + extra_rows
    layout = case.layout
    dst_k = torch.full((rows, layout.head_dim), poison, dtype=torch.uint8, device=device)
    dst_scale = torch.full((rows, layout.scale_bytes), poison, dtype=torch.uint8, device=device)
    if fp8_k:
        dst_k = dst_k.view(torch.float8_e4m3fn)
    if float_scales:
        dst_scale = dst_scale.view(torch.float32)
    return dict(kv_cache=kv_cache, dst_k=dst_k, dst_scale=dst_scale, block_table=table.to(device),
                cu_seq_lens=cu.to(device))
