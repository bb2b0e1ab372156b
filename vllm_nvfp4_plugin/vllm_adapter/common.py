"""Adapter pieces both backends share: vLLM's batch metadata and layer arguments → the attention core."""

from __future__ import annotations

from collections.abc import Collection

import torch
from vllm.v1.attention.backend import AttentionType, CommonAttentionMetadata

from ..kv_calibration import KEY_FORMATS, KVCalibration, LayerPolicy, load
from ..attention import NVFP4AttentionMetadata, cache_sides, check_supported, store_kv
from .spec import KEY_FORMAT_OF_KV_CACHE_DTYPE, NVFP4_4OVER6_KV_CACHE_DTYPE, check_nvfp4_kv_cache_dtype, page_view


def effective_sliding_window(sliding_window: int | None, max_model_len: int | None) -> int | None:
    """None when the window covers every sequence the engine admits (no token ever leaves it), else the window."""
    if sliding_window is None or sliding_window == -1:
        return None
    if max_model_len is not None and max_model_len <= sliding_window:
        return None
    return sliding_window


def current_max_model_len() -> int | None:
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    return config.model_config.max_model_len if config is not None and config.model_config is not None else None


def check_nvfp4_layer(kv_cache_dtype: str, attn_type: str, head_size: int, num_heads: int, num_kv_heads: int,
                      *, sliding_window=None, logits_soft_cap=None, alibi_slopes=None, sinks=None,
                      supported_features: Collection[str] = ()) -> None:
    """Raise, at model construction (engine start), naming what an NVFP4-cached layer asks that the calling
    backend's kernels lack (`supported_features`: the attention core's MODEL_FEATURES they serve). A sliding window
    at least as long as max_model_len is no window: such layers are served by every backend."""
    check_nvfp4_kv_cache_dtype(kv_cache_dtype)
    if attn_type != AttentionType.DECODER:
        raise NotImplementedError(f"NVFP4 KV cache supports decoder attention only, got attn_type={attn_type!r}")
    sliding_window = effective_sliding_window(sliding_window, current_max_model_len())
    check_supported(head_size, num_heads, num_kv_heads, sliding_window=sliding_window,
                    logits_soft_cap=logits_soft_cap, alibi_slopes=alibi_slopes, sinks=sinks,
                    supported_features=supported_features)


def store_nvfp4_kv(kv_cache_dtype: str, key: torch.Tensor, value: torch.Tensor, kv_cache, slot_mapping: torch.Tensor,
                   k_scale: torch.Tensor, v_scale: torch.Tensor, swizzle_v_scales: bool = False) -> None:
    """The core's store for `kv_cache_dtype`: "nvfp4_4over6" differs from "nvfp4" in the store op only."""
    store_kv(key, value, kv_cache, slot_mapping, k_scale, v_scale, swizzle_v_scales,
             four_over_six=kv_cache_dtype == NVFP4_4OVER6_KV_CACHE_DTYPE)


# The plugin's options in vLLM's `additional_config` (`--additional-config '{"vllm_nvfp4_plugin": {...}}'`).
ADDITIONAL_CONFIG_KEY = "vllm_nvfp4_plugin"
KV_CALIBRATION_OPTION = "kv_calibration"
KEY_FORMAT_OPTION = "key_format"  # "nvfp4" (default), "fp8" (FP8 E4M3 keys) or "int8" (INT8 keys); NVFP4 values
_CALIBRATIONS: dict[str, KVCalibration] = {}
_ENGINE_KEY_FORMAT = "nvfp4"  # the key format last seen with an engine's config (see engine_key_format)


def _plugin_options(config) -> dict:
    return ((config.additional_config or {}).get(ADDITIONAL_CONFIG_KEY) or {}) if config is not None else {}


def engine_key_format() -> str:
    """The key format of the engine's NVFP4 cache ("nvfp4", "fp8" or "int8"): `--kv-cache-dtype nvfp4_k8v4` /
    `nvfp4_ki8v4`, its `key_format` option, or its calibration file's (they must agree). Read while the engine's
    config is current (model construction builds every layer's impl, which calls this) and remembered for vLLM's spec
    hook (`customize_spec`), which runs later and without the config."""
    from vllm.config import get_current_vllm_config_or_none

    global _ENGINE_KEY_FORMAT
    config = get_current_vllm_config_or_none()
    if config is None:
        return _ENGINE_KEY_FORMAT
    option = _plugin_options(config).get(KEY_FORMAT_OPTION)
    if option is not None and option not in KEY_FORMATS:
        raise ValueError(f"additional_config {ADDITIONAL_CONFIG_KEY}.{KEY_FORMAT_OPTION} must be one of "
                         f"{KEY_FORMATS}, got {option!r}")
    calibration = engine_kv_calibration()
    if option is not None and calibration is not None and calibration.key_format != option:
        raise ValueError(f"additional_config {ADDITIONAL_CONFIG_KEY}.{KEY_FORMAT_OPTION} is {option!r} but the KV "
                         f"calibration file says key_format {calibration.key_format!r}")
    key_format = option or (calibration.key_format if calibration is not None else None)
    named = KEY_FORMAT_OF_KV_CACHE_DTYPE.get(config.cache_config.cache_dtype)
    if named is not None:
        if key_format is not None and key_format != named:
            raise ValueError(f"kv_cache_dtype {config.cache_config.cache_dtype!r} keeps {named.upper()} keys, but the "
                             f"plugin's options ask for key_format {key_format!r}")
        key_format = named
    _ENGINE_KEY_FORMAT = key_format or "nvfp4"
    return _ENGINE_KEY_FORMAT


def engine_kv_calibration() -> KVCalibration | None:
    """The per-layer policy file named by the engine's additional_config, loaded once per process and checked
    against the model; None when none is named. Raises naming the file at engine start when it does not fit."""
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    path = _plugin_options(config).get(KV_CALIBRATION_OPTION)
    if path is None:
        return None
    if path not in _CALIBRATIONS:
        calibration = load(path)
        model = config.model_config
        calibration.check_model(model.get_total_num_hidden_layers(), model.get_total_num_kv_heads(),
                                model.get_head_size(), str(path))
        if config.parallel_config.tensor_parallel_size != 1:
            raise NotImplementedError(f"{path}: a KV calibration is applied with tensor_parallel_size 1 only, got "
                                      f"{config.parallel_config.tensor_parallel_size}")
        _CALIBRATIONS[path] = calibration
    return _CALIBRATIONS[path]


class LayerKVPolicy:
    """One layer's store rule and key smoothing, with the smoothing factors kept on the activations' device."""

    def __init__(self, policy: LayerPolicy, num_heads: int):
        self.mode = policy.mode
        self.key_scales = policy.key_scales
        self._group = num_heads // policy.key_scales.shape[0] if policy.key_scales is not None else 1
        self._factors: dict = {}

    @classmethod
    def for_layer(cls, calibration: KVCalibration | None, kv_cache_dtype: str, layer_name: str,
                  num_heads: int) -> "LayerKVPolicy":
        if calibration is None:
            return cls(LayerPolicy(kv_cache_dtype, None), num_heads)
        from vllm.model_executor.models.utils import extract_layer_index

        return cls(calibration.layers[extract_layer_index(layer_name)], num_heads)

    def _factor(self, kind: str, like: torch.Tensor) -> torch.Tensor:
        key = (kind, like.device, like.dtype)
        if key not in self._factors:
            scales = self.key_scales if kind == "query" else 1.0 / self.key_scales  # powers of two: exact
            if kind == "query":
                scales = scales.repeat_interleave(self._group, 0)
            self._factors[key] = scales.to(like.device, like.dtype)
        return self._factors[key]

    def store(self, key, value, kv_cache, slot_mapping, k_scale, v_scale, swizzle_v_scales: bool = False) -> None:
        if self.key_scales is not None:
            key = key[:slot_mapping.shape[0]] * self._factor("key", key)
        store_nvfp4_kv(self.mode, key, value, kv_cache, slot_mapping, k_scale, v_scale, swizzle_v_scales)

    def query(self, query: torch.Tensor) -> torch.Tensor:
        """`query` `[tokens, heads, head]` for the smoothed keys: multiplied by their scales."""
        return query if self.key_scales is None else query * self._factor("query", query)


class LayerPolicyOwner:
    """Both backends' impls: the layer's `LayerKVPolicy`, resolved from its name at its first step (the name is
    known only once the model is built). Needs `calibration`, `kv_cache_dtype`, `num_heads` and `policy`."""

    def _layer_policy(self, layer: torch.nn.Module) -> LayerKVPolicy:
        if self.policy is None:
            self.policy = LayerKVPolicy.for_layer(self.calibration, self.kv_cache_dtype, layer.layer_name,
                                                  self.num_heads)
        return self.policy


class PageSidesOwner:
    """Both backends' impls: the (key_cache, value_cache) pair over vLLM's view of the layer's cache, made once per
    cache tensor (vLLM hands the layer the same tensor at every step). Needs `num_kv_heads`."""

    _sides_of: torch.Tensor | None = None

    def _page_sides(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._sides_of is not kv_cache:
            self._sides = cache_sides(page_view(kv_cache, self.num_kv_heads))
            self._sides_of = kv_cache
        return self._sides


def core_metadata(common: CommonAttentionMetadata) -> NVFP4AttentionMetadata:
    """The core's view of one batch; `num_actual_tokens` bounds the stored slots (the rest is padding)."""
    if isinstance(common.causal, torch.Tensor):
        raise NotImplementedError("NVFP4 KV cache attention takes one causal flag per batch, "
                                  "not per-request causality")
    return NVFP4AttentionMetadata(
        query_start_loc=common.query_start_loc,
        seq_lens=common.seq_lens,
        block_table=common.block_table_tensor,
        slot_mapping=common.slot_mapping[:common.num_actual_tokens],
        causal=bool(common.causal),
        max_query_len=common.max_query_len,
        max_seq_len=common.max_seq_len,
    )
