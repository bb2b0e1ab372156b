"""vLLM's CPU attention backend, extended with the NVFP4 KV cache.

Registered in place of `CPU_ATTN` (the only backend vLLM's CPU platform selects). With
`kv_cache_dtype="nvfp4"` (or "nvfp4_4over6") the spec, metadata, store and attention are the plugin's; with any other
dtype every call goes to vLLM's own CPU backend unchanged. NVFP4 layers with a sliding window, a logit soft-cap or
attention sinks are served (the kernel's model features); a sliding-window layer keeps vLLM's `SlidingWindowSpec`,
packed as an NVFP4 page, so vLLM frees the pages that leave the window. ALiBi is refused.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from vllm.logger import init_logger
from vllm.v1.attention.backend import AttentionMetadataBuilder, CommonAttentionMetadata
from vllm.v1.attention.backends.cpu_attn import (CPUAttentionBackend, CPUAttentionBackendImpl,
                                                 CPUAttentionMetadataBuilder)
from vllm.v1.kv_cache_interface import AttentionSpec

from ..attention import MODEL_FEATURES, DequantWorkspace, NVFP4AttentionMetadata, paged_attention
from .common import (LayerKVPolicy, LayerPolicyOwner, PageSidesOwner, check_nvfp4_layer, core_metadata,
                     engine_key_format, engine_kv_calibration)
from .spec import NVFP4_KV_CACHE_DTYPES, customize_nvfp4_spec

logger = init_logger("vllm.nvfp4_plugin.cpu")

# Layers run one after another in a worker, so they share one dequantization workspace.
_WORKSPACE = DequantWorkspace()


class KeyValueObserver:
    """Process-wide hooks, set by the calibration tool with the engine in its own process: `observe(layer_name, key,
    value)` sees every layer's keys and values as the cache receives them (after RoPE), `observe_query(layer_name,
    query)` its queries, whatever the cache dtype."""

    observe = None
    observe_query = None


def _is_nvfp4(kv_cache_dtype: str) -> bool:
    return kv_cache_dtype.startswith("nvfp4")


class NVFP4CPUAttentionBackend(CPUAttentionBackend):
    """`CPU_ATTN` plus "nvfp4" and "nvfp4_4over6". The KV-cache layout stays the parent's head-major LBHNC (HND) for every
    dtype: the choice is per class, not per dtype, and the parent's kernels read only that one."""

    supported_kv_cache_dtypes: ClassVar[list] = [*CPUAttentionBackend.supported_kv_cache_dtypes,
                                                     *NVFP4_KV_CACHE_DTYPES]

    @classmethod
    def supports_kv_cache_dtype(cls, kv_cache_dtype) -> bool:
        # vLLM 0.33's CPU backend also demands AVX-512/AMX for every quantized dtype (its FP8 kernels' need);
        # the plugin's NVFP4 kernels run on any x86-64.
        return _is_nvfp4(kv_cache_dtype or "") or super().supports_kv_cache_dtype(kv_cache_dtype)

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        return customize_nvfp4_spec(super().customize_spec(spec), engine_key_format())

    @staticmethod
    def get_impl_cls() -> type["NVFP4CPUAttentionImpl"]:
        return NVFP4CPUAttentionImpl

    @staticmethod
    def get_builder_cls() -> type["NVFP4CPUAttentionMetadataBuilder"]:
        return NVFP4CPUAttentionMetadataBuilder


class NVFP4CPUAttentionMetadataBuilder(CPUAttentionMetadataBuilder):
    """For NVFP4 groups: plain core metadata (the parent's builder plans its own kernels, and refuses
    quantized caches on CPUs without AVX-512/AMX)."""

    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str], vllm_config, device: torch.device):
        self.nvfp4 = kv_cache_spec.kv_quant_mode.is_nvfp4
        if self.nvfp4:
            AttentionMetadataBuilder.__init__(self, kv_cache_spec, layer_names, vllm_config, device)
        else:
            super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False):
        if not self.nvfp4:
            return super().build(common_prefix_len, common_attn_metadata, fast_build)
        return core_metadata(common_attn_metadata)


class NVFP4CPUAttentionImpl(LayerPolicyOwner, PageSidesOwner, CPUAttentionBackendImpl):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.nvfp4 = _is_nvfp4(self.kv_cache_dtype)
        if not self.nvfp4:
            return
        check_nvfp4_layer(self.kv_cache_dtype, self.attn_type, self.head_size, self.num_heads, self.num_kv_heads,
                          sliding_window=self.sliding_window, logits_soft_cap=self.logits_soft_cap,
                          alibi_slopes=self.alibi_slopes, sinks=self.sinks, supported_features=MODEL_FEATURES)
        self.calibration = engine_kv_calibration()  # raises here, at engine start, on a file that does not fit
        self.policy: LayerKVPolicy | None = None  # resolved from the layer's name at its first step
        keys = {"nvfp4": "NVFP4", "fp8": "FP8 E4M3", "int8": "INT8"}[engine_key_format()]
        logger.info_once("vllm_nvfp4_plugin: NVFP4 KV cache attention on CPU, %s keys (head size %d, %d query / %d "
                         "KV heads)", keys, self.head_size, self.num_heads, self.num_kv_heads)

    def do_kv_cache_update(self, layer: torch.nn.Module, key: torch.Tensor, value: torch.Tensor,
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        if KeyValueObserver.observe is not None:
            KeyValueObserver.observe(layer.layer_name, key[:slot_mapping.shape[0]], value[:slot_mapping.shape[0]])
        if not self.nvfp4:
            return super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        self._layer_policy(layer).store(key, value, self._page_sides(kv_cache), slot_mapping,
                                        layer._k_scale, layer._v_scale)

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: NVFP4AttentionMetadata | None, output: torch.Tensor,
                output_scale: torch.Tensor | None = None, output_block_scale: torch.Tensor | None = None):
        if KeyValueObserver.observe_query is not None and attn_metadata is not None:
            tokens = attn_metadata.num_query_tokens if self.nvfp4 else attn_metadata.num_actual_tokens
            KeyValueObserver.observe_query(layer.layer_name, query[:tokens])
        if not self.nvfp4:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                   output_block_scale)
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("NVFP4 KV cache attention on CPU does not fuse output quantization")
        if attn_metadata is None:  # profiling run
            return output
        # The parent keeps vLLM's "off" values: window -1, soft-cap 0; sinks in the model's dtype.
        sinks = self.sinks.to(torch.float32) if self.sinks is not None else None
        paged_attention(self._layer_policy(layer).query(query), self._page_sides(kv_cache), attn_metadata,
                        self.scale, layer._k_scale, layer._v_scale, output.view(query.shape), workspace=_WORKSPACE,
                        sliding_window=max(self.sliding_window, 0), logits_soft_cap=self.logits_soft_cap, sinks=sinks)
        return output
