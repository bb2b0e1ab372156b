"""Builds `vllm_nvfp4_plugin._C` against torch's stable ABI (target torch 2.10, so one build loads on 2.10+).

CPU kernels always; the CUDA kernels in csrc/cuda/ only when a CUDA toolkit and a CUDA build of torch are
both present. Install with `pip install --no-build-isolation .` so pip builds against the installed torch.
"""

import glob
import os
import re
import subprocess

import torch
from setuptools import setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

# [MAJ 1 byte][MIN 1 byte][PATCH 1 byte][ABI TAG 5 bytes]: 2.10.0 exposes only the stable API of 2.10.
TORCH_TARGET_VERSION = "-DTORCH_TARGET_VERSION=0x020a000000000000"
ROOT = os.path.dirname(os.path.abspath(__file__))


# Every architecture the CUDA kernels support: SM80 is their floor (cp.async, fp16 mma.sync), its PTX runs on
# later GPUs; SM89 has hardware FP8 conversions; the `a` targets of SM100/SM103/SM120/SM121 use the hardware
# E2M1 conversion (docs/GPU.md). TORCH_CUDA_ARCH_LIST overrides this list.
CUDA_ARCHS = ["8.0+PTX", "8.9", "9.0a", "10.0a", "12.0a"]
CUDA_ARCHS_12_9 = ["10.3a", "12.1a"]  # need CUDA 12.9 or newer


def nvcc_version() -> tuple[int, int]:
    """The toolkit's (major, minor) from `nvcc --version`; torch's CUDA version when nvcc cannot say."""
    try:
        text = subprocess.run([os.path.join(CUDA_HOME, "bin", "nvcc"), "--version"], capture_output=True,
                              text=True, check=True).stdout
        release = re.search(r"release (\d+)\.(\d+)", text)
        if release:
            return int(release.group(1)), int(release.group(2))
    except (OSError, subprocess.CalledProcessError):
        pass
    major, minor = torch.version.cuda.split(".")[:2]
    return int(major), int(minor)


def default_cuda_archs(toolkit: tuple[int, int]) -> list[str]:
    return CUDA_ARCHS + (CUDA_ARCHS_12_9 if toolkit >= (12, 9) else [])


def gencode_flags(archs: list[str]) -> list[str]:
    """nvcc flags for "9.0a"-style archs ("+PTX" also embeds the PTX). Given in the nvcc arguments, they replace
    torch's own arch flags, whose list of known archs depends on the torch version."""
    flags = []
    for arch in archs:
        number = arch.removesuffix("+PTX").replace(".", "")
        flags.append(f"-gencode=arch=compute_{number},code=sm_{number}")
        if arch.endswith("+PTX"):
            flags.append(f"-gencode=arch=compute_{number},code=compute_{number}")
    return flags


def extension():
    use_cuda = torch.version.cuda is not None and CUDA_HOME is not None
    sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
    # No fused multiply-add and no fast math: the kernels must round exactly like the reference.
    # -Wno-psabi: the CPU kernels' 64-byte vector helpers are always inlined, so no call crosses an ABI.
    cxx = ["-O3", "-fopenmp", "-ffp-contract=off", "-Wno-psabi", TORCH_TARGET_VERSION]
    args = {"cxx": cxx}
    if use_cuda:
        sources += sorted(glob.glob(os.path.join("csrc", "cuda", "*.cu")))
        # USE_CUDA declares the stable ABI's current-stream getter.
        cxx += ["-DUSE_CUDA"]
        # --threads: nvcc compiles a file's architectures in parallel (NVCC_THREADS, default one per CPU).
        args["nvcc"] = ["-O3", "-fmad=false", TORCH_TARGET_VERSION, "-DUSE_CUDA",
                        f"--threads={os.environ.get('NVCC_THREADS', '0')}"]
        if not os.environ.get("TORCH_CUDA_ARCH_LIST"):
            args["nvcc"] += gencode_flags(default_cuda_archs(nvcc_version()))
    make = CUDAExtension if use_cuda else CppExtension
    # py_limited_api: torch's builder defines Py_LIMITED_API as its oldest supported CPython (3.10 for torch 2.10).
    return make("vllm_nvfp4_plugin._C", sources, include_dirs=[os.path.join(ROOT, "csrc")],
                extra_compile_args=args, extra_link_args=["-fopenmp"], py_limited_api=True)


setup(
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExtension},
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)
