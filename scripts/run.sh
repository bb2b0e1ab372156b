#!/usr/bin/env bash
# The main job: installs what is needed (scripts/install.sh), then serves SmolLM2-135M-Instruct with
# `vllm serve --kv-cache-dtype nvfp4` through the plugin, asks it a question, and compares the KV-cache
# capacity with a bf16 cache of the same size (python -m vllm_nvfp4_plugin.tools.demo).
#
#   bash scripts/run.sh [demo arguments, see python -m vllm_nvfp4_plugin.tools.demo --help]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$(command -v python3 || command -v python)}
export PYTHON

bash scripts/install.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
exec "$PYTHON" -m vllm_nvfp4_plugin.tools.demo "$@"
