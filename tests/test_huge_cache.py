"""A KV cache larger than 4 GiB (and than 2^31 elements in its uint8 view) on CUDA: the store, the gather and the
attention touch pages near its end exactly as they touch the same pages in a small cache, and leave every other byte
alone. Any 32-bit offset arithmetic would wrap and write or read near the start instead.
"""

import math

import pytest
import torch

from vllm_nvfp4_plugin import ops
from vllm_nvfp4_plugin.layout import NVFP4PageLayout

pytestmark = pytest.mark.gpu

POISON = 0xA5
HUGE_BYTES = 5 << 30
SEQ_LENS = (37, 64, 5)  # tokens of each request; its pages are the last blocks of the huge cache


@pytest.mark.parametrize("hnd", [False, True], ids=["NHD", "HND"])
def test_pages_past_4_gib_are_stored_gathered_and_attended_exactly(hnd):
    head, kv_heads, block, group = 128, 8, 16, 4
    layout = NVFP4PageLayout(head, block, kv_heads, hnd)
    num_blocks = HUGE_BYTES // layout.page_bytes + 1
    assert num_blocks * layout.page_bytes > 2**32
    huge = layout.allocate(num_blocks, "cuda", fill=POISON)
    pages = [-(-n // block) for n in SEQ_LENS]
    # Request r's pages, last blocks first and out of order; the small cache holds the same pages at 0, 1, 2, ...
    huge_ids = torch.arange(num_blocks - 1, num_blocks - 1 - sum(pages), -1).flip(0)[torch.randperm(sum(pages))]
    small = layout.allocate(sum(pages), "cuda", fill=POISON)
    width = max(pages)
    huge_table = torch.zeros(len(SEQ_LENS), width, dtype=torch.int32)
    small_table = torch.zeros_like(huge_table)
    used = 0
    for r, n in enumerate(pages):
        huge_table[r, :n] = huge_ids[used:used + n]
        small_table[r, :n] = torch.arange(used, used + n)
        used += n
    huge_table, small_table = huge_table.cuda(), small_table.cuda()

    gen = torch.Generator(device="cuda").manual_seed(0)
    k_scale, v_scale = torch.tensor([0.5], device="cuda"), torch.tensor([2.0], device="cuda")
    for r, n in enumerate(SEQ_LENS):
        key, value = (torch.randn(n, kv_heads, head, device="cuda", generator=gen, dtype=torch.bfloat16) * 3
                      for _ in range(2))
        pos = torch.arange(n, device="cuda")
        for cache, table in ((huge, huge_table), (small, small_table)):
            slots = table[r, pos // block].long() * block + pos % block
            ops.reshape_and_cache_nvfp4(key, value, cache[:, 0], cache[:, 1], slots, k_scale, v_scale, False)

    written = huge_ids.cuda()
    assert torch.equal(huge[written.sort().values], small[small_table_order(huge_table, small_table, written)])
    untouched = torch.ones(num_blocks, dtype=torch.bool, device="cuda")
    untouched[written] = False
    # Block by block in chunks (a mask over 5 GiB at once would need another 5 GiB).
    for start in range(0, num_blocks, 1 << 16):
        chunk = huge[start:start + (1 << 16)][untouched[start:start + (1 << 16)]]
        assert bool((chunk == POISON).all()), f"bytes outside the written pages changed near block {start}"

    cu = torch.tensor([0, *torch.tensor(SEQ_LENS).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    rows = int(cu[-1])
    gathered = {}
    for name, cache, table in (("huge", huge, huge_table), ("small", small, small_table)):
        out_k = torch.empty(rows, kv_heads, head, device="cuda", dtype=torch.float32)
        out_v = torch.empty_like(out_k)
        ops.gather_nvfp4_kv_cache(cache[:, 0], cache[:, 1], table, cu, k_scale, v_scale, False, out_k, out_v)
        gathered[name] = (out_k, out_v)
    assert torch.equal(gathered["huge"][0], gathered["small"][0])
    assert torch.equal(gathered["huge"][1], gathered["small"][1])

    # Attention: two decode tokens and one 5-token chunk, read from the pages past 4 GiB.
    query_lens = (1, 1, 5)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    seq_lens = torch.tensor(SEQ_LENS, dtype=torch.int32, device="cuda")
    query = torch.randn(sum(query_lens), kv_heads * group, head, device="cuda", generator=gen, dtype=torch.bfloat16)
    outs = {}
    for name, cache, table in (("huge", huge, huge_table), ("small", small, small_table)):
        out = torch.full_like(query, float("nan"))
        ops.nvfp4_paged_attention(query, cache[:, 0], cache[:, 1], table, starts, seq_lens, k_scale, v_scale,
                                  1 / math.sqrt(head), True, False, max(query_lens), max(SEQ_LENS), out)
        outs[name] = out
    assert not outs["huge"].isnan().any()
    assert torch.equal(outs["huge"], outs["small"])


def small_table_order(huge_table: torch.Tensor, small_table: torch.Tensor, written: torch.Tensor) -> torch.Tensor:
    """The small cache's block holding each huge block of `written.sort()`."""
    mapping = dict(zip(huge_table.flatten().tolist(), small_table.flatten().tolist()))
    return torch.tensor([mapping[b] for b in written.sort().values.tolist()], device=written.device)
