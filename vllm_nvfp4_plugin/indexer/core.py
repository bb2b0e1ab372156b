"""Compute core of the DeepSeek-V3.2 lightning indexer over plain tensors: FP8 MQA logits and per-row top-k.

`logit[row, key] = scale(key) · Σ_h w[row, h] · relu(q[row, h] · k_fp8[key])`, the quantity DeepGEMM's
`fp8_mqa_logits` / `fp8_paged_mqa_logits` compute, here with torch matmuls in bounded tiles. It imports no
vLLM (the GPU test machine has none); `op.py` feeds it from vLLM's metadata.

Precision: FP8 E4M3 values are exact in bf16, so on CUDA the q·k products run as bf16 matmuls accumulating
into float32 outputs (the same products DeepGEMM's FP8 MMA forms); on the CPU, which has no such matmul,
in float32. The key scale is applied to the finished logit when a key has one scale (quant block = head
dim, what vLLM uses: relu commutes with a positive factor); with several scales per key the keys are
dequantized to float32 first.
"""

from __future__ import annotations

import torch

from ..layout import IndexerCacheLayout

FP8 = torch.float8_e4m3fn
DEFAULT_TILE_BYTES = 256 << 20  # bound on the float32 per-head scores of one tile


def _check_qkw(q: torch.Tensor, weights: torch.Tensor, head_dim: int) -> None:
    if q.dtype != FP8:
        raise ValueError(f"q must be float8_e4m3fn, got {q.dtype}")
    if q.size(-1) != head_dim:
        raise ValueError(f"q head dim {q.size(-1)} does not match the keys' head_dim {head_dim}")
    if weights.shape != q.shape[:-1]:
        raise ValueError(f"weights must have shape {tuple(q.shape[:-1])} (q without head_dim), "
                         f"got {tuple(weights.shape)}")


def _keys(values: torch.Tensor, scale_bytes: torch.Tensor, quant_block_size: int):
    """FP8 value bytes `[..., D]` and scale bytes `[..., S*4]` → (keys in the matmul dtype, per-key scale or None)."""
    fp8 = values.view(FP8)
    scales = scale_bytes.contiguous().view(torch.float32)
    if scales.size(-1) == 1:
        dtype = torch.bfloat16 if values.is_cuda else torch.float32
        return fp8.to(dtype), scales.squeeze(-1)
    blocks = fp8.float().unflatten(-1, (-1, quant_block_size)) * scales.unsqueeze(-1)
    return blocks.flatten(-2), None


def _scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """`q [B, R, D] · k [B, N, D]ᵀ → [B, R, N]` float32 (bf16 inputs accumulate into float32 outputs)."""
    if k.dtype == torch.float32:
        return torch.bmm(q.float(), k.transpose(1, 2))
    return torch.bmm(q.to(k.dtype), k.transpose(1, 2), out_dtype=torch.float32)


def _weighted_relu_sum(scores: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """`scores [B, H, N]`, `weights [B, H]` → `Σ_h w · relu(scores)` `[B, N]`."""
    return torch.bmm(weights.float().unsqueeze(1), scores.relu_()).squeeze(1)


def fp8_mqa_logits(q: torch.Tensor, k_values: torch.Tensor, k_scale_bytes: torch.Tensor, weights: torch.Tensor,
                   ks: torch.Tensor, ke: torch.Tensor, quant_block_size: int,
                   tile_bytes: int = DEFAULT_TILE_BYTES) -> torch.Tensor:
    """Logits of contiguous keys (a gathered prefill chunk): `[M, N]` float32, `-inf` outside `[ks[m], ke[m])`.

    q `[M, H, D]` FP8; k_values `[N, D]` FP8 bytes; k_scale_bytes `[N, D/quant_block_size*4]`; weights `[M, H]`.
    """
    m, h, d = q.shape
    _check_qkw(q, weights, k_values.size(1))
    n = k_values.size(0)
    k, k_scale = _keys(k_values, k_scale_bytes, quant_block_size)
    logits = torch.empty(m, n, dtype=torch.float32, device=q.device)
    cols = min(n, max(256, tile_bytes // (m * h * 4)))
    rows = max(1, min(m, tile_bytes // (cols * h * 4)))
    for c0 in range(0, n, cols):
        k_tile = k[c0:c0 + cols].unsqueeze(0)
        for r0 in range(0, m, rows):
            q_tile = q[r0:r0 + rows].reshape(1, -1, d)
            scores = _scores(q_tile, k_tile).view(-1, h, k_tile.size(1))
            logits[r0:r0 + rows, c0:c0 + cols] = _weighted_relu_sum(scores, weights[r0:r0 + rows])
    if k_scale is not None:
        logits.mul_(k_scale)
    col = torch.arange(n, device=q.device)
    outside = (col < ks.unsqueeze(1)) | (col >= ke.unsqueeze(1))
    return logits.masked_fill_(outside, float("-inf"))


def fp8_paged_mqa_logits(q: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor,
                         context_lens: torch.Tensor, block_table: torch.Tensor, max_context: int,
                         quant_block_size: int, tile_bytes: int = DEFAULT_TILE_BYTES) -> torch.Tensor:
    """Decode logits read straight from the paged indexer cache: `[B*n, max_context]` float32.

    q `[B, n, H, D]` FP8 (n query tokens per request, next_n); weights `[B, n, H]`; context_lens `[B, n]`: keys
    `[0, context_lens[b, j])` of request b are visible to its token j (`-inf` past it); block_table `[B, W]`
    int32; `max_context` (a host int) ≥ every context length bounds the columns.
    """
    b, n, h, d = q.shape
    layout = IndexerCacheLayout.from_cache(kv_cache, quant_block_size)
    _check_qkw(q, weights, layout.head_dim)
    if context_lens.shape != (b, n):
        raise ValueError(f"context_lens must have shape {(b, n)}, got {tuple(context_lens.shape)}")
    bs = layout.block_size
    num_pages = -(-max_context // bs)
    if num_pages > block_table.size(1):
        raise ValueError(f"max_context {max_context} needs {num_pages} blocks, block_table has {block_table.size(1)}")
    blocks = layout.block_bytes_view(kv_cache)
    req_context = context_lens.amax(1, keepdim=True)
    page_start = torch.arange(num_pages, device=q.device) * bs
    # Table entries past a request's context may be stale or padding: read block 0 there (masked below).
    pages = torch.where(page_start < req_context, block_table[:, :num_pages].long(), 0)
    q_rows = q.reshape(b, n * h, d)
    logits = torch.empty(b, n, num_pages * bs, dtype=torch.float32, device=q.device)
    tile_pages = max(1, tile_bytes // (b * n * h * bs * 4))
    for p0 in range(0, num_pages, tile_pages):
        tile = blocks[pages[:, p0:p0 + tile_pages]]  # [B, P, block_bytes]
        p = tile.size(1)
        values = tile[..., :bs * d].reshape(b, p * bs, d)
        scale_bytes = tile[..., bs * d:bs * layout.row_bytes].reshape(b, p * bs, layout.scale_bytes)
        k, k_scale = _keys(values, scale_bytes, quant_block_size)
        scores = _scores(q_rows, k).view(b * n, h, p * bs)
        tile_logits = _weighted_relu_sum(scores, weights.reshape(b * n, h)).view(b, n, p * bs)
        if k_scale is not None:
            tile_logits.mul_(k_scale.unsqueeze(1))
        logits[:, :, p0 * bs:(p0 + p) * bs] = tile_logits
    logits = logits[:, :, :max_context]
    col = torch.arange(max_context, device=q.device)
    logits.masked_fill_(col >= context_lens.unsqueeze(-1), float("-inf"))
    return logits.reshape(b * n, max_context)


def topk_per_row(logits: torch.Tensor, k: int, out: torch.Tensor, row_starts: torch.Tensor | None = None) -> None:
    """Write each row's `k` largest finite logits' columns, minus `row_starts[row]`, into `out [rows, k]`,
    best first; `-1` fills the places past a row's valid (finite) entries."""
    if out.shape != (logits.size(0), k) or out.dtype != torch.int32:
        raise ValueError(f"out must be int32 [{logits.size(0)}, {k}], got {out.dtype} {tuple(out.shape)}")
    found = min(k, logits.size(1))
    values, cols = torch.topk(logits, found, dim=1, sorted=True)
    if row_starts is not None:
        cols = cols - row_starts.unsqueeze(1)
    out[:, :found] = torch.where(values == float("-inf"), -1, cols)
    out[:, found:] = -1
