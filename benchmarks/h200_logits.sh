#!/usr/bin/env bash
# On the lent H200 (repo root; the run tool sets $OUT): build the extension for SM90a, run the indexer logits
# tests (CUDA cases, then the CPU ones), time bench_indexer.py, then the CUDA logits tests under
# compute-sanitizer (memcheck; racecheck: the prefill kernel stages keys in shared memory). Logs go to $OUT.
# STEPS picks steps (default: all); every step ends before DEADLINE seconds (the run tool's limit is 600).
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/h200_steps.sh"
OUT=$(realpath -m "${OUT:-out}")
STEPS=${STEPS:-"build tests bench cpu_tests memcheck racecheck"}
DEADLINE=${DEADLINE:-580}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
if has build; then
  TORCH_CUDA_ARCH_LIST="${ARCHS:-9.0a}" MAX_JOBS=16 step build 300 \
    python3 -m pip install -v --no-build-isolation --no-deps -e .
fi
GPU_TESTS="tests/test_logits_ops.py tests/test_logits_paths.py tests/test_indexer_core.py"
has tests && step tests 120 python3 -X faulthandler -m pytest -v -m gpu -p no:cacheprovider $GPU_TESTS
has bench && step bench 200 python3 benchmarks/bench_indexer.py --out "$OUT/bench.md"
has cpu_tests && step cpu_tests 120 python3 -m pytest -q -m "not gpu" -p no:cacheprovider $GPU_TESTS
export PYTORCH_NO_CUDA_MEMORY_CACHING=1  # one cudaMalloc per tensor: memcheck sees each tensor's end
has memcheck && step memcheck 150 compute-sanitizer --tool memcheck --error-exitcode 1 \
  python3 -m pytest -q -m gpu -p no:cacheprovider -k "not opcheck" tests/test_logits_ops.py tests/test_logits_paths.py
has racecheck && step racecheck 120 compute-sanitizer --tool racecheck --error-exitcode 1 \
  python3 -m pytest -q -m gpu -p no:cacheprovider -k "mqa_logits" tests/test_logits_ops.py tests/test_logits_paths.py
# The run tool brings back at most 8 files: the logs travel as one archive a call of this script.
archive="logs-$(date +%s).tar.gz"
mkdir -p "$OUT/logs" && mv "$OUT"/*.log "$OUT/logs/" && tar -czf "$OUT/$archive" -C "$OUT" logs && rm -r "$OUT/logs"
cat "$OUT/summary.txt"
exit $status
