"""DeepSeek-V3.2 sparse-indexer backend: metadata builder (`metadata.py`), op (`op.py`), compute core (`core.py`).

`core` imports no vLLM; `register_indexer()` imports the vLLM-facing modules only when vLLM has the
indexer classes.
"""

from __future__ import annotations

import logging

# A child of vLLM's "vllm" logger, so vLLM's handler prints it (as backends/__init__.py's does).
logger = logging.getLogger("vllm.nvfp4_plugin")


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
    from .op import OP_NAME, NVFP4SparseAttnIndexer

    current = op_registry_oot.get(SparseAttnIndexer.__name__)
    if current is NVFP4SparseAttnIndexer:
        return
    if current is not None:
        logger.warning("vllm_nvfp4_plugin: SparseAttnIndexer is already replaced by %s; "
                       "the plugin's indexer is not registered", current)
        return
    SparseAttnIndexer.register_oot(NVFP4SparseAttnIndexer)
    # vLLM splits piecewise CUDA graphs at its own indexer op; split at the plugin's the same way.
    if f"vllm::{OP_NAME}" not in CompilationConfig._attention_ops:
        CompilationConfig._attention_ops.append(f"vllm::{OP_NAME}")
    logger.info("vllm_nvfp4_plugin: DeepSeek-V3.2 sparse indexer registered (%s)", NVFP4SparseAttnIndexer.__name__)
