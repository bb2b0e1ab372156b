# Step runner of the GPU scripts (sourced). `start_run DEFAULT_STEPS DEFAULT_RESULTS_DIR`: reads STEPS and
# RESULTS_DIR from the environment (or the defaults), empties the summary and records the GPU. `has NAME`: whether
# $STEPS lists NAME. `step NAME SECONDS COMMAND...`: runs COMMAND with a time limit, logs it to
# $RESULTS_DIR/NAME.log, appends its exit code to $RESULTS_DIR/summary.txt and sets status=1 when it fails.
start_run() {
  STEPS=${STEPS:-$1}
  RESULTS_DIR=$(realpath -m "${RESULTS_DIR:-$2}")
  mkdir -p "$RESULTS_DIR" && : > "$RESULTS_DIR/summary.txt"
  export PYTHONUNBUFFERED=1
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$RESULTS_DIR/gpu.txt"
}
has() { [[ " $STEPS " == *" $1 "* ]]; }
status=0
step() {
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout "$limit" "$@" > "$RESULTS_DIR/$name.log" 2>&1
  local rc=$?
  echo "== $name: exit $rc in $((SECONDS - start)) s" | tee -a "$RESULTS_DIR/summary.txt"
  tail -15 "$RESULTS_DIR/$name.log"
  [ $rc -eq 0 ] || status=1
}
# Build the extension in place for ARCHS (TORCH_CUDA_ARCH_LIST; default: setup.py's list of every supported arch).
build_extension() {
  [ -n "${ARCHS:-}" ] && export TORCH_CUDA_ARCH_LIST=$ARCHS
  MAX_JOBS=${MAX_JOBS:-$(nproc)} step build 1800 python3 -m pip install -v --no-build-isolation --no-deps -e .
}
