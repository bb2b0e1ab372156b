"""The NVFP4 KV-cache spec and the mapping of vLLM's allocated views onto the docs/FORMATS.md page."""

import pytest
import torch
from vllm.v1.attention.backend import AttentionType, CommonAttentionMetadata
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheTensor, KVQuantMode, SlidingWindowSpec,
                                        create_kv_cache_views)

from vllm_nvfp4_plugin import reference
from vllm_nvfp4_plugin.attention import store_kv
from vllm_nvfp4_plugin.attention import MODEL_FEATURES
from vllm_nvfp4_plugin.layout import NVFP4PageLayout
from vllm_nvfp4_plugin.vllm_adapter import common
from vllm_nvfp4_plugin.vllm_adapter.common import check_nvfp4_layer, core_metadata
from vllm_nvfp4_plugin.vllm_adapter.cpu_backend import NVFP4CPUAttentionBackend
from vllm_nvfp4_plugin.vllm_adapter.spec import (HND_LAYOUTS, NHD_LAYOUTS, customize_nvfp4_spec, page_view,
                                                 spec_has_fp8_keys, spec_key_format)


def nvfp4_spec(head_size=64, num_kv_heads=3, block_size=32, **kw):
    return FullAttentionSpec(block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size,
                             dtype=torch.uint8, kv_quant_mode=KVQuantMode.NVFP4, **kw)


@pytest.mark.parametrize("head_size", [64, 128, 256])
def test_page_is_the_nvfp4_page(head_size):
    spec = NVFP4CPUAttentionBackend.customize_spec(nvfp4_spec(head_size, num_kv_heads=3, block_size=128))
    layout = NVFP4PageLayout(head_size, 128, 3)
    assert spec.num_heads == 6 and spec.state_content_size_bytes == head_size // 2 + head_size // 16
    assert spec.page_size_bytes == layout.page_bytes == 128 * 3 * 2 * (head_size // 2 + head_size // 16)
    bf16 = FullAttentionSpec(block_size=128, num_kv_heads=3, head_size=head_size, dtype=torch.bfloat16)
    assert NVFP4CPUAttentionBackend.customize_spec(bf16) == bf16  # other dtypes: the parent's spec
    assert bf16.page_size_bytes / spec.page_size_bytes > 3.5
    assert customize_nvfp4_spec(spec) == spec  # idempotent


def test_spec_rejects_what_the_page_cannot_hold():
    with pytest.raises(ValueError, match="head_size"):
        customize_nvfp4_spec(nvfp4_spec(head_size=96))
    with pytest.raises(NotImplementedError, match="head_size_v"):
        customize_nvfp4_spec(nvfp4_spec(head_size=128, head_size_v=64))


def vllm_views(spec, num_blocks: int, layout_kind):
    """(raw int8 buffer, its KVCacheTensor, the per-layer views) as vLLM allocates two layers of `spec`."""
    page = spec.page_size_bytes
    layer_outer = layout_kind.is_layer_compact
    tensor = KVCacheTensor(size=page * num_blocks * 2, layers=["l0", "l1"],
                           layer_stride=page * num_blocks if layer_outer else page,
                           block_stride=page if layer_outer else page * 2)
    raw = torch.zeros(tensor.size, dtype=torch.int8)
    return raw, tensor, create_kv_cache_views(raw, spec, num_blocks, layout_kind, tensor)


@pytest.mark.parametrize("layout_kind", HND_LAYOUTS + NHD_LAYOUTS, ids=lambda k: k.name)
def test_page_view_of_vllm_allocation(layout_kind):
    """Views that vLLM itself builds for two layers; tokens stored through `page_view` land at the
    docs/FORMATS.md offsets of their own layer's page, and nothing else changes."""
    num_blocks, head_size, kv_heads, block_size = 5, 64, 2, 32
    spec = customize_nvfp4_spec(nvfp4_spec(head_size, kv_heads, block_size))
    raw, tensor, views = vllm_views(spec, num_blocks, layout_kind)
    hnd = layout_kind in HND_LAYOUTS
    layout = NVFP4PageLayout(head_size, block_size, kv_heads, hnd=hnd)

    gen = torch.Generator().manual_seed(0)
    k = torch.randn(7, kv_heads, head_size, generator=gen).to(torch.bfloat16)
    v = torch.randn(7, kv_heads, head_size, generator=gen).to(torch.bfloat16)
    slots = torch.tensor([0, 1, 31, 32, 70, 100, 159])
    cache = page_view(views[1].view(torch.uint8), kv_heads)
    assert NVFP4PageLayout.is_hnd(cache[:, 0]) == hnd
    store_kv(k, v, cache, slots, torch.tensor(1.0), torch.tensor(2.0))

    raw_bytes = raw.view(torch.uint8)
    touched = torch.zeros_like(raw_bytes, dtype=torch.bool)
    for i, slot in enumerate(slots.tolist()):
        block, t = divmod(slot, block_size)
        page_start = tensor.layer_stride * 1 + tensor.block_stride * block
        for side, x, g in ((0, k, 1.0), (1, v, 2.0)):
            packed, sf = reference.nvfp4_encode(x[i], g)
            side_start = page_start + side * layout.side_bytes
            for h in range(kv_heads):
                d = side_start + layout.data_offset(t, h)
                s = side_start + layout.scale_offset(t, h, 0)
                assert torch.equal(raw_bytes[d:d + layout.data_dim], packed[h])
                assert torch.equal(raw_bytes[s:s + layout.scale_dim], sf[h].view(torch.uint8))
                touched[d:d + layout.data_dim] = True
                touched[s:s + layout.scale_dim] = True
    assert not raw_bytes[~touched].any(), "bytes outside the stored entries changed"


@pytest.mark.parametrize("layout_kind", HND_LAYOUTS + NHD_LAYOUTS, ids=lambda k: k.name)
def test_fp8_key_page_view_of_vllm_allocation(layout_kind):
    """The FP8-key page in views vLLM builds: FP8 keys then NVFP4 values at the layout's offsets, nothing else."""
    num_blocks, head_size, kv_heads, block_size = 5, 128, 2, 16
    spec = customize_nvfp4_spec(nvfp4_spec(head_size, kv_heads, block_size), key_format="fp8")
    layout = NVFP4PageLayout(head_size, block_size, kv_heads, hnd=layout_kind in HND_LAYOUTS, key_format="fp8")
    assert spec.page_size_bytes == layout.page_bytes == block_size * kv_heads * (128 + 72)
    raw, tensor, views = vllm_views(spec, num_blocks, layout_kind)
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(5, kv_heads, head_size, generator=gen).to(torch.bfloat16)
    v = torch.randn(5, kv_heads, head_size, generator=gen).to(torch.bfloat16)
    slots = torch.tensor([0, 15, 16, 40, 79])
    key_cache, value_cache = page_view(views[1].view(torch.uint8), kv_heads)
    assert NVFP4PageLayout.from_caches(key_cache, value_cache) == layout
    store_kv(k, v, (key_cache, value_cache), slots, torch.tensor(0.5), torch.tensor(2.0))

    raw_bytes = raw.view(torch.uint8)
    touched = torch.zeros_like(raw_bytes, dtype=torch.bool)
    for i, slot in enumerate(slots.tolist()):
        block, t = divmod(slot, block_size)
        page_start = tensor.layer_stride * 1 + tensor.block_stride * block
        packed, sf = reference.nvfp4_encode(v[i], 2.0)
        fp8 = reference.fp8_key_encode(k[i], 0.5)
        for h in range(kv_heads):
            key = page_start + layout.fp8_key_offset(t, h)
            d = page_start + layout.key_side_bytes + layout.data_offset(t, h)
            s = page_start + layout.key_side_bytes + layout.scale_offset(t, h, 0)
            assert torch.equal(raw_bytes[key:key + head_size], fp8[h])
            assert torch.equal(raw_bytes[d:d + layout.data_dim], packed[h])
            assert torch.equal(raw_bytes[s:s + layout.scale_dim], sf[h].view(torch.uint8))
            for start, n in ((key, head_size), (d, layout.data_dim), (s, layout.scale_dim)):
                touched[start:start + n] = True
    assert not raw_bytes[~touched].any(), "bytes outside the stored entries changed"


def test_page_view_rejects_other_layouts_and_shapes():
    num_blocks, slots, block_size, full_dim = 4, 4, 32, 36
    # Head slots outermost (as LHBNC lays them out): a block's page is not one run of bytes.
    head_outer = torch.zeros(num_blocks * slots * block_size * full_dim, dtype=torch.uint8).as_strided(
        (num_blocks, slots, block_size, full_dim), (block_size * full_dim, num_blocks * block_size * full_dim,
                                                    full_dim, 1))
    with pytest.raises(ValueError, match="dense"):
        page_view(head_outer, 2)
    with pytest.raises(ValueError, match="2\\*num_kv_heads"):
        page_view(torch.zeros(4, 3, 32, 36, dtype=torch.uint8), 2)


def test_layer_checks_name_what_is_unsupported():
    check_nvfp4_layer("nvfp4", AttentionType.DECODER, 128, 8, 2)
    check_nvfp4_layer("nvfp4_4over6", AttentionType.DECODER, 128, 8, 2)
    with pytest.raises(NotImplementedError, match="nvfp4_ds_mla"):
        check_nvfp4_layer("nvfp4_ds_mla", AttentionType.DECODER, 128, 8, 2)
    with pytest.raises(NotImplementedError, match="attn_type"):
        check_nvfp4_layer("nvfp4", AttentionType.ENCODER_ONLY, 128, 8, 2)
    with pytest.raises(NotImplementedError, match="sliding window"):  # a backend naming no features (CUDA's)
        check_nvfp4_layer("nvfp4", AttentionType.DECODER, 128, 8, 2, sliding_window=4096)
    with pytest.raises(NotImplementedError, match="sinks"):
        check_nvfp4_layer("nvfp4", AttentionType.DECODER, 128, 8, 2, sinks=torch.zeros(8))
    check_nvfp4_layer("nvfp4", AttentionType.DECODER, 128, 8, 2, sliding_window=4096, logits_soft_cap=30.0,
                      sinks=torch.zeros(8), supported_features=MODEL_FEATURES)  # what the CPU backend serves
    with pytest.raises(NotImplementedError, match="ALiBi"):
        check_nvfp4_layer("nvfp4", AttentionType.DECODER, 128, 8, 2, alibi_slopes=[0.5] * 8,
                          supported_features=MODEL_FEATURES)
    with pytest.raises(ValueError, match="head_size"):
        check_nvfp4_layer("nvfp4", AttentionType.DECODER, 80, 8, 2)


def tiny_config(additional_config=None, **cache):
    from vllm.config import CacheConfig, ModelConfig, VllmConfig

    from vllm_nvfp4_plugin.tools.models import tiny_llama_path

    return VllmConfig(model_config=ModelConfig(model=str(tiny_llama_path()), dtype="bfloat16", max_model_len=2048),
                      cache_config=CacheConfig(**cache), additional_config=additional_config or {})


def test_cpu_impl_serves_model_features_refuses_alibi_and_defers_other_dtypes():
    from vllm.config import set_current_vllm_config

    impl_cls = NVFP4CPUAttentionBackend.get_impl_cls()
    with set_current_vllm_config(tiny_config()):
        impl = impl_cls(8, 128, 0.1, 2, None, 512, "nvfp4", logits_soft_cap=30.0, sinks=torch.zeros(8))
        assert impl.nvfp4 and impl.sliding_window == 512
        with pytest.raises(NotImplementedError, match="ALiBi"):
            impl_cls(8, 128, 0.1, 2, [0.5] * 8, None, "nvfp4")
        bf16 = impl_cls(8, 96, 0.1, 2, None, 4096, "auto", logits_soft_cap=30.0)  # vLLM's own path takes these
        assert not bf16.nvfp4


@pytest.mark.parametrize("window", [None, 512], ids=["global", "sliding"])
def test_layer_spec_of_vllm_attention(window):
    """vLLM's own Attention layer on the plugin's CPU backend: a sliding-window layer gets vLLM's
    SlidingWindowSpec (so pages that leave the window are freed), a global one FullAttentionSpec, both packed as
    the NVFP4 page."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention import Attention
    from vllm.v1.worker.utils import customize_attention_spec

    config = tiny_config(cache_dtype="nvfp4", block_size=16)
    with set_current_vllm_config(config):  # the backend given as the registered CPU_ATTN would be
        layer = Attention(num_heads=4, head_size=256, scale=0.0625, num_kv_heads=1, cache_config=config.cache_config,
                          prefix="model.layers.0.self_attn.attn", per_layer_sliding_window=window,
                          logits_soft_cap=30.0, attn_backend=NVFP4CPUAttentionBackend)
        spec = customize_attention_spec(layer.get_attn_backend(), layer.get_kv_cache_spec(config))
    assert layer.impl.nvfp4 and layer.impl.sliding_window == (window or -1)
    if window is None:
        assert type(spec) is FullAttentionSpec
    else:
        assert type(spec) is SlidingWindowSpec and spec.sliding_window == 512
    assert spec.page_size_bytes == NVFP4PageLayout(256, spec.block_size, 1).page_bytes


def test_core_metadata_from_vllm_batch():
    common = CommonAttentionMetadata(
        query_start_loc=torch.tensor([0, 3, 4], dtype=torch.int32),
        query_start_loc_cpu=torch.tensor([0, 3, 4], dtype=torch.int32),
        seq_lens=torch.tensor([3, 9], dtype=torch.int32), num_reqs=2, num_actual_tokens=4, max_query_len=3,
        max_seq_len=9, block_table_tensor=torch.zeros(2, 4, dtype=torch.int32),
        slot_mapping=torch.tensor([0, 1, 2, 40, -1, -1]))
    meta = core_metadata(common)
    assert meta.slot_mapping.tolist() == [0, 1, 2, 40] and meta.causal and meta.num_query_tokens == 4
    with pytest.raises(NotImplementedError, match="causal"):
        core_metadata(common.replace(causal=torch.tensor([True, False])))


def fp8_key_layer_spec(config):
    """vLLM's Attention layer built with `config` current, its spec customized afterwards without it (as vLLM's
    model runner does)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention import Attention
    from vllm.v1.worker.utils import customize_attention_spec

    with set_current_vllm_config(config):
        layer = Attention(num_heads=4, head_size=128, scale=0.09, num_kv_heads=2, cache_config=config.cache_config,
                          prefix="model.layers.0.self_attn.attn", attn_backend=NVFP4CPUAttentionBackend)
        spec = layer.get_kv_cache_spec(config)
    return customize_attention_spec(layer.get_attn_backend(), spec)


def test_key_format_option_gives_vllm_layers_the_fp8_key_page(monkeypatch):
    monkeypatch.setattr(common, "_ENGINE_KEY_FORMAT", "nvfp4")  # the process-wide key format goes back after the test
    config = tiny_config({"vllm_nvfp4_plugin": {"key_format": "fp8"}}, cache_dtype="nvfp4", block_size=16)
    spec = fp8_key_layer_spec(config)
    assert spec.page_size_bytes == NVFP4PageLayout(128, 16, 2, key_format="fp8").page_bytes == 16 * 2 * (128 + 72)
    plain = fp8_key_layer_spec(tiny_config(cache_dtype="nvfp4", block_size=16))
    assert plain.page_size_bytes == NVFP4PageLayout(128, 16, 2).page_bytes
    assert (spec_key_format(spec), spec_key_format(plain)) == ("fp8", "nvfp4")


def test_fp8_keys_kv_cache_dtype_name_where_vllm_can_register_one(monkeypatch):
    """vLLM 0.33's register_kv_cache_dtype: `--kv-cache-dtype nvfp4_k8v4` validates and gives the FP8-key page."""
    monkeypatch.setattr(common, "_ENGINE_KEY_FORMAT", "nvfp4")
    import vllm.config.cache as cache_config
    from vllm.v1.kv_cache_interface import get_kv_quant_mode

    from vllm_nvfp4_plugin.vllm_adapter import register_kv_cache_dtypes

    if not hasattr(cache_config, "register_kv_cache_dtype"):
        pytest.skip("this vLLM has no register_kv_cache_dtype (0.32): the key_format option names the page")
    register_kv_cache_dtypes()
    register_kv_cache_dtypes()  # idempotent
    assert cache_config.KV_CACHE_DTYPES.count("nvfp4_k8v4") == 1 and get_kv_quant_mode("nvfp4_k8v4").is_nvfp4
    spec = fp8_key_layer_spec(tiny_config(cache_dtype="nvfp4_k8v4", block_size=16))
    assert spec.page_size_bytes == NVFP4PageLayout(128, 16, 2, key_format="fp8").page_bytes
    with pytest.raises(ValueError, match="nvfp4_k8v4' keeps FP8 keys, but the plugin's options ask for key_format"):
        fp8_key_layer_spec(tiny_config({"vllm_nvfp4_plugin": {"key_format": "nvfp4"}}, cache_dtype="nvfp4_k8v4"))


def test_key_format_option_gives_vllm_layers_the_int8_key_page(monkeypatch):
    monkeypatch.setattr(common, "_ENGINE_KEY_FORMAT", "nvfp4")
    config = tiny_config({"vllm_nvfp4_plugin": {"key_format": "int8"}}, cache_dtype="nvfp4", block_size=16)
    spec = fp8_key_layer_spec(config)
    layout = NVFP4PageLayout(128, 16, 2, key_format="int8")
    assert spec.page_size_bytes == layout.page_bytes == 16 * 2 * (130 + 72)
    assert not spec_has_fp8_keys(spec) and spec_key_format(spec) == "int8"


@pytest.mark.parametrize("hnd", [False, True], ids=["NHD", "HND"])
def test_int8_key_page_view_is_the_layout(hnd):
    """vLLM's `[num_blocks, H, N, C]` view of an int8-key page, H = KV heads, C = head + 2 + head/2 + head/16."""
    layout = NVFP4PageLayout(64, 16, 3, hnd, key_format="int8")
    entry = layout.key_dim + layout.full_dim
    pages = torch.zeros(4, layout.page_bytes, dtype=torch.uint8)
    view = (pages.view(4, 3, 16, entry) if hnd else pages.view(4, 16, 3, entry).transpose(1, 2))
    key_cache, value_cache = page_view(view, 3)
    assert NVFP4PageLayout.from_caches(key_cache, value_cache) == layout
    expected = layout.side_views(pages)
    assert all(a.stride() == b.stride() and a.shape == b.shape and a.data_ptr() == b.data_ptr()
               for a, b in zip((key_cache, value_cache), expected))


def test_int8_keys_kv_cache_dtype_name_where_vllm_can_register_one(monkeypatch):
    """vLLM 0.33's register_kv_cache_dtype: `--kv-cache-dtype nvfp4_ki8v4` validates and gives the INT8-key page."""
    monkeypatch.setattr(common, "_ENGINE_KEY_FORMAT", "nvfp4")
    import vllm.config.cache as cache_config

    from vllm_nvfp4_plugin.vllm_adapter import register_kv_cache_dtypes

    if not hasattr(cache_config, "register_kv_cache_dtype"):
        pytest.skip("this vLLM has no register_kv_cache_dtype (0.32): the key_format option names the page")
    register_kv_cache_dtypes()
    spec = fp8_key_layer_spec(tiny_config(cache_dtype="nvfp4_ki8v4", block_size=16))
    assert spec.page_size_bytes == NVFP4PageLayout(128, 16, 2, key_format="int8").page_bytes
    with pytest.raises(ValueError, match="nvfp4_ki8v4' keeps INT8 keys, but the plugin's options ask for key_format"):
        fp8_key_layer_spec(tiny_config({"vllm_nvfp4_plugin": {"key_format": "fp8"}}, cache_dtype="nvfp4_ki8v4"))
