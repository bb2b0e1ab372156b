"""The one place that knows where every byte of the two caches lives (docs/FORMATS.md §1 and §2).

The KV-cache spec, the ops' argument checks, the backends, the reference and the tests all ask these
descriptors for offsets instead of re-deriving them from strides.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

NVFP4_GROUP = 16  # head-dim elements that share one FP8 block scale
# How the K side stores a (token, head) key: NVFP4 like the V side, FP8 E4M3 bytes, or INT8 codes with one fp16 scale.
KEY_FORMATS = ("nvfp4", "fp8", "int8")
INT8_KEY_SCALE_BYTES = 2  # one little-endian IEEE fp16 scale per (token, head) of an int8-key page


@dataclass(frozen=True)
class NVFP4PageLayout:
    """Page of one layer's NVFP4 KV cache: `[num_blocks, 2, block_size, num_heads, full_dim]` uint8 (logical).

    Each side (K, V) of a block is `[DATA | SCALES]`; inside each region a (token, head) entry sits in
    NHD order (token-major) or HND order (head-major). V scales may be stored swizzled for trtllm-gen.

    `key_format` "fp8": the K side holds FP8 E4M3 keys instead, `key_dim` = head_size bytes per (token, head) entry in
    the same entry order and no block scales (key ≈ fp8 · k_scale). "int8": the K side is `[DATA | SCALES]` with
    head_size int8 codes per entry, then each entry's fp16 scale, both in the entry order (key ≈ code · scale ·
    k_scale; `key_dim` = head_size + 2). Either way the V side is unchanged and follows the K side.
    """

    head_size: int
    block_size: int
    num_heads: int
    hnd: bool = False
    swizzle_v_scales: bool = False
    key_format: str = "nvfp4"

    def __post_init__(self):
        if self.key_format not in KEY_FORMATS:
            raise ValueError(f"key_format must be one of {KEY_FORMATS}, got {self.key_format!r}")
        if self.head_size <= 0 or self.head_size % NVFP4_GROUP:
            raise ValueError(f"head_size must be a positive multiple of 16 for NVFP4, got {self.head_size}")
        if self.block_size <= 0 or self.num_heads <= 0:
            raise ValueError(f"block_size and num_heads must be positive, got {self.block_size}, {self.num_heads}")
        if self.swizzle_v_scales:
            if self.block_size % 4:
                raise ValueError(f"swizzle_v_scales needs block_size % 4 == 0, got block_size={self.block_size}")
            if self.scale_dim % 4:
                raise ValueError(f"swizzle_v_scales needs head_size % 64 == 0, got head_size={self.head_size}")

    @property
    def fp8_keys(self) -> bool:
        return self.key_format == "fp8"

    @property
    def int8_keys(self) -> bool:
        return self.key_format == "int8"

    # --- sizes -------------------------------------------------------------------------------------
    @property
    def data_dim(self) -> int:  # bytes of E2M1 codes per (token, head)
        return self.head_size // 2

    @property
    def scale_dim(self) -> int:  # FP8 block scales per (token, head)
        return self.head_size // NVFP4_GROUP

    @property
    def full_dim(self) -> int:  # bytes per (token, head, side)
        return self.data_dim + self.scale_dim

    @property
    def entries(self) -> int:  # (token, head) entries per side of a block
        return self.block_size * self.num_heads

    @property
    def data_region_bytes(self) -> int:
        return self.entries * self.data_dim

    @property
    def side_bytes(self) -> int:  # one NVFP4 side (V; K too with NVFP4 keys)
        return self.entries * self.full_dim

    @property
    def key_dim(self) -> int:  # bytes per (token, head) on the K side
        if self.key_format == "nvfp4":
            return self.full_dim
        return self.head_size + (INT8_KEY_SCALE_BYTES if self.int8_keys else 0)

    @property
    def key_side_bytes(self) -> int:
        return self.entries * self.key_dim

    @property
    def page_bytes(self) -> int:  # K and V of one block
        return self.key_side_bytes + self.side_bytes

    # --- offsets inside one side of one block --------------------------------------------------------
    def entry_index(self, token, head):
        """Position of (token, head) among the side's entries, in the physical order."""
        if self.hnd:
            return head * self.block_size + token
        return token * self.num_heads + head

    def data_offset(self, token, head):
        return self.entry_index(token, head) * self.data_dim

    def fp8_key_offset(self, token, head):
        """Byte offset of (token, head)'s first FP8 key byte in the K side of an `fp8_keys` page."""
        return self.entry_index(token, head) * self.head_size

    def int8_key_offset(self, token, head):
        """Byte offset of (token, head)'s first int8 code in the K side of an int8-key page."""
        return self.entry_index(token, head) * self.head_size

    def int8_key_scale_offset(self, token, head):
        """Byte offset of (token, head)'s fp16 scale in the K side of an int8-key page (after every entry's codes)."""
        return self.entries * self.head_size + self.entry_index(token, head) * INT8_KEY_SCALE_BYTES

    def scale_offset(self, token, head, s, swizzled: bool = False):
        """Byte offset of scale `s` of (token, head); `swizzled` applies trtllm-gen's V-scale order."""
        if swizzled:
            quarter = self.scale_dim // 4
            token, s = (token // 4) * 4 + s // quarter, (s % quarter) * 4 + token % 4
        return self.data_region_bytes + self.entry_index(token, head) * self.scale_dim + s

    # --- tensors ------------------------------------------------------------------------------------
    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, 2, self.block_size, self.num_heads, self.full_dim)

    def allocate(self, num_blocks: int, device="cpu", fill: int | None = None) -> torch.Tensor:
        """A cache as vLLM allocates it: HND is allocated head-major and permuted to the logical order."""
        if self.key_format != "nvfp4":
            raise ValueError(f"a {self.key_format}-key page has sides of different sizes: use allocate_sides")
        if self.hnd:
            t = torch.empty((num_blocks, 2, self.num_heads, self.block_size, self.full_dim),
                            dtype=torch.uint8, device=device).permute(0, 1, 3, 2, 4)
        else:
            t = torch.empty(self.kv_cache_shape(num_blocks), dtype=torch.uint8, device=device)
        if fill is not None:
            t.fill_(fill)
        return t

    def allocate_sides(self, num_blocks: int, device="cpu", fill: int | None = None):
        """(key_cache, value_cache) `[num_blocks, block_size, num_heads, key_dim / full_dim]` over one buffer of
        `page_bytes` per block, K side first (any key format)."""
        pages = torch.empty((num_blocks, self.page_bytes), dtype=torch.uint8, device=device)
        if fill is not None:
            pages.fill_(fill)
        return self.side_views(pages)

    def side_views(self, pages: torch.Tensor, page_stride: int | None = None):
        """(key_cache, value_cache) views of the pages whose block b starts at `pages[b]` (a uint8 tensor whose first
        dim steps `page_stride` bytes, by default its own stride)."""
        stride0 = pages.stride(0) if page_stride is None else page_stride

        def side(offset: int, dim: int) -> torch.Tensor:
            return pages.as_strided((pages.size(0), self.block_size, self.num_heads, dim),
                                    (stride0, *self._entry_strides(dim), 1), pages.storage_offset() + offset)

        return side(0, self.key_dim), side(self.key_side_bytes, self.full_dim)

    @staticmethod
    def is_hnd(side_cache: torch.Tensor) -> bool:
        """HND detection of docs/FORMATS.md §1 on a `[num_blocks, block_size, num_heads, full_dim]` view."""
        return side_cache.stride(2) > side_cache.stride(1)

    @classmethod
    def from_side_cache(cls, side_cache: torch.Tensor, swizzle_v_scales: bool = False) -> "NVFP4PageLayout":
        """Layout of `kv_cache[:, 0]` / `kv_cache[:, 1]`; raises ValueError naming the rule it breaks."""
        if side_cache.dim() != 4:
            raise ValueError(f"key_cache must be 4-D [num_blocks, block_size, num_heads, full_dim], "
                             f"got shape {tuple(side_cache.shape)}")
        _, block_size, num_heads, full_dim = side_cache.shape
        if full_dim % 9:
            raise ValueError(f"key_cache last dim must be head_size/2 + head_size/16 (a multiple of 9), got {full_dim}")
        layout = cls(full_dim // 9 * 16, block_size, num_heads, cls.is_hnd(side_cache), swizzle_v_scales)
        inner, outer = layout._inner_dim, layout._outer_dim

        def strided(dim: int, expected: int) -> bool:  # a dim of size 1 may carry any stride (as checks.cpp)
            return side_cache.size(dim) == 1 or side_cache.stride(dim) == expected

        if side_cache.stride(3) != 1 or not strided(inner, full_dim) or \
                not strided(outer, full_dim * side_cache.size(inner)):
            raise ValueError(f"key_cache must have contiguous block sides (NHD or HND), got strides "
                             f"{tuple(side_cache.stride())}")
        return layout

    @classmethod
    def from_caches(cls, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    swizzle_v_scales: bool = False) -> "NVFP4PageLayout":
        """Layout of a (key_cache, value_cache) pair: NVFP4 keys when both sides have one shape, else the key format
        key_cache's last dim names (value_cache's head size: FP8 keys; head size + 2: INT8 keys); raises ValueError
        naming the rule it breaks."""
        if key_cache.dim() == 4 and value_cache.dim() == 4 and key_cache.shape != value_cache.shape:
            layout = cls.from_side_cache(value_cache, swizzle_v_scales)
            head, last = layout.head_size, key_cache.shape[-1]
            key_format = {head: "fp8", head + INT8_KEY_SCALE_BYTES: "int8"}.get(last)
            if key_format is None or tuple(key_cache.shape[:3]) != tuple(value_cache.shape[:3]):
                raise ValueError(f"key_cache must have value_cache's shape {tuple(value_cache.shape)} (NVFP4 keys), "
                                 f"or its blocks, block size and heads with last dim head_size = {head} (FP8 keys) or "
                                 f"head_size + 2 = {head + 2} (INT8 keys), got {tuple(key_cache.shape)}")
            layout = replace(layout, key_format=key_format)
            strides = (*layout._entry_strides(last), 1)
            if any(key_cache.size(d) > 1 and key_cache.stride(d) != strides[d - 1] for d in (1, 2, 3)):
                raise ValueError(f"key_cache must hold contiguous {key_format.upper()} block sides in value_cache's "
                                 f"order (NHD or HND), got strides {tuple(key_cache.stride())}")
            return layout
        return cls.from_side_cache(key_cache, swizzle_v_scales)

    def _entry_strides(self, dim: int) -> tuple[int, int]:  # (token, head) strides of a side of `dim`-byte entries
        return (dim, self.block_size * dim) if self.hnd else (self.num_heads * dim, dim)

    @property
    def _inner_dim(self) -> int:  # logical dim that varies fastest between entries
        return 1 if self.hnd else 2

    @property
    def _outer_dim(self) -> int:
        return 2 if self.hnd else 1

    def side_bytes_view(self, side_cache: torch.Tensor) -> torch.Tensor:
        """`[num_blocks, side_bytes]` byte view of one side, whatever the layout and block stride."""
        return side_cache.as_strided((side_cache.size(0), self.side_bytes), (side_cache.stride(0), 1))

    def key_side_bytes_view(self, key_cache: torch.Tensor) -> torch.Tensor:
        """`[num_blocks, key_side_bytes]` byte view of the K side (any key format)."""
        return key_cache.as_strided((key_cache.size(0), self.key_side_bytes), (key_cache.stride(0), 1))


@dataclass(frozen=True)
class IndexerCacheLayout:
    """DeepSeek-V3.2 indexer K cache: uint8 `[num_blocks, block_size, head_dim + head_dim/quant_block_size*4]`.

    A block holds all its tokens' FP8 values first, then all their float32 scales.
    """

    head_dim: int = 128
    block_size: int = 64
    quant_block_size: int = 128

    def __post_init__(self):
        if self.quant_block_size <= 0 or self.head_dim <= 0 or self.head_dim % self.quant_block_size:
            raise ValueError(f"head_dim ({self.head_dim}) must be a positive multiple of "
                             f"quant_block_size ({self.quant_block_size})")
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")

    @property
    def num_scales(self) -> int:
        return self.head_dim // self.quant_block_size

    @property
    def scale_bytes(self) -> int:
        return self.num_scales * 4

    @property
    def row_bytes(self) -> int:  # bytes a token takes in the cache (132 at 128/128)
        return self.head_dim + self.scale_bytes

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.row_bytes

    def value_offset(self, token):
        return token * self.head_dim

    def scale_offset(self, token, j=0):
        """Byte offset of the float32 scale of quant block `j` of the token at block offset `token`."""
        return self.block_size * self.head_dim + (token * self.num_scales + j) * 4

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, self.block_size, self.row_bytes)

    def allocate(self, num_blocks: int, device="cpu", fill: int | None = None, block_stride: int | None = None):
        """A cache; `block_stride` (bytes) larger than the block gives a padded, strided view."""
        stride = block_stride or self.block_bytes
        if stride < self.block_bytes:
            raise ValueError(f"block_stride {stride} is smaller than a block ({self.block_bytes} bytes)")
        flat = torch.empty(num_blocks * stride, dtype=torch.uint8, device=device)
        if fill is not None:
            flat.fill_(fill)
        return flat.as_strided(self.kv_cache_shape(num_blocks), (stride, self.row_bytes, 1))

    @classmethod
    def from_cache(cls, kv_cache: torch.Tensor, quant_block_size: int) -> "IndexerCacheLayout":
        if kv_cache.dim() != 3:
            raise ValueError(f"kv_cache must be 3-D [num_blocks, block_size, head_dim + scales], "
                             f"got shape {tuple(kv_cache.shape)}")
        _, block_size, row = kv_cache.shape
        if quant_block_size <= 0:
            raise ValueError(f"quant_block_size must be positive, got {quant_block_size}")
        # row = head_dim * (1 + 4 / quant_block_size)
        head_dim, rem = divmod(row * quant_block_size, quant_block_size + 4)
        if rem:
            raise ValueError(f"kv_cache last dim {row} is not head_dim + head_dim/{quant_block_size}*4 for any head_dim")
        layout = cls(head_dim, block_size, quant_block_size)
        if kv_cache.stride(2) != 1 or kv_cache.stride(1) != row or kv_cache.stride(0) < layout.block_bytes:
            raise ValueError(f"kv_cache blocks must be contiguous rows of {row} bytes, got strides {tuple(kv_cache.stride())}")
        return layout

    def block_bytes_view(self, kv_cache: torch.Tensor) -> torch.Tensor:
        return kv_cache.as_strided((kv_cache.size(0), self.block_bytes), (kv_cache.stride(0), 1))
