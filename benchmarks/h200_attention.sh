#!/usr/bin/env bash
# On the lent H200 (repo root; the run tool sets $OUT): install FlashInfer 0.7.0.post1 + apache-tvm-ffi from the
# git-ignored .whl/ (carried), build the extension for SM90a, run the GPU attention tests, time NVFP4 decode.
# SKIP_BUILD=1 reuses an extension already built there (a warm machine keeps ignored build outputs).
set -euo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site FLASHINFER_CUDA_ARCH_LIST=9.0a TVM_FFI_DISABLE_TORCH_C_DLPACK=1 PYTHONUNBUFFERED=1
# FlashInfer JIT-compiles its NVFP4 decode modules on first use (~30 s each): compile them (heads 128 and 256)
# while the extension builds.
python3 - > "$OUT/flashinfer_warmup.log" 2>&1 <<'PY' &
import torch, flashinfer
for head in (128, 256):
    ws = torch.zeros(128 << 20, dtype=torch.uint8, device="cuda")
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
    w.plan(torch.tensor([0, 1], dtype=torch.int32), torch.zeros(1, dtype=torch.int32, device="cuda"),
           torch.tensor([1], dtype=torch.int32), 8, 2, head, 16, q_data_type=torch.bfloat16, kv_data_type=torch.uint8)
    data = torch.zeros(2, 1, 16, 2, head // 2, dtype=torch.uint8, device="cuda")
    sf = torch.zeros(2, 1, 16, 2, head // 16, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
    w.run(torch.zeros(1, 8, head, dtype=torch.bfloat16, device="cuda"), (data[0], data[1]), kv_cache_sf=(sf[0], sf[1]))
print("flashinfer warm")
PY
warmup=$!
if [ -z "${SKIP_BUILD:-}" ]; then
  TORCH_CUDA_ARCH_LIST="9.0a" MAX_JOBS=16 python3 -m pip install -q --no-build-isolation --no-deps -e . \
    > "$OUT/build.log" 2>&1 || { tail -50 "$OUT/build.log"; exit 1; }
fi
wait $warmup || tail -30 "$OUT/flashinfer_warmup.log"
python3 -m pytest -q -s -m gpu tests/test_attention_cuda.py 2>&1 | tee "$OUT/gpu_attention_tests.log"
python3 benchmarks/h200_attention.py --out "$OUT/h200_attention.md"
