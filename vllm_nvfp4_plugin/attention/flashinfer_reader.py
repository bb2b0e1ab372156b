"""CUDA attention over the plugin's NVFP4 cache: the plugin's own kernel by default, FlashInfer as the alternatives.

Decode readers (`CUDA_READERS`, "plugin" the default):

- "plugin": `ops.nvfp4_paged_attention`, one launch for a whole batch (decodes, prompts, chunks over cached
  prefixes), reading the NVFP4 pages directly; no host synchronisation, launch planned from the metadata's
  host-side length bounds, so it can be captured in a CUDA graph. Every head size (64, 128, 256). On the H200 it
  decodes faster than fa2 over the same pages (benchmarks/results/cuda_attention.md).
- "fa2": FlashInfer's fa2 tensor-core decode for the leading decode requests. FlashInfer (0.7) treats a uint8
  paged cache plus `kv_cache_sf` e4m3 block scales as NVFP4, on SM80, SM90 and SM120. It takes any
  page/token/head strides, so the data and scale regions of our `[DATA | SCALES]` sides are handed to it as
  strided views of the same bytes: nothing is copied. It misreads head size 64.

Prefills go to `DequantPrefill` where it runs (SM90 with FlashInfer): the requests' pages dequantized into a reused
bf16/fp16 workspace (the gather op), then FlashInfer's fa3 ragged prefill, measured at about bf16 speed and 6× the
fused kernel's, sliding windows, soft-caps and sinks included (the pages before a window are not gathered; sinks
through fa3's sink variant); elsewhere to the kernel ("plugin") or the attention core ("fa2").

Both readers take linear V scales: the cache is stored with `SWIZZLE_V_SCALES` (False).
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass

import torch

from .. import ops
from ..flashinfer_variants import fa3_sink_jit_args
from ..layout import NVFP4PageLayout
from .core import DequantWorkspace, cache_sides, paged_attention
from .metadata import NVFP4AttentionMetadata

SWIZZLE_V_SCALES = False  # fa2 and the core's gather both read linear V scales
CUDA_READERS = ("plugin", "fa2")

FA2_NVFP4_HEAD_SIZES = (128, 256)  # fa2 misreads NVFP4 at head 64
FA2_NVFP4_ARCH_MAJORS = (8, 9, 12)  # SM8x, SM90, SM12x read NVFP4 with fa2 (SM100 uses trtllm-gen)
WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's recommended split-k workspace
LOG2E = math.log2(math.e)


def flashinfer_decode_unavailable_reason(head_size: int, device: torch.device) -> str | None:
    """Why FlashInfer's NVFP4 decode cannot serve this head size on this device, or None if it can."""
    device = torch.device(device)
    if head_size not in FA2_NVFP4_HEAD_SIZES:
        return f"fa2 reads NVFP4 only at head sizes {FA2_NVFP4_HEAD_SIZES}, got {head_size}"
    if device.type != "cuda":
        return f"device {device} is not CUDA"
    major = torch.cuda.get_device_capability(device)[0]
    if major not in FA2_NVFP4_ARCH_MAJORS:
        return f"SM{major}x does not decode NVFP4 with fa2 (needs one of SM{FA2_NVFP4_ARCH_MAJORS}x)"
    if importlib.util.find_spec("flashinfer") is None:
        return "flashinfer is not installed"
    return None


def _region_view(side_cache: torch.Tensor, layout: NVFP4PageLayout, region_start: int, width: int,
                 dtype: torch.dtype) -> torch.Tensor:
    """One region (data or scales) of every block's side as FlashInfer's 4-D page tensor.

    NHD gives `[num_blocks, block_size, num_heads, width]`, HND `[num_blocks, num_heads, block_size, width]`;
    the token and head strides come from the layout descriptor's entry order.
    """
    token_stride = layout.entry_index(1, 0) * width
    head_stride = layout.entry_index(0, 1) * width
    if layout.hnd:
        size = (side_cache.size(0), layout.num_heads, layout.block_size, width)
        stride = (side_cache.stride(0), head_stride, token_stride, 1)
    else:
        size = (side_cache.size(0), layout.block_size, layout.num_heads, width)
        stride = (side_cache.stride(0), token_stride, head_stride, 1)
    return side_cache.as_strided(size, stride, side_cache.storage_offset() + region_start).view(dtype)


def nvfp4_flashinfer_views(side_cache: torch.Tensor, layout: NVFP4PageLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed E2M1 data uint8, block scales float8_e4m3fn) views of one side (`kv_cache[:, 0]` or `[:, 1]`)."""
    data = _region_view(side_cache, layout, 0, layout.data_dim, torch.uint8)
    scales = _region_view(side_cache, layout, layout.data_region_bytes, layout.scale_dim, torch.float8_e4m3fn)
    return data, scales


class FlashInferNVFP4Decoder:
    """Plans once per batch (host work, shared by all layers), then runs each layer's decode.

    `plan` takes the decode requests' block table (device) and their KV lengths (host);
    `run` takes one layer's queries `[num_decodes, num_q_heads, head_size]` and its two side caches.
    """

    def __init__(self, device: torch.device, hnd: bool, workspace_bytes: int = WORKSPACE_BYTES):
        import flashinfer

        self.hnd = hnd
        self.device = torch.device(device)
        self._workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=self.device)
        self._wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace, "HND" if hnd else "NHD", use_tensor_cores=True)
        self._planned: tuple | None = None

    def plan(self, block_table: torch.Tensor, seq_lens_cpu: torch.Tensor, num_q_heads: int, num_kv_heads: int,
             head_size: int, block_size: int, q_dtype: torch.dtype, sm_scale: float) -> None:
        reason = flashinfer_decode_unavailable_reason(head_size, self.device)
        if reason is not None:
            raise ValueError(f"FlashInfer NVFP4 decode cannot run: {reason}")
        if num_q_heads % num_kv_heads:
            raise ValueError(f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        if block_table.dim() != 2 or block_table.size(0) != seq_lens_cpu.numel():
            raise ValueError(f"block_table must be [num_decodes, max_blocks] with one row per seq_lens_cpu entry, "
                             f"got {tuple(block_table.shape)} and {seq_lens_cpu.numel()} lengths")
        seq_lens = seq_lens_cpu.to(torch.int64)
        if seq_lens.numel() and int(seq_lens.min()) < 1:
            raise ValueError("every decode request needs at least one cached token (seq_lens_cpu >= 1)")
        pages = (seq_lens + block_size - 1) // block_size
        if pages.numel() and int(pages.max()) > block_table.size(1):
            raise ValueError(f"a sequence needs {int(pages.max())} blocks but block_table has {block_table.size(1)}")
        indptr = torch.zeros(seq_lens.numel() + 1, dtype=torch.int32)
        indptr[1:] = torch.cumsum(pages, 0)
        last_page_len = (seq_lens - (pages - 1) * block_size).to(torch.int32)
        # CSR page list: (row, column) of every used block-table entry, gathered on the device.
        rows = torch.repeat_interleave(torch.arange(seq_lens.numel()), pages)
        cols = torch.arange(int(indptr[-1])) - torch.repeat_interleave(indptr[:-1].to(torch.int64), pages)
        indices = block_table[rows.to(block_table.device, non_blocking=True),
                              cols.to(block_table.device, non_blocking=True)].to(torch.int32)
        self._wrapper.plan(indptr, indices, last_page_len, num_q_heads, num_kv_heads, head_size, block_size,
                           q_data_type=q_dtype, kv_data_type=torch.uint8, sm_scale=sm_scale)
        self._planned = (seq_lens.numel(), num_q_heads, num_kv_heads, head_size, block_size, q_dtype)

    def run(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
            k_scale: float, v_scale: float, out: torch.Tensor) -> torch.Tensor:
        """Writes `out` `[num_decodes, num_q_heads, head_size]`; `k_scale`/`v_scale` are the global dequant scales."""
        if self._planned is None:
            raise RuntimeError("FlashInferNVFP4Decoder.run called before plan")
        num_decodes, num_q_heads, num_kv_heads, head_size, block_size, q_dtype = self._planned
        if key_cache.shape != value_cache.shape:  # an FP8- or INT8-key page
            key_format = NVFP4PageLayout.from_caches(key_cache, value_cache).key_format
            raise ValueError(f"FlashInfer fa2 reads NVFP4 keys only, got {key_format.upper()} keys (decode them with the "
                             f"plugin's kernel)")
        layout = NVFP4PageLayout.from_side_cache(key_cache)
        if (layout.head_size, layout.block_size, layout.num_heads) != (head_size, block_size, num_kv_heads):
            raise ValueError(f"key_cache holds head_size {layout.head_size}, block_size {layout.block_size}, "
                             f"{layout.num_heads} heads; the plan was for {head_size}, {block_size}, {num_kv_heads}")
        if layout.hnd != self.hnd:
            raise ValueError(f"key_cache is {'HND' if layout.hnd else 'NHD'} but the decoder was built for "
                             f"{'HND' if self.hnd else 'NHD'}")
        if NVFP4PageLayout.from_side_cache(value_cache) != layout:
            raise ValueError("value_cache must have the same layout as key_cache")
        if query.shape != (num_decodes, num_q_heads, head_size) or query.dtype != q_dtype:
            raise ValueError(f"query must be {q_dtype} [{num_decodes}, {num_q_heads}, {head_size}] as planned, "
                             f"got {query.dtype} {list(query.shape)}")
        k_data, k_sf = nvfp4_flashinfer_views(key_cache, layout)
        v_data, v_sf = nvfp4_flashinfer_views(value_cache, layout)
        return self._wrapper.run(query, (k_data, v_data), kv_cache_sf=(k_sf, v_sf),
                                 k_scale=float(k_scale), v_scale=float(v_scale), out=out)


@dataclass
class CudaBatch:
    """One batch as the CUDA path runs it: the leading `num_decodes` single-token requests through
    `decoder` (FlashInfer, already planned), the other requests (`rest`, query rows from `num_decodes` on)
    through the core. Without a decoder every request is in `rest`."""

    num_decodes: int
    decoder: FlashInferNVFP4Decoder | None
    rest: NVFP4AttentionMetadata | None


def plan_batch(metadata: NVFP4AttentionMetadata, query_start_loc_cpu: torch.Tensor, seq_lens_cpu: torch.Tensor,
               decoder: FlashInferNVFP4Decoder | None, num_q_heads: int, num_kv_heads: int, head_size: int,
               block_size: int, q_dtype: torch.dtype, sm_scale: float) -> CudaBatch:
    """Split a batch whose decode requests come first (vLLM reorders them so) and plan the decoder for them."""
    num_decodes = 0
    if decoder is not None:
        query_lens = (query_start_loc_cpu[1:] - query_start_loc_cpu[:-1]).tolist()
        while num_decodes < len(query_lens) and query_lens[num_decodes] == 1:
            num_decodes += 1
    if num_decodes:
        decoder.plan(metadata.block_table[:num_decodes], seq_lens_cpu[:num_decodes], num_q_heads, num_kv_heads,
                     head_size, block_size, q_dtype, sm_scale)
    if num_decodes == metadata.num_reqs:
        return CudaBatch(num_decodes, decoder, None)
    if num_decodes == 0:
        return CudaBatch(0, None, metadata)
    query_start = metadata.query_start_loc[num_decodes:]
    rest = NVFP4AttentionMetadata(
        query_start_loc=query_start - query_start[0],
        seq_lens=metadata.seq_lens[num_decodes:],
        block_table=metadata.block_table[num_decodes:metadata.num_reqs],
        slot_mapping=metadata.slot_mapping[num_decodes:],
        causal=metadata.causal,
    )
    return CudaBatch(num_decodes, decoder, rest)


def plugin_paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, metadata: NVFP4AttentionMetadata,
                           scale: float, k_scale: torch.Tensor, v_scale: torch.Tensor, out: torch.Tensor, *,
                           sliding_window: int = 0, logits_soft_cap: float = 0.0,
                           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The whole batch through the plugin's kernel; `metadata.max_query_len`/`max_seq_len` must bound the batch.
    The model features are `nvfp4_paged_attention`'s (0 or None: off)."""
    if metadata.max_query_len <= 0 or metadata.max_seq_len <= 0:
        raise ValueError(f"metadata needs positive host-side bounds max_query_len and max_seq_len for the plugin "
                         f"kernel's launch, got {metadata.max_query_len} and {metadata.max_seq_len}")
    ops.nvfp4_paged_attention(query, *cache_sides(kv_cache), metadata.block_table, metadata.query_start_loc,
                              metadata.seq_lens, k_scale, v_scale, scale, metadata.causal, SWIZZLE_V_SCALES,
                              metadata.max_query_len, metadata.max_seq_len, out, sliding_window, logits_soft_cap,
                              sinks)
    return out


class HalfWorkspace:
    """bf16/fp16 buffers for one batch's dequantized K and V, grown on demand and reused across layers."""

    def __init__(self):
        self._buffer: torch.Tensor | None = None

    def get(self, num_tokens: int, num_heads: int, head_size: int, device,
            dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        numel = num_tokens * num_heads * head_size
        if (self._buffer is None or self._buffer.numel() < 2 * numel or self._buffer.device != torch.device(device)
                or self._buffer.dtype != dtype):
            self._buffer = torch.empty(2 * numel, dtype=dtype, device=device)
        shape = (num_tokens, num_heads, head_size)
        return self._buffer[:numel].view(shape), self._buffer[numel:2 * numel].view(shape)


def dequant_prefill_unavailable_reason(head_size: int, device: torch.device) -> str | None:
    """Why `DequantPrefill` (FlashInfer fa3, SM90 only) cannot run here, or None if it can."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"device {device} is not CUDA"
    if torch.cuda.get_device_capability(device)[0] != 9:
        return "FlashInfer's fa3 prefill runs on SM90 only"
    if importlib.util.find_spec("flashinfer") is None:
        return "flashinfer is not installed"
    return None


def window_first_blocks(query_lens: torch.Tensor, seq_lens: torch.Tensor, sliding_window: int,
                        block_size: int) -> torch.Tensor:
    """Per request, the first block holding a key that one of its queries sees through `sliding_window` (0: no
    window): the query at position p sees keys after p - window, and the first query sits at seq_len - query_len.
    The blocks before it are the ones vLLM frees for a sliding-window layer."""
    if sliding_window <= 0:
        return torch.zeros_like(seq_lens, dtype=torch.int64)
    first_visible = (seq_lens.to(torch.int64) - query_lens.to(torch.int64) - sliding_window + 1).clamp(min=0)
    return first_visible // block_size


def add_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Joins per-head sink logits to finished attention rows in place: `out` `[tokens, heads, head_size]` normalized
    over the keys alone, `lse` `[tokens, heads]` their log-sum-exp in log2 units (fa3's), `sinks` `[heads]` in natural
    units. A sink z adds 2^(z·log2 e) to the softmax's denominator, so each row is scaled by
    1 / (1 + 2^(z·log2 e - lse))."""
    keep = torch.reciprocal(1.0 + torch.exp2(sinks.to(torch.float32) * LOG2E - lse))
    return torch.mul(out, keep.unsqueeze(-1), out=out)


class DequantPrefill:
    """Prefill as dequantize-to-bf16/fp16 (the gather op, into a reused workspace) + FlashInfer fa3 ragged prefill;
    plans on host lengths (once per batch, for every layer of a group).

    The model features ride on fa3: a sliding window as its `window_left`, with the pages wholly before a
    request's window left out of the gather (`visible_table`: never read, and the gather moves only the window); a
    logit soft-cap as its soft-cap variant; sinks as its sink variant (`fa3_sink_jit_args`), the sink logit inside
    the online softmax. That variant has no soft-cap: with both, the sinks join after the kernel, from its
    log-sum-exp (`add_sinks`)."""

    def __init__(self, device: torch.device, workspace_bytes: int = WORKSPACE_BYTES):
        import flashinfer

        self.device = torch.device(device)
        self._float_workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=self.device)
        self._wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(self._float_workspace, "NHD", backend="fa3")
        self._sink_wrappers: dict[tuple, object] = {}  # (dtype, head size, windowed) -> sink-variant wrapper
        self._planned = self._wrapper
        self._sink_variant = False
        self._kv = HalfWorkspace()
        self._cu_seq_lens: torch.Tensor | None = None
        self._num_kv_tokens = 0
        self._first_blocks: torch.Tensor | None = None

    def _sink_wrapper(self, dtype: torch.dtype, head_size: int, windowed: bool):
        key = (dtype, head_size, windowed)
        if key not in self._sink_wrappers:  # the workspace is shared: one plan runs at a time
            import flashinfer

            jit_args, jit_kwargs = fa3_sink_jit_args(dtype, head_size, windowed)
            self._sink_wrappers[key] = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(
                self._float_workspace, "NHD", backend="fa3", jit_args=jit_args, jit_kwargs=jit_kwargs)
        return self._sink_wrappers[key]

    def plan(self, query_start_loc_cpu: torch.Tensor, seq_lens_cpu: torch.Tensor, num_q_heads: int,
             num_kv_heads: int, head_size: int, causal: bool, sm_scale: float,
             q_dtype: torch.dtype = torch.bfloat16, *, sliding_window: int = 0, logits_soft_cap: float = 0.0,
             sinks: bool = False, block_size: int = 0) -> None:
        """`sliding_window` > 0 (causal only) needs the cache's `block_size`; `sinks`: whether the layers have
        sinks (their values come at run time)."""
        if sliding_window > 0 and (not causal or block_size <= 0):
            raise ValueError(f"sliding_window needs causal attention and a positive block_size, got causal={causal}, "
                             f"block_size={block_size}")
        query_lens = query_start_loc_cpu[1:] - query_start_loc_cpu[:-1]
        first_blocks = window_first_blocks(query_lens, seq_lens_cpu, sliding_window, block_size)
        kv_lens = seq_lens_cpu.to(torch.int64) - first_blocks * block_size
        kv_indptr = torch.zeros(seq_lens_cpu.numel() + 1, dtype=torch.int32)
        kv_indptr[1:] = torch.cumsum(kv_lens, 0)
        self._num_kv_tokens = int(kv_indptr[-1])
        self._num_q_tokens = int(query_start_loc_cpu[-1])
        self._cu_seq_lens = kv_indptr.to(self.device, non_blocking=True)
        self._first_blocks = (first_blocks.to(self.device, non_blocking=True) if sliding_window > 0 else None)
        self._sink_variant = sinks and not logits_soft_cap
        self._planned = (self._sink_wrapper(q_dtype, head_size, sliding_window > 0) if self._sink_variant
                         else self._wrapper)
        self._planned.plan(query_start_loc_cpu.to(torch.int32), kv_indptr, num_q_heads, num_kv_heads, head_size,
                           causal=causal, sm_scale=sm_scale, q_data_type=q_dtype, kv_data_type=q_dtype,
                           window_left=sliding_window - 1 if sliding_window > 0 else -1,
                           logits_soft_cap=logits_soft_cap)
        self._heads = (num_kv_heads, head_size)
        self._dtype = q_dtype
        self._sm_scale = float(sm_scale)
        self.features = (sliding_window, logits_soft_cap, sinks)

    def visible_table(self, block_table: torch.Tensor) -> torch.Tensor:
        """The planned requests' block-table rows starting at the first block their windows reach (the same rows
        without a window); once per batch, on the device."""
        if self._first_blocks is None:
            return block_table
        width = block_table.size(1)
        columns = (self._first_blocks[:, None] + torch.arange(width, device=block_table.device)).clamp(max=width - 1)
        return block_table.gather(1, columns)

    def gather(self, kv_cache: torch.Tensor, block_table: torch.Tensor, k_scale: torch.Tensor,
               v_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The planned requests' K and V from the first block their windows reach, dequantized into the reused
        workspace, `[kv tokens, kv heads, head]` each: `run`'s first step (the rest is fa3)."""
        if self._cu_seq_lens is None:
            raise RuntimeError("DequantPrefill.gather called before plan")
        key, value = self._kv.get(self._num_kv_tokens, *self._heads, self.device, self._dtype)
        ops.gather_nvfp4_kv_cache(*cache_sides(kv_cache), block_table, self._cu_seq_lens, k_scale, v_scale,
                                  SWIZZLE_V_SCALES, key, value)
        return key, value

    def run(self, query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, k_scale: torch.Tensor,
            v_scale: torch.Tensor, out: torch.Tensor, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """`block_table`: `visible_table` of the planned requests' rows; `sinks`: float32 `[num_q_heads]`, given
        exactly when planned with `sinks`."""
        if self._cu_seq_lens is None:
            raise RuntimeError("DequantPrefill.run called before plan")
        if (sinks is not None) != self.features[2]:
            raise ValueError(f"the prefill was planned {'with' if self.features[2] else 'without'} sinks, but sinks "
                             f"{'were not' if sinks is None else 'were'} given")
        heads = query.size(1)
        if sinks is not None and (sinks.dtype != torch.float32 or tuple(sinks.shape) != (heads,)
                                  or not sinks.is_contiguous() or sinks.device != query.device):
            raise ValueError(f"sinks must be a contiguous float32 [{heads}] tensor on {query.device}, got "
                             f"{sinks.dtype} {list(sinks.shape)} on {sinks.device}")
        key, value = self.gather(kv_cache, block_table, k_scale, v_scale)
        n = self._num_q_tokens
        if self._sink_variant:
            return self._planned.run(query[:n], key, value, sinks, self._sm_scale, out=out[:n])
        if sinks is None:
            return self._planned.run(query[:n], key, value, out=out[:n])
        _, lse = self._planned.run(query[:n], key, value, out=out[:n], return_lse=True)
        return add_sinks(out[:n], lse, sinks)


@dataclass
class KernelBatch:
    """A batch with prefills: the leading decode requests (query rows below `num_decode_tokens`) through the
    kernel (`decodes`) or FlashInfer's fa2 (`decoder`, planned), the other requests (block-table rows
    `prefill_block_table`, from the first block their windows reach) through `prefill`, a planned
    `DequantPrefill`, whose `features` (sliding window, soft-cap, sinks) are the layers'."""

    decodes: NVFP4AttentionMetadata | None
    num_decode_tokens: int
    prefill: DequantPrefill
    prefill_block_table: torch.Tensor
    decoder: FlashInferNVFP4Decoder | None = None


def plan_kernel_batch(metadata: NVFP4AttentionMetadata, query_start_loc_cpu: torch.Tensor,
                      seq_lens_cpu: torch.Tensor, prefill: DequantPrefill, num_q_heads: int, num_kv_heads: int,
                      head_size: int, sm_scale: float, q_dtype: torch.dtype = torch.bfloat16,
                      decoder: FlashInferNVFP4Decoder | None = None, block_size: int = 0, *,
                      sliding_window: int = 0, logits_soft_cap: float = 0.0, sinks: bool = False) -> KernelBatch:
    """Split a batch whose decode requests come first (vLLM reorders them so) and plan `prefill` for the rest;
    the decodes go to the kernel, or to `decoder` (planned here) when given. `block_size`: the cache's pages, for
    `decoder` and `sliding_window`. The layers' window, soft-cap and whether they have sinks are planned into
    `prefill` (the kernel takes them at run time); FlashInfer's fa2 decode takes none of them."""
    if decoder is not None and (sliding_window or logits_soft_cap or sinks):
        raise ValueError("FlashInfer's fa2 decode takes no sliding_window, logits_soft_cap or sinks: plan the decodes "
                         "for the plugin's kernel (decoder=None)")
    query_lens = (query_start_loc_cpu[1:] - query_start_loc_cpu[:-1]).tolist()
    num_decodes = 0
    while num_decodes < len(query_lens) and query_lens[num_decodes] == 1:
        num_decodes += 1
    decodes = None
    if num_decodes and decoder is not None:
        decoder.plan(metadata.block_table[:num_decodes], seq_lens_cpu[:num_decodes], num_q_heads, num_kv_heads,
                     head_size, block_size, q_dtype, sm_scale)
    elif num_decodes:
        decodes = NVFP4AttentionMetadata(
            query_start_loc=metadata.query_start_loc[:num_decodes + 1], seq_lens=metadata.seq_lens[:num_decodes],
            block_table=metadata.block_table[:num_decodes], slot_mapping=metadata.slot_mapping[:num_decodes],
            causal=metadata.causal, max_query_len=1, max_seq_len=metadata.max_seq_len)
    starts = query_start_loc_cpu[num_decodes:metadata.num_reqs + 1]
    prefill.plan(starts - starts[0], seq_lens_cpu[num_decodes:metadata.num_reqs], num_q_heads, num_kv_heads,
                 head_size, metadata.causal, sm_scale, q_dtype, sliding_window=sliding_window,
                 logits_soft_cap=logits_soft_cap, sinks=sinks, block_size=block_size)
    return KernelBatch(decodes, num_decodes, prefill,
                       prefill.visible_table(metadata.block_table[num_decodes:metadata.num_reqs]),
                       decoder if num_decodes else None)


def cuda_paged_attention(query: torch.Tensor, kv_cache: torch.Tensor,
                         batch: CudaBatch | KernelBatch | NVFP4AttentionMetadata,
                         scale: float, k_scale: torch.Tensor, v_scale: torch.Tensor, k_scale_float: float,
                         v_scale_float: float, out: torch.Tensor,
                         workspace: DequantWorkspace | None = None, *, sliding_window: int = 0,
                         logits_soft_cap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of `query` `[num_tokens, num_heads, head]` over the `[num_blocks, 2, block, heads, full]` cache.

    `batch` is core metadata (the plugin's kernel for the whole batch), a `KernelBatch` (kernel for the decodes,
    dequantize + fa3 for the prefills) or a `CudaBatch` planned for the "fa2" reader. The global
    dequant scales come twice: as float32 device tensors for the plugin's ops and as floats for FlashInfer (which
    folds them into its softmax scale and output). The model features (sliding window, soft-cap, float32 sinks)
    are served by the plugin's kernel, the core, and a `KernelBatch` whose prefill was planned with the same window,
    soft-cap and sink switch; FlashInfer's fa2 decode refuses them.
    """
    features = {"sliding_window": sliding_window, "logits_soft_cap": logits_soft_cap, "sinks": sinks}
    if isinstance(batch, NVFP4AttentionMetadata):
        return plugin_paged_attention(query, kv_cache, batch, scale, k_scale, v_scale, out, **features)
    if (sliding_window or logits_soft_cap or sinks is not None) and batch.decoder is not None:
        raise ValueError("sliding_window, logits_soft_cap and sinks need the plugin's kernel for decodes, not "
                         "FlashInfer's fa2")
    if isinstance(batch, KernelBatch):
        layer = (sliding_window, logits_soft_cap, sinks is not None)
        if batch.prefill.features != layer:
            raise ValueError(f"the prefill was planned for (sliding_window, logits_soft_cap, sinks) = "
                             f"{batch.prefill.features}, but the layer has {layer}")
        n = batch.num_decode_tokens
        if batch.decoder is not None:
            batch.decoder.run(query[:n], *cache_sides(kv_cache), k_scale_float, v_scale_float, out[:n])
        elif batch.decodes is not None:
            plugin_paged_attention(query[:n], kv_cache, batch.decodes, scale, k_scale, v_scale, out[:n], **features)
        batch.prefill.run(query[n:], kv_cache, batch.prefill_block_table, k_scale, v_scale, out[n:], sinks)
        return out
    n = batch.num_decodes
    if n:
        batch.decoder.run(query[:n], *cache_sides(kv_cache), k_scale_float, v_scale_float, out[:n])
    if batch.rest is not None:
        paged_attention(query[n:], kv_cache, batch.rest, scale, k_scale, v_scale, out[n:],
                        swizzle_v_scales=SWIZZLE_V_SCALES, workspace=workspace, **features)
    return out
