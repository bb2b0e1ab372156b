"""Stands in for vLLM's compiled library (`vllm._C_stable_libtorch`) on a CUDA machine that has vLLM's Python but
not its CUDA build: the capability queries vLLM asks at import answer "not supported", so vLLM takes its
PyTorch/Triton paths, and `weak_ref_tensor` (CUDA-graph capture) returns a view, a strong reference (graph outputs
then stay allocated); ops vLLM binds without calling them get a schema and no kernel. No kernel of vLLM is
defined."""
import torch

_lib = torch.library.Library("_C", "FRAGMENT")
for _name in ("cutlass_scaled_mm_supports_block_fp8", "cutlass_group_gemm_supported", "cutlass_scaled_mm_supports_fp8",
              "cutlass_scaled_mm_supports_fp4"):
    _lib.define(f"{_name}(int cuda_device_capability) -> bool")
    _lib.impl(_name, lambda cuda_device_capability: False, "CompositeExplicitAutograd")
_lib.define("weak_ref_tensor(Tensor(a) input) -> Tensor(a)")
_lib.impl("weak_ref_tensor", lambda input: input.view(input.shape), "CompositeExplicitAutograd")
# Bound (not called) by SiluAndMul's constructor on CUDA; with custom ops off its PyTorch forward runs.
_lib.define("silu_and_mul(Tensor! result, Tensor input) -> ()")
