#!/usr/bin/env bash
# The sparse indexer's logits ops on a CUDA GPU: build, correctness (CUDA then CPU cases), timing at
# DeepSeek-V3.2 shapes, and the sanitizers. Needs a CUDA toolkit, a CUDA build of torch and the test dependencies.
#
#   bash benchmarks/gpu_logits.sh
#   STEPS="tests bench" bash benchmarks/gpu_logits.sh
#
# Steps (STEPS, space-separated):
#   build      pip install -e . (ARCHS or TORCH_CUDA_ARCH_LIST picks the archs)
#   tests      the CUDA cases of the logits tests
#   bench      benchmarks/bench_indexer.py (decode and prefill-chunk steps beside their floors) into bench.md
#   cpu_tests  the CPU cases of the same tests
#   memcheck   compute-sanitizer memcheck over the CUDA logits cases
#   racecheck  compute-sanitizer racecheck over the kernels that stage keys in shared memory
# Logs, bench.md and summary.txt go to RESULTS_DIR (default out/gpu_logits); exits 1 if a step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_steps.sh
start_run "build tests bench cpu_tests memcheck racecheck" out/gpu_logits

has build && build_extension
TESTS="tests/test_logits_ops.py tests/test_logits_paths.py tests/test_indexer_core.py"
has tests && step tests 600 python3 -X faulthandler -m pytest -v -m gpu -p no:cacheprovider $TESTS
has bench && step bench 600 python3 benchmarks/bench_indexer.py --out "$RESULTS_DIR/bench.md"
has cpu_tests && step cpu_tests 600 python3 -m pytest -q -m "not gpu" -p no:cacheprovider $TESTS
export PYTORCH_NO_CUDA_MEMORY_CACHING=1  # one cudaMalloc per tensor: memcheck sees each tensor's end
has memcheck && step memcheck 1200 compute-sanitizer --tool memcheck --error-exitcode 1 \
  python3 -m pytest -q -m gpu -p no:cacheprovider -k "not opcheck" tests/test_logits_ops.py tests/test_logits_paths.py
has racecheck && step racecheck 1200 compute-sanitizer --tool racecheck --error-exitcode 1 \
  python3 -m pytest -q -m gpu -p no:cacheprovider -k "mqa_logits" tests/test_logits_ops.py tests/test_logits_paths.py
cat "$RESULTS_DIR/summary.txt"
exit $status
