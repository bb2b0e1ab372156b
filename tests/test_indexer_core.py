"""Indexer compute core (no vLLM) against a float64 reference indexer, on the CPU and (gpu marker) CUDA.

Keys go into the paged cache through the compiled store op and come out through the compiled gather
op (prefill) or straight from the pages (decode). The reference scores the unquantized keys' FP8 round
trip in float64; selected index sets must equal the reference's, ties compared as score sets.
The helpers here are shared with the vLLM layer-level tests (test_indexer.py).
"""

from __future__ import annotations

import pytest
import torch

import vllm_nvfp4_plugin.ops  # noqa: F401  (registers torch.ops.vllm_nvfp4)
from vllm_nvfp4_plugin import reference
from vllm_nvfp4_plugin.indexer import core
from vllm_nvfp4_plugin.layout import IndexerCacheLayout

FP8 = torch.float8_e4m3fn
GARBAGE = 0x7F  # E4M3 NaN: any unwritten cache byte that leaked into a visible logit would show


# --- float reference ---------------------------------------------------------------------------

def fp8_round_trip(k: torch.Tensor, quant_block_size: int, scale_fmt: str) -> torch.Tensor:
    """The keys as the cache holds them, dequantized to float64 (`[n, D]`)."""
    values, scale_bytes = reference.indexer_quantize(k.cpu(), quant_block_size, scale_fmt)
    scales = scale_bytes.view(torch.float32).double()
    return (values.view(FP8).double().unflatten(1, (-1, quant_block_size)) * scales.unsqueeze(-1)).flatten(1)


def reference_logits(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
    """`Σ_h w_h relu(q_h · k)` of query tokens (q `[R, H, D]` FP8, w `[R, H]`) over keys `[L, D]` float64:
    `[R, L]`, `-inf` at keys `>= context[row]`."""
    scores = torch.einsum("rhd,ld->rhl", q.cpu().double(), keys).relu()
    logits = (scores * w.cpu().double().unsqueeze(-1)).sum(1)
    return logits.masked_fill(torch.arange(keys.size(0)) >= context.cpu().unsqueeze(1), float("-inf"))


def assert_logits_close(logits: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal `-inf` places, finite values close relative to the largest reference logit."""
    scale = float(ref[ref.isfinite()].abs().max())
    torch.testing.assert_close(logits.cpu().double(), ref, rtol=1e-4, atol=1e-4 * scale)


def assert_same_selection(selected: torch.Tensor, ref: torch.Tensor, k: int) -> None:
    """Each row of `selected` (`[R, k]` key indices, -1 padded) must pick a best-`k` set of the row's finite
    reference logits (`ref [R, L]`), ties compared as score sets."""
    sel = selected.cpu().long()
    want = ref.isfinite().sum(1).clamp(max=k).unsqueeze(1)
    valid = torch.arange(k) < want
    assert (sel[~valid] == -1).all(), "expected -1 past each row's visible keys"
    assert ((sel[valid] >= 0) & (sel[valid] < ref.size(1))).all(), "indices outside the keys"
    picked = ref.gather(1, sel.clamp(min=0)).masked_fill(~valid, float("-inf"))
    assert picked[valid].isfinite().all(), "selected keys the row cannot see"
    ordered = sel.masked_fill(~valid, -1).sort(1).values
    assert ((ordered[:, 1:] != ordered[:, :-1]) | (ordered[:, 1:] < 0)).all(), "repeated indices in a row"
    got = picked.sort(1, descending=True).values
    best = ref.topk(min(k, ref.size(1)), dim=1).values
    scale = float(ref[ref.isfinite()].abs().max())
    torch.testing.assert_close(got[:, :best.size(1)][valid[:, :best.size(1)]], best[valid[:, :best.size(1)]],
                               rtol=1e-5, atol=1e-5 * scale)


# --- cache set-up ------------------------------------------------------------------------------

def random_queries(g: torch.Generator, tokens: int, heads: int, head_dim: int):
    q = (torch.randn(tokens, heads, head_dim, generator=g) * 2).to(FP8)
    w = torch.randn(tokens, heads, generator=g)
    return q, w


def cache_with_keys(key_lens: list[int], block_size: int, head_dim: int, quant_block_size: int, scale_fmt: str,
                    device: str, seed: int = 0):
    """A padded-stride cache holding `key_lens[r]` keys per request in shuffled blocks, via the store op.

    Returns (cache, block_table int32 `[R, W]`, per-request unquantized keys)."""
    g = torch.Generator().manual_seed(seed)
    layout = IndexerCacheLayout(head_dim, block_size, quant_block_size)
    blocks_per_req = [-(-n // block_size) for n in key_lens]
    width = max(blocks_per_req) + 1
    num_blocks = sum(blocks_per_req) + 2
    order = torch.randperm(num_blocks, generator=g).int()
    table = torch.zeros(len(key_lens), width, dtype=torch.int32)
    used = 0
    for r, nb in enumerate(blocks_per_req):
        table[r, :nb] = order[used:used + nb]
        table[r, nb:] = order[-1]  # a stale block past the request's last one
        used += nb
    cache = layout.allocate(num_blocks, device, fill=GARBAGE, block_stride=layout.block_bytes + 48)
    keys = [torch.randn(n, head_dim, generator=g).to(torch.bfloat16) for n in key_lens]
    for r, k in enumerate(keys):
        pos = torch.arange(k.size(0))
        slots = table[r, pos // block_size].long() * block_size + pos % block_size
        torch.ops.vllm_nvfp4.indexer_k_quant_and_cache(k.to(device), cache, slots.to(device), quant_block_size,
                                                       scale_fmt)
    return cache, table.to(device), keys


# --- tests -------------------------------------------------------------------------------------

@pytest.mark.parametrize("topk", [64, 512])
@pytest.mark.parametrize("quant_block_size", [128, 64])
def test_prefill_chunk_logits_and_topk(device, topk, quant_block_size):
    """Two prefix-cached requests in one gathered chunk: rows see keys [ks, ke), causal."""
    head_dim, heads, block_size = 128, 8, 64
    key_lens, query_lens = [700, 130], [90, 130]
    cache, table, keys = cache_with_keys(key_lens, block_size, head_dim, quant_block_size, "ue8m0", device)
    cu = torch.tensor([0, 700, 830], dtype=torch.int32, device=device)
    dst_k = torch.empty(900, head_dim, dtype=torch.uint8, device=device)
    dst_scale = torch.empty(900, head_dim // quant_block_size * 4, dtype=torch.uint8, device=device)
    torch.ops.vllm_nvfp4.cp_gather_indexer_k_quant_cache(cache, dst_k, dst_scale, table, cu)
    positions = [torch.arange(n - q, n) for n, q in zip(key_lens, query_lens)]
    ks = torch.cat([torch.full((q,), int(c)) for q, c in zip(query_lens, cu[:-1].cpu())]).to(device, torch.int32)
    ke = torch.cat([int(c) + p + 1 for p, c in zip(positions, cu[:-1].cpu())]).to(device, torch.int32)
    q, w = random_queries(torch.Generator().manual_seed(1), sum(query_lens), heads, head_dim)
    logits = core.fp8_mqa_logits(q.to(device), dst_k[:830], dst_scale[:830], w.to(device), ks, ke)
    out = torch.empty(logits.size(0), topk, dtype=torch.int32, device=device)
    core.topk_per_row(logits, topk, out, row_starts=ks)

    # Reference in the chunk's columns: request r's keys sit at [cu[r], cu[r+1]).
    ref = torch.full(logits.shape, float("-inf"), dtype=torch.float64)
    row = 0
    for r, pos in enumerate(positions):
        start = int(cu[r])
        rows = slice(row, row + len(pos))
        ref[rows, start:start + key_lens[r]] = reference_logits(
            q[rows], w[rows], fp8_round_trip(keys[r], quant_block_size, "ue8m0"), pos + 1)
        row += len(pos)
    assert_logits_close(logits, ref)
    assert_same_selection(torch.where(out >= 0, out + ks.unsqueeze(1), -1), ref, topk)


@pytest.mark.parametrize("topk", [64, 512])
@pytest.mark.parametrize("quant_block_size", [128, 64])
def test_paged_decode_logits_and_topk(device, topk, quant_block_size):
    """next_n = 3 decode tokens per request, one request with 2 (a padded row), contexts shorter than top-k."""
    head_dim, heads, block_size, next_n = 128, 8, 64, 3
    key_lens = [600, 40, 257]
    decode_lens = [3, 2, 3]
    cache, table, keys = cache_with_keys(key_lens, block_size, head_dim, quant_block_size, "", device, seed=2)
    context = torch.zeros(3, next_n, dtype=torch.int32)
    for r, (n, d) in enumerate(zip(key_lens, decode_lens)):
        context[r, :d] = torch.arange(n - d + 1, n + 1)
    q, w = random_queries(torch.Generator().manual_seed(3), 3 * next_n, heads, head_dim)
    q, w = q.view(3, next_n, heads, head_dim), w.view(3, next_n, heads)
    logits = core.fp8_paged_mqa_logits(q.to(device), cache, w.to(device), context.to(device), table,
                                       max(key_lens) + 5, quant_block_size)
    out = torch.empty(logits.size(0), topk, dtype=torch.int32, device=device)
    core.topk_per_row(logits, topk, out)
    ref = torch.full((3 * next_n, logits.size(1)), float("-inf"), dtype=torch.float64)
    for r in range(3):
        ref[r * next_n:(r + 1) * next_n, :key_lens[r]] = reference_logits(
            q[r], w[r], fp8_round_trip(keys[r], quant_block_size, ""), context[r])
    assert_logits_close(logits, ref)
    assert_same_selection(out, ref, topk)
    assert (out[next_n + 2] == -1).all()  # the padded token of request 1


def test_core_rejects_bad_input():
    """The ops' own checks reach the caller (tests/test_logits_ops.py has the full table)."""
    cache, table, _ = cache_with_keys([64], 64, 128, 128, "", "cpu")
    q, w = random_queries(torch.Generator().manual_seed(0), 1, 4, 128)
    ctx = torch.tensor([[64]], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="indexer_paged_mqa_logits: q: dtype must be float8_e4m3fn"):
        core.fp8_paged_mqa_logits(q.float().view(1, 1, 4, 128), cache, w.view(1, 1, 4), ctx, table, 64, 128)
    with pytest.raises(RuntimeError, match=r"weights: must have shape \[batch, next_n, heads\]"):
        core.fp8_paged_mqa_logits(q.view(1, 1, 4, 128), cache, w.view(1, 4, 1), ctx, table, 64, 128)
    with pytest.raises(RuntimeError, match="logits: at most block_table's 2 blocks"):
        core.fp8_paged_mqa_logits(q.view(1, 1, 4, 128), cache, w.view(1, 1, 4), ctx, table, 150, 128)
    with pytest.raises(RuntimeError, match="k: head_dim 128 does not match q's 64"):
        core.fp8_mqa_logits(q[:, :, :64].contiguous(), torch.zeros(8, 128, dtype=torch.uint8),
                            torch.zeros(8, 4, dtype=torch.uint8), w, torch.zeros(1, dtype=torch.int32),
                            torch.ones(1, dtype=torch.int32))
    with pytest.raises(ValueError, match="out must be int32"):
        core.topk_per_row(torch.zeros(2, 10), 4, torch.empty(2, 4, dtype=torch.int64))
