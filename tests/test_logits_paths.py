"""The indexer logits ops on the layouts the kernels take slower paths for, against reference.py's float64 logits:
q, k and cache rows that are not 16-byte (or not even 4-byte) aligned (byte loads), more than 64 heads (the
CUDA op's second, accumulating launch over the next 64), block sizes that are no power of two, next_n > 1.
Same tolerances and poisoned padding as test_logits_ops.py."""

import pytest
import torch
from test_logits_ops import (
    NAN_BYTE,
    absolute_terms,
    assert_logits_match,
    assert_paged_logits_match,
    paged_case,
    poisoned_logits,
    queries,
    random_keys,
)

from vllm_nvfp4_plugin import ops, reference

FP8 = torch.float8_e4m3fn


@pytest.mark.parametrize("rows,keys,heads,quant_block_size,k_offset,q_offset", [
    (9, 150, 80, 128, 1, 0),  # k rows at odd addresses; two head groups
    (7, 90, 100, 64, 3, 5),   # q at an odd address too
    (5, 260, 17, 32, 0, 0),
])
def test_mqa_logits_unaligned_and_many_heads(device, rows, keys, heads, quant_block_size, k_offset, q_offset):
    g = torch.Generator().manual_seed(rows * 1000 + keys)
    values, scale_bytes = random_keys(g, keys, 128, quant_block_size, "ue8m0")
    q, w = queries(g, (rows,), heads, 128)
    ke = torch.randint(0, keys + 1, (rows,), generator=g).int()
    ks = (ke - torch.randint(0, keys, (rows,), generator=g).int()).clamp(min=0)
    want = torch.empty(rows, keys, dtype=torch.float64)
    reference.indexer_mqa_logits(q, values, scale_bytes, w, ks, ke, want)
    k = torch.full((keys, 128 + 40), NAN_BYTE, dtype=torch.uint8, device=device)[:, k_offset:k_offset + 128]
    k.copy_(values)
    q_at = torch.empty(q.numel() + q_offset, dtype=FP8, device=device)[q_offset:].view(q.shape)
    q_at.copy_(q)
    got = poisoned_logits(rows, keys, device)
    ops.indexer_mqa_logits(q_at, k, scale_bytes.to(device), w.to(device), ks.to(device), ke.to(device), got)
    assert_logits_match(got, want, absolute_terms(q, w, values, scale_bytes), device)


@pytest.mark.parametrize("batch,next_n,heads,quant_block_size,block_size,pad,columns", [
    (3, 2, 80, 128, 64, 0, 300),  # two head groups, speculative tokens
    (3, 1, 64, 128, 64, 4, 300),  # blocks 4-byte but not 16-byte aligned
    (2, 3, 33, 64, 24, 8, 200),   # a block size that is no power of two
    (2, 1, 128, 32, 16, 1, 150),  # blocks at odd addresses
])
def test_paged_mqa_logits_unaligned_and_many_heads(device, batch, next_n, heads, quant_block_size, block_size, pad,
                                                   columns):
    g = torch.Generator().manual_seed(batch * 100 + heads + pad)
    lens = (torch.randint(1, columns + 50, (batch, 1), generator=g) + torch.arange(next_n)).int()
    cache, table, q, w = paged_case(g, lens, heads, quant_block_size, block_size, columns, device, pad=pad,
                                    scale_fmt="")
    assert_paged_logits_match(cache, table, q, w, lens, quant_block_size, columns, device)
