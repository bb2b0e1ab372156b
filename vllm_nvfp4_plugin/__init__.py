"""vLLM plugin: NVFP4 KV cache, its ops and attention backends, and a sparse-indexer backend.

vLLM calls `register()` (entry point `vllm.general_plugins`) in every process it starts, so it is
idempotent and cheap: it only imports `vllm_adapter` (the one subpackage that touches vLLM) and
registers the adapters with vLLM's registries.
"""

_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    _registered = True
    from .vllm_adapter import register_all

    register_all()
