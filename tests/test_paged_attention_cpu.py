"""The CPU `nvfp4_paged_attention` against the plain-torch oracle (fp32 attention over the dequantized cache).

Every case: pages in shuffled order, pages nothing was stored in filled with 0xFF (NaN block scales, so a read past
a request's length shows), garbage in unused block-table columns, padding query rows of NaN, the output poisoned with
NaN so unwritten rows show and rows past the batch's tokens must stay untouched; with a sliding window, the bytes of
every key older than its request's first window are poisoned as well (the reference reads a clean copy). The
reference writes the op's output dtype, so a bf16 or fp16 output is compared with the same rounding; relative L2 error
of the whole output ≤ 1e-3 (float32 outputs agree to float32 rounding).
"""

import copy
import math
import os
import pickle
import re
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_nvfp4_plugin import ops, reference
from vllm_nvfp4_plugin.attention import NVFP4AttentionMetadata, store_kv
from vllm_nvfp4_plugin.attention.core import cache_sides, paged_attention, paged_attention_reference
from vllm_nvfp4_plugin.layout import NVFP4PageLayout
from vllm_nvfp4_plugin.tools.paged_case import PagedCase, relative_l2

REL_L2 = 1e-3
PAD_ROWS = 3
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
PREFILL_MIN_ROWS = 16  # cpu_attention.cpp: requests this long take the prefill code


def cpu_flags() -> set[str]:
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    return set()


AMX = {"amx_tile", "amx_bf16", "avx512_bf16"} <= cpu_flags()
# bf16 queries over NVFP4 keys take their own prefill code (AMX tile products, or AVX512-BF16 a split at a time)
BF16_PREFILL = "avx512_bf16" in cpu_flags()


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def outliers(x):  # one element of each group 200 times the rest
    x.unflatten(-1, (-1, 16))[..., 3] *= 200.0


def zero_groups(x):  # every other group all zero (block scale 0)
    x.unflatten(-1, (-1, 16))[..., ::2, :] = 0.0


def saturated(x):  # block scales saturate at 448, codes at ±6
    x *= 1e4


def tiny(x):  # subnormal block scales (below 2^-6), some rounding to 0
    x *= 1e-2


class Case:
    """Requests `(query_len, context_len)` over one NVFP4 cache written by the CPU store op (PagedCase's K/V).

    Model features: `window` (sliding window, 0: none), `soft_cap` (0: none), `sinks` (True: random per-head sink
    logits around the scores' scale)."""

    def __init__(self, requests, *, head_size=128, kv_heads=2, group=4, block_size=16, hnd=False, swizzle=False,
                 dtype=torch.bfloat16, causal=True, seed=0, k_scale=0.75, v_scale=1.25, scale=None, shape_kv=None,
                 window=0, soft_cap=0.0, sinks=False, key_format="nvfp4"):
        gen = torch.Generator().manual_seed(seed)
        self.window, self.soft_cap = window, soft_cap
        self.sinks = torch.randn(kv_heads * group, generator=gen) * 2 + 1 if sinks else None
        self.layout = NVFP4PageLayout(head_size, block_size, kv_heads, hnd, swizzle, key_format)
        self.requests, self.causal, self.dtype = list(requests), causal, dtype
        self.paged = PagedCase(requests, self.layout, kv_heads * group, gen, dtype=dtype, k_scale=k_scale,
                               v_scale=v_scale, extra_table_columns=2, unused_entry=-7)
        self.k_scale, self.v_scale = torch.tensor([k_scale]), torch.tensor([v_scale])
        if shape_kv is not None:
            for x in self.paged.k + self.paged.v:
                shape_kv(x)
        # FP8 or INT8 keys: a (key_cache, value_cache) pair, their unused bytes 0xFF (FP8 NaN keys, fp16 NaN key
        # scales, NaN V block scales)
        allocate = self.layout.allocate if key_format == "nvfp4" else self.layout.allocate_sides
        self.cache = allocate(self.paged.num_blocks, fill=0xFF)
        key, value, slots = self.paged.context_tokens()
        store_kv(key, value, self.cache, slots, self.k_scale, self.v_scale, swizzle)
        self.num_tokens = sum(n for n, _ in requests)
        pad = torch.full((PAD_ROWS, kv_heads * group, head_size), float("nan"), dtype=dtype)
        self.query = torch.cat(self.paged.q + [pad])
        self.query_start_loc = self.paged.query_start_loc()
        self.seq_lens = torch.tensor(self.paged.seq_lens, dtype=torch.int32)
        self.scale = head_size ** -0.5 if scale is None else scale
        self.clean_cache = self.cache  # what the reference reads (poison_keys_outside_windows leaves it intact)

    def args(self, out, max_query_len=None, max_seq_len=None, cache=None):
        cache = self.cache if cache is None else cache
        return (self.query, *cache_sides(cache), self.paged.block_table, self.query_start_loc,
                self.seq_lens, self.k_scale, self.v_scale, self.scale, self.causal, self.layout.swizzle_v_scales,
                max(self.paged.query_lens) if max_query_len is None else max_query_len,
                max(self.paged.seq_lens) if max_seq_len is None else max_seq_len, out,
                self.window, self.soft_cap, self.sinks)

    def poison_keys_outside_windows(self) -> int:
        """Overwrite with 0xFF (NaN block scales) the K and V bytes of every cached token older than the window of
        its request's first query row: a kernel that reads one of them writes NaN. Returns how many tokens."""
        assert self.layout.key_format == "nvfp4", "poisons NVFP4 keys"
        self.clean_cache = self.cache.clone()
        layout, poisoned = self.layout, 0
        heads = torch.arange(layout.num_heads)[:, None]
        data = torch.arange(layout.data_dim)
        for r, (n, c) in enumerate(self.requests):
            first_window_key = max(0, c - n - self.window + 1)
            if self.window == 0 or n == 0 or first_window_key == 0:
                continue
            pos = torch.arange(first_window_key)
            blocks = self.paged.block_table[r, pos // layout.block_size].long()[:, None, None]
            t = (pos % layout.block_size)[:, None, None]
            for side, swizzled in ((0, False), (1, layout.swizzle_v_scales)):
                view = layout.side_bytes_view(self.cache[:, side])
                view[blocks, layout.data_offset(t, heads[None]) + data] = 0xFF
                scales = torch.arange(layout.scale_dim)
                view[blocks, layout.scale_offset(t, heads[None], scales, swizzled)] = 0xFF
            poisoned += first_window_key
        return poisoned

    def run(self, **bounds) -> torch.Tensor:
        out = torch.full_like(self.query, float("nan"))
        ops.nvfp4_paged_attention(*self.args(out, **bounds))
        return out

    def reference(self) -> torch.Tensor:
        out = torch.zeros_like(self.query)
        reference.nvfp4_paged_attention(*self.args(out, cache=self.clean_cache))
        return out

    def rows(self, first: int, last: int, requests) -> "Case":
        """This case's query rows [first, last) as a batch of `requests` over the same pages."""
        part = copy.copy(self)
        part.requests, part.num_tokens = list(requests), last - first
        part.query = self.query[first:last]
        part.query_start_loc = torch.tensor([0] + [n for n, _ in requests], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        part.seq_lens = torch.tensor([c for _, c in requests], dtype=torch.int32)
        part.paged = copy.copy(self.paged)
        part.paged.requests = list(requests)
        return part

    def check(self, out: torch.Tensor, rel_l2: float = REL_L2) -> float:
        rows = self.num_tokens
        assert torch.isnan(out[rows:]).all(), "rows past query_start_loc[-1] were written"
        assert torch.isfinite(out[:rows]).all(), "a query row was left unwritten or is not finite"
        err = relative_l2(out[:rows], self.reference()[:rows])
        assert err <= rel_l2, f"relative L2 error {err:.2e} > {rel_l2}"
        return err


# Decodes (one key, a key past a page boundary, many splits), a whole prompt, chunks over cached prefixes (one
# starting on a page boundary, one ending on one), speculative-decode rows.
MIXED = [(1, 1), (1, 17), (1, 1300), (37, 37), (20, 75), (16, 48), (9, 64), (3, 130)]


@pytest.mark.parametrize("head_size", [64, 128, 256])
@pytest.mark.parametrize("hnd", [False, True], ids=["NHD", "HND"])
@pytest.mark.parametrize("swizzle", [False, True], ids=["linear", "swizzled"])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_mixed_batch_every_layout(head_size, hnd, swizzle, group):
    case = Case(MIXED, head_size=head_size, hnd=hnd, swizzle=swizzle, group=group, seed=head_size + group)
    case.check(case.run())


@pytest.mark.parametrize("head_size", [64, 128, 256])
@pytest.mark.parametrize("hnd", [False, True], ids=["NHD", "HND"])
@pytest.mark.parametrize("group", [1, 3, 8])
def test_fp8_keys_mixed_batch(head_size, hnd, group):
    case = Case(MIXED, head_size=head_size, hnd=hnd, swizzle=hnd, group=group, seed=head_size + group, key_format="fp8")
    case.check(case.run())


@pytest.mark.parametrize("shape_kv", [outliers, zero_groups, saturated, tiny], ids=lambda f: f.__name__)
def test_fp8_keys_adversarial_values(shape_kv):
    case = Case(MIXED, shape_kv=shape_kv, seed=5, key_format="fp8", k_scale=2.0 if shape_kv is saturated else 0.75)
    case.check(case.run())


def test_fp8_keys_with_model_features():
    case = Case(MIXED, window=45, soft_cap=3.0, sinks=True, dtype=torch.float16, seed=8, key_format="fp8")
    case.check(case.run())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_query_and_output_dtypes(dtype):
    case = Case(MIXED, dtype=dtype, seed=3)
    # float32 in and out: only float32 rounding separates the kernel from the reference
    case.check(case.run(), 1e-5 if dtype == torch.float32 else REL_L2)


@pytest.mark.parametrize("block_size", [1, 5, 12, 32, 128])
def test_block_sizes(block_size):
    case = Case([(1, 700), (13, 13), (30, 250)], block_size=block_size, swizzle=block_size % 4 == 0, seed=block_size)
    case.check(case.run())


def test_non_causal():
    case = Case([(1, 100), (50, 50), (30, 300)], causal=False, seed=5)
    case.check(case.run())


def test_long_contexts_split_and_merge():
    """Contexts of many splits: a small batch runs each split as its own task, a prompt merges them as it goes."""
    case = Case([(1, 5000), (3, 2100), (600, 1700)], kv_heads=1, group=8, seed=6)
    case.check(case.run())


def test_loose_bounds():
    """Host bounds above the real lengths give the same bytes."""
    case = Case([(1, 700), (9, 300)], seed=7)
    assert same_bytes(case.run(), case.run(max_query_len=64, max_seq_len=20000))


@pytest.mark.parametrize("shape_kv", [outliers, zero_groups, saturated, tiny])
def test_adversarial_values(shape_kv):
    case = Case([(1, 300), (1, 2000), (40, 500)], shape_kv=shape_kv, k_scale=1.0, v_scale=1.0, seed=8)
    if shape_kv in (outliers, saturated):
        case.scale = 1e-4  # logits in a range where the fp32 reference and the kernel agree on the softmax
    case.check(case.run())


def test_peaked_softmax():
    """Large logits: each row's probability mass sits on a few keys, the rest underflows to 0."""
    case = Case([(1, 900), (30, 300)], scale=0.5, dtype=torch.float32, seed=9)
    case.check(case.run())


def test_random_cache_bytes():
    """Every code and scale bit pattern (subnormal and maximal block scales), written straight into the pages."""
    case = Case([(1, 700), (20, 900)], swizzle=True, seed=10)
    g = torch.Generator().manual_seed(10)
    data = torch.randint(0, 256, (case.cache.numel(),), generator=g, dtype=torch.uint8)
    case.cache.copy_(torch.where((data & 0x7F) == 0x7F, data - 1, data).view(case.cache.shape))  # no NaN scale
    case.scale = 1e-3
    case.check(case.run())


# --- model features: sliding window, soft-cap, sinks ------------------------------------------------------------

# Windows of one key, shorter than a page (16 keys), a page, not a multiple of one (edges mid-page), longer than a
# split (512 keys), longer than every context (no key leaves it).
WINDOWS = [1, 5, 16, 37, 100, 700, 5000]


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("block_size", [5, 16, 32])
def test_sliding_window_never_reads_older_keys(window, block_size):
    case = Case(MIXED, window=window, block_size=block_size, swizzle=block_size % 4 == 0, seed=window + block_size)
    poisoned = case.poison_keys_outside_windows()
    assert poisoned > 0 or window == 5000
    case.check(case.run())


@pytest.mark.parametrize("window", [1300, 2**62])
def test_window_as_wide_as_every_context_is_no_window(window):
    case = Case(MIXED, seed=26)
    plain = case.run()
    case.window = window
    assert same_bytes(case.run(), plain)


@pytest.mark.parametrize("window", [1, 37, 600])
def test_sliding_window_non_causal(window):
    """Without the causal mask a row sees every key from its window's start to the end of the context."""
    case = Case([(1, 100), (50, 50), (30, 700)], causal=False, window=window, seed=20 + window)
    case.poison_keys_outside_windows()
    case.check(case.run())


def test_sliding_window_long_contexts():
    """Windows ending deep in long contexts: whole splits before them are skipped, small batches split the rest."""
    case = Case([(1, 5000), (3, 2100), (600, 1700)], kv_heads=1, group=8, window=700, seed=21)
    case.poison_keys_outside_windows()
    case.check(case.run())


@pytest.mark.parametrize("soft_cap", [0.5, 5.0, 30.0, 1e4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_soft_cap(soft_cap, dtype):
    """Caps below and above the logits' range (scale 0.5: logits up to about ±20); a huge cap is nearly none."""
    case = Case(MIXED, soft_cap=soft_cap, scale=0.5, dtype=dtype, seed=22)
    case.check(case.run(), 1e-5 if dtype == torch.float32 else REL_L2)


@pytest.mark.parametrize("shift", [-1e30, -10.0, 0.0, 10.0, 1e30], ids=["none", "low", "even", "high", "all"])
def test_sinks(shift):
    """Sinks far below the logits (nothing changes), comparable to them, and far above (rows go to 0: the kernel's
    exp stops at e^-87 where the reference's underflows, so to within 1e-30)."""
    case = Case(MIXED, sinks=True, dtype=torch.float32, seed=23)
    case.sinks += shift
    out = case.run()
    if shift < 1e30:
        case.check(out, 1e-5)
    else:
        assert out[:case.num_tokens].abs().max() < 1e-30 and torch.isnan(out[case.num_tokens:]).all()


@pytest.mark.parametrize("head_size", [64, 128, 256])
@pytest.mark.parametrize("hnd", [False, True], ids=["NHD", "HND"])
@pytest.mark.parametrize("swizzle", [False, True], ids=["linear", "swizzled"])
@pytest.mark.parametrize("group", [1, 8])
def test_every_feature_every_layout(head_size, hnd, swizzle, group):
    case = Case(MIXED, head_size=head_size, hnd=hnd, swizzle=swizzle, group=group, window=29, soft_cap=3.0,
                sinks=True, seed=head_size + group + 24)
    case.poison_keys_outside_windows()
    case.check(case.run())


@pytest.mark.parametrize("features", [dict(window=40, soft_cap=10.0), dict(window=40, sinks=True),
                                      dict(soft_cap=10.0, sinks=True), dict(window=300, soft_cap=2.0, sinks=True)],
                         ids=["window+cap", "window+sinks", "cap+sinks", "all"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_feature_pairs(features, dtype):
    case = Case(MIXED, dtype=dtype, seed=25, **features)
    case.poison_keys_outside_windows()
    case.check(case.run(), 1e-5 if dtype == torch.float32 else REL_L2)


# --- the result depends only on the row's own query and context ------------------------------------------------

FEATURES = [{}, dict(window=100, soft_cap=5.0, sinks=True)]


@pytest.mark.parametrize("features", FEATURES, ids=["plain", "features"])
def test_request_alone_equals_request_in_a_large_batch(features):
    """Alone, a decode row's splits run as separate tasks; among 80 decodes, one task merges them. Same bytes."""
    case = Case([(1, 3000)] + [(1, 40 + r) for r in range(79)], kv_heads=1, seed=11, **features)
    alone = case.rows(0, 1, [(1, 3000)])
    alone.check(alone.run())
    assert same_bytes(alone.run(), case.run()[:1])


@pytest.mark.parametrize("head_size", [64, 128, 256])
@pytest.mark.parametrize("features", FEATURES + [dict(window=1), dict(window=530)], ids=["plain", "features",
                                                                                         "window 1", "window 530"])
def test_chunks_and_decodes_equal_the_whole_prompt(features, head_size):
    """A prompt in one step, the same prompt in chunks over its cached prefix, and its last row as a decode (with a
    window, each starts reading at its own first row's window: other tiles and splits, the same bytes). On a CPU with
    AVX512-BF16 a decode (bf16 queries) takes the decode code and the prompt the prefill code: the same values to the
    contract's rel-L2."""
    case = Case([(700, 700)], head_size=head_size, seed=12, **features)
    whole = case.run()
    case.check(whole)
    for lo, hi in [(0, 250), (250, 513), (513, 699), (699, 700)]:
        part = case.rows(lo, hi, [(hi - lo, hi)])
        part.poison_keys_outside_windows()  # the chunks come in order: later ones start later
        if BF16_PREFILL and hi - lo < PREFILL_MIN_ROWS:
            assert relative_l2(part.run(), whole[lo:hi]) <= REL_L2, (lo, hi)
        else:
            assert same_bytes(part.run(), whole[lo:hi]), (lo, hi)


@pytest.mark.parametrize("head_size", [64, 128, 256])
@pytest.mark.parametrize("features", FEATURES + [dict(window=200)], ids=["plain", "features", "window 200"])
def test_prefill_among_decodes_equals_its_chunks(features, head_size):
    """Prefill requests (a whole prompt, chunks over cached prefixes, one of PREFILL_MIN_ROWS rows) among decodes, at
    SmolLM2's GQA group of 3: each meets the reference, and gives the bytes of its rows cut into two chunks of one
    batch, where they fill units and vectors of 16 pairs from other offsets."""
    requests = [(1, 900), (40, 1100), (1, 30), (PREFILL_MIN_ROWS, 600), (300, 300), (2, 700)]
    case = Case(requests, head_size=head_size, kv_heads=3, group=3, seed=21, **features)
    case.poison_keys_outside_windows()
    out = case.run()
    case.check(out)
    first = 0
    for r, (n, c) in enumerate(requests):
        cut = n // 2 + 3 if n >= 2 * PREFILL_MIN_ROWS + 6 else n
        if n >= PREFILL_MIN_ROWS:
            chunks = case.rows(first, first + n, [(cut, c - n + cut), (n - cut, c)] if cut < n else [(n, c)])
            chunks.paged.block_table = case.paged.block_table[[r, r] if cut < n else [r]]
            assert same_bytes(chunks.run(), out[first:first + n]), (n, c)
        first += n


THREADS_SCRIPT = """
import pickle, sys, torch
import test_paged_attention_cpu as t
outs = []
for head_size in (64, 128):
    for features in ({}, dict(window=333, soft_cap=4.0, sinks=True), dict(key_format="fp8"), dict(key_format="int8")):
        case = t.Case([(1, 3000), (1, 70), (300, 900), (2, 5000)], head_size=head_size, kv_heads=2, group=4, seed=13,
                      **features)
        outs.append(case.run().view(torch.int16).tolist())
sys.stdout.buffer.write(pickle.dumps(outs))
"""


def run_script(script: str, **env) -> bytes:
    return subprocess.run([sys.executable, "-c", script], cwd=TESTS_DIR, env={**os.environ, **env},
                          capture_output=True, check=True, timeout=600).stdout


def test_identical_bytes_at_one_and_two_threads():
    assert run_script(THREADS_SCRIPT, OMP_NUM_THREADS="1") == run_script(THREADS_SCRIPT, OMP_NUM_THREADS="2")


ISA_SCRIPT = """
import pickle, sys, torch
import test_paged_attention_cpu as t
outs = []
features = dict(window=45, soft_cap=2.0, sinks=True)
for seed, (head_size, hnd, swizzle, dtype, extra) in enumerate([
        (64, False, True, torch.bfloat16, {}), (128, True, False, torch.float16, {}),
        (256, False, False, torch.float32, {}), (128, True, True, torch.float32, {}),
        (64, True, False, torch.float32, features), (128, False, True, torch.bfloat16, features),
        (256, True, True, torch.float32, dict(soft_cap=0.7)), (64, True, True, torch.float32, dict(key_format="fp8")),
        (128, False, False, torch.bfloat16, dict(key_format="fp8", window=45, sinks=True)),
        (64, False, True, torch.bfloat16, dict(key_format="int8")), (128, True, False, torch.float32, dict(key_format="int8")),
        (256, True, True, torch.float16, dict(key_format="int8", window=45, soft_cap=2.0, sinks=True)),
        (256, True, False, torch.bfloat16, {})]):
    case = t.Case(t.MIXED, head_size=head_size, hnd=hnd, swizzle=swizzle, dtype=dtype, seed=seed, **extra)
    if case.layout.key_format == "nvfp4":
        case.poison_keys_outside_windows()
    out = case.run()
    case.check(out)
    outs.append((out[:case.num_tokens].float().tolist(), dtype == torch.float32))
sys.stdout.buffer.write(pickle.dumps(outs))
"""


# avx512bf16: without AMX; avx512: without the BF16 dot product either
@pytest.mark.parametrize("isa", ["avx512bf16", "avx512", "avx2", "baseline"])
def test_instruction_set_variants_agree(isa):
    """This CPU runs its best variant; each lower one, forced, meets the reference and agrees with the best."""
    best = pickle.loads(run_script(ISA_SCRIPT))
    forced = pickle.loads(run_script(ISA_SCRIPT, VLLM_NVFP4_CPU_ISA=isa))
    for (a, float32), (b, _) in zip(best, forced):
        assert relative_l2(torch.tensor(b), torch.tensor(a)) <= (1e-5 if float32 else REL_L2)


@pytest.mark.skipif(not AMX, reason="this CPU has no AMX-BF16, so the AMX variant cannot run here (the others are tested)")
def test_amx_variant_runs_where_the_cpu_has_it():
    """bf16 queries over NVFP4 keys take AMX tile products by default here, requests of 16 query rows or more for
    scores and weighted sums, shorter ones for the scores (the test above checks them against the reference): their
    bytes differ from the forced AVX512-BF16 variant's, whose float32 sums run in another order. float32 and fp16 queries and FP8 and INT8 keys take the same code in both."""
    best = pickle.loads(run_script(ISA_SCRIPT))
    forced = pickle.loads(run_script(ISA_SCRIPT, VLLM_NVFP4_CPU_ISA="avx512bf16"))
    differing = [i for i, ((a, _), (b, _)) in enumerate(zip(best, forced)) if a != b]
    assert differing == [0, 5, 9]  # ISA_SCRIPT's bf16 cases over NVFP4 keys


# --- the core's CPU path --------------------------------------------------------------------------------------

def test_core_runs_the_kernel_and_matches_the_gather_path():
    case = Case(MIXED, kv_heads=2, group=3, seed=14)
    metadata = NVFP4AttentionMetadata(case.query_start_loc, case.seq_lens, case.paged.block_table,
                                      torch.empty(0, dtype=torch.int64), True)  # no host bounds: from the tensors
    out, gathered = torch.full_like(case.query, float("nan")), torch.full_like(case.query, float("nan"))
    paged_attention(case.query, case.cache, metadata, case.scale, case.k_scale, case.v_scale, out)
    paged_attention_reference(case.query, case.cache, metadata, case.scale, case.k_scale, case.v_scale, gathered)
    assert same_bytes(out, case.run())
    rows = case.num_tokens
    assert torch.isnan(gathered[rows:]).all()
    assert relative_l2(out[:rows], gathered[:rows]) <= REL_L2
    for r in range(len(MIXED)):  # and both against fp32 attention over the dequantized K/V
        lo, hi = case.query_start_loc[r:r + 2].tolist()
        assert relative_l2(out[lo:hi], case.paged.expected(r, case.scale)) <= 1e-2


# --- torch.library and argument checks ----------------------------------------------------------------------

def test_opcheck():
    case = Case([(1, 40), (5, 20)], head_size=64, seed=15)
    case.query = case.query[:case.num_tokens]
    out = torch.zeros_like(case.query)
    torch.library.opcheck(torch.ops.vllm_nvfp4.nvfp4_paged_attention.default, args=case.args(out))


def bad_arguments(case: Case):
    """(argument index, replacement, the error's text)."""
    q, cache = case.query, case.cache
    lens = case.seq_lens
    starts = case.query_start_loc
    table = case.paged.block_table
    return [
        (0, q.to(torch.float64), "query: dtype must be bfloat16, float16 or float32"),
        (0, q[..., :64], "query: head size 64 does not match key_cache's 128"),
        (0, q[:, :5], "query: 5 heads are not a positive multiple of key_cache's 2 KV heads"),
        (0, q.transpose(1, 2).contiguous().transpose(1, 2), "query: the head dim must be contiguous"),
        (1, cache[:, 0].view(torch.int8), "key_cache: dtype must be uint8"),
        (2, cache[:, 1, :8], "value_cache: must have key_cache's shape"),
        (3, table.long(), "block_table: dtype must be int32"),
        (3, table[:1], "block_table: needs a row for each of the 2 requests"),
        (3, table[:, :1], "block_table: request 0 of 40 tokens needs 3 blocks"),
        (3, torch.full_like(table, 999), "block_table: entry [0, 0] = 999 is not a block of the cache"),
        (4, starts[:2], "query_start_loc: must have shape [num_reqs + 1]"),
        (4, torch.tensor([1, 1, 6], dtype=torch.int32), "query_start_loc: must start at 0"),
        (4, torch.tensor([0, 4, 2], dtype=torch.int32), "query_start_loc: must be non-decreasing"),
        (4, torch.tensor([0, 1, 99], dtype=torch.int32), "query_start_loc: 99 query tokens do not fit"),
        (5, lens.long(), "seq_lens: dtype must be int32"),
        (5, torch.tensor([40, 4], dtype=torch.int32), "seq_lens: request 1 has 5 query tokens but seq_len 4"),
        (6, torch.ones(2), "k_scale: must hold one float32"),
        (7, torch.ones(1, dtype=torch.float64), "v_scale: dtype must be float32"),
        (11, 0, "max_query_len: request 0 has 1 query tokens, more than max_query_len = 0"),
        (12, 39, "max_seq_len: request 0 has seq_len 40, more than max_seq_len = 39"),
        (12, -1, "max_seq_len: must be non-negative"),
        (13, torch.empty_like(q, dtype=torch.float32), "out: dtype must be query's BFloat16"),
        (13, q[:-1].clone(), "out: must have query's shape"),
        (14, -1, "sliding_window: must be >= 0 (0: no window), got -1"),
        (15, -2.0, "logits_soft_cap: must be finite and >= 0 (0: no soft-cap), got -2"),
        (15, math.inf, "logits_soft_cap: must be finite and >= 0 (0: no soft-cap), got inf"),
        (15, math.nan, "logits_soft_cap: must be finite and >= 0 (0: no soft-cap), got nan"),
        (16, torch.zeros(8, dtype=torch.float64), "sinks: dtype must be float32, got Double"),
        (16, torch.zeros(8, dtype=torch.bfloat16), "sinks: dtype must be float32, got BFloat16"),
        (16, torch.zeros(9), "sinks: must be a contiguous [num_q_heads] = [8] tensor, got shape [9]"),
        (16, torch.zeros(8, 1), "sinks: must be a contiguous [num_q_heads] = [8] tensor, got shape [8, 1]"),
        (16, torch.zeros(16)[::2], "sinks: must be a contiguous [num_q_heads] = [8] tensor"),
    ]


@pytest.mark.parametrize("index", range(32))
def test_bad_arguments_name_the_argument(index):
    case = Case([(1, 40), (5, 20)], seed=16)
    out = torch.full_like(case.query, float("nan"))
    position, replacement, message = bad_arguments(case)[index]
    args = list(case.args(out))
    args[position] = replacement
    with pytest.raises(RuntimeError, match=re.escape(message)):
        ops.nvfp4_paged_attention(*args)
    assert torch.isnan(out).all(), "a rejected call wrote its output"


def test_head_size_must_be_supported():
    case = Case([(1, 40)], head_size=96, seed=17)
    with pytest.raises(RuntimeError, match="key_cache: head size 96 is not 64, 128 or 256"):
        case.run()


# --- fuzzing ----------------------------------------------------------------------------------------------

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def cases(draw) -> Case:
    swizzle = draw(st.booleans())
    block_size = draw(st.integers(1, 8).map(lambda b: 4 * b) if swizzle else st.integers(1, 33))
    requests = []
    for _ in range(draw(st.integers(1, 5))):
        context = draw(st.integers(0, 700))
        requests.append((draw(st.integers(0, min(context, 40))), context))
    return Case(requests, head_size=draw(st.sampled_from([64, 128, 256])), kv_heads=draw(st.integers(1, 3)),
                group=draw(st.sampled_from([1, 2, 3, 4, 8])), block_size=block_size, hnd=draw(st.booleans()),
                swizzle=swizzle, dtype=draw(st.sampled_from([torch.bfloat16, torch.float16, torch.float32])),
                causal=draw(st.booleans()), seed=draw(st.integers(0, 2**20)),
                window=draw(st.one_of(st.just(0), st.integers(1, 800))),
                soft_cap=draw(st.one_of(st.just(0.0), st.floats(0.1, 100.0))), sinks=draw(st.booleans()),
                key_format=draw(st.sampled_from(["nvfp4", "fp8", "int8"])))


@FUZZ
@given(case=cases())
def test_fuzz_against_reference(case):
    if case.layout.key_format == "nvfp4":
        case.poison_keys_outside_windows()
    out = case.run()
    if case.num_tokens:
        case.check(out)
    else:
        assert torch.isnan(out).all()
