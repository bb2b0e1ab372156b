"""INT8 keys with NVFP4 values (an int8-key page, docs/FORMATS.md §1): the encoding's rules, the CPU and CUDA stores and
gathers bit for bit against the reference (every layout, V-scale order, dtype and value store rule; guard pages, block
padding and unused slots poisoned), the page's errors, layout.h against layout.py, and the CPU attention kernel over
the page (the CUDA one: test_paged_attention_cuda.py).
"""

import os
import subprocess

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from op_cases import FLOAT_DTYPES, NVFP4Case, bits, nvfp4_gather_inputs, nvfp4_store_inputs
from test_kv_modes import store
from test_paged_attention_cpu import MIXED, Case, outliers, saturated, tiny, zero_groups
from vllm_nvfp4_plugin import ops, reference
from vllm_nvfp4_plugin.layout import NVFP4PageLayout

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def int8_key_case(head_size=128, hnd=False, swizzle=False, dtype=torch.bfloat16, seed=0, **kw) -> NVFP4Case:
    return NVFP4Case(head_size=head_size, num_heads=1 + seed % 3, block_size=16 if seed % 2 else 32, num_blocks=5,
                     num_tokens=60, dtype=dtype, hnd=hnd, swizzle_v_scales=swizzle, row_pad=16 * (seed % 3),
                     block_pad=seed % 2 * 40, seed=seed, key_format="int8", **kw)


def test_int8_key_page_sizes():
    layout = NVFP4PageLayout(64, 16, 3, key_format="int8")
    assert (layout.key_dim, layout.full_dim) == (66, 36)
    assert layout.page_bytes == 16 * 3 * (66 + 36)  # 256 / 102 = 2.51x fewer bytes than bf16
    assert layout.int8_key_scale_offset(0, 0) == 16 * 3 * 64 and layout.int8_key_scale_offset(1, 2) == 16 * 3 * 64 + 10
    hnd = NVFP4PageLayout(64, 16, 3, hnd=True, key_format="int8")
    assert hnd.int8_key_offset(1, 2) == (2 * 16 + 1) * 64 and hnd.int8_key_scale_offset(1, 2) == 16 * 3 * 64 + 66
    with pytest.raises(ValueError, match="key_format must be one of"):
        NVFP4PageLayout(64, 16, 3, key_format="int4")


def encode(row):
    codes, scale = reference.int8_key_encode(torch.tensor([row], dtype=torch.float32), 1.0)
    return codes.view(torch.int8)[0].tolist(), int(scale[0, 0]) | int(scale[0, 1]) << 8


def test_int8_key_encoding_rules():
    # amax 127: scale fp16(1.0); codes round half to even
    codes, scale = encode([127.0, 2.5, -3.5, 0.5] + [0.0] * 12)
    assert scale == 0x3C00 and codes[:4] == [127, 2, -4, 0]
    assert encode([0.0] * 8 + [-0.0] * 8) == ([0] * 16, 0)  # all zero: scale 0, codes 0
    # NaN: the fp16 NaN 0x7E00 and all-zero codes; inf: the scale saturates at 65504, the code at 127
    assert encode([1.0, float("nan")] + [3.0] * 14) == ([0] * 16, 0x7E00)
    codes, scale = encode([float("-inf"), 1e9, 1.0] + [0.0] * 13)
    assert scale == 0x7BFF and codes[:3] == [-127, 127, 0]
    codes, scale = encode([1e-4] + [0.0] * 15)  # a subnormal fp16 scale (its rounding moves the code off 127)
    assert 0 < scale < 0x0400 and 120 <= codes[0] <= 127
    assert encode([1e-7] + [0.0] * 15) == ([0] * 16, 0)  # a scale below fp16's smallest subnormal: 0
    codes, scale = reference.int8_key_encode(torch.tensor([[1.0, float("nan")] + [0.0] * 14]), 1.0)
    assert reference.int8_key_decode(codes, scale, 1.0).isnan().all()


def test_int8_keys_nan_and_inf_through_the_ops(device):
    """A NaN key stores the NaN scale and zero codes, an inf one saturates, a zero one stores scale 0; each gathers
    back as the reference's (NaN bit patterns aside: CUDA's float NaN is another than the CPU's)."""
    layout = NVFP4PageLayout(64, 4, 1, key_format="int8")
    key = torch.randn(4, 1, 64)
    key[0, 0, 3], key[1, 0, 5], key[2, 0] = float("nan"), float("inf"), 0.0
    value = torch.randn(4, 1, 64)  # finite: an NVFP4 group's NaN sign after an inf is the machine's (test_ops_cpu)
    caches, expected = layout.allocate_sides(1, device, fill=0x5A), layout.allocate_sides(1, fill=0x5A)
    one = torch.ones(1)
    ops.reshape_and_cache_nvfp4(key.to(device), value.to(device), *caches, torch.arange(4, device=device),
                                one.to(device), one.to(device), False)
    reference.reshape_and_cache_nvfp4(key, value, *expected, torch.arange(4), one, one, False)
    assert all(torch.equal(a.cpu(), b) for a, b in zip(caches, expected))
    out, ref_out = (torch.empty(4, 1, 64, device=device), torch.empty(4, 1, 64, device=device)), \
        (torch.empty(4, 1, 64), torch.empty(4, 1, 64))
    table, cu = torch.zeros(1, 1, dtype=torch.int32), torch.tensor([0, 4], dtype=torch.int32)
    ops.gather_nvfp4_kv_cache(*caches, table.to(device), cu.to(device), one.to(device), one.to(device), False, *out)
    reference.gather_nvfp4_kv_cache(*expected, table, cu, one, one, False, *ref_out)
    got, want = out[0].cpu(), ref_out[0]
    if device == "cpu":  # the CPU kernel's NaN is the reference's
        assert torch.equal(bits(got), bits(want))
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(bits(got[~got.isnan()]), bits(want[~want.isnan()]))
    assert got[0].isnan().all() and (got[2] == 0).all() and got[1, 0, 5] == 127 * 65504


@pytest.mark.parametrize("hnd", [False, True], ids=["NHD", "HND"])
@pytest.mark.parametrize("swizzle", [False, True], ids=["linear", "swizzled"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("four_over_six", [False, True], ids=["nvfp4", "4over6"])
def test_int8_key_store_matches_reference(hnd, swizzle, dtype, four_over_six):
    seed = 7 * hnd + 13 * swizzle + 31 * FLOAT_DTYPES.index(dtype) + four_over_six
    case = int8_key_case(64 * (1 + seed % 4) if seed % 4 != 2 else 128, hnd, swizzle, dtype, seed)
    op, ref_op = ((ops.reshape_and_cache_nvfp4_4over6, reference.reshape_and_cache_nvfp4_4over6) if four_over_six
                  else (ops.reshape_and_cache_nvfp4, reference.reshape_and_cache_nvfp4))
    buffer, expected = store(case, "cpu", op, ref_op)
    assert torch.equal(buffer, expected)  # guard pages, block padding and unused slots included


@pytest.mark.parametrize("hnd", [False, True], ids=["NHD", "HND"])
@pytest.mark.parametrize("swizzle", [False, True], ids=["linear", "swizzled"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_int8_key_gather_matches_reference(hnd, swizzle, dtype):
    seed = 3 + 2 * hnd + swizzle + 5 * FLOAT_DTYPES.index(dtype)
    case = int8_key_case(128, hnd, swizzle, dtype, seed)
    args, expected = (nvfp4_gather_inputs(case, [50, 0, 17, 33], "cpu") for _ in range(2))
    ops.gather_nvfp4_kv_cache(**args)
    reference.gather_nvfp4_kv_cache(**expected)
    for name in ("out_key", "out_value"):
        assert torch.equal(bits(args[name]), bits(expected[name]))
        assert (args[name][100:] == 12345.0).all()  # rows past cu_seq_lens[-1] untouched


@st.composite
def int8_key_cases(draw) -> NVFP4Case:
    swizzle = draw(st.booleans())
    head_size = draw(st.sampled_from([64, 128, 192, 256] if swizzle else [16, 32, 48, 64, 80, 128, 256]))
    block_size = draw(st.integers(1, 8).map(lambda b: 4 * b) if swizzle else st.integers(2, 33))
    num_blocks = draw(st.integers(1, 4))
    return NVFP4Case(head_size=head_size, num_heads=draw(st.integers(1, 4)), block_size=block_size,
                     num_blocks=num_blocks, num_tokens=draw(st.integers(0, min(num_blocks * block_size, 24))),
                     dtype=draw(st.sampled_from(FLOAT_DTYPES)), hnd=draw(st.booleans()), swizzle_v_scales=swizzle,
                     row_pad=draw(st.sampled_from([0, 16, 48])), block_pad=draw(st.sampled_from([0, 8, 100])),
                     negative_slots=draw(st.sampled_from([0.0, 0.1, 0.5])), seed=draw(st.integers(0, 2**20)),
                     key_format="int8")


# `device` is a constant string per test, so reusing the fixture across examples is safe.
FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@FUZZ
@given(case=int8_key_cases(), four_over_six=st.booleans())
def test_fuzz_int8_key_store(device, case, four_over_six):
    op, ref_op = ((ops.reshape_and_cache_nvfp4_4over6, reference.reshape_and_cache_nvfp4_4over6) if four_over_six
                  else (ops.reshape_and_cache_nvfp4, reference.reshape_and_cache_nvfp4))
    buffer, expected = store(case, device, op, ref_op)
    assert torch.equal(buffer, expected)


@FUZZ
@given(case=int8_key_cases(), data=st.data(), out_dtype=st.sampled_from(FLOAT_DTYPES))
def test_fuzz_int8_key_gather(device, case, data, out_dtype):
    capacity = case.num_blocks * case.block_size
    seq_lens = data.draw(st.lists(st.integers(0, capacity), min_size=1, max_size=8))
    args, expected = nvfp4_gather_inputs(case, seq_lens, device, out_dtype), nvfp4_gather_inputs(case, seq_lens, "cpu",
                                                                                                 out_dtype)
    ops.gather_nvfp4_kv_cache(**args)
    reference.gather_nvfp4_kv_cache(**expected)
    for name in ("out_key", "out_value"):
        assert torch.equal(bits(args[name].cpu()), bits(expected[name]))


@pytest.mark.parametrize("change,message", [
    (lambda k, v: (k[..., :100], v),
     r"key_cache: last dim 100 is not head_size/2 \+ head_size/16 .* or head size \+ 2 \(INT8 keys\)"),
    (lambda k, v: (k[:3], v), r"key_cache: INT8 keys must have value_cache's blocks"),
    (lambda k, v: (k.transpose(1, 2).contiguous().transpose(1, 2), v),
     r"key_cache: INT8 key block sides must be contiguous"),
], ids=["key_dim", "key_blocks", "key_strides"])
def test_int8_key_cache_bad_input(change, message):
    args = nvfp4_store_inputs(int8_key_case(seed=4), "cpu")
    args.pop("buffer")
    args["key_cache"], args["value_cache"] = change(args["key_cache"], args["value_cache"])
    with pytest.raises(RuntimeError, match=message):
        ops.reshape_and_cache_nvfp4(**args)


def test_int8_key_layout_bad_input():
    key_cache, value_cache = NVFP4PageLayout(128, 16, 2, key_format="int8").allocate_sides(3)
    with pytest.raises(ValueError, match=r"key_cache must have value_cache's shape .* \(INT8 keys\)"):
        NVFP4PageLayout.from_caches(key_cache[..., :129], value_cache)
    with pytest.raises(ValueError, match=r"key_cache must hold contiguous INT8 block sides"):
        NVFP4PageLayout.from_caches(key_cache.transpose(1, 2).contiguous().transpose(1, 2), value_cache)
    assert NVFP4PageLayout.from_caches(key_cache, value_cache).int8_keys


def test_int8_keys_round_trip_closer_than_fp8_keys_on_gaussian_keys():
    g = torch.Generator().manual_seed(1)
    key = torch.randn(64, 2, 128, generator=g)  # an outlier channel would take the token's scale: FP8 keys err less
    errors = {}
    for key_format in ("fp8", "int8"):
        layout = NVFP4PageLayout(128, 16, 2, key_format=key_format)
        caches, scale = layout.allocate_sides(4, fill=0), torch.ones(1)
        ops.reshape_and_cache_nvfp4(key, key, *caches, torch.arange(64), scale, scale, False)
        out = torch.empty_like(key), torch.empty_like(key)
        ops.gather_nvfp4_kv_cache(*caches, torch.arange(4, dtype=torch.int32).view(1, 4),
                                  torch.tensor([0, 64], dtype=torch.int32), scale, scale, False, *out)
        errors[key_format] = ((out[0] - key).norm() / key.norm()).item()
    assert errors["int8"] * 2 < errors["fp8"]


LAYOUT_PROGRAM = r"""
#include <cstdio>
#include "layout.h"
using namespace vllm_nvfp4;
int main() {
  for (int hnd = 0; hnd < 2; ++hnd)
    for (int f = 0; f < 3; ++f) {
      const NVFP4PageLayout l{64, 16, 3, hnd != 0, false, static_cast<KeyFormat>(f)};
      std::printf("%lld %lld %lld %lld %lld %lld\n", (long long)l.key_dim(), (long long)l.key_side_bytes(),
                  (long long)l.page_bytes(), (long long)l.int8_key_offset(5, 2), (long long)l.int8_key_scale_offset(5, 2),
                  (long long)l.fp8_key_offset(7, 1));
    }
}
"""


def test_layout_h_matches_layout_py(tmp_path):
    """csrc/layout.h's key formats, sizes and key offsets equal layout.py's."""
    source, exe = tmp_path / "layout.cpp", tmp_path / "layout"
    source.write_text(LAYOUT_PROGRAM)
    subprocess.run(["c++", "-std=c++17", f"-I{os.path.join(ROOT, 'csrc')}", str(source), "-o", str(exe)], check=True)
    lines = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split("\n")
    expected = []
    for hnd in (False, True):
        for key_format in ("nvfp4", "fp8", "int8"):  # KeyFormat's order
            l = NVFP4PageLayout(64, 16, 3, hnd, key_format=key_format)
            expected.append(f"{l.key_dim} {l.key_side_bytes} {l.page_bytes} {l.int8_key_offset(5, 2)} "
                            f"{l.int8_key_scale_offset(5, 2)} {l.fp8_key_offset(7, 1)}")
    assert lines[:6] == expected


@pytest.mark.gpu
@pytest.mark.parametrize("hnd", [False, True], ids=["NHD", "HND"])
@pytest.mark.parametrize("swizzle", [False, True], ids=["linear", "swizzled"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_int8_key_cuda_ops_match_reference(hnd, swizzle, dtype):
    """The CUDA store (both value rules) and gather of an int8-key page, bit for bit; guard pages untouched."""
    seed = 7 * hnd + 13 * swizzle + 31 * FLOAT_DTYPES.index(dtype)
    for i, (op, ref_op) in enumerate(((ops.reshape_and_cache_nvfp4, reference.reshape_and_cache_nvfp4),
                                      (ops.reshape_and_cache_nvfp4_4over6, reference.reshape_and_cache_nvfp4_4over6))):
        case = int8_key_case(64 * (1 + (seed + i) % 4) if (seed + i) % 4 != 2 else 128, hnd, swizzle, dtype, seed + i)
        buffer, expected = store(case, "cuda", op, ref_op)
        assert torch.equal(buffer, expected)
    case = int8_key_case((64, 128, 256)[seed % 3], hnd, swizzle, dtype, seed)
    args, expected = nvfp4_gather_inputs(case, [50, 0, 17, 33], "cuda"), nvfp4_gather_inputs(case, [50, 0, 17, 33], "cpu")
    ops.gather_nvfp4_kv_cache(**args)
    reference.gather_nvfp4_kv_cache(**expected)
    for name in ("out_key", "out_value"):
        assert torch.equal(bits(args[name].cpu()), bits(expected[name]))  # poisoned rows past the tokens included


# --- attention over the page -----------------------------------------------------------------------------------

@pytest.mark.parametrize("head_size", [64, 128, 256])
@pytest.mark.parametrize("hnd", [False, True], ids=["NHD", "HND"])
@pytest.mark.parametrize("group", [1, 3, 8])
def test_int8_keys_mixed_batch(head_size, hnd, group):
    case = Case(MIXED, head_size=head_size, hnd=hnd, swizzle=hnd, group=group, seed=head_size + group,
                key_format="int8")
    case.check(case.run())


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_int8_keys_query_dtypes(dtype):
    case = Case(MIXED, dtype=dtype, seed=4, key_format="int8")
    case.check(case.run(), 1e-5 if dtype == torch.float32 else 1e-3)


@pytest.mark.parametrize("shape_kv", [outliers, zero_groups, saturated, tiny], ids=lambda f: f.__name__)
def test_int8_keys_adversarial_values(shape_kv):
    case = Case(MIXED, shape_kv=shape_kv, seed=5, key_format="int8", k_scale=2.0 if shape_kv is saturated else 0.75)
    case.check(case.run())


def test_int8_keys_with_model_features():
    case = Case(MIXED, window=45, soft_cap=3.0, sinks=True, dtype=torch.float16, seed=8, key_format="int8")
    case.check(case.run())
