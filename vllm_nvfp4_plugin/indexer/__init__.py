"""DeepSeek-V3.2 sparse-indexer compute core (`core.py`), independent of vLLM; its vLLM op and metadata
builder live in `vllm_nvfp4_plugin.vllm_adapter`."""
