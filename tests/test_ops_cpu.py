"""The compiled ops against the plain-torch reference, bit for bit, on every device under test.

The reference computes every offset with vllm_nvfp4_plugin/layout.py and the kernels with csrc/layout.h,
so byte equality over NHD and HND, linear and swizzled V scales, is also the proof that the two agree.
"""

import os
import platform
import subprocess
import sys

import pytest
import torch

from op_cases import (FLOAT_DTYPES, IndexerCase, NVFP4Case, bits, indexer_cache, indexer_gather_inputs,
                      indexer_store_inputs, nvfp4_cache, nvfp4_gather_inputs, nvfp4_store_inputs)
from vllm_nvfp4_plugin import ops, reference
from vllm_nvfp4_plugin.layout import NVFP4PageLayout

LAYOUTS = pytest.mark.parametrize("hnd", [False, True], ids=["NHD", "HND"])
V_SCALES = pytest.mark.parametrize("swizzle", [False, True], ids=["linear", "swizzled"])
DTYPES = pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)


def run_store(case: NVFP4Case, device, fill=0xA5):
    """(op's cache buffer, reference's cache buffer, the reference's arguments)."""
    args, expected = nvfp4_store_inputs(case, device, fill), nvfp4_store_inputs(case, "cpu", fill)
    buffer, expected_buffer = args.pop("buffer"), expected.pop("buffer")
    ops.reshape_and_cache_nvfp4(**args)
    reference.reshape_and_cache_nvfp4(**expected)
    return buffer.cpu(), expected_buffer, expected


# --- NVFP4 store ----------------------------------------------------------------------------------

@LAYOUTS
@V_SCALES
@DTYPES
@pytest.mark.parametrize("head_size", [64, 128, 256])
def test_store_matches_reference(device, hnd, swizzle, dtype, head_size):
    seed = head_size + 7 * hnd + 13 * swizzle + 31 * FLOAT_DTYPES.index(dtype)  # varies the other parameters
    case = NVFP4Case(head_size=head_size, num_heads=1 + seed % 4, block_size=16 if seed % 2 else 32,
                     num_blocks=5, num_tokens=60, dtype=dtype, hnd=hnd, swizzle_v_scales=swizzle,
                     row_pad=16 * (seed % 3), block_pad=seed % 2 * 40, seed=seed)
    buffer, expected, _ = run_store(case, device)
    assert torch.equal(buffer, expected)


@pytest.mark.parametrize("block_size,num_heads", [(2, 3), (5, 1), (7, 2), (12, 4)])
def test_store_matches_reference_odd_blocks(device, block_size, num_heads):
    for hnd in (False, True):
        case = NVFP4Case(head_size=48, num_heads=num_heads, block_size=block_size, num_blocks=40 // block_size + 2,
                         num_tokens=30,
                         hnd=hnd, dtype=torch.float16, seed=block_size)
        buffer, expected, _ = run_store(case, device)
        assert torch.equal(buffer, expected)


@DTYPES
def test_store_negative_global_scales(device, dtype):
    """Negative global scales give negative block scales (tiny groups -0), whose factor 1 / (SF · global) is only 0
    where SF is zero, as in the reference (the CPU kernels once zeroed it for every negative SF)."""
    case = NVFP4Case(head_size=128, num_heads=2, block_size=16, num_blocks=5, num_tokens=60, dtype=dtype, seed=3)
    args, expected = nvfp4_store_inputs(case, device, 0xA5), nvfp4_store_inputs(case, "cpu", 0xA5)
    for kwargs in (args, expected):
        kwargs["k_scale"], kwargs["v_scale"] = -kwargs["k_scale"].abs(), -kwargs["v_scale"].abs()
    buffer, expected_buffer = args.pop("buffer"), expected.pop("buffer")
    ops.reshape_and_cache_nvfp4(**args)
    reference.reshape_and_cache_nvfp4(**expected)
    assert torch.equal(buffer.cpu(), expected_buffer)


def allowed_store_bytes(case: NVFP4Case, slot_mapping: torch.Tensor) -> torch.Tensor:
    """Mask of the cache buffer's bytes the store may write: data and scales of the valid slots' entries."""
    layout = case.layout
    buffer, _ = nvfp4_cache(case, "cpu", 0)
    mask = torch.zeros(buffer.numel(), dtype=torch.bool)
    page_stride = layout.page_bytes + case.block_pad
    for slot in slot_mapping.tolist():
        if slot < 0:
            continue
        block, offset = divmod(slot, case.block_size)
        for side, swizzled in ((0, False), (1, case.swizzle_v_scales)):
            base = (block + 1) * page_stride + side * layout.side_bytes  # +1: the leading guard page
            for h in range(case.num_heads):
                start = base + layout.data_offset(offset, h)
                mask[start:start + layout.data_dim] = True
                for s in range(layout.scale_dim):
                    mask[base + layout.scale_offset(offset, h, s, swizzled)] = True
    return mask


@LAYOUTS
@V_SCALES
def test_store_writes_only_target_slots(device, hnd, swizzle):
    case = NVFP4Case(head_size=64, num_heads=3, block_size=8, num_blocks=4, num_tokens=20, hnd=hnd,
                     swizzle_v_scales=swizzle, block_pad=24, negative_slots=0.3, seed=3)
    zeros, expected, args = run_store(case, device, fill=0x00)
    ones, _, _ = run_store(case, device, fill=0xFF)
    mask = allowed_store_bytes(case, args["slot_mapping"])
    assert 0 < mask.sum() < mask.numel() // 2
    assert (zeros[~mask] == 0x00).all() and (ones[~mask] == 0xFF).all()  # nothing else written
    assert torch.equal(zeros[mask], ones[mask])  # every allowed byte written, whatever the fill
    assert torch.equal(zeros, expected)


def test_store_all_slots_negative_writes_nothing(device):
    args = nvfp4_store_inputs(NVFP4Case(negative_slots=1.0, seed=5), device, fill=0x5A)
    buffer = args.pop("buffer")
    ops.reshape_and_cache_nvfp4(**args)
    assert (buffer == 0x5A).all()


# --- NVFP4 gather ---------------------------------------------------------------------------------

def run_gather(case: NVFP4Case, seq_lens, device, out_dtype=None):
    args = nvfp4_gather_inputs(case, seq_lens, device, out_dtype)
    expected = nvfp4_gather_inputs(case, seq_lens, "cpu", out_dtype)
    ops.gather_nvfp4_kv_cache(**args)
    reference.gather_nvfp4_kv_cache(**expected)
    return args, expected


@LAYOUTS
@V_SCALES
@pytest.mark.parametrize("num_seqs", [1, 7, 300])
def test_gather_matches_reference(device, hnd, swizzle, num_seqs):
    g = torch.Generator().manual_seed(num_seqs)
    max_len = {1: 200, 7: 60, 300: 9}[num_seqs]
    seq_lens = torch.randint(0, max_len + 1, (num_seqs,), generator=g).tolist()
    seq_lens[0] = max_len  # at least one full-length sequence
    dtype = FLOAT_DTYPES[num_seqs % 3]
    # block_pad: the block stride is larger than the page
    case = NVFP4Case(head_size=128, num_heads=2, block_size=16, num_blocks=12, dtype=dtype, hnd=hnd,
                     swizzle_v_scales=swizzle, block_pad=48, row_pad=16 * (num_seqs % 2), seed=num_seqs)
    args, expected = run_gather(case, seq_lens, device)
    total = sum(seq_lens)
    for name in ("out_key", "out_value"):
        assert torch.equal(bits(args[name].cpu()), bits(expected[name]))
        assert (args[name][total:] == 12345.0).all()  # rows past cu_seq_lens[-1] untouched


@pytest.mark.parametrize("out_dtype", FLOAT_DTYPES, ids=str)
def test_gather_output_dtypes(device, out_dtype):
    case = NVFP4Case(head_size=256, num_heads=1, block_size=32, hnd=True, dtype=torch.bfloat16, seed=11)
    args, expected = run_gather(case, [70, 0, 33], device, out_dtype)
    assert torch.equal(bits(args["out_key"].cpu()), bits(expected["out_key"]))
    assert torch.equal(bits(args["out_value"].cpu()), bits(expected["out_value"]))


def test_gather_of_no_tokens_writes_nothing(device):
    args = nvfp4_gather_inputs(NVFP4Case(seed=2), [0, 0], device)
    ops.gather_nvfp4_kv_cache(**args)
    assert (args["out_key"] == 12345.0).all() and (args["out_value"] == 12345.0).all()


@pytest.mark.parametrize("out_dtype", FLOAT_DTYPES, ids=str)
def test_gather_nan_scales_give_nan_groups(device, out_dtype):
    """A NaN block scale (E4M3 0x7F/0xFF) makes its group NaN and nothing else. NaN bit patterns are not
    compared: torch's own casts do not agree on them (a NaN becomes bf16 0xFFFF or 0x7FC0 by code path)."""
    case = NVFP4Case(head_size=64, num_heads=2, block_size=4, num_blocks=3, dtype=out_dtype, seed=9)
    args = nvfp4_gather_inputs(case, [5, 7], device)
    expected = nvfp4_gather_inputs(case, [5, 7], "cpu")
    for inputs in (args, expected):
        layout = NVFP4PageLayout.from_side_cache(inputs["key_cache"])
        for side, code in ((inputs["key_cache"], 0x7F), (inputs["value_cache"], 0xFF)):
            flat = layout.side_bytes_view(side)
            flat[:, layout.scale_offset(1, 0, 2)] = code  # in every block
            flat[:, layout.scale_offset(3, 1, 0)] = code
    ops.gather_nvfp4_kv_cache(**args)
    reference.gather_nvfp4_kv_cache(**expected)
    for name in ("out_key", "out_value"):
        got, want = args[name].cpu(), expected[name]
        assert torch.equal(got.isnan(), want.isnan()) and want.isnan().any()
        assert torch.equal(bits(got[~got.isnan()]), bits(want[~want.isnan()]))


@LAYOUTS
@V_SCALES
def test_store_then_gather_round_trip(device, hnd, swizzle):
    """NVFP4 keeps Gaussian data to a relative L2 error of about 0.1 (measured 0.095-0.097)."""
    layout = NVFP4PageLayout(128, 16, 4, hnd, swizzle)
    g = torch.Generator().manual_seed(7)
    n = 64
    key = torch.randn(n, 4, 128, generator=g).to(device)
    value = (torch.randn(n, 4, 128, generator=g) * 30).to(device)
    kv_cache = layout.allocate(4, device, fill=0)
    scale = torch.ones(1, device=device)
    ops.reshape_and_cache_nvfp4(key, value, kv_cache[:, 0], kv_cache[:, 1], torch.arange(n, device=device),
                                scale, scale * 8, swizzle)
    out_key, out_value = torch.empty_like(key), torch.empty_like(value)
    block_table = torch.arange(4, dtype=torch.int32, device=device).view(1, 4)
    cu_seq_lens = torch.tensor([0, n], dtype=torch.int32, device=device)
    ops.gather_nvfp4_kv_cache(kv_cache[:, 0], kv_cache[:, 1], block_table, cu_seq_lens, scale, scale * 8, swizzle,
                              out_key, out_value)
    for x, y in ((key, out_key), (value, out_value)):
        rel_l2 = ((y - x).norm() / x.norm()).item()
        assert 0.085 < rel_l2 < 0.11


# --- Sparse-indexer cache ---------------------------------------------------------------------------

def run_indexer_store(case: IndexerCase, scale_fmt, device, fill=0xA5):
    args, expected = indexer_store_inputs(case, scale_fmt, device, fill), indexer_store_inputs(case, scale_fmt, "cpu", fill)
    buffer, expected_buffer = args.pop("buffer"), expected.pop("buffer")
    ops.indexer_k_quant_and_cache(**args)
    reference.indexer_k_quant_and_cache(**expected)
    return buffer.cpu(), expected_buffer, expected


@pytest.mark.parametrize("scale_fmt", ["", "ue8m0", "mxfp8"])
@DTYPES
@pytest.mark.parametrize("head_dim,quant_block_size,block_size", [(128, 128, 64), (128, 32, 16), (256, 128, 7)])
def test_indexer_store_matches_reference(device, scale_fmt, dtype, head_dim, quant_block_size, block_size):
    case = IndexerCase(head_dim=head_dim, quant_block_size=quant_block_size, block_size=block_size,
                       num_blocks=6, num_tokens=5 * block_size, dtype=dtype, block_pad=4 * (block_size % 3),
                       seed=head_dim + quant_block_size + block_size)
    buffer, expected, _ = run_indexer_store(case, scale_fmt, device)
    assert torch.equal(buffer, expected)


def every_bf16_under_each_scale(mantissa: float = 1.0, non_finite: bool = True) -> torch.Tensor:
    """Rows of 128 bf16 values: for each power-of-two scale 2^e the store can pick (e = -22, the 1e-4 floor, to 119),
    a row leader 448 · 2^e that sets it, then every bf16 value of no larger magnitude (so the subnormal, rounding
    and saturation cases of every scale); then every bf16 value behind an inf and behind a NaN (scale 1).
    `mantissa` multiplies the leaders (float32 scales that are not powers of two); `non_finite` adds the last two."""
    every = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int16).view(torch.bfloat16)
    magnitude = every.view(torch.int16) & 0x7FFF
    rows = []
    leaders = [x for x in (448.0 * mantissa * 2.0 ** e for e in range(-22, 120, 3)) if x < 3.38e38]  # bf16-finite
    for leader in leaders + ([float("inf"), float("nan")] if non_finite else []):
        lead = torch.tensor(leader, dtype=torch.bfloat16)
        values = every[magnitude <= (lead.view(torch.int16) & 0x7FFF)] if leader == leader else every
        values = torch.cat([values, values.new_zeros(-len(values) % 127)]).view(-1, 127)
        rows.append(torch.cat([lead.expand(len(values), 1), values], dim=1))
    return torch.cat(rows)


def test_stores_of_every_float16_value(device):
    """Every float16 bit pattern (zeros, subnormals, infs, NaNs) as keys of both stores: the CPU kernels convert
    float16 in vector operations of their own. The NVFP4 store gets the NaNs as zeros: a NaN makes its group's
    factor NaN, and which of two NaNs a product keeps (so the sign of that code) is not specified."""
    every = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int16).view(torch.float16).view(512, 1, 128)
    numbers = torch.where(every.isnan(), 0.0, every)
    case = NVFP4Case(head_size=128, num_heads=1, block_size=16, num_blocks=32, num_tokens=512, dtype=torch.float16)
    (buffer, kv_cache), (expected_buffer, expected_cache) = nvfp4_cache(case, device, 0xA5), nvfp4_cache(case, "cpu", 0xA5)
    slots, scale = torch.arange(512), torch.tensor([0.5])
    ops.reshape_and_cache_nvfp4(numbers.to(device), numbers.flip(0).to(device), kv_cache[:, 0], kv_cache[:, 1],
                                slots.to(device), scale.to(device), scale.to(device), True)
    reference.reshape_and_cache_nvfp4(numbers, numbers.flip(0), expected_cache[:, 0], expected_cache[:, 1], slots,
                                      scale, scale, True)
    assert torch.equal(buffer.cpu(), expected_buffer)
    indexer = IndexerCase(block_size=64, num_blocks=8, num_tokens=512)
    (buffer, kv_cache), (expected_buffer, expected_cache) = indexer_cache(indexer, device, 0xA5), indexer_cache(indexer, "cpu", 0xA5)
    ops.indexer_k_quant_and_cache(every.view(512, 128).to(device), kv_cache, slots.to(device), 128, "ue8m0")
    reference.indexer_k_quant_and_cache(every.view(512, 128), expected_cache, slots, 128, "ue8m0")
    assert torch.equal(buffer.cpu(), expected_buffer)


@pytest.mark.parametrize("scale_fmt", ["ue8m0", "mxfp8", ""])
def test_indexer_store_every_bf16_value(device, scale_fmt):
    """The AVX-512 path quantizes bf16 keys under power-of-two scales from their bits; float32 scales (leaders
    448 · 1.1484375 · 2^e, not powers of two) make every quotient a full float32 to round. Check both on every
    value. Float32 rows are finite only: an inf or NaN makes the scale non-finite, and which NaN's sign each code
    then carries depends on the machine (inf / inf is −NaN on x86, the canonical +NaN on the GPU)."""
    k = every_bf16_under_each_scale(1.1484375, non_finite=False) if scale_fmt == "" else every_bf16_under_each_scale()
    case = IndexerCase(block_size=64, num_blocks=-(-len(k) // 64), num_tokens=len(k))
    buffer, kv_cache = indexer_cache(case, device, 0xA5)
    expected_buffer, expected_cache = indexer_cache(case, "cpu", 0xA5)
    slots = torch.arange(len(k))
    ops.indexer_k_quant_and_cache(k.to(device), kv_cache, slots.to(device), 128, scale_fmt)
    reference.indexer_k_quant_and_cache(k, expected_cache, slots, 128, scale_fmt)
    assert torch.equal(buffer.cpu(), expected_buffer)


@pytest.mark.parametrize("scale_fmt", ["", "mxfp8"])
def test_indexer_store_writes_only_target_slots(device, scale_fmt):
    case = IndexerCase(head_dim=128, quant_block_size=64, block_size=16, num_blocks=4, num_tokens=30,
                       block_pad=20, negative_slots=0.3, seed=4)
    zeros, expected, args = run_indexer_store(case, scale_fmt, device, fill=0x00)
    ones, _, _ = run_indexer_store(case, scale_fmt, device, fill=0xFF)
    layout = case.layout
    stride = layout.block_bytes + case.block_pad
    mask = torch.zeros(zeros.numel(), dtype=torch.bool)
    for slot in args["slot_mapping"].tolist():
        if slot >= 0:
            base = (slot // case.block_size + 1) * stride  # +1: the leading guard block
            t = slot % case.block_size
            mask[base + layout.value_offset(t):base + layout.value_offset(t) + layout.head_dim] = True
            mask[base + layout.scale_offset(t):base + layout.scale_offset(t) + layout.scale_bytes] = True
    assert (zeros[~mask] == 0x00).all() and (ones[~mask] == 0xFF).all()
    assert torch.equal(zeros[mask], ones[mask])
    assert torch.equal(zeros, expected)


@pytest.mark.parametrize("num_seqs", [1, 7, 300])
@pytest.mark.parametrize("fp8_k,float_scales", [(False, False), (True, True)], ids=["bytes", "typed"])
def test_indexer_gather_matches_reference(device, num_seqs, fp8_k, float_scales):
    g = torch.Generator().manual_seed(num_seqs)
    max_len = {1: 300, 7: 100, 300: 20}[num_seqs]
    seq_lens = torch.randint(0, max_len + 1, (num_seqs,), generator=g).tolist()
    seq_lens[-1] = max_len
    # 132-byte rows (not 16-byte aligned) and a block stride larger than the block
    case = IndexerCase(head_dim=128, quant_block_size=128, block_size=16, num_blocks=40, block_pad=36, seed=num_seqs)
    args = indexer_gather_inputs(case, seq_lens, device, float_scales, fp8_k)
    expected = indexer_gather_inputs(case, seq_lens, "cpu", float_scales, fp8_k)
    ops.cp_gather_indexer_k_quant_cache(**args)
    reference.cp_gather_indexer_k_quant_cache(**expected)
    total = sum(seq_lens)
    for name in ("dst_k", "dst_scale"):
        got = bits(args[name].cpu()).view(args[name].size(0), -1)
        assert torch.equal(got, bits(expected[name]).view(got.shape))
        assert (got[total:] == 0xC3).all()  # rows past cu_seq_lens[-1] untouched


def test_indexer_store_then_gather_round_trip(device):
    """FP8 with one scale per 128 elements keeps Gaussian keys to a relative L2 error of about 0.02."""
    case = IndexerCase(num_tokens=128, num_blocks=2, negative_slots=0.0, dtype=torch.float32)
    k = torch.randn(128, 128, generator=torch.Generator().manual_seed(1)).to(device)
    _, kv_cache = indexer_cache(case, device, 0)
    ops.indexer_k_quant_and_cache(k, kv_cache, torch.arange(128, device=device), 128, "")
    dst_k = torch.empty(128, 128, dtype=torch.float8_e4m3fn, device=device)
    dst_scale = torch.empty(128, 1, dtype=torch.float32, device=device)
    block_table = torch.tensor([[0, 1]], dtype=torch.int32, device=device)
    ops.cp_gather_indexer_k_quant_cache(kv_cache, dst_k, dst_scale, block_table,
                                        torch.tensor([0, 128], dtype=torch.int32, device=device))
    rel_l2 = ((dst_k.float() * dst_scale - k).norm() / k.norm()).item()
    assert 0.01 < rel_l2 < 0.04


# --- torch.library checks ---------------------------------------------------------------------------

def opcheck_cases(device):
    store = nvfp4_store_inputs(NVFP4Case(head_size=64, num_tokens=6, num_blocks=2, block_size=4, seed=1), device)
    store.pop("buffer")
    gather = nvfp4_gather_inputs(NVFP4Case(head_size=64, num_blocks=2, block_size=4, seed=1), [3, 5], device)
    indexer = indexer_store_inputs(IndexerCase(num_tokens=5, block_size=4, num_blocks=2), "ue8m0", device)
    indexer.pop("buffer")
    indexer_gather = indexer_gather_inputs(IndexerCase(block_size=4, num_blocks=3), [2, 7], device)
    return [(torch.ops.vllm_nvfp4.reshape_and_cache_nvfp4, store),
            (torch.ops.vllm_nvfp4.gather_nvfp4_kv_cache, gather),
            (torch.ops.vllm_nvfp4.indexer_k_quant_and_cache, indexer),
            (torch.ops.vllm_nvfp4.cp_gather_indexer_k_quant_cache, indexer_gather)]


@pytest.mark.parametrize("index", range(4), ids=["store", "gather", "indexer_store", "indexer_gather"])
def test_opcheck(device, index):
    op, kwargs = opcheck_cases(device)[index]
    torch.library.opcheck(op.default, args=tuple(kwargs.values()))


# --- instruction-set variants -------------------------------------------------------------------------

@pytest.mark.skipif(platform.machine() != "x86_64", reason="the encoder is x86-64 AVX-512 code")
def test_avx512_e2m1_encoder_equals_reference_ladder_on_every_float(tmp_path):
    """The AVX-512 store rounds to E2M1 with float arithmetic instead of the reference's comparisons; every
    non-negative non-NaN float32 (its input is |x| times a finite factor) must get the ladder's code."""
    with open("/proc/cpuinfo") as f:
        if "avx512f" not in f.read():
            pytest.skip("this CPU has no AVX-512 to run it")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    exe = tmp_path / "e2m1_avx512_exhaustive"
    subprocess.run(["c++", "-O2", "-std=c++17", "-ffp-contract=off", f"-I{os.path.join(root, 'csrc')}",
                    os.path.join(root, "tests", "e2m1_avx512_exhaustive.cpp"), "-o", str(exe)], check=True)
    result = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("0 mismatches"), result.stdout


def check_every_op_variant() -> None:
    """Every op, layout, V-scale order, dtype and scale format once against the reference (run per ISA)."""
    for seed, (hnd, swizzle, dtype) in enumerate((h, s, d) for h in (False, True) for s in (False, True)
                                                 for d in FLOAT_DTYPES):
        case = NVFP4Case(head_size=64 * (1 + seed % 4), num_heads=1 + seed % 3, dtype=dtype, hnd=hnd,
                         swizzle_v_scales=swizzle, row_pad=16 * (seed % 2), seed=seed)
        buffer, expected, _ = run_store(case, "cpu")
        assert torch.equal(buffer, expected), case
        args, expected = run_gather(case, [37, 0, 50], "cpu")
        assert torch.equal(bits(args["out_key"]), bits(expected["out_key"])), case
        assert torch.equal(bits(args["out_value"]), bits(expected["out_value"])), case
    for seed, scale_fmt in enumerate(["", "ue8m0", "mxfp8"]):
        for dtype in FLOAT_DTYPES:
            case = IndexerCase(quant_block_size=(128, 64, 24)[seed] if dtype != torch.float16 else 32,
                               head_dim=(128, 128, 96)[seed], dtype=dtype, seed=seed)
            buffer, expected, _ = run_indexer_store(case, scale_fmt, "cpu")
            assert torch.equal(buffer, expected), (case, scale_fmt)


@pytest.mark.parametrize("isa", ["avx2", "baseline"])
def test_lower_instruction_sets_match_reference(isa):
    """The CPU kernels also run as AVX2 and baseline x86-64 code; this CPU picks the best, so force each."""
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "VLLM_NVFP4_CPU_ISA": isa}
    subprocess.run([sys.executable, "-c", "import test_ops_cpu; test_ops_cpu.check_every_op_variant()"],
                   cwd=tests_dir, env=env, check=True, timeout=300)


def test_default_instruction_set_matches_reference():
    check_every_op_variant()


def test_unknown_instruction_set_is_rejected():
    env = {**os.environ, "VLLM_NVFP4_CPU_ISA": "sse9"}
    code = ("import torch, vllm_nvfp4_plugin.ops as o; from vllm_nvfp4_plugin.layout import NVFP4PageLayout as L; "
            "c = L(64, 4, 1).allocate(1); x = torch.zeros(1, 1, 64); s = torch.ones(1); "
            "o.reshape_and_cache_nvfp4(x, x, c[:, 0], c[:, 1], torch.zeros(1, dtype=torch.long), s, s, False)")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0 and "VLLM_NVFP4_CPU_ISA must be avx512bf16, avx512, avx2 or baseline" in result.stderr
