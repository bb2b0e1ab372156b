"""The vLLM-independent attention core against fp32 attention over the reference-dequantized cache."""

import re

import pytest
import torch

from vllm_nvfp4_plugin import reference
from vllm_nvfp4_plugin.attention import (MODEL_FEATURES, DequantWorkspace, NVFP4AttentionMetadata, check_supported,
                                         paged_attention, store_kv)
from vllm_nvfp4_plugin.layout import NVFP4PageLayout
from vllm_nvfp4_plugin.tools.paged_case import PagedCase, relative_l2

K_SCALE, V_SCALE = torch.tensor(0.5), torch.tensor(2.0)  # non-unit global dequant scales


class Batch(PagedCase):
    """A PagedCase on a CPU cache: the earlier steps' tokens are stored, `run` stores this step's and attends."""

    def __init__(self, requests, layout, num_heads, gen, num_padding_tokens=0, dtype=torch.bfloat16):
        super().__init__(requests, layout, num_heads, gen, dtype=dtype, k_scale=K_SCALE.item(),
                         v_scale=V_SCALE.item(), extra_table_columns=1)
        self.cache = layout.allocate(self.num_blocks, fill=0xFF)  # garbage where nothing was stored
        key, value, slots = self.earlier_tokens()
        store_kv(key, value, self.cache, slots, K_SCALE, V_SCALE)
        self.query, self.key, self.value, self.slot_mapping = self.step(num_padding_tokens)

    def metadata(self, causal=True):
        return NVFP4AttentionMetadata.from_lengths(self.query_lens, self.seq_lens, self.block_table,
                                                   self.slot_mapping, causal)

    def run(self, scale, causal=True, workspace=None):
        store_kv(self.key, self.value, self.cache, self.slot_mapping, K_SCALE, V_SCALE)
        out = torch.full_like(self.query, 7.0)
        paged_attention(self.query, self.cache, self.metadata(causal), scale, K_SCALE, V_SCALE, out,
                        workspace=workspace)
        return out


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
    errors = batch.errors(out, scale)
    assert max(errors) <= 1e-2, errors
    assert torch.all(out[sum(batch.query_lens):] == 7.0), "padding rows must stay untouched"


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3), (8, 1)])
def test_gqa_prefill_and_decode(num_heads, num_kv_heads):
    gen = torch.Generator().manual_seed(num_heads)
    layout = NVFP4PageLayout(64, block_size=32, num_heads=num_kv_heads)
    requests = [(48, 48), (1, 90), (16, 70)]
    batch = Batch(requests, layout, num_heads=num_heads, gen=gen)
    errors = batch.errors(batch.run(0.125), 0.125)
    assert max(errors) <= 1e-2, errors


def test_chunked_prefill_over_several_steps_equals_one_pass():
    """A prompt fed in chunks (each chunk attending to the cache the previous ones wrote) gives the same
    output as the whole prompt in one step: chunking changes the schedule, never the result. Chunks of 16 rows or
    more: on a CPU with AVX512-BF16 or AMX shorter ones take other code (tests/test_paged_attention_cpu.py)."""
    gen = torch.Generator().manual_seed(3)
    layout = NVFP4PageLayout(128, block_size=16, num_heads=2)
    whole = Batch([(60, 60)], layout, num_heads=4, gen=gen)
    one_pass = whole.run(0.1)
    chunks = []
    for start, end in [(0, 25), (25, 42), (42, 60)]:
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
    assert relative_l2(out, batch.expected(0, 0.125, causal=False)) <= 1e-2
    assert relative_l2(out, batch.expected(0, 0.125, causal=True)) > 0.05  # the mask matters in this case


def test_workspace_is_reused_across_calls_and_sizes():
    gen = torch.Generator().manual_seed(5)
    layout = NVFP4PageLayout(64, block_size=16, num_heads=2)
    workspace = DequantWorkspace()
    for requests in ([(1, 200), (1, 20)], [(3, 40)], [(1, 10)]):
        batch = Batch(requests, layout, num_heads=4, gen=gen)
        errors = batch.errors(batch.run(0.125, workspace=workspace), 0.125)
        assert max(errors) <= 1e-2, errors


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


def test_backends_name_the_features_their_kernels_serve():
    """The CPU backend passes MODEL_FEATURES; a backend that passes none (the default) refuses every feature."""
    features = dict(sliding_window=512, logits_soft_cap=30.0, sinks=torch.zeros(4))
    check_supported(64, 4, 2, **features, supported_features=MODEL_FEATURES)
    with pytest.raises(NotImplementedError, match="soft-cap"):
        check_supported(64, 4, 2, **features, supported_features=("sliding_window",))
    with pytest.raises(NotImplementedError, match="ALiBi"):
        check_supported(64, 4, 2, alibi_slopes=[0.5], supported_features=MODEL_FEATURES)
    with pytest.raises(ValueError, match="sliding_window must be positive"):
        check_supported(64, 4, 2, sliding_window=0, supported_features=MODEL_FEATURES)
    with pytest.raises(ValueError, match=re.escape("sinks must have one value per query head, shape (4,)")):
        check_supported(64, 4, 2, sinks=torch.zeros(2), supported_features=MODEL_FEATURES)
    with pytest.raises(ValueError, match="supported_features must be among"):
        check_supported(64, 4, 2, supported_features=("alibi",))


def test_features_reach_the_kernel_on_cpu_only():
    gen = torch.Generator().manual_seed(7)
    layout = NVFP4PageLayout(64, block_size=16, num_heads=2)
    batch = Batch([(1, 70), (20, 50)], layout, num_heads=4, gen=gen)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    meta = batch.metadata()
    store_kv(batch.key, batch.value, batch.cache, batch.slot_mapping, K_SCALE, V_SCALE)
    out, want = torch.empty_like(batch.query), torch.zeros_like(batch.query)
    paged_attention(batch.query, batch.cache, meta, 0.125, K_SCALE, V_SCALE, out, sliding_window=9,
                    logits_soft_cap=2.0, sinks=sinks)
    reference.nvfp4_paged_attention(batch.query, batch.cache[:, 0], batch.cache[:, 1], batch.block_table,
                                    meta.query_start_loc, meta.seq_lens, K_SCALE, V_SCALE, 0.125, True, False, 20, 70,
                                    want, 9, 2.0, sinks)
    assert relative_l2(out[:21], want[:21]) <= 1e-3
    with pytest.raises(NotImplementedError, match="CPU kernel only"):
        paged_attention(batch.query.to("meta"), batch.cache, meta, 0.125, K_SCALE, V_SCALE, out, sliding_window=9)


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
