"""The indexer logits ops (`indexer_mqa_logits`, `indexer_paged_mqa_logits`) against reference.py's float64 logits.

The ops sum in float32 in an order of their own, so finite logits are compared within a bound scaled by the
row's absolute terms `Σ_h |w| Σ_d |q·k|·s`; the `-inf` places must match exactly. The logits rows are wider
than the op's columns and poisoned, so a write past a row's columns shows; the cache keeps a poisoned padding
between blocks and poisoned unused blocks (E4M3 NaN), and the block table holds garbage past each request's
context, so a read of anything invisible shows too.
"""

import os
import re
import subprocess
import sys

import pytest
import torch

from vllm_nvfp4_plugin import ops, reference
from vllm_nvfp4_plugin.layout import IndexerCacheLayout

FP8 = torch.float8_e4m3fn
POISON = 12345.0
NAN_BYTE = 0x7F  # E4M3 NaN
# Float32 sums of ~200 terms: the CPU's error stays far below 3e-5 of the absolute terms; CUDA's FP8 tensor-core
# accumulation may keep fewer bits.
RTOL = {"cpu": 3e-5, "cuda": 1e-4}


def random_keys(g: torch.Generator, n: int, head_dim: int, quant_block_size: int, scale_fmt: str):
    """FP8 value bytes `[n, D]` and float32 scale bytes `[n, 4·D/qbs]` as the store op makes them (keys of mixed
    magnitude, so the per-key scales differ)."""
    k = torch.randn(n, head_dim, generator=g) * torch.rand(n, 1, generator=g).mul(8).exp2()
    return reference.indexer_quantize(k.bfloat16(), quant_block_size, scale_fmt)


def queries(g: torch.Generator, shape: tuple, heads: int, head_dim: int):
    q = (torch.randn(*shape, heads, head_dim, generator=g) * 3).to(FP8)
    return q, torch.randn(*shape, heads, generator=g)


def poisoned_logits(rows: int, columns: int, device: str, pad: int = 5) -> torch.Tensor:
    return torch.full((rows, columns + pad), POISON, device=device)[:, :columns]


def assert_logits_match(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor, device: str) -> None:
    """`got` (the op's, on its device) equals the float64 reference `want` within RTOL of `bound` per element,
    with identical -inf places; the poisoned padding past the columns is untouched."""
    padded = got.as_strided((got.size(0), got.stride(0)), (got.stride(0), 1))[:, got.size(1):]
    assert (padded.cpu() == POISON).all(), "the op wrote past its columns"
    got, want = got.cpu().double(), want.double()
    assert torch.equal(got == float("-inf"), want == float("-inf")), "-inf places differ"
    finite = want.isfinite()
    err = (got - want).abs()[finite]
    allowed = RTOL[device] * bound[finite] + 1e-30
    assert (err <= allowed).all(), f"max error {float((err / allowed).max()):.2f}× the allowed bound"


def absolute_terms(q, w, values, scale_bytes) -> torch.Tensor:
    """`Σ_h |w| Σ_b s Σ_d |q·k|`: what a float32 summation's rounding error scales with."""
    scales = scale_bytes.view(torch.float32)
    return reference._mqa_logits(q.float().abs().to(FP8), w.abs(), values.view(FP8).float().abs().to(FP8)
                                 .view(torch.uint8), scales)


@pytest.mark.parametrize("quant_block_size,scale_fmt,heads", [(128, "ue8m0", 64), (128, "", 16), (64, "", 7),
                                                              (32, "ue8m0", 32)])
@pytest.mark.parametrize("scale_dtype", [torch.uint8, torch.float32])
def test_mqa_logits_match_reference(device, quant_block_size, scale_fmt, heads, scale_dtype):
    g = torch.Generator().manual_seed(quant_block_size + heads)
    rows, keys, head_dim = 37, 300, 128
    values, scale_bytes = random_keys(g, keys, head_dim, quant_block_size, scale_fmt)
    q, w = queries(g, (rows,), heads, head_dim)
    # Causal ranges over a chunk, plus rows that see nothing, all keys, or clamp out-of-range bounds.
    ke = torch.randint(0, keys + 1, (rows,), generator=g).int()
    ks = (ke - torch.randint(0, 200, (rows,), generator=g).int()).clamp(min=0)
    ks[:4] = torch.tensor([0, 10, -5, 250], dtype=torch.int32)
    ke[:4] = torch.tensor([keys, 10, 400, 100], dtype=torch.int32)
    want = torch.empty(rows, keys, dtype=torch.float64)
    reference.indexer_mqa_logits(q, values, scale_bytes, w, ks, ke, want)
    k_scale = scale_bytes if scale_dtype == torch.uint8 else scale_bytes.view(torch.float32)
    # Keys in a wider buffer (the gather's output rows carry any stride).
    k_rows = torch.full((keys, head_dim + 64), NAN_BYTE, dtype=torch.uint8)[:, :head_dim]
    k_rows.copy_(values)
    got = poisoned_logits(rows, keys, device)
    args = [t.to(device) for t in (q, k_rows, k_scale, w, ks, ke)]
    ops.indexer_mqa_logits(*args, got)
    assert_logits_match(got, want, absolute_terms(q, w, values, scale_bytes), device)


def paged_case(g: torch.Generator, context_lens: torch.Tensor, heads: int, quant_block_size: int, block_size: int,
               columns: int, device: str, pad: int = 96, scale_fmt: str = "ue8m0"):
    """Keys of each request stored with the store op into shuffled blocks of a NaN-poisoned cache whose blocks are
    `pad` bytes apart; garbage block-table entries past each request's longest context."""
    batch, next_n = context_lens.shape
    head_dim = 128
    layout = IndexerCacheLayout(head_dim, block_size, quant_block_size)
    stored = context_lens.amax(1).clamp(max=columns)  # keys past the columns are never read
    pages = [-(-int(n) // block_size) for n in stored]
    num_blocks = sum(pages) + 3
    cache = layout.allocate(num_blocks, device, fill=NAN_BYTE, block_stride=layout.block_bytes + pad)
    free = torch.randperm(num_blocks, generator=g).tolist()
    width = -(-columns // block_size) + 1
    table = torch.randint(-(1 << 30), 1 << 30, (batch, width), generator=g, dtype=torch.int32)
    for b, n in enumerate(pages):
        table[b, :n] = torch.tensor([free.pop() for _ in range(n)], dtype=torch.int32)
        keys = int(stored[b])
        k = (torch.randn(keys, head_dim, generator=g) * torch.rand(keys, 1, generator=g).mul(8).exp2()).bfloat16()
        c = torch.arange(keys)
        slots = table[b, c // block_size].long() * block_size + c % block_size
        ops.indexer_k_quant_and_cache(k.to(device), cache, slots.to(device), quant_block_size, scale_fmt)
    q, w = queries(g, (batch, next_n), heads, head_dim)
    return cache, table, q, w


def assert_paged_logits_match(cache, table, q, w, context_lens, quant_block_size: int, columns: int, device: str):
    """The op's paged logits on `device` against the reference, bounded by the same reference over |q|, |w|, |k|."""
    rows = q.size(0) * q.size(1)
    want = torch.empty(rows, columns, dtype=torch.float64)
    reference.indexer_paged_mqa_logits(q, cache, w, context_lens, table, quant_block_size, want)
    got = poisoned_logits(rows, columns, device)
    ops.indexer_paged_mqa_logits(q.to(device), cache, w.to(device), context_lens.to(device), table.to(device),
                                 quant_block_size, got)
    flat = cache.cpu().clone()
    layout = IndexerCacheLayout.from_cache(flat, quant_block_size)
    values = layout.block_bytes_view(flat)[:, :layout.block_size * layout.head_dim]
    values.copy_(values.view(FP8).float().abs().to(FP8).view(torch.uint8))
    bound = torch.empty(rows, columns, dtype=torch.float64)
    reference.indexer_paged_mqa_logits(q.float().abs().to(FP8), flat, w.abs(), context_lens, table, quant_block_size,
                                       bound)
    assert_logits_match(got, want, bound, device)


@pytest.mark.parametrize("next_n,heads,quant_block_size,block_size", [(1, 64, 128, 64), (3, 32, 64, 16),
                                                                     (2, 5, 128, 64)])
def test_paged_mqa_logits_match_reference(device, next_n, heads, quant_block_size, block_size):
    g = torch.Generator().manual_seed(next_n * 100 + heads)
    batch, columns = 6, 700  # fewer columns than the table's blocks hold
    lens = torch.randint(1, 800, (batch, 1), generator=g) + torch.arange(next_n)  # speculative: one more a token
    lens[0] = 0  # a request with no keys yet
    lens[1] = torch.arange(next_n) + 1000  # longer than the columns: clamped
    context_lens = lens.int()
    cache, table, q, w = paged_case(g, context_lens, heads, quant_block_size, block_size, columns, device)
    assert_paged_logits_match(cache, table, q, w, context_lens, quant_block_size, columns, device)


def test_paged_logits_are_independent_of_the_batch(device):
    """A request's logits do not depend on which other requests share the call (no cross-row leakage)."""
    g = torch.Generator().manual_seed(7)
    context_lens = torch.tensor([[300], [5], [129]], dtype=torch.int32)
    cache, table, q, w = paged_case(g, context_lens, 64, 128, 64, 320, device)
    together = torch.empty(3, 320, device=device)
    ops.indexer_paged_mqa_logits(q.to(device), cache, w.to(device), context_lens.to(device), table.to(device), 128,
                                 together)
    for b in range(3):
        alone = torch.empty(1, 320, device=device)
        ops.indexer_paged_mqa_logits(q[b:b + 1].to(device), cache, w[b:b + 1].to(device),
                                     context_lens[b:b + 1].to(device), table[b:b + 1].to(device), 128, alone)
        assert torch.equal(alone[0], together[b])


def test_opcheck(device):
    """opcheck's fake-tensor and AOT-dispatch tests. Its schema test cannot compare FP8 tensors ("mul_cpu_reduced_float"
    is not implemented for them), so the schema's one mutated argument is checked here directly: every input's
    bytes are unchanged after the call."""
    g = torch.Generator().manual_seed(3)
    values, scale_bytes = random_keys(g, 70, 128, 128, "")
    q, w = queries(g, (9,), 16, 128)
    ks, ke = torch.zeros(9, dtype=torch.int32), torch.arange(9, dtype=torch.int32) * 8
    mqa = [t.to(device) for t in (q, values, scale_bytes, w, ks, ke)] + [torch.empty(9, 70, device=device)]
    context_lens = torch.tensor([[40, 41], [100, 101]], dtype=torch.int32)
    cache, table, q, w = paged_case(g, context_lens, 16, 128, 64, 128, device)
    paged = [q.to(device), cache, w.to(device), context_lens.to(device), table.to(device), 128,
             torch.empty(4, 128, device=device)]
    tests = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    for op, args in ((torch.ops.vllm_nvfp4.indexer_mqa_logits, mqa), (torch.ops.vllm_nvfp4.indexer_paged_mqa_logits,
                                                                      paged)):
        torch.library.opcheck(op.default, args, test_utils=tests)
        inputs = [a for a in args[:-1] if isinstance(a, torch.Tensor)]
        before = [a.cpu().view(torch.uint8).clone() for a in inputs]
        op(*args)
        assert all(torch.equal(a.cpu().view(torch.uint8), b) for a, b in zip(inputs, before)), "an input changed"


# --- bad input ---------------------------------------------------------------------------------------------

def mqa_args(device: str) -> dict:
    g = torch.Generator().manual_seed(0)
    values, scale_bytes = random_keys(g, 20, 128, 128, "")
    q, w = queries(g, (4,), 8, 128)
    return dict(q=q.to(device), k=values.to(device), k_scale=scale_bytes.to(device), weights=w.to(device),
                ks=torch.zeros(4, dtype=torch.int32, device=device), ke=torch.full((4,), 20, dtype=torch.int32,
                                                                                    device=device),
                logits=torch.empty(4, 20, device=device))


def paged_args(device: str) -> dict:
    layout = IndexerCacheLayout(128, 16, 128)
    g = torch.Generator().manual_seed(0)
    q, w = queries(g, (2, 1), 8, 128)
    return dict(q=q.to(device), kv_cache=layout.allocate(4, device, fill=0), weights=w.to(device),
                context_lens=torch.tensor([[20], [9]], dtype=torch.int32, device=device),
                block_table=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=device), quant_block_size=128,
                logits=torch.empty(2, 32, device=device))


BAD_MQA = [
    ("q", lambda a: a["q"].float(), "q: dtype must be float8_e4m3fn"),
    ("q", lambda a: a["q"][:, :, :64].contiguous(), "k: head_dim 128 does not match q's 64"),
    ("k_scale", lambda a: a["k_scale"][:, :3], "k_scale: 3 scale bytes a key do not split head_dim 128"),
    ("k_scale", lambda a: a["k_scale"][:19], "k_scale: must have k's 20 rows"),
    ("weights", lambda a: a["weights"][:, :7], "weights: must have shape [rows, heads] = [4, 8]"),
    ("ks", lambda a: a["ks"].long(), "ks: dtype must be int32"),
    ("ke", lambda a: a["ke"][:3], "ke: must have shape [rows] = [4]"),
    ("logits", lambda a: a["logits"][:, :19], "logits: must have one column per key (20)"),
    ("logits", lambda a: a["logits"].double(), "logits: dtype must be float32"),
]

BAD_PAGED = [
    ("quant_block_size", lambda a: 96, "quant_block_size: head_dim 128 must be a positive multiple of quant_block_size 96"),
    ("quant_block_size", lambda a: 64, "kv_cache: last dim 132 is not head_dim + head_dim/quant_block_size*4"),
    ("block_table", lambda a: a["block_table"][:1], "block_table: must have one row per request (2)"),
    ("context_lens", lambda a: a["context_lens"].view(1, 2), "context_lens: must have shape [batch, next_n] = [2, 1]"),
    ("logits", lambda a: torch.empty(2, 33, device=a["q"].device), "logits: at most block_table's 2 blocks × 16 = 32"),
    ("weights", lambda a: a["weights"].bfloat16(), "weights: dtype must be float32"),
]


@pytest.mark.parametrize("name,change,message", BAD_MQA, ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(BAD_MQA)])
def test_mqa_logits_bad_input(device, name, change, message):
    args = mqa_args(device)
    args[name] = change(args)
    with pytest.raises(RuntimeError, match=re.escape("indexer_mqa_logits: " + message)):
        ops.indexer_mqa_logits(**args)


@pytest.mark.parametrize("name,change,message", BAD_PAGED,
                         ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(BAD_PAGED)])
def test_paged_mqa_logits_bad_input(device, name, change, message):
    args = paged_args(device)
    args[name] = change(args)
    with pytest.raises(RuntimeError, match=re.escape("indexer_paged_mqa_logits: " + message)):
        ops.indexer_paged_mqa_logits(**args)


def test_paged_block_ids_out_of_range_cpu():
    """On the CPU, where checking is free, a visible block-table entry outside the cache is an error; entries past
    the context are never read, so garbage there is fine."""
    args = paged_args("cpu")
    args["block_table"] = torch.tensor([[0, 1], [2, 99]], dtype=torch.int32)
    ops.indexer_paged_mqa_logits(**args)  # request 1 sees 9 keys: only its first block
    args["block_table"] = torch.tensor([[0, 4], [2, 99]], dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"indexer_paged_mqa_logits: block_table: entry \[0, 1\] = 4 is not a block"):
        ops.indexer_paged_mqa_logits(**args)


# --- exactness, CPU variants and threads -------------------------------------------------------------------

def test_every_fp8_code_is_read_exactly(device):
    """Key d=0 holds each of the 256 E4M3 codes (scale 1, the rest 0); q = ±1 at d=0: the logits must be exactly
    relu(±value), NaN for the NaN codes — a wrong entry in any FP8 conversion shows."""
    values = torch.zeros(256, 128, dtype=torch.uint8)
    values[:, 0] = torch.arange(256, dtype=torch.uint8)
    scales = torch.ones(256, 1)
    q = torch.zeros(2, 1, 128)
    q[0, 0, 0], q[1, 0, 0] = 1, -1
    q = q.to(FP8)
    got = torch.empty(2, 256, device=device)
    ops.indexer_mqa_logits(q.to(device), values.to(device), scales.to(device), torch.ones(2, 1, device=device),
                           torch.zeros(2, dtype=torch.int32, device=device),
                           torch.full((2,), 256, dtype=torch.int32, device=device), got)
    code = values[:, 0].view(FP8).float()
    want = torch.stack([code.relu(), (-code).relu()])
    assert torch.equal(got.cpu().isnan(), want.isnan())
    assert torch.equal(got.cpu().nan_to_num(), want.nan_to_num())


@pytest.mark.parametrize("isa", ["avx512", "avx2", "baseline"])
def test_lower_instruction_sets_match_reference(isa):
    """This CPU runs the best variant (AVX-512 BF16 or AMX); force each lower one through the same CPU cases."""
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "VLLM_NVFP4_CPU_ISA": isa}
    cases = "(match_reference or unaligned or every_fp8_code) and not instruction_sets"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu", "-k", cases,
                    "test_logits_ops.py", "test_logits_paths.py"], cwd=tests_dir, env=env, check=True, timeout=600)


def test_cpu_logits_do_not_depend_on_the_thread_count():
    g = torch.Generator().manual_seed(11)
    values, scale_bytes = random_keys(g, 2048, 128, 128, "")
    q, w = queries(g, (64,), 64, 128)
    ks, ke = torch.zeros(64, dtype=torch.int32), torch.randint(1500, 2049, (64,), generator=g).int()
    context_lens = torch.tensor([[2000], [1], [1500], [700]], dtype=torch.int32)
    cache, table, pq, pw = paged_case(g, context_lens, 64, 128, 64, 2000, "cpu")
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            mqa, paged = torch.empty(64, 2048), torch.empty(4, 2000)
            ops.indexer_mqa_logits(q, values, scale_bytes, w, ks, ke, mqa)
            ops.indexer_paged_mqa_logits(pq, cache, pw, context_lens, table, 128, paged)
            results.append((mqa, paged))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
