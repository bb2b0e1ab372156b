"""Compute core of the DeepSeek-V3.2 lightning indexer over plain tensors: FP8 MQA logits and per-row top-k.

`logit[row, key] = scale(key) · Σ_h w[row, h] · relu(q[row, h] · k_fp8[key])`, the quantity DeepGEMM's
`fp8_mqa_logits` / `fp8_paged_mqa_logits` compute, here by the plugin's compiled ops (CPU and CUDA kernels,
`vllm_nvfp4.indexer_mqa_logits` / `indexer_paged_mqa_logits`); the top-k is torch's. It imports no vLLM (the GPU
test machine has none); `op.py` feeds it from vLLM's metadata.
"""

from __future__ import annotations

import torch

from .. import ops


def fp8_mqa_logits(q: torch.Tensor, k_values: torch.Tensor, k_scale_bytes: torch.Tensor, weights: torch.Tensor,
                   ks: torch.Tensor, ke: torch.Tensor) -> torch.Tensor:
    """Logits of contiguous keys (a gathered prefill chunk): `[M, N]` float32, `-inf` outside `[ks[m], ke[m])`.

    q `[M, H, D]` FP8; k_values `[N, D]` FP8 bytes; k_scale_bytes `[N, D/quant_block_size*4]`; weights `[M, H]`.
    """
    logits = torch.empty(q.size(0), k_values.size(0), dtype=torch.float32, device=q.device)
    ops.indexer_mqa_logits(q, k_values, k_scale_bytes, weights.float().contiguous(), ks, ke, logits)
    return logits


def fp8_paged_mqa_logits(q: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor,
                         context_lens: torch.Tensor, block_table: torch.Tensor, max_context: int,
                         quant_block_size: int) -> torch.Tensor:
    """Decode logits read straight from the paged indexer cache: `[B*n, max_context]` float32.

    q `[B, n, H, D]` FP8 (n query tokens per request, next_n); weights `[B, n, H]`; context_lens `[B, n]`: keys
    `[0, context_lens[b, j])` of request b are visible to its token j (`-inf` past it); block_table `[B, W]`
    int32; `max_context` (a host int) ≥ every context length bounds the columns.
    """
    b, n = q.shape[:2]
    logits = torch.empty(b * n, max_context, dtype=torch.float32, device=q.device)
    ops.indexer_paged_mqa_logits(q, kv_cache, weights.float().contiguous(), context_lens.int().contiguous(),
                                 block_table, quant_block_size, logits)
    return logits


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
