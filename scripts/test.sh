#!/usr/bin/env bash
# Installs what is needed (scripts/install.sh), then runs the whole test suite. What .ci/run calls.
#
#   bash scripts/test.sh                      # the whole suite
#   bash scripts/test.sh --fast               # -m "not e2e and not slow": ops, cores, spec, vLLM layers (minutes)
#   bash scripts/test.sh tests/test_models.py # or any pytest arguments instead of "tests"
#   bash scripts/test.sh --fast -k indexer    # --fast, then more pytest arguments
#
# Markers (tests/conftest.py): gpu (skipped without CUDA), vllm, e2e, slow.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$(command -v python3 || command -v python)}
export PYTHON

start=$SECONDS
bash scripts/install.sh
install_s=$((SECONDS - start))
echo "== install took ${install_s}s"

# Everything the tests need is local: never wait on a hub.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1

# Idle OpenMP threads sleep instead of spinning: with more runnable threads than cores, a spinning team waits out
# whole scheduler slices (a threaded layer test took 67 s instead of 0.7 s while other jobs ran).
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}

fast=()
if [[ "${1:-}" == "--fast" ]]; then
  shift
  fast=(-m "not e2e and not slow")
fi
start=$SECONDS
set +e
has_path=0
for arg in "$@"; do [[ -e "${arg%%::*}" ]] && has_path=1; done
[[ $has_path == 1 ]] || set -- "$@" tests
set -- "${fast[@]}" "$@"
"$PYTHON" -m pytest -ra -p no:cacheprovider --timeout=1200 --durations=30 "$@"
status=$?
set -e
echo "== tests took $((SECONDS - start))s (install ${install_s}s)"
if [[ $status -eq 5 ]]; then
  echo "pytest collected no tests: that is a failure" >&2
  exit 1
fi
exit $status
