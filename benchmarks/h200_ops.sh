#!/usr/bin/env bash
# On the lent H200 (repo root; the run tool sets $OUT): build the extension for SM90a and SM100a, run the op
# tests on CUDA, time the ops beside a copy and FlashInfer's writer, run the doctor, then the op tests under
# compute-sanitizer (memcheck; racecheck for the gathers, which use shared memory). Logs go to $OUT.
# FlashInfer 0.7.0.post1 + apache-tvm-ffi come from the git-ignored .whl/ (carried).
# SKIP_BUILD=1 reuses an extension already built there; STEPS picks steps (default: all; the benchmark right
# after the op tests); every step ends before DEADLINE seconds (the run tool's limit is 600). ARCHS sets
# TORCH_CUDA_ARCH_LIST (default "9.0a;10.0a"); MEMCHECK_K and MEMCHECK_LARGE_K narrow the memcheck steps' -k.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/h200_steps.sh"
OUT=$(realpath -m "${OUT:-out}")
STEPS=${STEPS:-"build cuda_tests tests bench bad_inputs bad_inputs_backtrace doctor memcheck memcheck_large racecheck ncu"}
DEADLINE=${DEADLINE:-580}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
# Builds and tests the tree it runs in. BUILD_HEAD=1 builds the committed tree (git HEAD) of a real checkout
# instead. Not in the run tool's copy: it carries a .git whose HEAD is the session's first commit, whose archive
# came out empty (2026-11-29); there, copy the tree to test into a folder and run this script from it.
if [ -n "${BUILD_HEAD:-}" ]; then
  echo "commit $(git rev-parse --short HEAD); uncommitted changes left out: $(git status --short | wc -l)" | tee "$OUT/summary.txt"
  rm -rf /tmp/clean && mkdir /tmp/clean && git archive HEAD | tar -x -C /tmp/clean && cd /tmp/clean
fi
export PYTHONPATH=/tmp/site FLASHINFER_CUDA_ARCH_LIST=9.0a TVM_FFI_DISABLE_TORCH_C_DLPACK=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"

# FlashInfer JIT-compiles its page writer and NVFP4 decode on first use (~30 s each): warm them during the build.
python3 - > "$OUT/flashinfer_warmup.log" 2>&1 <<'PY' &
import torch, flashinfer
k = torch.zeros(4, 2, 128, dtype=torch.bfloat16, device="cuda")
data = torch.zeros(1, 16, 2, 64, dtype=torch.uint8, device="cuda")
sf = torch.zeros(1, 16, 2, 8, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
one = torch.ones(1, device="cuda")
flashinfer.nvfp4_quantize_append_paged_kv_cache_with_slot_mapping(
    k, k, torch.arange(4, device="cuda"), (data, data.clone()), (sf, sf.clone()), one, one, "NHD")
for layout in ("NHD", "HND"):
    ws = torch.zeros(128 << 20, dtype=torch.uint8, device="cuda")
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, layout, use_tensor_cores=True)
    w.plan(torch.tensor([0, 1], dtype=torch.int32), torch.zeros(1, dtype=torch.int32, device="cuda"),
           torch.tensor([1], dtype=torch.int32), 8, 2, 128, 16, q_data_type=torch.bfloat16, kv_data_type=torch.uint8)
    w.run(torch.zeros(1, 8, 128, dtype=torch.bfloat16, device="cuda"), (data, data), kv_cache_sf=(sf, sf))
print("flashinfer warm")
PY
warmup=$!
if has build && [ -z "${SKIP_BUILD:-}" ]; then
  TORCH_CUDA_ARCH_LIST="${ARCHS:-9.0a;10.0a}" MAX_JOBS=16 step build 300 \
    python3 -m pip install -v --no-build-isolation --no-deps -e .
  grep -o "sm_100a" "$OUT/build.log" | head -1
fi
wait $warmup || tail -20 "$OUT/flashinfer_warmup.log"

# One pytest per file, so a crash names its file; -v logs each case as it starts. test_bad_inputs runs its
# CPU cases too: whether an op's error reaches Python on this machine's torch at all.
has cuda_tests && step test_ops_cuda 120 python3 -X faulthandler -m pytest -v -p no:cacheprovider tests/test_ops_cuda.py
has tests && step test_ops_cpu 150 python3 -X faulthandler -m pytest -v -m gpu -p no:cacheprovider tests/test_ops_cpu.py
# The issue's target shapes, beside a same-run copy and FlashInfer's writer (what `bench_ops.py --device cuda`
# appends to its own table).
has bench && step bench 200 python3 benchmarks/bench_ops_cuda.py --flashinfer --out "$OUT/bench.md"
has bad_inputs && step test_bad_inputs 90 python3 -X faulthandler -m pytest -v -p no:cacheprovider tests/test_bad_inputs.py
if has bad_inputs_backtrace && ! grep -q " passed" "$OUT/test_bad_inputs.log"; then  # a crash: where, natively
  step bad_inputs_backtrace 90 cuda-gdb -q -batch -ex run -ex "bt 30" --args python3 -m pytest -x -q -m gpu \
    -p no:cacheprovider tests/test_bad_inputs.py
fi
has doctor && step doctor 90 python3 -m vllm_nvfp4_plugin.tools.doctor
has racecheck && step racecheck 120 compute-sanitizer --tool racecheck --error-exitcode 1 \
  python3 -m pytest -q -m gpu -p no:cacheprovider -k "gather and not opcheck" tests/test_ops_cpu.py
# One cudaMalloc per tensor, so memcheck sees the end of every tensor rather than of a cached pool.
export PYTORCH_NO_CUDA_MEMORY_CACHING=1
has memcheck && step memcheck 200 compute-sanitizer --tool memcheck --error-exitcode 1 \
  python3 -m pytest -q -m gpu -p no:cacheprovider -k "${MEMCHECK_K:-not opcheck}" tests/test_ops_cpu.py
has memcheck_large && step memcheck_large 120 compute-sanitizer --tool memcheck --error-exitcode 1 \
  python3 -m pytest -q -p no:cacheprovider -k "${MEMCHECK_LARGE_K:-}" tests/test_ops_cuda.py
has ncu && step ncu 150 ncu --clock-control none --section SpeedOfLight --section Occupancy --section WarpStateStats \
  --section MemoryWorkloadAnalysis -k "regex:reshape|gather|indexer" python3 benchmarks/bench_ops_cuda.py --once
# The run tool brings back at most 8 files: the logs travel as one archive.
mkdir -p "$OUT/logs" && mv "$OUT"/*.log "$OUT/logs/" && tar -czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -r "$OUT/logs"
cat "$OUT/summary.txt"
exit $status
