#!/usr/bin/env bash
# vLLM with the plugin on a CUDA GPU: needs vLLM (0.32/0.33) importable on its CUDA platform (its CUDA wheel, or its
# Python alone: benchmarks/vllm_python_only.py), a CUDA build of torch and the plugin built (STEPS=build does it).
#
#   bash benchmarks/gpu_vllm.sh
#   FLASHINFER_PATH=/opt/flashinfer_site bash benchmarks/gpu_vllm.sh
#
# Steps (STEPS, space-separated):
#   build          pip install -e . (ARCHS or TORCH_CUDA_ARCH_LIST picks the archs)
#   indexer_tests  the sparse indexer's layer tests (tests/test_indexer.py, tests/test_indexer_core.py) with real
#                  vLLM metadata, on CPU and CUDA tensors
#   engines        benchmarks/vllm_engines.py: tiny Llamas (head 64/128/256) served by vLLM's engine with the
#                  CUSTOM backend and an NVFP4 KV cache, beside a bf16 engine; writes engine.md and engine.json
#   graphs         benchmarks/vllm_engines.py --cudagraphs: the same engines eager and with CUDA graphs (FULL decode,
#                  FULL_AND_PIECEWISE), tokens compared and decode steps timed; writes graphs/engine.md
# FLASHINFER_PATH: a folder holding FlashInfer outside the default path (pip install --target DIR); the engines
# then also run once without it, every request through the plugin's attention core.
# Logs and summary.txt go to RESULTS_DIR (default out/gpu_vllm); exits 1 if a step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_steps.sh
start_run "build indexer_tests engines graphs" out/gpu_vllm
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python3 -c "import torch, vllm; print('torch', torch.__version__, 'vllm', vllm.__version__)" | tee -a "$RESULTS_DIR/gpu.txt"

has build && build_extension
has indexer_tests && step indexer_tests 900 python3 -m pytest -q -p no:cacheprovider -rs \
  tests/test_indexer.py tests/test_indexer_core.py
has engines && step engines 1200 python3 benchmarks/vllm_engines.py ${FLASHINFER_PATH:+--flashinfer-path "$FLASHINFER_PATH"} \
  --out "$RESULTS_DIR"
has graphs && step graphs 1200 python3 benchmarks/vllm_engines.py --cudagraphs --out "$RESULTS_DIR/graphs"
cat "$RESULTS_DIR/summary.txt"
exit $status
