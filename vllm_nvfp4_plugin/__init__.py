"""vLLM plugin: NVFP4 KV cache, its ops and attention backends, and a sparse-indexer backend.

vLLM calls `register()` (entry point `vllm.general_plugins`) in every process it starts, so it is
idempotent and cheap: it only imports the adapters and registers them with vLLM's registries.
"""

_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    _registered = True
    from .backends import register_attention_backends
    from .indexer import register_indexer

    register_attention_backends()
    register_indexer()
