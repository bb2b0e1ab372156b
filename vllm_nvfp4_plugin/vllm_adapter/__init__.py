"""Everything that imports or patches vLLM: the attention backends, the KV-cache spec, the sparse-indexer
op and metadata, the logits processor of the fidelity tool, and the version compatibility shims.

Each touch point, why it exists, the vLLM versions it was checked against and the test that guards it are
listed in docs/VLLM_TOUCH_POINTS.md. Backends are registered by dotted path, so registering the CUDA backend
imports nothing CUDA on a CPU host.
"""

from __future__ import annotations

import logging

from .compat import check_vllm_version

CPU_BACKEND = "vllm_nvfp4_plugin.vllm_adapter.cpu_backend.NVFP4CPUAttentionBackend"
CUDA_BACKEND = "vllm_nvfp4_plugin.vllm_adapter.cuda_backend.NVFP4CudaBackend"

# A child of vLLM's "vllm" logger, so vLLM's handler prints it with the process name.
logger = logging.getLogger("vllm.nvfp4_plugin")


def register_all() -> None:
    """Check the vLLM version, then register the attention backends, the KV-cache dtype names and the sparse
    indexer."""
    check_vllm_version()
    register_attention_backends()
    register_kv_cache_dtypes()
    register_indexer()


def register_kv_cache_dtypes() -> None:
    """`--kv-cache-dtype nvfp4_k8v4` (FP8 keys, NVFP4 values) and `nvfp4_ki8v4` (INT8 keys, NVFP4 values)
    through vLLM's `register_kv_cache_dtype` (0.33): uint8 caches of vLLM's NVFP4 quant mode, so vLLM hands their
    specs to the plugin's backends. vLLM 0.32 has no such hook; there the pages are `--kv-cache-dtype nvfp4` with the
    `key_format` option."""
    try:
        from vllm.config.cache import KV_CACHE_DTYPES, register_kv_cache_dtype
    except ImportError:
        return
    import torch
    from vllm.v1.kv_cache_interface import KVQuantMode

    from .spec import KEY_FORMAT_OF_KV_CACHE_DTYPE

    def nvfp4_values_dtype(dtype_name: str) -> type:
        class NVFP4ValuesKVCacheDtype:
            name = dtype_name

            def torch_dtype(self):
                return torch.uint8

            def quant_mode(self):
                return KVQuantMode.NVFP4

        return NVFP4ValuesKVCacheDtype

    for name, key_format in KEY_FORMAT_OF_KV_CACHE_DTYPE.items():
        if name in KV_CACHE_DTYPES:
            continue
        register_kv_cache_dtype(name)(nvfp4_values_dtype(name))
        logger.info("vllm_nvfp4_plugin registered kv_cache_dtype %r (%s keys, NVFP4 values)", name, key_format.upper())


def register_attention_backends() -> None:
    """Override `CPU_ATTN` (what vLLM's CPU platform always selects) and register `CUSTOM` (selected on
    CUDA with `--attention-backend CUSTOM`). Setting a registry entry twice is harmless."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN, CPU_BACKEND)
    register_backend(AttentionBackendEnum.CUSTOM, CUDA_BACKEND)
    logger.info("vllm_nvfp4_plugin registered attention backends: CPU_ATTN -> %s, CUSTOM -> %s",
                CPU_BACKEND, CUDA_BACKEND)


def register_indexer() -> None:
    """Replace vLLM's `SparseAttnIndexer` with the plugin's (idempotent); log why not when it can't."""
    try:
        from vllm.config.compilation import CompilationConfig
        from vllm.model_executor.custom_op import op_registry_oot
        from vllm.model_executor.layers.sparse_attn_indexer import SparseAttnIndexer
        from vllm.v1.attention.backends.mla.indexer import DeepseekV32IndexerBackend  # noqa: F401
    except ImportError as e:
        logger.info("vllm_nvfp4_plugin: this vLLM has no DeepSeek-V3.2 sparse indexer (%s); "
                    "the indexer backend is not registered", e)
        return
    from .indexer_op import OP_NAME, NVFP4SparseAttnIndexer

    current = op_registry_oot.get(SparseAttnIndexer.__name__)
    if current is NVFP4SparseAttnIndexer:
        return
    if current is not None:
        logger.warning("vllm_nvfp4_plugin: SparseAttnIndexer is already replaced by %s; "
                       "the plugin's indexer is not registered", current)
        return
    SparseAttnIndexer.register_oot(NVFP4SparseAttnIndexer)
    # vLLM splits piecewise CUDA graphs at its own indexer op (a class-level list, no registration hook);
    # split at the plugin's op the same way.
    if f"vllm::{OP_NAME}" not in CompilationConfig._attention_ops:
        CompilationConfig._attention_ops.append(f"vllm::{OP_NAME}")
    logger.info("vllm_nvfp4_plugin: DeepSeek-V3.2 sparse indexer registered (%s)", NVFP4SparseAttnIndexer.__name__)
