"""The vLLM-independent attention core against fp32 attention over the reference-dequantized cache."""

import pytest
import torch

from vllm_nvfp4_plugin import reference
from vllm_nvfp4_plugin.attention import (DequantWorkspace, NVFP4AttentionMetadata, check_supported,
                                         paged_attention, store_kv)
from vllm_nvfp4_plugin.layout import NVFP4PageLayout

K_SCALE, V_SCALE = torch.tensor(0.5), torch.tensor(2.0)  # non-unit global dequant scales


def rel_l2(x, y):
    return ((x.float() - y.float()).norm() / y.float().norm()).item()


def expected_attention(q, k, v, scale, causal):
    """fp32 attention of `q` [n, H, D] as the last n positions of context `k`, `v` [c, Hkv, D]; plain math."""
    n, heads, _ = q.shape
    c, kv_heads, _ = k.shape
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("nhd,chd->hnc", q.float(), k.float()) * scale
    if causal:
        allowed = torch.arange(c)[None, :] <= torch.arange(n)[:, None] + (c - n)
        scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hnc,chd->nhd", scores.softmax(-1), v.float())


def dequantized(x, global_scale):
    return reference.nvfp4_decode(*reference.nvfp4_encode(x, global_scale), global_scale)


class Batch:
    """Requests given as (query_len, context_len): the first context_len - query_len tokens of each are
    already in the cache (a cached prefix or earlier chunks); the step stores the query tokens' K/V."""

    def __init__(self, requests, layout, num_heads, gen, num_padding_tokens=0, dtype=torch.bfloat16):
        self.requests, self.layout = requests, layout
        heads, kv_heads, d = num_heads, layout.num_heads, layout.head_size
        blocks_per_req = [-(-c // layout.block_size) for _, c in requests]
        num_blocks = sum(blocks_per_req) + 2
        self.cache = layout.allocate(num_blocks, fill=0xFF)  # garbage where nothing was stored
        order = torch.randperm(num_blocks, generator=gen)
        self.block_table = torch.zeros(len(requests), max(blocks_per_req) + 1, dtype=torch.int32)
        used = 0
        for r, nb in enumerate(blocks_per_req):
            self.block_table[r, :nb] = order[used:used + nb]
            used += nb
        self.k = [torch.randn(c, kv_heads, d, generator=gen).to(dtype) for _, c in requests]
        self.v = [torch.randn(c, kv_heads, d, generator=gen).to(dtype) for _, c in requests]
        self.q = [torch.randn(n, heads, d, generator=gen).to(dtype) for n, _ in requests]

        def slots(r, positions):
            blocks = self.block_table[r, positions // layout.block_size].long()
            return blocks * layout.block_size + positions % layout.block_size

        for r, (n, c) in enumerate(requests):  # the cached part, written before this step
            if c == n:
                continue
            prefix = torch.arange(c - n)
            store_kv(self.k[r][:c - n], self.v[r][:c - n], self.cache, slots(r, prefix), K_SCALE, V_SCALE)
        pad = torch.zeros(num_padding_tokens, heads, d, dtype=dtype)
        pad_kv = torch.zeros(num_padding_tokens, kv_heads, d, dtype=dtype)
        self.query = torch.cat([*self.q, pad])
        self.key = torch.cat([k[c - n:] for k, (n, c) in zip(self.k, requests)] + [pad_kv])
        self.value = torch.cat([v[c - n:] for v, (n, c) in zip(self.v, requests)] + [pad_kv])
        self.slot_mapping = torch.cat([slots(r, torch.arange(c - n, c)) for r, (n, c) in enumerate(requests)]
                                      + [torch.full((num_padding_tokens,), -1)])

    def metadata(self, causal=True):
        return NVFP4AttentionMetadata.from_lengths([n for n, _ in self.requests], [c for _, c in self.requests],
                                                   self.block_table, self.slot_mapping, causal)

    def run(self, scale, causal=True, workspace=None):
        store_kv(self.key, self.value, self.cache, self.slot_mapping, K_SCALE, V_SCALE)
        out = torch.full_like(self.query, 7.0)
        paged_attention(self.query, self.cache, self.metadata(causal), scale, K_SCALE, V_SCALE, out,
                        workspace=workspace)
        return out

    def expected(self, r, scale, causal=True):
        return expected_attention(self.q[r], dequantized(self.k[r], K_SCALE), dequantized(self.v[r], V_SCALE),
                                  scale, causal)


# (query_len, context_len): whole-prompt prefill, chunk over a cached prefix, decodes, a one-token prompt
MIXED = [(37, 37), (20, 75), (1, 50), (1, 129), (1, 1), (5, 5)]


@pytest.mark.parametrize("hnd", [False, True], ids=["NHD", "HND"])
@pytest.mark.parametrize("head_size", [64, 128, 256])
def test_mixed_batch_matches_fp32_attention(head_size, hnd):
    gen = torch.Generator().manual_seed(head_size + hnd)
    layout = NVFP4PageLayout(head_size, block_size=16, num_heads=2, hnd=hnd)
    batch = Batch(MIXED, layout, num_heads=6, gen=gen, num_padding_tokens=3)
    scale = head_size ** -0.5
    out = batch.run(scale)
    start = 0
    for r, (n, _) in enumerate(MIXED):
        assert rel_l2(out[start:start + n], batch.expected(r, scale)) <= 1e-2, f"request {r}"
        start += n
    assert torch.all(out[start:] == 7.0), "padding rows must stay untouched"


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3), (8, 1)])
def test_gqa_prefill_and_decode(num_heads, num_kv_heads):
    gen = torch.Generator().manual_seed(num_heads)
    layout = NVFP4PageLayout(64, block_size=32, num_heads=num_kv_heads)
    requests = [(48, 48), (1, 90), (16, 70)]
    batch = Batch(requests, layout, num_heads=num_heads, gen=gen)
    out = batch.run(0.125)
    start = 0
    for r, (n, _) in enumerate(requests):
        assert rel_l2(out[start:start + n], batch.expected(r, 0.125)) <= 1e-2
        start += n


def test_chunked_prefill_over_several_steps_equals_one_pass():
    """A prompt fed in chunks (each chunk attending to the cache the previous ones wrote) gives the same
    output as the whole prompt in one step: chunking changes the schedule, never the result."""
    gen = torch.Generator().manual_seed(3)
    layout = NVFP4PageLayout(128, block_size=16, num_heads=2)
    whole = Batch([(60, 60)], layout, num_heads=4, gen=gen)
    one_pass = whole.run(0.1)
    chunks = []
    for start, end in [(0, 25), (25, 50), (50, 60)]:
        meta = NVFP4AttentionMetadata.from_lengths([end - start], [end], whole.block_table,
                                                   whole.slot_mapping[start:end])
        store_kv(whole.key[start:end], whole.value[start:end], whole.cache, meta.slot_mapping, K_SCALE, V_SCALE)
        out = torch.empty_like(whole.query[start:end])
        chunks.append(paged_attention(whole.query[start:end], whole.cache, meta, 0.1, K_SCALE, V_SCALE, out))
    assert torch.equal(torch.cat(chunks), one_pass)


def test_non_causal_sees_whole_context():
    gen = torch.Generator().manual_seed(4)
    layout = NVFP4PageLayout(64, block_size=16, num_heads=1)
    batch = Batch([(10, 30)], layout, num_heads=2, gen=gen)
    out = batch.run(0.125, causal=False)
    assert rel_l2(out, batch.expected(0, 0.125, causal=False)) <= 1e-2
    assert rel_l2(out, batch.expected(0, 0.125, causal=True)) > 0.05  # the mask matters in this case


def test_workspace_is_reused_across_calls_and_sizes():
    gen = torch.Generator().manual_seed(5)
    layout = NVFP4PageLayout(64, block_size=16, num_heads=2)
    workspace = DequantWorkspace()
    for requests in ([(1, 200), (1, 20)], [(3, 40)], [(1, 10)]):
        batch = Batch(requests, layout, num_heads=4, gen=gen)
        out = batch.run(0.125, workspace=workspace)
        start = 0
        for r, (n, _) in enumerate(requests):
            assert rel_l2(out[start:start + n], batch.expected(r, 0.125)) <= 1e-2
            start += n


def test_rejects_unsupported_configurations():
    check_supported(128, 8, 2)
    with pytest.raises(ValueError, match="head_size"):
        check_supported(96, 8, 2)
    with pytest.raises(ValueError, match="num_kv_heads"):
        check_supported(64, 6, 4)
    with pytest.raises(NotImplementedError, match="sliding window"):
        check_supported(64, 4, 2, sliding_window=512)
    with pytest.raises(NotImplementedError, match="soft-cap"):
        check_supported(64, 4, 2, logits_soft_cap=30.0)
    with pytest.raises(NotImplementedError, match="ALiBi"):
        check_supported(64, 4, 2, alibi_slopes=[0.5])
    with pytest.raises(NotImplementedError, match="sinks"):
        check_supported(64, 4, 2, sinks=torch.zeros(4))
    check_supported(64, 4, 2, sliding_window=-1, logits_soft_cap=0)  # vLLM's "off" values


def test_rejects_bad_inputs():
    gen = torch.Generator().manual_seed(6)
    layout = NVFP4PageLayout(64, block_size=16, num_heads=2)
    batch = Batch([(4, 4)], layout, num_heads=4, gen=gen)
    out = torch.empty_like(batch.query)
    with pytest.raises(ValueError, match="seq_lens must include"):
        meta = NVFP4AttentionMetadata.from_lengths([4], [3], batch.block_table, batch.slot_mapping)
        paged_attention(batch.query, batch.cache, meta, 0.1, K_SCALE, V_SCALE, out)
    with pytest.raises(ValueError, match="kv_cache must be uint8"):
        paged_attention(batch.query, batch.cache.view(torch.int8), batch.metadata(), 0.1, K_SCALE, V_SCALE, out)
    with pytest.raises(ValueError, match="KV heads"):
        paged_attention(batch.query[:, :3], batch.cache, batch.metadata(), 0.1, K_SCALE, V_SCALE, out[:, :3])
    with pytest.raises(ValueError, match="query_start_loc"):
        NVFP4AttentionMetadata(torch.tensor([0, 4, 8]), torch.tensor([4]), batch.block_table, batch.slot_mapping)
