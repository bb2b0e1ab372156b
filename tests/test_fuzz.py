"""Hypothesis fuzzing of the ops against the reference over shapes, layouts, dtypes and scales.

Small shapes keep each example in milliseconds, so the four tests run a few thousand cases in CI. An
example whose inputs have no token to write or gather checks that the op leaves its outputs untouched.
"""

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from op_cases import (FLOAT_DTYPES, IndexerCase, NVFP4Case, bits, indexer_gather_inputs, indexer_store_inputs,
                      nvfp4_gather_inputs, nvfp4_store_inputs)
from vllm_nvfp4_plugin import ops, reference

# `device` is a constant string per test, so reusing the fixture across examples is safe.
FUZZ = settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@st.composite
def nvfp4_cases(draw) -> NVFP4Case:
    swizzle = draw(st.booleans())
    head_size = draw(st.sampled_from([64, 128, 192, 256] if swizzle else [16, 32, 48, 64, 80, 128, 256]))
    block_size = draw(st.integers(1, 8).map(lambda b: 4 * b) if swizzle else st.integers(2, 33))
    num_blocks = draw(st.integers(1, 4))
    return NVFP4Case(head_size=head_size, num_heads=draw(st.integers(1, 4)), block_size=block_size,
                     num_blocks=num_blocks, num_tokens=draw(st.integers(0, min(num_blocks * block_size, 24))),
                     dtype=draw(st.sampled_from(FLOAT_DTYPES)), hnd=draw(st.booleans()), swizzle_v_scales=swizzle,
                     row_pad=draw(st.sampled_from([0, 16, 48])), block_pad=draw(st.sampled_from([0, 8, 100])),
                     negative_slots=draw(st.sampled_from([0.0, 0.1, 0.5])), seed=draw(st.integers(0, 2**20)))


@st.composite
def indexer_cases(draw) -> IndexerCase:
    quant_block_size = draw(st.sampled_from([16, 32, 64, 128]))
    block_size = draw(st.integers(1, 20))
    num_blocks = draw(st.integers(1, 4))
    return IndexerCase(head_dim=quant_block_size * draw(st.integers(1, 4)), quant_block_size=quant_block_size,
                       block_size=block_size, num_blocks=num_blocks,
                       num_tokens=draw(st.integers(0, min(num_blocks * block_size, 24))),
                       dtype=draw(st.sampled_from(FLOAT_DTYPES)), block_pad=draw(st.sampled_from([0, 4, 37])),
                       negative_slots=draw(st.sampled_from([0.0, 0.1, 0.5])), seed=draw(st.integers(0, 2**20)))


def seq_lens_for(draw, capacity: int) -> list[int]:
    return draw(st.lists(st.integers(0, capacity), min_size=1, max_size=8))


@FUZZ
@given(case=nvfp4_cases())
def test_fuzz_store(device, case):
    args, expected = nvfp4_store_inputs(case, device), nvfp4_store_inputs(case, "cpu")
    buffer, expected_buffer = args.pop("buffer"), expected.pop("buffer")
    ops.reshape_and_cache_nvfp4(**args)
    reference.reshape_and_cache_nvfp4(**expected)
    assert torch.equal(buffer.cpu(), expected_buffer)


@FUZZ
@given(case=nvfp4_cases(), data=st.data(), out_dtype=st.sampled_from(FLOAT_DTYPES))
def test_fuzz_gather(device, case, data, out_dtype):
    seq_lens = seq_lens_for(data.draw, case.num_blocks * case.block_size)
    args = nvfp4_gather_inputs(case, seq_lens, device, out_dtype)
    expected = nvfp4_gather_inputs(case, seq_lens, "cpu", out_dtype)
    ops.gather_nvfp4_kv_cache(**args)
    reference.gather_nvfp4_kv_cache(**expected)
    assert torch.equal(bits(args["out_key"].cpu()), bits(expected["out_key"]))
    assert torch.equal(bits(args["out_value"].cpu()), bits(expected["out_value"]))


@FUZZ
@given(case=indexer_cases(), scale_fmt=st.sampled_from(["", "ue8m0", "mxfp8"]))
def test_fuzz_indexer_store(device, case, scale_fmt):
    args, expected = indexer_store_inputs(case, scale_fmt, device), indexer_store_inputs(case, scale_fmt, "cpu")
    buffer, expected_buffer = args.pop("buffer"), expected.pop("buffer")
    ops.indexer_k_quant_and_cache(**args)
    reference.indexer_k_quant_and_cache(**expected)
    assert torch.equal(buffer.cpu(), expected_buffer)


@FUZZ
@given(case=indexer_cases(), data=st.data(), float_scales=st.booleans(), fp8_k=st.booleans())
def test_fuzz_indexer_gather(device, case, data, float_scales, fp8_k):
    seq_lens = seq_lens_for(data.draw, case.num_blocks * case.block_size)
    args = indexer_gather_inputs(case, seq_lens, device, float_scales, fp8_k)
    expected = indexer_gather_inputs(case, seq_lens, "cpu", float_scales, fp8_k)
    ops.cp_gather_indexer_k_quant_cache(**args)
    reference.cp_gather_indexer_k_quant_cache(**expected)
    for name in ("dst_k", "dst_scale"):
        assert torch.equal(bits(args[name].cpu()), bits(expected[name]))
