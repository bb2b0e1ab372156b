"""The indexer op: vLLM's `SparseAttnIndexer` replaced (`register_oot`) by one that needs no DeepGEMM.

Every step it stores the new keys with `vllm_nvfp4.indexer_k_quant_and_cache`; for each prefill chunk it
gathers the chunk's keys with `vllm_nvfp4.cp_gather_indexer_k_quant_cache` and scores them with
`core.fp8_mqa_logits` (the compiled `vllm_nvfp4.indexer_mqa_logits`); decode tokens are scored straight from the
paged cache (`core.fp8_paged_mqa_logits`, the compiled `vllm_nvfp4.indexer_paged_mqa_logits`).
The per-row top-k lands in vLLM's index buffer (request-local positions, int32, -1 past the context).

vLLM 0.32 hard-codes the indexer cache's backend (`DeepseekV32IndexerCache.get_attn_backend`), so the op
points the cache it is given at the plugin's backend, whose builder makes the metadata this op reads.
"""

from __future__ import annotations

import logging

import torch
import vllm.envs as envs
from vllm.compilation.breakable_cudagraph import eager_break_during_capture
from vllm.config import get_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.model_executor.custom_op import CustomOp
from vllm.model_executor.layers.sparse_attn_indexer import SparseAttnIndexer
from vllm.utils.torch_utils import direct_register_custom_op

from .. import ops  # noqa: F401  (registers torch.ops.vllm_nvfp4)
from ..layout import IndexerCacheLayout
from ..indexer import core
from .indexer_metadata import IndexerBackend, IndexerMetadata

logger = logging.getLogger("vllm.nvfp4_plugin.indexer")

OP_NAME = "nvfp4_sparse_attn_indexer"  # in vLLM's op library: torch.ops.vllm.nvfp4_sparse_attn_indexer


def run_indexer(md: IndexerMetadata, q: torch.Tensor, k: torch.Tensor | None, weights: torch.Tensor,
                kv_cache: torch.Tensor, topk_indices_buffer: torch.Tensor, quant_block_size: int, scale_fmt: str,
                topk_tokens: int, skip_k_cache_insert: bool, num_tokens: int) -> None:
    """One step of the indexer for the batch `md` describes (q `[T, H, D]` FP8, weights `[T, H]`)."""
    if kv_cache.size(1) != md.block_size:
        raise ValueError(f"kv_cache block size {kv_cache.size(1)} does not match the block size {md.block_size} "
                         f"the indexer metadata was built for")
    layout = IndexerCacheLayout.from_cache(kv_cache, quant_block_size)
    if not skip_k_cache_insert:
        slots = md.slot_mapping
        torch.ops.vllm_nvfp4.indexer_k_quant_and_cache(k[:slots.size(0)], kv_cache, slots, quant_block_size,
                                                       scale_fmt)
    topk_indices_buffer[:num_tokens] = -1
    if md.prefill is not None:
        _prefill(md, q, weights, kv_cache, layout, topk_indices_buffer[:, :topk_tokens])
    if md.decode is not None:
        _decode(md, q, weights, kv_cache, topk_indices_buffer[:md.num_decode_tokens, :topk_tokens], quant_block_size)


def _prefill(md: IndexerMetadata, q, weights, kv_cache, layout: IndexerCacheLayout, topk_out):
    chunks = md.prefill.chunks
    rows = max(chunk.total_seq_lens for chunk in chunks)
    dst_k = torch.empty(rows, layout.head_dim, dtype=torch.uint8, device=kv_cache.device)
    dst_scale = torch.empty(rows, layout.scale_bytes, dtype=torch.uint8, device=kv_cache.device)
    for chunk in chunks:
        n, tokens = chunk.total_seq_lens, slice(chunk.token_start, chunk.token_end)
        torch.ops.vllm_nvfp4.cp_gather_indexer_k_quant_cache(kv_cache, dst_k, dst_scale, chunk.block_table,
                                                             chunk.cu_seq_lens)
        logits = core.fp8_mqa_logits(q[tokens], dst_k[:n], dst_scale[:n], weights[tokens], chunk.cu_seqlen_ks,
                                     chunk.cu_seqlen_ke)
        core.topk_per_row(logits, topk_out.size(1), topk_out[tokens], row_starts=chunk.cu_seqlen_ks)


def _decode(md: IndexerMetadata, q, weights, kv_cache, topk_out, quant_block_size):
    dec = md.decode
    b, n = dec.seq_lens.shape
    t = md.num_decode_tokens
    padded = t != b * n
    if padded:  # requests with fewer than n decode tokens: place each token at its (request, position)
        q_bytes = torch.zeros(b, n, *q.shape[1:], dtype=torch.uint8, device=q.device)
        q_bytes[dec.token_req, dec.token_pos] = q[:t].view(torch.uint8)
        q_dec = q_bytes.view(q.dtype)
        w_dec = weights.new_zeros(b, n, weights.size(1))
        w_dec[dec.token_req, dec.token_pos] = weights[:t]
    else:
        q_dec, w_dec = q[:t].view(b, n, *q.shape[1:]), weights[:t].view(b, n, -1)
    logits = core.fp8_paged_mqa_logits(q_dec, kv_cache, w_dec, dec.seq_lens, dec.block_table, dec.max_context,
                                       quant_block_size)
    if padded:
        logits = logits[dec.token_req * n + dec.token_pos]
    core.topk_per_row(logits, topk_out.size(1), topk_out)


@eager_break_during_capture
def nvfp4_sparse_attn_indexer(hidden_states: torch.Tensor, q_fp8: torch.Tensor, k: torch.Tensor | None,
                              weights: torch.Tensor, kv_cache: torch.Tensor, topk_indices_buffer: torch.Tensor,
                              layer_name: str, quant_block_size: int, scale_fmt: str, topk_tokens: int,
                              max_total_seq_len: int, skip_k_cache_insert: bool) -> None:
    attn_metadata = get_forward_context().attn_metadata
    if not isinstance(attn_metadata, dict):
        # Profiling run: touch the step's peak workspace (gathered keys, logits) once.
        row_bytes = IndexerCacheLayout.from_cache(kv_cache, quant_block_size).row_bytes
        torch.empty(max_total_seq_len * row_bytes + (envs.VLLM_SPARSE_INDEXER_MAX_LOGITS_MB << 20),
                    dtype=torch.uint8, device=kv_cache.device)
        return
    run_indexer(attn_metadata[layer_name], q_fp8, k, weights, kv_cache, topk_indices_buffer, quant_block_size,
                scale_fmt, topk_tokens, skip_k_cache_insert, hidden_states.size(0))


def _fake(hidden_states, q_fp8, k, weights, kv_cache, topk_indices_buffer, layer_name, quant_block_size, scale_fmt,
          topk_tokens, max_total_seq_len, skip_k_cache_insert) -> None:
    return None


# Only the index buffer is declared mutated, as vLLM declares its own indexer op (the cache is written in place).
# Registered for every backend, not only the platform's dispatch key (vLLM's default): the op runs the plugin's
# CPU or CUDA kernels by the tensors' device, so CPU tensors also run where vLLM's platform is CUDA.
direct_register_custom_op(OP_NAME, nvfp4_sparse_attn_indexer, mutates_args=["topk_indices_buffer"], fake_impl=_fake,
                          dispatch_key="CompositeExplicitAutograd")


def _unsupported(use_fp4_cache: bool, scale_fmt: str | None, compress_ratio: int, candidate_blocks) -> str | None:
    parallel = get_current_vllm_config().parallel_config
    if use_fp4_cache:
        return "an MXFP4 indexer cache"
    if scale_fmt == "mxfp8":  # UE8M0 exponent bytes, not the float32 scales the logits ops read
        return "scale_fmt='mxfp8'"
    if compress_ratio != 1:
        return f"compress_ratio={compress_ratio}"
    if candidate_blocks is not None:
        return "two-level candidate blocks"
    if parallel.decode_context_parallel_size > 1 or parallel.prefill_context_parallel_size > 1:
        return "context parallelism"
    return None


class NVFP4SparseAttnIndexer(SparseAttnIndexer):
    """DeepSeek-V3.2's indexer op on the plugin's ops (CPU and CUDA, no DeepGEMM)."""

    def __init__(self, k_cache, quant_block_size: int, scale_fmt: str | None, topk_tokens: int, head_dim: int,
                 max_model_len: int, max_total_seq_len: int, topk_indices_buffer: torch.Tensor,
                 skip_k_cache_insert: bool = False, use_fp4_cache: bool = False, compress_ratio: int = 1,
                 candidate_blocks: torch.Tensor | None = None, candidate_block_size: int = 0,
                 candidate_write: bool = False):
        reason = _unsupported(use_fp4_cache, scale_fmt, compress_ratio, candidate_blocks)
        if reason is not None:
            # Models the plugin does not cover (DeepSeek-V4's compressed indexer, ...) keep vLLM's op.
            logger.info("vllm_nvfp4_plugin: indexer with %s: using vLLM's own SparseAttnIndexer", reason)
            self.__class__ = SparseAttnIndexer
            SparseAttnIndexer.__init__(
                self, k_cache, quant_block_size, scale_fmt, topk_tokens, head_dim, max_model_len,
                max_total_seq_len, topk_indices_buffer, skip_k_cache_insert, use_fp4_cache, compress_ratio,
                candidate_blocks, candidate_block_size, candidate_write)
            return
        CustomOp.__init__(self)  # not SparseAttnIndexer.__init__: it demands DeepGEMM on CUDA
        if quant_block_size <= 0 or head_dim % quant_block_size:
            raise ValueError(f"head_dim ({head_dim}) must be a multiple of quant_block_size ({quant_block_size})")
        if topk_indices_buffer.dtype != torch.int32 or topk_indices_buffer.dim() != 2:
            raise ValueError(f"topk_indices_buffer must be a 2-D int32 tensor, got {topk_indices_buffer.dtype} "
                             f"{tuple(topk_indices_buffer.shape)}")
        if topk_tokens > topk_indices_buffer.size(1):
            raise ValueError(f"topk_tokens ({topk_tokens}) is larger than the top-k index buffer's width "
                             f"({topk_indices_buffer.size(1)})")
        self.k_cache = k_cache
        self.quant_block_size = quant_block_size
        self.scale_fmt = scale_fmt or ""
        self.topk_tokens = topk_tokens
        self.head_dim = head_dim
        self.max_model_len = max_model_len
        self.max_total_seq_len = max_total_seq_len
        self.topk_indices_buffer = topk_indices_buffer
        self.skip_k_cache_insert = skip_k_cache_insert
        k_cache.get_attn_backend = _plugin_indexer_backend

    def forward_native(self, hidden_states: torch.Tensor, q_quant: torch.Tensor, k: torch.Tensor | None,
                       weights: torch.Tensor) -> torch.Tensor:
        if not isinstance(q_quant, torch.Tensor):
            raise ValueError("q_quant must be one FP8 tensor (MXFP4 queries are not supported by the plugin)")
        torch.ops.vllm.nvfp4_sparse_attn_indexer(
            hidden_states, q_quant, k, weights, self.k_cache.kv_cache, self.topk_indices_buffer,
            self.k_cache.prefix, self.quant_block_size, self.scale_fmt, self.topk_tokens, self.max_total_seq_len,
            self.skip_k_cache_insert)
        return self.topk_indices_buffer

    # One implementation for every platform CustomOp may dispatch to.
    forward_cuda = forward_cpu = forward_hip = forward_xpu = forward_oot = forward_native


def _plugin_indexer_backend() -> type[IndexerBackend]:
    return IndexerBackend
