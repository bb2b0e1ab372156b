"""The plugin's CUDA attention backend: vLLM's `CUSTOM` slot (`--attention-backend CUSTOM`), NVFP4 KV cache only.

Thin over the vLLM-independent CUDA path (`attention.flashinfer_reader`): the builder turns vLLM's batch into
core metadata; the impl stores with the plugin's op and attends. The decode reader is chosen by the environment
variable `VLLM_NVFP4_CUDA_READER` (`resolved_reader`):

- "plugin" (default): the plugin's `nvfp4_paged_attention` kernel. It needs no host sync and plans its launch from vLLM's
  host-side length bounds, so the builder declares CUDA-graph support for uniform single-token decode batches
  (FULL graphs), whose tokens equal eager steps' (it splits each request by its own length, not by the bound;
  benchmarks/results/vllm_cuda_engines.md). On the H200 it decodes faster than fa2
  (benchmarks/results/cuda_attention.md).
- "fa2": FlashInfer's fa2 decode for the leading decode requests (no CUDA graphs: its plan reads lengths on the
  host).

Batches with prefills (eager) send their prefills to `DequantPrefill` (pages dequantized to bf16, FlashInfer fa3,
about bf16 speed) where it runs (SM90 with FlashInfer); else to the kernel ("plugin") or the attention core.

Layers with a sliding window, a logit soft-cap or attention sinks (Gemma 2/3, gpt-oss, Mistral-style windows) decode
through the plugin's kernel whatever the reader (FlashInfer's NVFP4 decode takes none of them), and prefill through
`DequantPrefill` with fa3's window, soft-cap and sink variants, where it runs and the group's layers share one
window, soft-cap and sink switch (else through the kernel). A sliding-window layer keeps vLLM's
`SlidingWindowSpec`, packed as an NVFP4 page, so vLLM frees the pages that leave the window; neither path reads
them. ALiBi is refused at engine start.

V scales are stored linear, the order every reader reads.
"""

from __future__ import annotations

import os
from typing import ClassVar

import torch
from vllm.config import VllmConfig, get_layers_from_vllm_config
from vllm.logger import init_logger
from vllm.model_executor.layers.attention import Attention
from vllm.platforms.interface import DeviceCapability
from vllm.v1.attention.backend import (AttentionBackend, AttentionCGSupport, AttentionImpl,
                                       AttentionMetadataBuilder, AttentionType, CommonAttentionMetadata,
                                       MultipleOf)
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout

from ..attention import MODEL_FEATURES, SUPPORTED_HEAD_SIZES, DequantWorkspace
from ..attention import NVFP4AttentionMetadata
from ..attention.flashinfer_reader import (CUDA_READERS, SWIZZLE_V_SCALES, CudaBatch, DequantPrefill,
                                           FlashInferNVFP4Decoder, KernelBatch, cuda_paged_attention,
                                           dequant_prefill_unavailable_reason, flashinfer_decode_unavailable_reason,
                                           plan_batch, plan_kernel_batch)
from .spec import HND_LAYOUTS, NHD_LAYOUTS, NVFP4_KV_CACHE_DTYPES, customize_nvfp4_spec, spec_key_format
from .common import (LayerKVPolicy, LayerPolicyOwner, PageSidesOwner, check_nvfp4_layer, core_metadata,
                     current_max_model_len, effective_sliding_window, engine_key_format, engine_kv_calibration)

logger = init_logger("vllm.nvfp4_plugin.cuda")

# Layers run one after another in a worker, so they share one dequantization workspace.
_WORKSPACE = DequantWorkspace()


READER_ENV = "VLLM_NVFP4_CUDA_READER"


def resolved_reader(device: torch.device) -> str:
    """The decode reader `VLLM_NVFP4_CUDA_READER` selects ("plugin" by default) on this device: "plugin", "fa2"
    or, off CUDA, "core"; raises naming the allowed values."""
    reader = os.environ.get(READER_ENV, "plugin")
    if reader not in CUDA_READERS:
        raise ValueError(f"{READER_ENV} must be one of {CUDA_READERS}, got {reader!r}")
    if torch.device(device).type != "cuda":
        return "core"
    return reader


def _check_kv_cache_dtype(kv_cache_dtype: str) -> None:
    if kv_cache_dtype not in NVFP4_KV_CACHE_DTYPES:
        raise ValueError(f"the vllm_nvfp4_plugin CUSTOM backend serves kv_cache_dtype in {NVFP4_KV_CACHE_DTYPES} "
                         f"only, got {kv_cache_dtype!r}: pass --kv-cache-dtype nvfp4 or pick another backend")


class NVFP4CudaBackend(AttentionBackend):
    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list] = list(NVFP4_KV_CACHE_DTYPES)

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"  # the registry slot it is registered under (the layer looks its name up in the enum)

    @staticmethod
    def get_impl_cls() -> type["NVFP4CudaImpl"]:
        return NVFP4CudaImpl

    @staticmethod
    def get_builder_cls() -> type["NVFP4CudaMetadataBuilder"]:
        return NVFP4CudaMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(16)]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(SUPPORTED_HEAD_SIZES)

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (*NHD_LAYOUTS, *HND_LAYOUTS)  # token-major first: FlashInfer's native order

    @classmethod
    def supports_compute_capability(cls, capability: DeviceCapability) -> bool:
        return capability >= DeviceCapability(8, 0)

    @classmethod
    def supports_sink(cls) -> bool:
        return True

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_combination(cls, head_size, dtype, kv_cache_dtype, block_size, use_mla, has_sink, use_sparse,
                             use_mm_prefix, device_capability) -> str | None:
        if kv_cache_dtype not in NVFP4_KV_CACHE_DTYPES:
            return f"the CUSTOM (vllm_nvfp4_plugin) backend needs kv_cache_dtype in {NVFP4_KV_CACHE_DTYPES}, got {kv_cache_dtype!r}"
        return None

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        return customize_nvfp4_spec(spec, engine_key_format())


def shared_decode_params(vllm_config: VllmConfig, layer_names: list[str]) -> tuple[int, torch.dtype, float] | None:
    """(query heads, query dtype, softmax scale) shared by a KV-cache group's layers: FlashInfer plans once per
    batch for all of them. None (decode through the core) if the layers disagree."""
    layers = get_layers_from_vllm_config(vllm_config, Attention, layer_names)
    params = {(layer.impl.num_heads, layer.dtype, layer.impl.scale) for layer in layers.values()}
    if len(params) != 1:
        logger.warning("vllm_nvfp4_plugin: layers %s differ in query heads, dtype or softmax scale (%s); "
                       "decoding through the attention core instead of FlashInfer", layer_names, params)
        return None
    return params.pop()


def group_uses_model_features(vllm_config: VllmConfig, layer_names: list[str]) -> bool:
    """Whether any of the group's layers has a sliding window, a logit soft-cap or sinks."""
    layers = get_layers_from_vllm_config(vllm_config, Attention, layer_names)
    return any(layer.impl.model_features for layer in layers.values())


def shared_prefill_features(vllm_config: VllmConfig, layer_names: list[str]) -> tuple[int, float, bool] | None:
    """(sliding window, soft-cap, has sinks) shared by a KV-cache group's layers, which `DequantPrefill` plans once
    per batch for all of them (the sink values it takes at run time, per layer); None if the layers disagree."""
    layers = get_layers_from_vllm_config(vllm_config, Attention, layer_names)
    features = {(layer.impl.sliding_window, layer.impl.logits_soft_cap, layer.impl.sinks is not None)
                for layer in layers.values()}
    return features.pop() if len(features) == 1 else None


class NVFP4CudaMetadataBuilder(AttentionMetadataBuilder[CudaBatch | KernelBatch | NVFP4AttentionMetadata]):
    """Core metadata for every batch, planned for the resolved reader: the plugin's kernel needs nothing more;
    fa2 is planned for the batch's leading decode requests; prefills are planned for `DequantPrefill` where it
    runs. Off CUDA (or when fa2 cannot read the head size and "fa2" was asked for) the core serves every request.
    A group whose layers use model features decodes through the kernel, and prefills through `DequantPrefill`
    planned with the layers' shared window, soft-cap and sink switch (through the kernel if they differ)."""

    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str], vllm_config: VllmConfig,
                 device: torch.device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        if not kv_cache_spec.kv_quant_mode.is_nvfp4:
            raise ValueError(f"the vllm_nvfp4_plugin CUSTOM backend serves NVFP4 KV caches only, got a "
                             f"{kv_cache_spec.kv_quant_mode} spec for layers {layer_names}")
        self._init_reorder_batch_threshold(1)  # decodes first: the decode reader takes the leading run
        self._reader = resolved_reader(device)
        self._decoder: FlashInferNVFP4Decoder | None = None
        self._decode_params: tuple[int, torch.dtype, float] | None = None
        self._prefill: DequantPrefill | None = None
        self._prefill_features: tuple[int, float, bool] | None = (0, 0.0, False)  # the group's window, cap, sinks
        if self._reader == "core":
            logger.info_once("vllm_nvfp4_plugin: NVFP4 attention through the core (device %s)", device)
            return
        if group_uses_model_features(vllm_config, layer_names):
            self._reader = "plugin"
            self._prefill_features = shared_prefill_features(vllm_config, layer_names)
            logger.info_once("vllm_nvfp4_plugin: layers %s use a sliding window, soft-cap or sinks: decode through "
                             "the plugin's CUDA kernel", ", ".join(layer_names))
        key_format = spec_key_format(kv_cache_spec)
        if self._reader == "fa2" and key_format != "nvfp4":
            self._reader = "plugin"
            logger.info_once("vllm_nvfp4_plugin: %s keys: decode through the plugin's CUDA kernel (FlashInfer reads "
                             "NVFP4 keys only)", key_format.upper())
        fa2_reason = flashinfer_decode_unavailable_reason(kv_cache_spec.head_size, device)
        prefill_reason = dequant_prefill_unavailable_reason(kv_cache_spec.head_size, device)
        needs_params = (self._reader == "fa2" and fa2_reason is None) or prefill_reason is None
        if needs_params:  # FlashInfer plans once per batch for all the group's layers
            self._decode_params = shared_decode_params(vllm_config, layer_names)
        if self._decode_params is not None and prefill_reason is None and self._prefill_features is not None:
            self._prefill = DequantPrefill(device)
        if self._reader == "fa2" and (fa2_reason is not None or self._decode_params is None):
            self._reader = "core"
        logger.info_once("vllm_nvfp4_plugin: NVFP4 decode through %s, prefill through %s",
                         {"plugin": "the plugin's CUDA kernel", "fa2": "FlashInfer fa2", "core": "the core"}[self._reader],
                         "dequantize + FlashInfer fa3" if self._prefill is not None else
                         ("the plugin's CUDA kernel" if self._reader == "plugin" else "the core"))

    @classmethod
    def get_cudagraph_support(cls, vllm_config: VllmConfig, kv_cache_spec: AttentionSpec) -> AttentionCGSupport:
        # The kernel's launch depends only on host-side bounds; the fa2 plan and the core read lengths on the host.
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        if resolved_reader(device) == "plugin":
            return AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
        return AttentionCGSupport.NEVER

    def _seq_lens_cpu(self, common: CommonAttentionMetadata) -> torch.Tensor:
        upper_bound = common.seq_lens_cpu_upper_bound
        exact_upper_bound = upper_bound is not None and self.vllm_config.speculative_config is None
        return upper_bound if exact_upper_bound else common.seq_lens.cpu()

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> CudaBatch | KernelBatch | NVFP4AttentionMetadata:
        metadata = core_metadata(common_attn_metadata)
        if self._reader == "core":
            return CudaBatch(0, None, metadata)
        if self._reader == "fa2" and self._decoder is None:  # the layout is resolved by the first build
            layout = self.vllm_config.cache_config.get_resolved_kv_cache_layout()
            self._decoder = FlashInferNVFP4Decoder(self.device, hnd=layout in HND_LAYOUTS)
        spec = self.kv_cache_spec
        if self._prefill is not None and common_attn_metadata.max_query_len > 1:
            num_q_heads, q_dtype, sm_scale = self._decode_params
            sliding_window, logits_soft_cap, sinks = self._prefill_features
            return plan_kernel_batch(metadata, common_attn_metadata.query_start_loc_cpu,
                                     self._seq_lens_cpu(common_attn_metadata), self._prefill, num_q_heads,
                                     spec.num_kv_heads, spec.head_size, sm_scale, q_dtype, self._decoder,
                                     spec.block_size, sliding_window=sliding_window,
                                     logits_soft_cap=logits_soft_cap, sinks=sinks)
        if self._reader == "plugin":
            return metadata
        num_q_heads, q_dtype, sm_scale = self._decode_params
        return plan_batch(metadata, common_attn_metadata.query_start_loc_cpu, self._seq_lens_cpu(common_attn_metadata),
                          self._decoder, num_q_heads, spec.num_kv_heads, spec.head_size, spec.block_size, q_dtype,
                          sm_scale)


class NVFP4CudaImpl(LayerPolicyOwner, PageSidesOwner,
                    AttentionImpl[CudaBatch | KernelBatch | NVFP4AttentionMetadata]):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 alibi_slopes: list[float] | None = None, sliding_window: int | None = None,
                 kv_cache_dtype: str = "auto", logits_soft_cap: float | None = None,
                 attn_type: str = AttentionType.DECODER, kv_sharing_target_layer_name: str | None = None,
                 sinks: torch.Tensor | None = None) -> None:
        num_kv_heads = num_kv_heads or num_heads
        _check_kv_cache_dtype(kv_cache_dtype)
        check_nvfp4_layer(kv_cache_dtype, attn_type, head_size, num_heads, num_kv_heads,
                          sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                          alibi_slopes=alibi_slopes, sinks=sinks, supported_features=MODEL_FEATURES)
        # The kernel's "off" values: window 0, soft-cap 0, no sinks. A window that covers every admitted sequence is
        # none, so such layers keep the FlashInfer prefill.
        self.sliding_window = effective_sliding_window(sliding_window, current_max_model_len()) or 0
        self.logits_soft_cap = float(logits_soft_cap or 0.0)
        self.sinks = sinks  # the model's parameter, loaded after construction
        self.model_features = bool(self.sliding_window or self.logits_soft_cap or sinks is not None)
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.calibration = engine_kv_calibration()  # raises here, at engine start, on a file that does not fit
        self.policy: LayerKVPolicy | None = None  # resolved from the layer's name at its first step
        key_format = engine_key_format()  # read here, with the config current, for customize_spec
        keys = {"nvfp4": "NVFP4", "fp8": "FP8 E4M3", "int8": "INT8"}[key_format]
        logger.info_once("vllm_nvfp4_plugin: NVFP4 KV cache attention on CUDA, %s keys (head size %d, %d query / %d "
                         "KV heads)", keys, head_size, num_heads, num_kv_heads)

    def do_kv_cache_update(self, layer: torch.nn.Module, key: torch.Tensor, value: torch.Tensor,
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        if self.kv_sharing_target_layer_name is not None:  # the target layer stores the shared cache
            return
        self._layer_policy(layer).store(key, value, self._page_sides(kv_cache), slot_mapping,
                                        layer._k_scale, layer._v_scale, SWIZZLE_V_SCALES)

    def forward(self, layer: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: CudaBatch | KernelBatch | NVFP4AttentionMetadata | None,
                output: torch.Tensor,
                output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("the vllm_nvfp4_plugin CUSTOM backend does not fuse output quantization")
        if attn_metadata is None:  # profiling run
            return output
        sinks = self.sinks.to(torch.float32) if self.sinks is not None else None
        cuda_paged_attention(self._layer_policy(layer).query(query), self._page_sides(kv_cache),
                             attn_metadata, self.scale, layer._k_scale, layer._v_scale, layer._k_scale_float,
                             layer._v_scale_float, output.view(query.shape), workspace=_WORKSPACE,
                             sliding_window=self.sliding_window, logits_soft_cap=self.logits_soft_cap, sinks=sinks)
        return output
