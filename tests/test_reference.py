"""The oracle itself, against the facts docs/FORMATS.md states (values worked out by hand, not by the code).

The compiled ops are checked against `reference` elsewhere; these tests make sure the reference is right.
"""

import math

import pytest
import torch

from vllm_nvfp4_plugin import reference
from vllm_nvfp4_plugin.layout import IndexerCacheLayout, NVFP4PageLayout


def e2m1_round(values):
    x = torch.tensor(values, dtype=torch.float32)
    return reference.e2m1_decode(reference.e2m1_encode(x)).tolist()


def test_e2m1_rounds_to_nearest_with_ties_to_even_code():
    # docs/FORMATS.md: 0.25→0, 0.75→1, 1.25→1, 1.75→2, 2.5→2, 3.5→4, 5→4; saturate at 6
    assert e2m1_round([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]) == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert e2m1_round([0.26, 0.74, 1.3, 1.7, 2.6, 3.4, 5.1, 6.0, 7.0, math.inf]) == \
        [0.5, 0.5, 1.5, 1.5, 3.0, 3.0, 6.0, 6.0, 6.0, 6.0]
    assert e2m1_round([-0.76, -5.0, -100.0]) == [-1.0, -4.0, -6.0]


def test_e2m1_codes_and_sign_bit():
    codes = torch.arange(16, dtype=torch.uint8)
    assert reference.e2m1_decode(codes).tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    negative_zero = reference.e2m1_encode(torch.tensor([-0.0, 0.0, -0.1]))
    assert negative_zero.tolist() == [8, 0, 8]  # the sign bit comes from the float's sign, -0 included


def test_e4m3_saturates_and_keeps_subnormals():
    x = torch.tensor([500.0, math.inf, -1e9, 2.0**-9, 3 * 2.0**-10, 2.0**-10])
    got = reference.e4m3(x).view(torch.uint8).tolist()
    # 448 = 0x7E; 2^-9 is the smallest subnormal (code 1); 1.5·2^-9 ties to even (code 2); 2^-10 ties to 0
    assert got == [0x7E, 0x7E, 0xFE, 0x01, 0x02, 0x00]


def test_nvfp4_group_bytes_by_hand():
    # amax 6 with global 1 → SF = e4m3(1.0) = 0x38; x = 6 → code 7, x = -1 → code 0xA, low nibble = even element
    group = torch.zeros(16)
    group[0], group[1], group[2], group[3] = 6.0, -1.0, 0.5, 3.0
    packed, sf = reference.nvfp4_encode(group, 1.0)
    assert sf.view(torch.uint8).tolist() == [0x38]
    assert packed.tolist() == [0xA7, 0x51, 0, 0, 0, 0, 0, 0]
    # global 2: SF = e4m3(6/6/2) = 0.5 (0x30), out_scale 1/(0.5·2) = 1, the same codes
    packed, sf = reference.nvfp4_encode(group, 2.0)
    assert sf.view(torch.uint8).tolist() == [0x30] and packed.tolist() == [0xA7, 0x51, 0, 0, 0, 0, 0, 0]


def test_nvfp4_scale_saturation_and_zero_groups():
    big = torch.full((16,), 1e6)
    packed, sf = reference.nvfp4_encode(big, 1.0)
    assert sf.view(torch.uint8).item() == 0x7E and (packed == 0x77).all()  # SF 448, codes saturate at 6
    zero = torch.tensor([-0.0] * 8 + [0.0] * 8)
    packed, sf = reference.nvfp4_encode(zero, 1.0)
    assert sf.view(torch.uint8).item() == 0 and packed.tolist() == [0x88] * 4 + [0] * 4  # out_scale 0, signs kept
    tiny = torch.full((16,), 6 * 2.0**-9)  # SF = 2^-9, the smallest E4M3 subnormal
    packed, sf = reference.nvfp4_encode(tiny, 1.0)
    assert sf.view(torch.uint8).item() == 0x01 and (packed == 0x77).all()


def test_nvfp4_round_trip_error_on_gaussian_data():
    """NVFP4 (E2M1 values, E4M3 scale per 16) keeps Gaussian data to a relative L2 error of about 0.095."""
    x = torch.randn(2048, 128, generator=torch.Generator().manual_seed(0))
    for global_scale in (1.0, 0.01, 8.0):
        packed, sf = reference.nvfp4_encode(x * global_scale, global_scale)
        y = reference.nvfp4_decode(packed, sf, global_scale)
        rel_l2 = ((y - x * global_scale).norm() / (x * global_scale).norm()).item()
        assert 0.085 < rel_l2 < 0.105


def test_page_layout_sizes_and_offsets():
    layout = NVFP4PageLayout(head_size=128, block_size=16, num_heads=4)
    assert (layout.data_dim, layout.scale_dim, layout.full_dim) == (64, 8, 72)
    assert layout.data_region_bytes == 16 * 4 * 64 and layout.side_bytes == 16 * 4 * 72
    assert layout.data_offset(3, 2) == (3 * 4 + 2) * 64 and layout.scale_offset(3, 2, 5) == 4096 + (3 * 4 + 2) * 8 + 5
    hnd = NVFP4PageLayout(128, 16, 4, hnd=True)
    assert hnd.data_offset(3, 2) == (2 * 16 + 3) * 64
    assert NVFP4PageLayout.is_hnd(hnd.allocate(2)[:, 0]) and not NVFP4PageLayout.is_hnd(layout.allocate(2)[:, 0])


def test_swizzled_v_scales_by_hand_and_a_permutation():
    layout = NVFP4PageLayout(128, 16, 2, swizzle_v_scales=True)  # S = 8, S/4 = 2
    # (t=5, s=3) → row 4 + 3//2 = 5, column (3%2)·4 + 5%4 = 5
    assert layout.scale_offset(5, 1, 3, swizzled=True) == layout.data_region_bytes + (5 * 2 + 1) * 8 + 5
    for hnd in (False, True):
        layout = NVFP4PageLayout(256, 8, 3, hnd=hnd, swizzle_v_scales=True)
        t, h, s = torch.meshgrid(torch.arange(8), torch.arange(3), torch.arange(16), indexing="ij")
        linear = layout.scale_offset(t, h, s).flatten().sort().values
        swizzled = layout.scale_offset(t, h, s, swizzled=True).flatten().sort().values
        assert torch.equal(linear, swizzled)  # the same bytes, in another order


@pytest.mark.parametrize("bad", [dict(head_size=72), dict(block_size=6, swizzle_v_scales=True),
                                 dict(head_size=32, swizzle_v_scales=True)])
def test_page_layout_rejects_impossible_shapes(bad):
    with pytest.raises(ValueError):
        NVFP4PageLayout(**{"head_size": 128, "block_size": 16, "num_heads": 1, **bad})


def test_indexer_layout_and_scale_formats():
    layout = IndexerCacheLayout(128, 64, 128)
    assert layout.row_bytes == 132 and layout.scale_offset(3) == 64 * 128 + 3 * 4
    k = torch.tensor([[448.0 * 3] + [1.0] * 127, [0.0] * 128])
    values, scales = reference.indexer_quantize(k, 128, "")
    assert scales.view(torch.float32).tolist() == [[3.0], [pytest.approx(1e-4 / 448)]]
    assert values[0, 0] == 0x7E and values[1].eq(0).all()  # amax maps to 448; an all-zero row stays 0
    _, ue8m0 = reference.indexer_quantize(k, 128, "ue8m0")
    assert ue8m0.view(torch.float32)[0].item() == 4.0  # 2^ceil(log2 3)
    values_mx, mx = reference.indexer_quantize(k, 128, "mxfp8")
    assert mx[0].tolist() == [129] * 4  # exponent 2 + 127, four times
    assert torch.equal(values_mx, reference.indexer_quantize(k, 128, "ue8m0")[0])
    with pytest.raises(ValueError, match="scale_fmt"):
        reference.indexer_quantize(k, 128, "fp8")


def test_reference_with_nothing_to_do_writes_nothing():
    """All slots negative / empty sequences: the oracle, like the ops, leaves the caches untouched."""
    layout = NVFP4PageLayout(128, 16, 2)
    kv = layout.allocate(3, fill=0xA5)
    x = torch.randn(4, 2, 128, dtype=torch.bfloat16)
    one = torch.tensor(1.0)
    reference.reshape_and_cache_nvfp4(x, x, kv[:, 0], kv[:, 1], torch.full((4,), -1), one, one, False)
    assert bool((kv == 0xA5).all())
    out = torch.full((5, 2, 128), 7.0)
    table = torch.zeros(2, 3, dtype=torch.int32)
    reference.gather_nvfp4_kv_cache(kv[:, 0], kv[:, 1], table, torch.zeros(3, dtype=torch.int32), one, one, False,
                                    out, out.clone())
    assert bool((out == 7.0).all())
    indexer = IndexerCacheLayout(128, 64, 128)
    cache = indexer.allocate(2, fill=0x5A)
    reference.indexer_k_quant_and_cache(torch.randn(3, 128), cache, torch.full((3,), -1), 128, "ue8m0")
    assert bool((cache == 0x5A).all())


def dense_attention(q, k, v, scale, causal, window, soft_cap, sinks):
    """One request, one (query, head) at a time in float64: the softmax over the keys the row sees, written out."""
    n, heads, d = q.shape
    c, kv_heads, _ = k.shape
    out = torch.zeros(n, heads, d, dtype=torch.float64)
    for i in range(n):
        p = c - n + i
        keys = [j for j in range(c) if (not causal or j <= p) and (window == 0 or j > p - window)]
        for h in range(heads):
            hk = h // (heads // kv_heads)
            logits = [scale * float(q[i, h].double() @ k[j, hk].double()) for j in keys]
            if soft_cap:
                logits = [soft_cap * math.tanh(s / soft_cap) for s in logits]
            top = max(logits + ([float(sinks[h])] if sinks is not None else []))
            weights = [math.exp(s - top) for s in logits]
            denominator = sum(weights) + (math.exp(float(sinks[h]) - top) if sinks is not None else 0.0)
            for w, j in zip(weights, keys):
                out[i, h] += w / denominator * v[j, hk].double()
    return out


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "non-causal"])
@pytest.mark.parametrize("features", [dict(), dict(window=1), dict(window=7), dict(window=40), dict(soft_cap=0.8),
                                      dict(sinks=True), dict(window=6, soft_cap=2.0, sinks=True)],
                         ids=["plain", "window 1", "window 7", "window 40", "soft-cap", "sinks", "all"])
def test_paged_attention_against_a_dense_softmax(causal, features):
    """The oracle's window (the query at p sees keys > p - w), soft-cap (c·tanh(s/c) on the scaled logit) and sinks
    (one more logit per head in the denominator only) against the softmax written out key by key."""
    from vllm_nvfp4_plugin.tools.paged_case import PagedCase, dequantized

    gen = torch.Generator().manual_seed(1)
    layout = NVFP4PageLayout(64, 4, 2)
    requests, heads, scale, k_scale, v_scale = [(1, 13), (5, 5), (4, 11)], 4, 0.4, 0.5, 2.0
    case = PagedCase(requests, layout, heads, gen, dtype=torch.float32, k_scale=k_scale, v_scale=v_scale)
    cache = layout.allocate(case.num_blocks, fill=0)
    key, value, slots = case.context_tokens()
    reference.reshape_and_cache_nvfp4(key, value, cache[:, 0], cache[:, 1], slots, torch.tensor([k_scale]),
                                      torch.tensor([v_scale]), False)
    window, soft_cap = features.get("window", 0), features.get("soft_cap", 0.0)
    sinks = torch.randn(heads, generator=gen) * 2 if features.get("sinks") else None
    query = torch.cat(case.q)
    out = torch.zeros_like(query)
    reference.nvfp4_paged_attention(query, cache[:, 0], cache[:, 1], case.block_table, case.query_start_loc(),
                                    torch.tensor(case.seq_lens, dtype=torch.int32), torch.tensor([k_scale]),
                                    torch.tensor([v_scale]), scale, causal, False, 5, 13, out, window, soft_cap, sinks)
    starts = case.query_start_loc().tolist()
    for r in range(len(requests)):
        want = dense_attention(case.q[r], dequantized(case.k[r], k_scale), dequantized(case.v[r], v_scale), scale,
                               causal, window, soft_cap, sinks)
        torch.testing.assert_close(out[starts[r]:starts[r + 1]].double(), want, rtol=1e-5, atol=1e-5)
