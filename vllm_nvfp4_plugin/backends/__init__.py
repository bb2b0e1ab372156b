"""Registration of the plugin's attention backends with vLLM's registry, by dotted path: nothing is
imported here, so registering the CUDA backend costs nothing (and imports nothing CUDA) on a CPU host."""

from __future__ import annotations

import logging

CPU_BACKEND = "vllm_nvfp4_plugin.backends.cpu.NVFP4CPUAttentionBackend"
CUDA_BACKEND = "vllm_nvfp4_plugin.backends.cuda.NVFP4CudaBackend"

# A child of vLLM's "vllm" logger, so vLLM's handler prints it with the process name.
logger = logging.getLogger("vllm.nvfp4_plugin")


def register_attention_backends() -> None:
    """Override `CPU_ATTN` (what vLLM's CPU platform always selects) and register `CUSTOM` (selected on
    CUDA with `--attention-backend CUSTOM`). Setting a registry entry twice is harmless."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN, CPU_BACKEND)
    register_backend(AttentionBackendEnum.CUSTOM, CUDA_BACKEND)
    logger.info("vllm_nvfp4_plugin registered attention backends: CPU_ATTN -> %s, CUSTOM -> %s",
                CPU_BACKEND, CUDA_BACKEND)
