"""The NVFP4-family KV modes beyond plain NVFP4, bit for bit against the reference: `nvfp4_4over6` stores, and FP8
E4M3 keys with NVFP4 values (an `fp8_keys` page: the same ops, told apart by the caches' shapes).

Plain NVFP4 must not move when a mode is added: its cache bytes are pinned to digests recorded from the ops and the
reference as they were before `nvfp4_4over6` existed.
"""

import hashlib

import pytest
import torch

from op_cases import FLOAT_DTYPES, NVFP4Case, bits, nvfp4_gather_inputs, nvfp4_store_inputs
from vllm_nvfp4_plugin import ops, reference
from vllm_nvfp4_plugin.layout import NVFP4_GROUP, NVFP4PageLayout


def store(case: NVFP4Case, device, op, ref_op):
    args, expected = nvfp4_store_inputs(case, device), nvfp4_store_inputs(case, "cpu")
    buffer, expected_buffer = args.pop("buffer"), expected.pop("buffer")
    op(**args)
    ref_op(**expected)
    return buffer.cpu(), expected_buffer


@pytest.mark.parametrize("hnd", [False, True], ids=["NHD", "HND"])
@pytest.mark.parametrize("swizzle", [False, True], ids=["linear", "swizzled"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("head_size", [64, 128, 256])
def test_4over6_store_matches_reference(device, hnd, swizzle, dtype, head_size):
    seed = head_size + 7 * hnd + 13 * swizzle + 31 * FLOAT_DTYPES.index(dtype)
    case = NVFP4Case(head_size=head_size, num_heads=1 + seed % 4, block_size=16 if seed % 2 else 32, num_blocks=5,
                     num_tokens=60, dtype=dtype, hnd=hnd, swizzle_v_scales=swizzle, row_pad=16 * (seed % 3),
                     block_pad=seed % 2 * 40, seed=seed)
    buffer, expected = store(case, device, ops.reshape_and_cache_nvfp4_4over6,
                             reference.reshape_and_cache_nvfp4_4over6)
    assert torch.equal(buffer, expected)


@pytest.mark.gpu
def test_4over6_large_store_matches_reference():
    num_tokens = 20_000
    case = NVFP4Case(head_size=128, num_heads=8, block_size=16, num_blocks=num_tokens // 16 + 8,
                     num_tokens=num_tokens, hnd=True, swizzle_v_scales=True, row_pad=16, seed=5)
    buffer, expected = store(case, "cuda", ops.reshape_and_cache_nvfp4_4over6,
                             reference.reshape_and_cache_nvfp4_4over6)
    assert torch.equal(buffer, expected)


def test_4over6_errs_no_more_than_nvfp4_per_group():
    x = torch.randn(4096, 128) * torch.rand(4096, 1) * 10
    x[::7, :16] *= 30  # outlier groups
    errors = {}
    for four_over_six in (False, True):
        packed, sf = reference.nvfp4_encode(x, 0.5, four_over_six)
        decoded = reference.nvfp4_decode(packed, sf, 0.5)
        errors[four_over_six] = (decoded - x).square().unflatten(-1, (-1, NVFP4_GROUP)).sum(-1)
    assert (errors[True] <= errors[False]).all()
    assert (errors[True] < errors[False]).float().mean() > 0.2  # max/4 wins on a good share of Gaussian groups


def test_4over6_takes_max_over_4_where_it_is_exact():
    # 4 · {1, 0.75, 0.5, ...}: on the max/4 grid every value is a code; on the max/6 grid 0.75·max = 4.5 is not.
    x = torch.tensor([4.0, 3.0, 2.0, 1.0] * 4).reshape(1, 16)
    packed, sf = reference.nvfp4_encode(x, 1.0, four_over_six=True)
    assert torch.equal(reference.nvfp4_decode(packed, sf, 1.0), x)
    assert sf.float().item() == 1.0  # 4 / 4


# Digests of plain NVFP4 cache buffers, recorded from the ops and the reference before nvfp4_4over6 was added.
PLAIN_NVFP4_DIGESTS = {
    (False, False, torch.bfloat16): "70987b1aca31f746abca5ed567fe92429532caa2e0030c7319977d780626f57f",
    (True, True, torch.float16): "288ac638cd227a8206408d71329bdca41e3f37242b53e56938cdbcae67d610cb",
    (False, True, torch.float32): "b7c673c489f48de5f4e9bcb6ffd012dc684ffe5a276d8278a1397391b1fa7d69",
}


@pytest.mark.parametrize("hnd,swizzle,dtype", list(PLAIN_NVFP4_DIGESTS), ids=str)
def test_plain_nvfp4_bytes_unchanged(device, hnd, swizzle, dtype):
    case = NVFP4Case(head_size=128, num_heads=2, num_tokens=60, dtype=dtype, hnd=hnd, swizzle_v_scales=swizzle,
                     seed=11)
    buffer, expected = store(case, device, ops.reshape_and_cache_nvfp4, reference.reshape_and_cache_nvfp4)
    digest = PLAIN_NVFP4_DIGESTS[(hnd, swizzle, dtype)]
    assert hashlib.sha256(buffer.numpy().tobytes()).hexdigest() == digest
    assert hashlib.sha256(expected.numpy().tobytes()).hexdigest() == digest


def test_4over6_store_names_itself_in_errors():
    case = NVFP4Case(num_tokens=4)
    args = nvfp4_store_inputs(case, "cpu")
    args.pop("buffer")
    args["k_scale"] = args["k_scale"].double()
    with pytest.raises(RuntimeError, match="reshape_and_cache_nvfp4_4over6: k_scale"):
        ops.reshape_and_cache_nvfp4_4over6(**args)


@pytest.mark.vllm
def test_a_sliding_window_that_covers_max_model_len_is_no_window():
    from vllm_nvfp4_plugin.vllm_adapter.common import effective_sliding_window

    assert effective_sliding_window(512, 512) is None  # Gemma 3's local layers at max_model_len 512
    assert effective_sliding_window(512, 256) is None
    assert effective_sliding_window(512, 1024) == 512  # tokens leave the window: a backend must serve windows
    assert effective_sliding_window(512, None) == 512
    assert effective_sliding_window(None, 1024) is None and effective_sliding_window(-1, 1024) is None


# --- FP8 E4M3 keys, NVFP4 values (an fp8_keys page) ----------------------------------------------------

def fp8_key_case(head_size=128, hnd=False, swizzle=False, dtype=torch.bfloat16, seed=0, **kw) -> NVFP4Case:
    return NVFP4Case(head_size=head_size, num_heads=1 + seed % 3, block_size=16 if seed % 2 else 32, num_blocks=5,
                     num_tokens=60, dtype=dtype, hnd=hnd, swizzle_v_scales=swizzle, row_pad=16 * (seed % 3),
                     block_pad=seed % 2 * 40, seed=seed, key_format="fp8", **kw)


def test_fp8_key_page_sizes():
    layout = NVFP4PageLayout(128, 16, 8, key_format="fp8")
    assert (layout.key_dim, layout.full_dim) == (128, 72)
    assert layout.page_bytes == 16 * 8 * (128 + 72)  # 2.56x fewer bytes than bf16's 16 * 8 * 512
    assert NVFP4PageLayout(128, 16, 8).page_bytes == 16 * 8 * 144


@pytest.mark.parametrize("hnd", [False, True], ids=["NHD", "HND"])
@pytest.mark.parametrize("swizzle", [False, True], ids=["linear", "swizzled"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("four_over_six", [False, True], ids=["nvfp4", "4over6"])
def test_fp8_key_store_matches_reference(hnd, swizzle, dtype, four_over_six):
    seed = 7 * hnd + 13 * swizzle + 31 * FLOAT_DTYPES.index(dtype) + four_over_six
    case = fp8_key_case(64 * (1 + seed % 4) if seed % 4 != 2 else 128, hnd, swizzle, dtype, seed)
    op, ref_op = ((ops.reshape_and_cache_nvfp4_4over6, reference.reshape_and_cache_nvfp4_4over6) if four_over_six
                  else (ops.reshape_and_cache_nvfp4, reference.reshape_and_cache_nvfp4))
    buffer, expected = store(case, "cpu", op, ref_op)
    assert torch.equal(buffer, expected)  # guard pages, block padding and unused slots included


@pytest.mark.parametrize("hnd", [False, True], ids=["NHD", "HND"])
@pytest.mark.parametrize("swizzle", [False, True], ids=["linear", "swizzled"])
def test_fp8_key_gather_matches_reference(hnd, swizzle):
    seed = 3 + 2 * hnd + swizzle
    case = fp8_key_case(128, hnd, swizzle, FLOAT_DTYPES[seed % 3], seed)
    args, expected = (nvfp4_gather_inputs(case, [50, 0, 17, 33], "cpu") for _ in range(2))
    ops.gather_nvfp4_kv_cache(**args)
    reference.gather_nvfp4_kv_cache(**expected)
    for name in ("out_key", "out_value"):
        assert torch.equal(bits(args[name]), bits(expected[name]))
        assert (args[name][100:] == 12345.0).all()  # rows past cu_seq_lens[-1] untouched


def test_fp8_keys_round_trip_ten_times_closer_than_nvfp4():
    g = torch.Generator().manual_seed(1)
    key = torch.randn(64, 2, 128, generator=g)
    key[..., 5] *= 40  # an outlier channel, as real models' keys have
    errors = {}
    for key_format in ("nvfp4", "fp8"):
        layout = NVFP4PageLayout(128, 16, 2, key_format=key_format)
        key_cache, value_cache = layout.allocate_sides(4, fill=0)
        scale = torch.ones(1)
        ops.reshape_and_cache_nvfp4(key, key, key_cache, value_cache, torch.arange(64), scale, scale, False)
        out = torch.empty_like(key), torch.empty_like(key)
        ops.gather_nvfp4_kv_cache(key_cache, value_cache, torch.arange(4, dtype=torch.int32).view(1, 4),
                                  torch.tensor([0, 64], dtype=torch.int32), scale, scale, False, *out)
        errors[key_format] = ((out[0] - key).norm() / key.norm()).item()
        assert torch.equal(out[1], reference_nvfp4(key))  # values stay NVFP4
    assert errors["fp8"] < 0.03 and errors["fp8"] * 3 < errors["nvfp4"]


def reference_nvfp4(x):
    packed, sf = reference.nvfp4_encode(x, 1.0)
    return reference.nvfp4_decode(packed, sf, 1.0)


@pytest.mark.parametrize("change,message", [
    (lambda k, v: (k[..., :100], v),
     r"key_cache: last dim 100 is not head_size/2 \+ head_size/16 .* or value_cache's head size \(FP8 keys\)"),
    (lambda k, v: (k[:3], v), r"key_cache: FP8 keys must have value_cache's blocks"),
    (lambda k, v: (k.transpose(1, 2).contiguous().transpose(1, 2), v),
     r"key_cache: FP8 key block sides must be contiguous"),
], ids=["key_dim", "key_blocks", "key_strides"])
def test_fp8_key_cache_bad_input(change, message):
    args = nvfp4_store_inputs(fp8_key_case(seed=4), "cpu")
    args.pop("buffer")
    args["key_cache"], args["value_cache"] = change(args["key_cache"], args["value_cache"])
    with pytest.raises(RuntimeError, match=message):
        ops.reshape_and_cache_nvfp4(**args)


def test_fp8_key_layout_bad_input():
    key_cache, value_cache = NVFP4PageLayout(128, 16, 2, key_format="fp8").allocate_sides(3)
    with pytest.raises(ValueError, match=r"key_cache must have value_cache's shape .* \(FP8 keys\)"):
        NVFP4PageLayout.from_caches(key_cache[..., :100], value_cache)
    with pytest.raises(ValueError, match=r"key_cache must hold contiguous FP8 block sides"):
        NVFP4PageLayout.from_caches(key_cache.transpose(1, 2).contiguous().transpose(1, 2), value_cache)
    assert NVFP4PageLayout.from_caches(key_cache, value_cache).fp8_keys


@pytest.mark.gpu
@pytest.mark.parametrize("hnd", [False, True], ids=["NHD", "HND"])
@pytest.mark.parametrize("swizzle", [False, True], ids=["linear", "swizzled"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_fp8_key_cuda_ops_match_reference(hnd, swizzle, dtype):
    """The CUDA store (both value rules) and gather of an fp8_keys page, bit for bit; guard pages untouched."""
    seed = 7 * hnd + 13 * swizzle + 31 * FLOAT_DTYPES.index(dtype)
    for i, (op, ref_op) in enumerate(((ops.reshape_and_cache_nvfp4, reference.reshape_and_cache_nvfp4),
                                      (ops.reshape_and_cache_nvfp4_4over6, reference.reshape_and_cache_nvfp4_4over6))):
        case = fp8_key_case(64 * (1 + (seed + i) % 4) if (seed + i) % 4 != 2 else 128, hnd, swizzle, dtype, seed + i)
        buffer, expected = store(case, "cuda", op, ref_op)
        assert torch.equal(buffer, expected)
    case = fp8_key_case((64, 128, 256)[seed % 3], hnd, swizzle, dtype, seed)
    args, expected = nvfp4_gather_inputs(case, [50, 0, 17, 33], "cuda"), nvfp4_gather_inputs(case, [50, 0, 17, 33], "cpu")
    ops.gather_nvfp4_kv_cache(**args)
    reference.gather_nvfp4_kv_cache(**expected)
    for name in ("out_key", "out_value"):
        assert torch.equal(bits(args[name].cpu()), bits(expected[name]))
