"""gsm8k accuracy-regression harness: lm-eval's gsm8k through vLLM with bf16 vs NVFP4 KV cache."""
