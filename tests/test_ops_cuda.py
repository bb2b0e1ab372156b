"""CUDA-only cases: stores large enough for the kernels' 4-tokens-a-thread path, bit for bit against the reference.

The CUDA stores switch to a software-pipelined kernel (each thread quantizes 4 tokens, loading the next one's
inputs during the current one) once the tokens fill every SM 8 times over; the shared op tests are too small
to reach it. The thresholds below mirror csrc/cuda (8 waves of 2048 threads per SM).
"""

import pytest
import torch

from op_cases import IndexerCase, NVFP4Case, indexer_store_inputs, nvfp4_store_inputs
from vllm_nvfp4_plugin import ops, reference

pytestmark = pytest.mark.gpu


def pipelined_tokens(threads_per_token: int) -> int:
    """A token count just past the CUDA stores' threshold for the 4-tokens-a-thread kernel."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return 8 * 2048 * sms // threads_per_token + 777  # 777: the last block is partly empty


@pytest.mark.parametrize("hnd,swizzle", [(False, False), (True, True)], ids=["NHD-linear", "HND-swizzled"])
def test_large_nvfp4_store_matches_reference(hnd, swizzle):
    num_tokens = pipelined_tokens(threads_per_token=8 * 8)  # 8 groups of head 128, 8 heads
    case = NVFP4Case(head_size=128, num_heads=8, block_size=16, num_blocks=num_tokens // 16 + 8,
                     num_tokens=num_tokens, hnd=hnd, swizzle_v_scales=swizzle, row_pad=16, seed=9)
    args, expected = nvfp4_store_inputs(case, "cuda"), nvfp4_store_inputs(case, "cpu")
    buffer, expected_buffer = args.pop("buffer"), expected.pop("buffer")
    ops.reshape_and_cache_nvfp4(**args)
    reference.reshape_and_cache_nvfp4(**expected)
    assert torch.equal(buffer.cpu(), expected_buffer)


@pytest.mark.parametrize("scale_fmt", ["", "ue8m0"])
def test_large_indexer_store_matches_reference(scale_fmt):
    num_tokens = pipelined_tokens(threads_per_token=128 // 8)  # 8 elements a thread
    case = IndexerCase(num_tokens=num_tokens, block_size=64, num_blocks=num_tokens // 64 + 4, seed=3)
    args, expected = indexer_store_inputs(case, scale_fmt, "cuda"), indexer_store_inputs(case, scale_fmt, "cpu")
    buffer, expected_buffer = args.pop("buffer"), expected.pop("buffer")
    ops.indexer_k_quant_and_cache(**args)
    reference.indexer_k_quant_and_cache(**expected)
    assert torch.equal(buffer.cpu(), expected_buffer)
