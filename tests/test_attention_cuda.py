"""FlashInfer reader views (CPU) and the CUDA attention paths (GPU) against fp32 attention over the dequantized cache."""

import math

import pytest
import torch

from vllm_nvfp4_plugin import reference
from vllm_nvfp4_plugin.attention.flashinfer_reader import (
    FlashInferNVFP4Decoder, flashinfer_decode_unavailable_reason, nvfp4_flashinfer_views)
from vllm_nvfp4_plugin.layout import NVFP4PageLayout

K_SCALE, V_SCALE = 0.75, 1.25  # non-unit global dequant scales, as a checkpoint may give


def _random_cache(layout, num_blocks, num_tokens, device, gen):
    """A cache with `num_tokens` tokens written by the reference store at shuffled slots; returns (cache, k, v, slots)."""
    cache = layout.allocate(num_blocks, device, fill=0)
    k = torch.randn(num_tokens, layout.num_heads, layout.head_size, generator=gen).to(device, torch.bfloat16)
    v = torch.randn(num_tokens, layout.num_heads, layout.head_size, generator=gen).to(device, torch.bfloat16)
    slots = torch.randperm(num_blocks * layout.block_size, generator=gen)[:num_tokens].to(device)
    reference.reshape_and_cache_nvfp4(k, v, cache[:, 0], cache[:, 1], slots, torch.tensor(K_SCALE),
                                      torch.tensor(V_SCALE), False)
    return cache, k, v, slots


@pytest.mark.parametrize("hnd", [False, True])
@pytest.mark.parametrize("head_size", [64, 128])
def test_flashinfer_views_address_every_entry(hnd, head_size):
    """The strided data/scale views FlashInfer gets decode to exactly what the reference store encoded."""
    gen = torch.Generator().manual_seed(0)
    layout = NVFP4PageLayout(head_size, block_size=16, num_heads=3, hnd=hnd)
    cache, k, v, slots = _random_cache(layout, num_blocks=5, num_tokens=50, device="cpu", gen=gen)
    blocks, offsets = slots // layout.block_size, slots % layout.block_size
    for side, x, g in ((0, k, K_SCALE), (1, v, V_SCALE)):
        data, sf = nvfp4_flashinfer_views(cache[:, side], layout)
        assert data.dtype == torch.uint8 and sf.dtype == torch.float8_e4m3fn
        if hnd:  # FlashInfer's HND page is [head, token]; compare in token-major order
            data, sf = data.transpose(1, 2), sf.transpose(1, 2)
        packed, scales = reference.nvfp4_encode(x, g)
        assert torch.equal(data[blocks, offsets], packed)
        assert torch.equal(sf[blocks, offsets].view(torch.uint8), scales.view(torch.uint8))


def test_head_64_and_cpu_are_not_flashinfer():
    assert "head sizes" in flashinfer_decode_unavailable_reason(64, torch.device("cpu"))
    assert "not CUDA" in flashinfer_decode_unavailable_reason(128, torch.device("cpu"))


# --- GPU -----------------------------------------------------------------------------------------

def _dequantized(cache, layout, block_table, seq_lens):
    """fp32 K, V `[total_tokens, heads, head]` of each sequence's cached tokens, by the reference gather."""
    cu = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(seq_lens), 0)
    total = int(cu[-1])
    out_k = torch.empty(total, layout.num_heads, layout.head_size, device=cache.device)
    out_v = torch.empty_like(out_k)
    reference.gather_nvfp4_kv_cache(cache[:, 0], cache[:, 1], block_table, cu.to(cache.device),
                                    torch.tensor(K_SCALE), torch.tensor(V_SCALE), False, out_k, out_v)
    return out_k, out_v, cu.tolist()


def _fp32_attention(q, k, v, causal_offset=None):
    """Exact attention of `q` `[n, hq, d]` over `k, v` `[L, hkv, d]` (GQA); causal if `causal_offset` is given."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, 1).float()
    v = v.repeat_interleave(group, 1).float()
    logits = torch.einsum("nhd,lhd->hnl", q.float(), k) / math.sqrt(q.shape[-1])
    if causal_offset is not None:  # query i sits at position causal_offset + i
        pos_q = torch.arange(q.shape[0], device=q.device).view(-1, 1) + causal_offset
        logits = logits.masked_fill(torch.arange(k.shape[0], device=q.device).view(1, -1) > pos_q, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", logits.softmax(-1), v)


def _rel_l2(x, ref):
    return ((x.float() - ref).norm() / ref.norm()).item()


def _decode_batch(layout, seq_lens, device, gen):
    """A cache holding `seq_lens` tokens per sequence in shuffled blocks, and its block table."""
    blocks_per_seq = [(n + layout.block_size - 1) // layout.block_size for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
    slots, start = [], 0
    for i, (n, nb) in enumerate(zip(seq_lens, blocks_per_seq)):
        table[i, :nb] = perm[start:start + nb]
        start += nb
        pos = torch.arange(n)
        slots.append(table[i, pos // layout.block_size].long() * layout.block_size + pos % layout.block_size)
    cache = layout.allocate(num_blocks, device, fill=0)
    total = sum(seq_lens)
    k = torch.randn(total, layout.num_heads, layout.head_size, generator=gen).to(device, torch.bfloat16)
    v = torch.randn(total, layout.num_heads, layout.head_size, generator=gen).to(device, torch.bfloat16)
    from vllm_nvfp4_plugin import ops
    ops.reshape_and_cache_nvfp4(k, v, cache[:, 0], cache[:, 1], torch.cat(slots).to(device),
                                torch.tensor(K_SCALE, device=device), torch.tensor(V_SCALE, device=device), False)
    return cache, table.to(device)


@pytest.mark.gpu
@pytest.mark.parametrize("hnd", [False, True])
@pytest.mark.parametrize("head_size", [128, 256])
def test_flashinfer_decode_matches_fp32_attention(hnd, head_size):
    pytest.importorskip("flashinfer")
    device = torch.device("cuda")
    reason = flashinfer_decode_unavailable_reason(head_size, device)
    if reason:
        pytest.skip(reason)
    gen = torch.Generator().manual_seed(head_size + hnd)
    layout = NVFP4PageLayout(head_size, block_size=16, num_heads=2, hnd=hnd)
    seq_lens = [1, 17, 300, 1025]
    cache, table = _decode_batch(layout, seq_lens, device, gen)
    q = torch.randn(len(seq_lens), 8, head_size, generator=gen).to(device, torch.bfloat16)
    decoder = FlashInferNVFP4Decoder(device, hnd)
    decoder.plan(table, torch.tensor(seq_lens, dtype=torch.int32), 8, 2, head_size, 16, torch.bfloat16,
                 1 / math.sqrt(head_size))
    out = torch.empty_like(q)
    decoder.run(q, cache[:, 0], cache[:, 1], K_SCALE, V_SCALE, out)
    k, v, cu = _dequantized(cache, layout, table, seq_lens)
    ref = torch.cat([_fp32_attention(q[i:i + 1], k[cu[i]:cu[i + 1]], v[cu[i]:cu[i + 1]])
                     for i in range(len(seq_lens))])
    err = _rel_l2(out, ref)
    print(f"flashinfer decode head={head_size} hnd={hnd} rel_l2={err:.2e}")
    assert err <= 1e-2
