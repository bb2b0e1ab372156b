#!/usr/bin/env bash
# The cache ops on a CUDA GPU: build, correctness, timing, the doctor and the sanitizers. Needs a CUDA toolkit,
# a CUDA build of torch and this package's test dependencies; FlashInfer (0.7) is used when importable.
#
#   bash benchmarks/gpu_ops.sh                  # every step but ncu
#   STEPS="tests bench" bash benchmarks/gpu_ops.sh
#
# Steps (STEPS, space-separated):
#   build           pip install -e . (ARCHS or TORCH_CUDA_ARCH_LIST picks the archs, e.g. ARCHS=9.0a)
#   cuda_tests      tests/test_ops_cuda.py: stores and gathers at 40k-140k tokens
#   tests           the CUDA cases of tests/test_ops_cpu.py (every layout, scale order, dtype and stride)
#   bench           benchmarks/bench_ops_cuda.py at the target shapes, beside a same-run copy (and FlashInfer's
#                   writer), into bench.md
#   attention_tests the CUDA attention tests (nvfp4_paged_attention, the readers and the core on CUDA)
#   attention_bench benchmarks/bench_attention_cuda.py (decode and prefill beside FlashInfer) into attention.md
#   bad_inputs      tests/test_bad_inputs.py
#   doctor          python -m vllm_nvfp4_plugin.tools.doctor
#   racecheck       compute-sanitizer racecheck over the gathers (they stage rows in shared memory)
#   attention_racecheck  compute-sanitizer racecheck over the attention kernels (the decode kernel's per-warp rings
#                   and merge, the fused kernel's stage ring; -k ATTENTION_RACECHECK_K picks the cases)
#   memcheck        compute-sanitizer memcheck over the CUDA cases of tests/test_ops_cpu.py (-k MEMCHECK_K)
#   memcheck_large  compute-sanitizer memcheck over tests/test_ops_cuda.py (-k MEMCHECK_LARGE_K)
#   ncu             Nsight Compute (speed of light, occupancy, warp states, memory) of one call of each op
# Logs, bench.md and summary.txt go to RESULTS_DIR (default out/gpu_ops); exits 1 if a step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_steps.sh
start_run "build cuda_tests tests bench attention_tests attention_bench bad_inputs doctor racecheck memcheck memcheck_large" \
  out/gpu_ops

has build && build_extension
PYTEST="python3 -X faulthandler -m pytest -v -p no:cacheprovider"
has cuda_tests && step cuda_tests 600 $PYTEST tests/test_ops_cuda.py
has tests && step tests 600 $PYTEST -m gpu tests/test_ops_cpu.py
if has bench; then
  flashinfer=$(python3 -c "import flashinfer" 2>/dev/null && echo --flashinfer)
  step bench 900 python3 benchmarks/bench_ops_cuda.py $flashinfer --out "$RESULTS_DIR/bench.md"
fi
has attention_tests && step attention_tests 900 $PYTEST -m gpu tests/test_paged_attention_cuda.py \
  tests/test_attention_cuda.py
has attention_bench && step attention_bench 900 python3 benchmarks/bench_attention_cuda.py --out "$RESULTS_DIR/attention.md"
has bad_inputs && step bad_inputs 300 $PYTEST tests/test_bad_inputs.py
has doctor && step doctor 300 python3 -m vllm_nvfp4_plugin.tools.doctor
has racecheck && step racecheck 900 compute-sanitizer --tool racecheck --error-exitcode 1 \
  python3 -m pytest -q -m gpu -p no:cacheprovider -k "gather and not opcheck" tests/test_ops_cpu.py
# Every layout, head size and key format of both kernels, split-KV and its combine, multi-token decode (graph
# capture is left out).
ATTENTION_RACECHECK_CASES="decode_layouts or prefill_chunked_and_mixed or multi_token or sinks_with_splits"
ATTENTION_RACECHECK_CASES+=" or long_context_splits or byte_keys_decode_layouts or byte_keys_prefill"
has attention_racecheck && step attention_racecheck 900 compute-sanitizer --tool racecheck --error-exitcode 1 \
  python3 -m pytest -q -m gpu -p no:cacheprovider -k "${ATTENTION_RACECHECK_K:-$ATTENTION_RACECHECK_CASES}" \
  tests/test_paged_attention_cuda.py
# One cudaMalloc per tensor, so memcheck sees where every tensor ends rather than a cached pool.
export PYTORCH_NO_CUDA_MEMORY_CACHING=1
has memcheck && step memcheck 1200 compute-sanitizer --tool memcheck --error-exitcode 1 \
  python3 -m pytest -q -m gpu -p no:cacheprovider -k "${MEMCHECK_K:-not opcheck}" tests/test_ops_cpu.py
has memcheck_large && step memcheck_large 1200 compute-sanitizer --tool memcheck --error-exitcode 1 \
  python3 -m pytest -q -p no:cacheprovider -k "${MEMCHECK_LARGE_K:-}" tests/test_ops_cuda.py
has ncu && step ncu 900 ncu --clock-control none --section SpeedOfLight --section Occupancy \
  --section WarpStateStats --section MemoryWorkloadAnalysis -k "regex:reshape|gather|indexer" \
  python3 benchmarks/bench_ops_cuda.py --once
cat "$RESULTS_DIR/summary.txt"
exit $status
