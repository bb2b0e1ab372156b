"""The CUSTOM (CUDA) backend's vLLM-facing parts, on CPU tensors: registration, configuration checks, spec,
and builder + impl end to end over a vLLM-shaped cache (on CPU the core path serves every request)."""

import itertools

import pytest
import torch
from vllm.config import CacheConfig, VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.attention import Attention
from vllm.platforms.interface import DeviceCapability
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVQuantMode

from vllm_nvfp4_plugin import reference
from vllm_nvfp4_plugin.attention.flashinfer_reader import FlashInferNVFP4Decoder, dequant_prefill_unavailable_reason
from vllm_nvfp4_plugin.layout import NVFP4PageLayout
from vllm_nvfp4_plugin.tools.paged_case import PagedCase, relative_l2
from vllm_nvfp4_plugin.vllm_adapter import common as adapter_common, register_attention_backends
from vllm_nvfp4_plugin.vllm_adapter.cuda_backend import (NVFP4CudaBackend, NVFP4CudaMetadataBuilder,
                                                         shared_decode_params, shared_prefill_features)
from vllm_nvfp4_plugin.vllm_adapter.spec import page_view

HOPPER = DeviceCapability(9, 0)


def test_registered_as_custom():
    register_attention_backends()
    assert AttentionBackendEnum.CUSTOM.get_class() is NVFP4CudaBackend
    assert AttentionBackendEnum[NVFP4CudaBackend.get_name()] is AttentionBackendEnum.CUSTOM


def _reasons(head_size=128, dtype=torch.bfloat16, kv_cache_dtype="nvfp4", has_sink=False, capability=HOPPER,
             **kwargs):
    return NVFP4CudaBackend.validate_configuration(head_size, dtype, kv_cache_dtype, 16, False, has_sink, False,
                                                   False, False, capability, "decoder", **kwargs)


@pytest.mark.parametrize("head_size", [64, 128, 256])
@pytest.mark.parametrize("kv_cache_dtype", ["nvfp4", "nvfp4_4over6"])
def test_valid_configuration(head_size, kv_cache_dtype):
    assert _reasons(head_size, kv_cache_dtype=kv_cache_dtype) == []


def test_sinks_and_sliding_window_are_valid():
    assert _reasons(has_sink=True, has_sliding_window=True) == []


@pytest.mark.parametrize("kwargs, reason", [
    ({"kv_cache_dtype": "auto"}, "needs kv_cache_dtype in"),
    ({"kv_cache_dtype": "fp8"}, "needs kv_cache_dtype in"),
    ({"head_size": 96}, "head_size not supported"),
    ({"dtype": torch.float32}, "dtype not supported"),
    ({"capability": DeviceCapability(7, 5)}, "compute capability not supported"),
])
def test_invalid_configuration_names_the_reason(kwargs, reason):
    assert any(reason in r for r in _reasons(**kwargs))


def test_customize_spec_packs_the_nvfp4_page():
    spec = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.uint8,
                             kv_quant_mode=KVQuantMode.NVFP4)
    packed = NVFP4CudaBackend.customize_spec(spec)
    assert packed.num_heads == 16 and packed.state_content_bytes == 72
    assert packed.page_size_bytes == NVFP4PageLayout(128, 16, 8).page_bytes


@pytest.fixture(scope="module")
def vllm_config():
    config = VllmConfig(cache_config=CacheConfig(cache_dtype="nvfp4"))
    with set_current_vllm_config(config):
        yield config


_layer_ids = itertools.count()


def attention_layer(vllm_config, num_heads=8, head_size=128, scale=0.1, num_kv_heads=2, cache_dtype="nvfp4",
                    **kwargs):
    """A real vLLM `Attention` layer on the CUSTOM backend, as a model builds it at engine start."""
    cache_config = CacheConfig(cache_dtype=cache_dtype)
    return Attention(num_heads, head_size, scale, num_kv_heads, cache_config=cache_config,
                     prefix=f"model.layers.{next(_layer_ids)}.self_attn.attn", attn_backend=NVFP4CudaBackend,
                     **kwargs)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"cache_dtype": "auto"}, ValueError, "kv_cache_dtype in \\('nvfp4', 'nvfp4_4over6', 'nvfp4_k8v4', 'nvfp4_ki8v4'\\) only"),
    ({"per_layer_sliding_window": 0}, ValueError, "sliding_window must be positive"),
    ({"sinks": torch.zeros(4)}, ValueError, "sinks must have one value per query head"),
    ({"alibi_slopes": [0.5] * 8}, NotImplementedError, "does not support ALiBi"),
    ({"attn_type": "encoder_only"}, NotImplementedError, "decoder attention only"),
    ({"head_size": 96}, ValueError, "supports head_size in"),
])
def test_layer_construction_rejects_unsupported_features(vllm_config, kwargs, error, match):
    with pytest.raises(error, match=match):
        attention_layer(vllm_config, **kwargs)


def test_decode_params_shared_by_the_group(vllm_config):
    """FlashInfer plans once per batch: the group's layers must agree on heads, dtype and scale."""
    same = [attention_layer(vllm_config).layer_name for _ in range(2)]
    assert shared_decode_params(vllm_config, same) == (8, torch.get_default_dtype(), 0.1)
    other = attention_layer(vllm_config, scale=0.2).layer_name
    assert shared_decode_params(vllm_config, same + [other]) is None


def test_prefill_features_shared_by_the_group(vllm_config):
    """The dequantized prefill plans one window, soft-cap and sink switch per batch (fa3 compiles each as a variant);
    the sink values differ per layer freely."""
    heads = 8
    same = [attention_layer(vllm_config, per_layer_sliding_window=64, logits_soft_cap=30.0,
                            sinks=torch.randn(heads)).layer_name for _ in range(2)]
    assert shared_prefill_features(vllm_config, same) == (64, 30.0, True)
    other = attention_layer(vllm_config, per_layer_sliding_window=128, logits_soft_cap=30.0).layer_name
    assert shared_prefill_features(vllm_config, same + [other]) is None
    no_sinks = attention_layer(vllm_config, per_layer_sliding_window=64, logits_soft_cap=30.0).layer_name
    assert shared_prefill_features(vllm_config, same + [no_sinks]) is None
    plain = [attention_layer(vllm_config).layer_name]
    assert shared_prefill_features(vllm_config, plain) == (0, 0.0, False)


K_SCALE, V_SCALE = 0.75, 1.25


def _vllm_layer_cache(num_blocks, num_kv_heads, block_size, full_dim, hnd):
    """The per-layer view vLLM hands a backend, `[num_blocks, 2*kv_heads, block_size, full_dim]`, in the
    physical order of LBHNC (HND) or LBNHC (NHD), filled with garbage."""
    if hnd:
        return torch.full((num_blocks, 2 * num_kv_heads, block_size, full_dim), 0xEE, dtype=torch.uint8)
    physical = torch.full((num_blocks, block_size, 2 * num_kv_heads, full_dim), 0xEE, dtype=torch.uint8)
    return physical.permute(0, 2, 1, 3)


@pytest.mark.parametrize("hnd", [False, True])
def test_builder_and_impl_match_fp32_attention(vllm_config, hnd):
    """Two decodes, a chunk over a cached prefix and a fresh prompt, plus padding rows, through
    build → do_kv_cache_update → forward, against fp32 attention over the dequantized K/V."""
    gen = torch.Generator().manual_seed(int(hnd))
    heads, kv_heads, d, block = 8, 2, 64, 16
    requests = [(1, 40), (1, 7), (5, 33), (12, 12)]  # (query_len, context_len)
    num_padding = 3
    spec = NVFP4CudaBackend.customize_spec(FullAttentionSpec(
        block_size=block, num_kv_heads=kv_heads, head_size=d, dtype=torch.uint8, kv_quant_mode=KVQuantMode.NVFP4))
    layer = attention_layer(vllm_config, heads, d, d ** -0.5, kv_heads)
    impl = layer.impl
    # Global scales as a checkpoint's would be loaded (vLLM keeps a tensor and a float copy).
    layer._k_scale.fill_(K_SCALE)
    layer._v_scale.fill_(V_SCALE)
    layer._k_scale_float, layer._v_scale_float = K_SCALE, V_SCALE
    builder = NVFP4CudaMetadataBuilder(spec, [layer.layer_name], vllm_config, torch.device("cpu"))

    case = PagedCase(requests, NVFP4PageLayout(d, block, kv_heads), heads, gen, k_scale=K_SCALE, v_scale=V_SCALE)
    kv_cache = _vllm_layer_cache(case.num_blocks, kv_heads, block, spec.state_content_bytes, hnd)
    earlier_key, earlier_value, earlier_slots = case.earlier_tokens()  # earlier steps' tokens
    impl.do_kv_cache_update(layer, earlier_key, earlier_value, kv_cache, earlier_slots)

    _, key, value, slot_mapping = case.step()
    query = case.step(num_padding)[0]
    query_start, seq_lens = case.query_start_loc(), torch.tensor(case.seq_lens, dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=query_start, query_start_loc_cpu=query_start, seq_lens=seq_lens,
        num_reqs=len(requests), num_actual_tokens=int(query_start[-1]), max_query_len=12, max_seq_len=40,
        block_table_tensor=case.block_table, slot_mapping=slot_mapping, seq_lens_cpu_upper_bound=seq_lens)
    metadata = builder.build(0, common)

    impl.do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
    output = torch.full((query.shape[0], heads * d), 7.0, dtype=torch.bfloat16)
    impl.forward(layer, query, key, value, kv_cache, metadata, output)

    out = output.view(query.shape)
    errors = case.errors(out, d ** -0.5)
    assert max(errors) <= 1e-2, errors
    assert torch.all(out[int(query_start[-1]):] == 7.0), "padding rows must stay untouched"


def backend_step(layer, builder, case: PagedCase, kv_cache: torch.Tensor, device):
    """The earlier tokens stored, then one step of `case` through build → do_kv_cache_update → forward; returns
    (query, output, block_table, query_start_loc, seq_lens) on `device`."""
    earlier_key, earlier_value, earlier_slots = (t.to(device) for t in case.earlier_tokens())
    layer.impl.do_kv_cache_update(layer, earlier_key, earlier_value, kv_cache, earlier_slots)
    query, key, value, slot_mapping = (t.to(device) for t in case.step())
    query_start_cpu = case.query_start_loc()
    query_start, block_table = query_start_cpu.to(device), case.block_table.to(device)
    seq_lens = torch.tensor(case.seq_lens, dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=query_start, query_start_loc_cpu=query_start_cpu, seq_lens=seq_lens.to(device),
        num_reqs=len(case.seq_lens), num_actual_tokens=int(query_start_cpu[-1]), max_query_len=max(case.query_lens),
        max_seq_len=max(case.seq_lens), block_table_tensor=block_table, slot_mapping=slot_mapping,
        seq_lens_cpu_upper_bound=seq_lens)
    metadata = builder.build(0, common)
    layer.impl.do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
    output = torch.empty(query.shape[0], query.shape[1] * query.shape[2], dtype=torch.bfloat16, device=device)
    layer.impl.forward(layer, query, key, value, kv_cache, metadata, output)
    return query, output, block_table, query_start, seq_lens.to(device)


@pytest.mark.parametrize("features", [
    {"per_layer_sliding_window": 20},
    {"logits_soft_cap": 2.0},
    {"sinks": True},
    {"per_layer_sliding_window": 20, "sinks": True},
    {"per_layer_sliding_window": 9, "logits_soft_cap": 2.0, "sinks": True},
])
def test_model_features_reach_the_kernel(vllm_config, features, device):
    """A layer with a window, soft-cap or sinks: build → store → forward (on CUDA the plugin's kernel for the
    decode and, where FlashInfer's fa3 runs, dequantize + fa3 for the prompt and chunk, else the kernel; on CPU the
    core's CPU kernel) against the reference over the same pages, which applies the same features; without them
    the output moves."""
    gen = torch.Generator().manual_seed(len(features))
    heads, kv_heads, d, block = 4, 2, 64, 16
    requests = [(1, 45), (6, 38), (17, 17)]  # decode, chunk over a cached prefix, fresh prompt
    sinks = (torch.randn(heads, generator=gen) + 2.0).to(device) if features.pop("sinks", False) else None
    layer = attention_layer(vllm_config, heads, d, d ** -0.5, kv_heads, sinks=sinks, **features)
    layer._k_scale, layer._v_scale = layer._k_scale.to(device), layer._v_scale.to(device)
    assert layer.impl.model_features
    spec = NVFP4CudaBackend.customize_spec(FullAttentionSpec(
        block_size=block, num_kv_heads=kv_heads, head_size=d, dtype=torch.uint8, kv_quant_mode=KVQuantMode.NVFP4))
    builder = NVFP4CudaMetadataBuilder(spec, [layer.layer_name], vllm_config, torch.device(device))
    dequant_prefill = device == "cuda" and dequant_prefill_unavailable_reason(d, torch.device(device)) is None
    assert (builder._prefill is not None) == dequant_prefill
    case = PagedCase(requests, NVFP4PageLayout(d, block, kv_heads), heads, gen)
    kv_cache = _vllm_layer_cache(case.num_blocks, kv_heads, block, spec.state_content_bytes, hnd=False).to(device)
    query, output, block_table, query_start, seq_lens = backend_step(layer, builder, case, kv_cache, device)

    page = page_view(kv_cache, kv_heads)
    args = (query, page[:, 0], page[:, 1], block_table, query_start, seq_lens, layer._k_scale,
            layer._v_scale, d ** -0.5, True, False, 17, 45)
    want, plain = torch.empty_like(query), torch.empty_like(query)
    reference.nvfp4_paged_attention(*args, want, layer.impl.sliding_window, layer.impl.logits_soft_cap, sinks)
    reference.nvfp4_paged_attention(*args, plain)
    got = output.view(query.shape)
    assert relative_l2(got.cpu(), want.cpu()) <= 1e-2
    assert relative_l2(got.cpu(), plain.cpu()) > 5e-2, "the features must change the output"


@pytest.mark.parametrize("key_format", ["fp8", "int8"])
@pytest.mark.parametrize("hnd", [False, True], ids=["NHD", "HND"])
def test_byte_key_page_through_the_backend(key_format, hnd, device, monkeypatch):
    """key_format "fp8" or "int8": the FP8- or INT8-key page, and build → store → forward (on CUDA the plugin's kernel
    decodes, FlashInfer reading NVFP4 keys only; off CUDA the core) matches the reference over the same pages."""
    monkeypatch.setattr(adapter_common, "_ENGINE_KEY_FORMAT", "nvfp4")  # the process-wide key format goes back after
    gen = torch.Generator().manual_seed(3 + hnd)
    heads, kv_heads, d, block = 8, 2, 128, 16
    requests = [(1, 45), (1, 3), (6, 38), (17, 17)]
    config = VllmConfig(cache_config=CacheConfig(cache_dtype="nvfp4"),
                        additional_config={"vllm_nvfp4_plugin": {"key_format": key_format}})
    entry = d + 2 * (key_format == "int8") + 72  # K's bytes and V's of one (token, head)
    with set_current_vllm_config(config):
        layer = attention_layer(config, heads, d, d ** -0.5, kv_heads)
    layer._k_scale.fill_(K_SCALE)
    layer._v_scale.fill_(V_SCALE)
    layer._k_scale, layer._v_scale = layer._k_scale.to(device), layer._v_scale.to(device)
    layer._k_scale_float, layer._v_scale_float = K_SCALE, V_SCALE
    with set_current_vllm_config(config):
        spec = NVFP4CudaBackend.customize_spec(FullAttentionSpec(
            block_size=block, num_kv_heads=kv_heads, head_size=d, dtype=torch.uint8, kv_quant_mode=KVQuantMode.NVFP4))
        assert (spec.num_heads, spec.state_content_bytes) == (kv_heads, entry)
        builder = NVFP4CudaMetadataBuilder(spec, [layer.layer_name], config, torch.device(device))
    case = PagedCase(requests, NVFP4PageLayout(d, block, kv_heads), heads, gen)
    physical = (case.num_blocks, kv_heads, block, entry) if hnd else (case.num_blocks, block, kv_heads, entry)
    kv_cache = torch.full(physical, 0xEE, dtype=torch.uint8, device=device)
    kv_cache = kv_cache if hnd else kv_cache.permute(0, 2, 1, 3)
    query, output, block_table, query_start, seq_lens = backend_step(layer, builder, case, kv_cache, device)

    key_cache, value_cache = page_view(kv_cache, kv_heads)
    assert NVFP4PageLayout.from_caches(key_cache, value_cache).key_format == key_format
    want = torch.empty_like(query)
    reference.nvfp4_paged_attention(query, key_cache, value_cache, block_table, query_start, seq_lens,
                                    layer._k_scale, layer._v_scale, d ** -0.5, True, False, 17, 45, want)
    assert relative_l2(output.view(query.shape).cpu(), want.cpu()) <= 1e-2


@pytest.mark.parametrize("kv_cache_dtype", ["nvfp4_k8v4", "nvfp4_ki8v4"])
def test_byte_key_kv_cache_dtypes_are_served(kv_cache_dtype):
    assert NVFP4CudaBackend.supports_combination(128, torch.bfloat16, kv_cache_dtype, 16, False, False, False, False,
                                                 HOPPER) is None


@pytest.mark.parametrize("key_format", ["fp8", "int8"])
def test_fa2_reader_refuses_byte_keys_by_name(key_format):
    """FlashInfer fa2 reads NVFP4 keys only: handed an FP8- or INT8-key page, its reader names the key format (the
    builder sends such layers to the plugin's kernel instead)."""
    decoder = object.__new__(FlashInferNVFP4Decoder)  # the check comes before any FlashInfer call
    decoder._planned = (1, 8, 2, 128, 16, torch.bfloat16)
    key_cache, value_cache = NVFP4PageLayout(128, 16, 2, key_format=key_format).allocate_sides(2)
    query = torch.zeros(1, 8, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=f"fa2 reads NVFP4 keys only, got {key_format.upper()} keys"):
        decoder.run(query, key_cache, value_cache, 1.0, 1.0, torch.empty_like(query))
