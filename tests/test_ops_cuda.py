"""CUDA-only cases: stores over many waves of thread blocks, bit for bit against the reference.

The shared op tests (test_ops_cpu.py, run on CUDA too) use at most a few hundred tokens, one wave of blocks;
these launch grids of thousands of blocks with random slots, as a prefill does, over NVFP4, fp8_keys and int8-key pages. The shared indexer cases pad
their blocks off 16-byte alignment (the byte path); the last test here keeps them aligned, so every scale format
and thread width runs the vector kernels.
"""

import pytest
import torch

from op_cases import IndexerCase, NVFP4Case, bits, indexer_store_inputs, nvfp4_gather_inputs, nvfp4_store_inputs
from vllm_nvfp4_plugin import ops, reference

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("hnd,swizzle", [(False, False), (True, True)], ids=["NHD-linear", "HND-swizzled"])
def test_large_nvfp4_store_matches_reference(hnd, swizzle):
    num_tokens = 40_000
    case = NVFP4Case(head_size=128, num_heads=8, block_size=16, num_blocks=num_tokens // 16 + 8,
                     num_tokens=num_tokens, hnd=hnd, swizzle_v_scales=swizzle, row_pad=16, seed=9)
    args, expected = nvfp4_store_inputs(case, "cuda"), nvfp4_store_inputs(case, "cpu")
    buffer, expected_buffer = args.pop("buffer"), expected.pop("buffer")
    ops.reshape_and_cache_nvfp4(**args)
    reference.reshape_and_cache_nvfp4(**expected)
    assert torch.equal(buffer.cpu(), expected_buffer)


BYTE_KEYS = pytest.mark.parametrize("key_format", ["fp8", "int8"])


@BYTE_KEYS
@pytest.mark.parametrize("hnd,swizzle,four_over_six", [(False, False, False), (True, True, False), (False, True, True)],
                         ids=["NHD-linear", "HND-swizzled", "NHD-swizzled-4over6"])
def test_large_byte_key_store_matches_reference(key_format, hnd, swizzle, four_over_six):
    """fp8_keys and int8-key pages: FP8 E4M3 or INT8 keys, NVFP4 values; block padding keeps K and V sides off 16-byte
    boundaries."""
    num_tokens = 20_000
    case = NVFP4Case(head_size=128, num_heads=8, block_size=16, num_blocks=num_tokens // 16 + 8,
                     num_tokens=num_tokens, hnd=hnd, swizzle_v_scales=swizzle, row_pad=16, block_pad=8 * hnd, seed=10,
                     key_format=key_format)
    op, ref_op = ((ops.reshape_and_cache_nvfp4_4over6, reference.reshape_and_cache_nvfp4_4over6) if four_over_six
                  else (ops.reshape_and_cache_nvfp4, reference.reshape_and_cache_nvfp4))
    args, expected = nvfp4_store_inputs(case, "cuda"), nvfp4_store_inputs(case, "cpu")
    buffer, expected_buffer = args.pop("buffer"), expected.pop("buffer")
    op(**args)
    ref_op(**expected)
    assert torch.equal(buffer.cpu(), expected_buffer)


@BYTE_KEYS
@pytest.mark.parametrize("head_size,hnd,swizzle", [(64, False, False), (128, True, True), (256, False, True)])
def test_large_byte_key_gather_matches_reference(key_format, head_size, hnd, swizzle):
    case = NVFP4Case(head_size=head_size, num_heads=4, block_size=16, num_blocks=600, hnd=hnd,
                     swizzle_v_scales=swizzle, seed=head_size, key_format=key_format)
    seq_lens = [3000, 1, 0, 2500, 17]
    args, expected = nvfp4_gather_inputs(case, seq_lens, "cuda"), nvfp4_gather_inputs(case, seq_lens, "cpu")
    ops.gather_nvfp4_kv_cache(**args)
    reference.gather_nvfp4_kv_cache(**expected)
    for name in ("out_key", "out_value"):
        assert torch.equal(bits(args[name].cpu()), bits(expected[name]))  # poisoned rows past the tokens included


@pytest.mark.parametrize("scale_fmt", ["", "ue8m0"])
def test_large_indexer_store_matches_reference(scale_fmt):
    num_tokens = 140_000
    case = IndexerCase(num_tokens=num_tokens, block_size=64, num_blocks=num_tokens // 64 + 4, seed=3)
    args, expected = indexer_store_inputs(case, scale_fmt, "cuda"), indexer_store_inputs(case, scale_fmt, "cpu")
    buffer, expected_buffer = args.pop("buffer"), expected.pop("buffer")
    ops.indexer_k_quant_and_cache(**args)
    reference.indexer_k_quant_and_cache(**expected)
    assert torch.equal(buffer.cpu(), expected_buffer)


@pytest.mark.parametrize("scale_fmt", ["", "ue8m0", "mxfp8"])
@pytest.mark.parametrize("quant_block_size", [128, 32, 8])  # 16 elements a thread (one 16-byte store), 16, 8
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_aligned_indexer_store_matches_reference(scale_fmt, quant_block_size, dtype):
    case = IndexerCase(quant_block_size=quant_block_size, num_tokens=8_000, num_blocks=8_000 // 64 + 4, dtype=dtype,
                       seed=quant_block_size)
    args, expected = indexer_store_inputs(case, scale_fmt, "cuda"), indexer_store_inputs(case, scale_fmt, "cpu")
    cache = args["kv_cache"]
    assert cache.data_ptr() % 16 == 0 and cache.stride(0) % 16 == 0, "the case must take the vector path"
    buffer, expected_buffer = args.pop("buffer"), expected.pop("buffer")
    ops.indexer_k_quant_and_cache(**args)
    reference.indexer_k_quant_and_cache(**expected)
    assert torch.equal(buffer.cpu(), expected_buffer)
