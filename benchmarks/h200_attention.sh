#!/usr/bin/env bash
# On the lent H200 (repo root; the run tool sets $OUT): install FlashInfer 0.7.0.post1 + apache-tvm-ffi from the
# git-ignored .whl/ (carried), build the extension for SM90a, run the GPU attention tests, time NVFP4 decode.
# SKIP_BUILD=1 reuses an extension already built there (a warm machine keeps ignored build outputs).
set -euo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site FLASHINFER_CUDA_ARCH_LIST=9.0a TVM_FFI_DISABLE_TORCH_C_DLPACK=1 PYTHONUNBUFFERED=1
if [ -z "${SKIP_BUILD:-}" ]; then
  TORCH_CUDA_ARCH_LIST="9.0a" MAX_JOBS=16 python3 -m pip install -q --no-build-isolation --no-deps -e . \
    > "$OUT/build.log" 2>&1 || { tail -50 "$OUT/build.log"; exit 1; }
fi
python3 -m pytest -q -s -m gpu tests/test_attention_cuda.py 2>&1 | tee "$OUT/gpu_attention_tests.log"
python3 benchmarks/h200_attention.py --out "$OUT/h200_attention.md"
