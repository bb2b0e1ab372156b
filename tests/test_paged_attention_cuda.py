"""The CUDA `nvfp4_paged_attention` against the plain-torch oracle (fp32 attention over the dequantized cache).

Every case: pages in shuffled order, unused page bytes 0xFF (NaN block scales and NaN FP8 keys, so a read past a
request's length shows), garbage in unused block-table columns, output poisoned with NaN so unwritten rows show and
rows past the batch's tokens must stay untouched. Accuracy: relative L2 error of the whole output ≤ 5e-3. The
byte_keys cases run the same batches over FP8 E4M3 keys, and over INT8 keys (unused scale bytes 0xFFFF: NaN), with
NVFP4 values.
"""

import math

import pytest
import torch

from vllm_nvfp4_plugin import ops, reference
from vllm_nvfp4_plugin.layout import NVFP4PageLayout

pytestmark = pytest.mark.gpu

REL_L2 = 5e-3
PAD_ROWS = 3


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


class Batch:
    """Requests `(query_len, context_len)` over one NVFP4 cache; K/V written by the CUDA store op. `key_format`
    "fp8" or "int8": an FP8- or INT8-key page; with `split_sides` its K and V sides are two allocations of different
    block strides."""

    def __init__(self, requests, *, head_size=128, kv_heads=2, group=4, block_size=16, hnd=False, swizzle=False,
                 dtype=torch.bfloat16, causal=True, kv=None, seed=0, k_scale=0.75, v_scale=1.25, features=None,
                 key_format="nvfp4", split_sides=False):
        self.gen = torch.Generator().manual_seed(seed)
        self.layout = NVFP4PageLayout(head_size, block_size, kv_heads, hnd, swizzle, key_format)
        self.requests, self.causal, self.dtype = requests, causal, dtype
        self.features = dict(features or {})  # sliding_window, logits_soft_cap, sinks
        self.q_heads = kv_heads * group
        pages = [-(-c // block_size) for _, c in requests]
        num_blocks = sum(pages) + 3
        if key_format != "nvfp4":
            self.pages = torch.full((num_blocks, self.layout.page_bytes), 0xFF, dtype=torch.uint8, device="cuda")
            self.key_cache, self.value_cache = self.layout.side_views(self.pages)
            if split_sides:
                self.value_pages = torch.full((num_blocks, self.layout.side_bytes + 48), 0xFF, dtype=torch.uint8,
                                              device="cuda")
                self.value_cache = self.value_pages.as_strided(
                    self.value_cache.shape, (self.value_pages.stride(0), *self.value_cache.stride()[1:]), 0)
        else:
            self.cache = self.pages = self.layout.allocate(num_blocks, "cuda", fill=0xFF)
            self.key_cache, self.value_cache = self.cache[:, 0], self.cache[:, 1]
        order = torch.randperm(num_blocks, generator=self.gen)
        table = torch.full((len(requests), max(pages) + 2), -7, dtype=torch.int32)
        used = 0
        for r, n in enumerate(pages):
            table[r, :n] = order[used:used + n]
            used += n
        self.block_table = table.cuda()
        self.k_scale = torch.tensor([k_scale], device="cuda")
        self.v_scale = torch.tensor([v_scale], device="cuda")
        for r, (_, c) in enumerate(requests):
            k, v = (kv or self.randn)(c, kv_heads, head_size)
            pos = torch.arange(c)
            slots = table[r, pos // block_size].long() * block_size + pos % block_size
            ops.reshape_and_cache_nvfp4(k.cuda(), v.cuda(), self.key_cache, self.value_cache, slots.cuda(),
                                        self.k_scale, self.v_scale, swizzle)
        self.num_tokens = sum(n for n, _ in requests)
        self.query = self.randn(self.num_tokens + PAD_ROWS, self.q_heads, head_size)[0].cuda()
        starts = [0]
        for n, _ in requests:
            starts.append(starts[-1] + n)
        self.query_start_loc = torch.tensor(starts, dtype=torch.int32, device="cuda")
        self.seq_lens = torch.tensor([c for _, c in requests], dtype=torch.int32, device="cuda")
        self.scale = 1.0 / math.sqrt(head_size)

    def randn(self, *shape):
        return tuple(torch.randn(*shape, generator=self.gen).to(self.dtype) for _ in range(2))

    def args(self, out, max_query_len=None, max_seq_len=None):
        return (self.query, self.key_cache, self.value_cache, self.block_table, self.query_start_loc, self.seq_lens,
                self.k_scale, self.v_scale, self.scale, self.causal, self.layout.swizzle_v_scales,
                max_query_len or max(n for n, _ in self.requests), max_seq_len or max(c for _, c in self.requests),
                out)

    def run(self, **bounds) -> torch.Tensor:
        out = torch.full_like(self.query, float("nan"))
        ops.nvfp4_paged_attention(*self.args(out, **bounds), **self.features)
        return out

    def reference(self) -> torch.Tensor:
        out = torch.zeros(self.query.shape, dtype=torch.float32, device="cuda")
        reference.nvfp4_paged_attention(*self.args(out), **self.features)
        return out

    def check(self, out: torch.Tensor, ref: torch.Tensor | None = None) -> float:
        rows = self.num_tokens
        assert torch.isnan(out[rows:]).all(), "rows past query_start_loc[-1] were written"
        assert torch.isfinite(out[:rows]).all(), "a query row was left unwritten or is not finite"
        err = rel_l2(out[:rows], (self.reference() if ref is None else ref)[:rows])
        assert err <= REL_L2, f"relative L2 error {err:.2e} > {REL_L2}"
        return err


DECODES = [(1, 1), (1, 17), (1, 300), (1, 1025), (1, 4100)]


@pytest.mark.parametrize("head_size", [64, 128, 256])
@pytest.mark.parametrize("hnd", [False, True])
@pytest.mark.parametrize("swizzle", [False, True])
def test_decode_layouts(head_size, hnd, swizzle):
    batch = Batch(DECODES, head_size=head_size, hnd=hnd, swizzle=swizzle)
    batch.check(batch.run())


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_groups_and_dtypes(group, dtype):
    batch = Batch(DECODES, group=group, dtype=dtype, seed=group)
    batch.check(batch.run())


def test_long_context_splits():
    """One request over 40,000 tokens: the KV range is split across many CTAs and merged."""
    batch = Batch([(1, 40000), (1, 3)], kv_heads=1, group=8, seed=3)
    batch.check(batch.run())


@pytest.mark.parametrize("next_n", [2, 3, 5])
def test_multi_token_decode(next_n):
    """next_n query tokens a request (speculative decode): causal inside the step, GQA rows share the tiles."""
    batch = Batch([(next_n, 40), (next_n, 1000), (next_n, next_n)], group=8, seed=next_n)
    batch.check(batch.run())


@pytest.mark.parametrize("head_size", [64, 128, 256])
@pytest.mark.parametrize("hnd", [False, True])
def test_prefill_chunked_and_mixed(head_size, hnd):
    """Decodes, a whole prompt, chunks after cached prefixes (causal offset), in one launch."""
    requests = [(1, 500), (1, 33), (200, 200), (77, 1000), (64, 64), (5, 130)]
    batch = Batch(requests, head_size=head_size, hnd=hnd, seed=head_size)
    batch.check(batch.run())


@pytest.mark.parametrize("requests", [[(1, 100), (50, 50), (30, 300)], [(1, 100), (3, 50), (2, 300)]],
                         ids=["mixed", "decode"])
def test_non_causal(requests):
    batch = Batch(requests, causal=False, seed=5)
    batch.check(batch.run())


@pytest.mark.parametrize("block_size", [1, 4, 8, 24, 32, 64])
@pytest.mark.parametrize("head_size", [64, 128])  # the decode kernel copies head 64's rows its own way
def test_decode_block_sizes(block_size, head_size):
    """Blocks a multiple of 16 (one table read a 16-key block) and not (a read a key), swizzled where allowed."""
    # The op takes block sides on 16-byte boundaries: a head-64 block of one key (36 bytes a head and side) needs
    # 4 KV heads for that.
    kv_heads = 4 if head_size == 64 else 2
    batch = Batch(DECODES + [(2, 500)], block_size=block_size, head_size=head_size, kv_heads=kv_heads,
                  swizzle=block_size % 4 == 0, seed=block_size)
    batch.check(batch.run())


FEATURE_BATCHES = {
    "decode": [(1, 1), (1, 37), (1, 700), (1, 2100)],
    "spec": [(3, 300), (2, 50), (3, 3)],  # 12 query rows a request: the decode kernel's two n8 blocks
    "prefill": [(40, 200), (7, 7), (1, 90), (64, 1100)],
}


def _sinks(q_heads, seed):
    g = torch.Generator().manual_seed(seed)
    sinks = torch.randn(q_heads, generator=g) * 2
    sinks[::3] += 6.0  # a few heads whose sink outweighs every key
    return sinks.cuda()


@pytest.mark.parametrize("batch_kind", list(FEATURE_BATCHES))
@pytest.mark.parametrize("window", [1, 5, 16, 23, 100, 5000])
@pytest.mark.parametrize("head_size", [64, 128])  # the decode kernel copies head 64's rows its own way
def test_sliding_window(batch_kind, window, head_size):
    """Windows shorter and longer than a page, edges mid-page. Keys before the window are never read: the pages
    wholly before it are overwritten with 0xFF (NaN block scales) after the reference has read them."""
    batch = Batch(FEATURE_BATCHES[batch_kind], head_size=head_size, block_size=16, swizzle=window % 2 == 1,
                  seed=window, features={"sliding_window": window})
    ref = batch.reference()
    for r, (n, c) in enumerate(batch.requests):
        first_visible = max(0, c - n - window + 1)
        batch.pages[batch.block_table[r, :first_visible // 16].long()] = 0xFF
    batch.check(batch.run(), ref)


@pytest.mark.parametrize("batch_kind", list(FEATURE_BATCHES))
@pytest.mark.parametrize("head_size", [64, 128, 256])
def test_soft_cap_and_sinks(batch_kind, head_size):
    batch = Batch(FEATURE_BATCHES[batch_kind], head_size=head_size, seed=head_size, block_size=32)
    batch.scale = 4.0 / math.sqrt(head_size)  # logits of several units, so a cap of 3 bends them
    for features in ({"logits_soft_cap": 3.0}, {"sinks": _sinks(batch.q_heads, head_size)},
                     {"sliding_window": 37, "logits_soft_cap": 3.0, "sinks": _sinks(batch.q_heads, 1)}):
        batch.features = features
        batch.check(batch.run())


def test_sinks_with_splits():
    """A long request: the sinks join the split-KV merge once, not once a split."""
    batch = Batch([(1, 30000), (1, 5)], kv_heads=1, group=8, seed=11)
    batch.features = {"sinks": _sinks(8, 11)}
    batch.check(batch.run())
    batch.features = {"sinks": _sinks(8, 12), "sliding_window": 4000}
    batch.check(batch.run())


def test_loose_bounds():
    """Host bounds above the real lengths (a CUDA graph's capture sizes) give the same result."""
    batch = Batch([(1, 700), (9, 300)], seed=6)
    exact = batch.run()
    batch.check(exact)
    loose = batch.run(max_query_len=64, max_seq_len=20000)
    batch.check(loose)


@pytest.mark.parametrize("features", [{}, {"sinks": True}], ids=["plain", "sinks"])
def test_decode_bits_independent_of_bounds_and_padding(features):
    """A decode request's output bits depend on it alone: not on the host's max_seq_len bound (vLLM captures its CUDA
    graphs for max_model_len) nor on empty requests padding the batch (to a graph's capture size), so an engine's
    eager steps and graph replays give the same tokens."""
    batch = Batch([(1, 3000), (1, 700), (1, 20)], seed=13)
    if features:
        batch.features = {"sinks": _sinks(batch.q_heads, 13)}
    exact = batch.run()
    batch.check(exact)
    rows = batch.num_tokens
    assert torch.equal(batch.run(max_seq_len=32768)[:rows], exact[:rows])
    batch.query_start_loc = torch.cat([batch.query_start_loc, batch.query_start_loc[-1:]])
    batch.seq_lens = torch.cat([batch.seq_lens, torch.zeros_like(batch.seq_lens[:1])])
    batch.block_table = torch.cat([batch.block_table, batch.block_table[:1]])
    padded = batch.run(max_seq_len=32768)
    assert torch.equal(padded[:rows], exact[:rows])
    assert torch.isnan(padded[rows:]).all()


def _adversarial_kv(kind):
    def make(n, heads, d):
        g = torch.Generator().manual_seed(n)
        x = torch.randn(2, n, heads, d, generator=g)
        groups = x.view(2, n, heads, d // 16, 16)
        if kind == "outliers":  # one element a group 200x the rest
            groups[..., 3] *= 200.0
        elif kind == "zero_groups":  # every other group all zero (block scale 0)
            groups[..., ::2, :] = 0.0
        elif kind == "saturated":  # block scales saturate at 448, codes at ±6
            groups *= 1e4
        elif kind == "zero_keys":  # every third key all zero (INT8: scale 0)
            x[0, ::3] = 0.0
        elif kind == "fp16_top":  # INT8 key scales saturate at 65504, codes at ±127
            groups *= 1e8
        return x[0].bfloat16(), x[1].bfloat16()
    return make


@pytest.mark.parametrize("requests", [[(1, 300), (1, 2000), (40, 500)], [(1, 300), (1, 2000), (2, 77)]],
                         ids=["mixed", "decode"])
@pytest.mark.parametrize("kind", ["outliers", "zero_groups", "saturated"])
def test_adversarial_values(kind, requests):
    batch = Batch(requests, kv=_adversarial_kv(kind), seed=7, k_scale=1.0, v_scale=1.0)
    if kind in ("outliers", "saturated"):
        batch.scale = 1e-4  # keeps the logits in a range where fp32 reference and kernel agree on the softmax
    batch.check(batch.run())


@pytest.mark.parametrize("key_format", ["nvfp4", "fp8", "int8"], ids=["nvfp4_keys", "fp8_keys", "int8_keys"])
@pytest.mark.parametrize("requests", [[(1, 700), (20, 900)], [(1, 700), (1, 900)]], ids=["mixed", "decode"])
def test_random_cache_bytes(requests, key_format):
    """Every code and scale bit pattern (subnormal and max block scales included; with FP8 keys every key byte but the
    NaNs, subnormals and ±448 included; with INT8 keys every code, -128 included, and fp16 scales of either sign up to
    2^-3, subnormals and 0 included), written straight into the pages."""
    batch = Batch(requests, head_size=128, swizzle=True, key_format=key_format, seed=8)
    g = torch.Generator().manual_seed(8)
    raw = torch.randint(0, 256, batch.pages.shape, generator=g, dtype=torch.uint8)
    data = torch.where((raw & 0x7F) == 0x7F, raw - 1, raw)  # no E4M3 NaN scale or key
    if key_format == "int8":
        codes = batch.layout.entries * batch.layout.head_size
        data[:, :codes] = raw[:, :codes]
        high = data[:, codes + 1:codes + 2 * batch.layout.entries:2]  # the scales' sign and exponent bytes
        high.copy_((high & 0x80) | (high & 0x7F) % 0x30)
    batch.pages.copy_(data.cuda())
    batch.scale = 1e-3
    batch.check(batch.run())


@pytest.mark.parametrize("key_format", ["nvfp4", "fp8", "int8"], ids=["nvfp4_keys", "fp8_keys", "int8_keys"])
def test_cuda_graph_replay_with_new_lengths(key_format):
    """Captured once at the bounds, replayed after the lengths and queries changed in place."""
    batch = Batch([(1, 3000), (1, 2600), (1, 20)], group=4, key_format=key_format, seed=9)
    out = torch.full_like(batch.query, float("nan"))
    args = batch.args(out, max_query_len=1, max_seq_len=4096)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ops.nvfp4_paged_attention(*args)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.nvfp4_paged_attention(*args)
    batch.seq_lens.copy_(torch.tensor([17, 2500, 1], dtype=torch.int32))  # every request shrinks: its pages stay
    batch.requests = [(1, 17), (1, 2500), (1, 1)]
    batch.query.copy_(torch.randn(batch.query.shape, generator=batch.gen).to(batch.dtype))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    batch.check(out)


def test_bad_inputs_name_the_argument():
    batch = Batch([(1, 20)])
    out = torch.empty_like(batch.query)
    args = list(batch.args(out))
    with pytest.raises(RuntimeError, match="query: dtype must be bfloat16 or float16"):
        ops.nvfp4_paged_attention(batch.query.float(), *args[1:-1], out.float())
    with pytest.raises(RuntimeError, match="out: dtype must be query's"):
        ops.nvfp4_paged_attention(*args[:-1], out.half())
    with pytest.raises(RuntimeError, match="query_start_loc"):
        ops.nvfp4_paged_attention(args[0], *args[1:4], batch.query_start_loc[:1], *args[5:])
    with pytest.raises(RuntimeError, match="sliding_window: must be >= 0"):
        ops.nvfp4_paged_attention(*args, sliding_window=-1)
    with pytest.raises(RuntimeError, match="logits_soft_cap: must be finite and >= 0"):
        ops.nvfp4_paged_attention(*args, logits_soft_cap=float("inf"))
    with pytest.raises(RuntimeError, match="sinks: must be a contiguous"):
        ops.nvfp4_paged_attention(*args, sinks=torch.zeros(3, device="cuda"))


def test_reader_routes_core_metadata_to_the_kernel():
    """The CUDA reader's default: core metadata with host bounds goes to the kernel."""
    from vllm_nvfp4_plugin.attention import NVFP4AttentionMetadata
    from vllm_nvfp4_plugin.attention.flashinfer_reader import cuda_paged_attention

    batch = Batch([(1, 300), (30, 80)], seed=10)
    metadata = NVFP4AttentionMetadata(batch.query_start_loc, batch.seq_lens, batch.block_table,
                                      torch.empty(0, dtype=torch.int64, device="cuda"), True, 30, 300)
    out = torch.full_like(batch.query, float("nan"))
    cuda_paged_attention(batch.query, batch.cache, metadata, batch.scale, batch.k_scale, batch.v_scale, 0.75, 1.25,
                         out)
    batch.check(out)


@pytest.mark.parametrize("requests", [[(4096, 4096)], [(64, 1000), (200, 200)]])
def test_dequant_prefill_matches_reference(requests):
    """The other prefill route: pages dequantized to bf16, FlashInfer fa3 ragged prefill (causal offset per request)."""
    pytest.importorskip("flashinfer")
    from vllm_nvfp4_plugin.attention.flashinfer_reader import DequantPrefill

    batch = Batch(requests, seed=11)
    prefill = DequantPrefill(torch.device("cuda"))
    prefill.plan(batch.query_start_loc.cpu(), batch.seq_lens.cpu(), batch.q_heads, batch.layout.num_heads,
                 batch.layout.head_size, True, batch.scale)
    out = torch.full_like(batch.query, float("nan"))
    prefill.run(batch.query, batch.cache, batch.block_table, batch.k_scale, batch.v_scale, out)
    batch.check(out)


def test_dequant_prefill_gathers_from_the_window():
    """`DequantPrefill.gather` dequantizes each request's tokens from the first block its window reaches on, as the
    reference gather does over those blocks, bit for bit."""
    pytest.importorskip("flashinfer")
    from vllm_nvfp4_plugin.attention.flashinfer_reader import DequantPrefill

    batch = Batch([(40, 1000), (300, 300)], seed=12)
    prefill = DequantPrefill(torch.device("cuda"))
    prefill.plan(batch.query_start_loc.cpu(), batch.seq_lens.cpu(), batch.q_heads, batch.layout.num_heads,
                 batch.layout.head_size, True, batch.scale, sliding_window=100, block_size=16)
    key, value = prefill.gather(batch.cache, prefill.visible_table(batch.block_table), batch.k_scale, batch.v_scale)
    first = (1000 - 40 - 100 + 1) // 16  # the first query sees keys 861 on: block 53
    table = torch.full_like(batch.block_table, -1)
    table[0, :batch.block_table.size(1) - first] = batch.block_table[0, first:]
    table[1] = batch.block_table[1]
    lengths = [1000 - 16 * first, 300]
    cu = torch.tensor([0, lengths[0], sum(lengths)], dtype=torch.int32, device="cuda")
    ref_key, ref_value = torch.full_like(key, float("nan")), torch.full_like(value, float("nan"))
    reference.gather_nvfp4_kv_cache(batch.key_cache, batch.value_cache, table, cu, batch.k_scale, batch.v_scale, False,
                                    ref_key, ref_value)
    assert key.shape == (sum(lengths), batch.layout.num_heads, batch.layout.head_size)
    assert torch.equal(key, ref_key) and torch.equal(value, ref_value)


def test_kernel_batch_decodes_by_kernel_prefills_by_dequant():
    """A mixed batch planned by plan_kernel_batch: leading decodes through the kernel, the rest dequantized + fa3."""
    pytest.importorskip("flashinfer")
    from vllm_nvfp4_plugin.attention import NVFP4AttentionMetadata
    from vllm_nvfp4_plugin.attention.flashinfer_reader import DequantPrefill, cuda_paged_attention, plan_kernel_batch

    batch = Batch([(1, 300), (1, 50), (64, 1000), (200, 200)], seed=12)
    metadata = NVFP4AttentionMetadata(batch.query_start_loc, batch.seq_lens, batch.block_table,
                                      torch.empty(0, dtype=torch.int64, device="cuda"), True, 200, 1000)
    plan = plan_kernel_batch(metadata, batch.query_start_loc.cpu(), batch.seq_lens.cpu(),
                             DequantPrefill(torch.device("cuda")), batch.q_heads, batch.layout.num_heads,
                             batch.layout.head_size, batch.scale)
    assert plan.num_decode_tokens == 2 and plan.decodes.num_reqs == 2
    out = torch.full_like(batch.query, float("nan"))
    cuda_paged_attention(batch.query, batch.cache, plan, batch.scale, batch.k_scale, batch.v_scale, 0.75, 1.25, out)
    batch.check(out)


DEQUANT_FEATURES = [{"sliding_window": 1}, {"sliding_window": 23}, {"sliding_window": 100},
                    {"sliding_window": 5000}, {"logits_soft_cap": 3.0}, {"sinks": True},
                    {"sliding_window": 100, "sinks": True},
                    {"sliding_window": 37, "logits_soft_cap": 3.0, "sinks": True}]


@pytest.mark.parametrize("features", DEQUANT_FEATURES, ids=lambda f: "+".join(f"{k}={v}" for k, v in f.items()))
@pytest.mark.parametrize("head_size", [64, 128])
def test_kernel_batch_with_model_features(features, head_size):
    """A layer's window, soft-cap and sinks through plan_kernel_batch: decodes by the kernel, prefills dequantized +
    fa3 with its window and soft-cap, sinks through its sink variant (with a soft-cap, from its log-sum-exp). The
    pages wholly before each request's window are overwritten with 0xFF (NaN block scales) after the reference has
    read them: the gather skips them. A layer whose features differ from the plan's is refused."""
    pytest.importorskip("flashinfer")
    from vllm_nvfp4_plugin.attention import NVFP4AttentionMetadata
    from vllm_nvfp4_plugin.attention.flashinfer_reader import DequantPrefill, cuda_paged_attention, plan_kernel_batch

    requests = [(1, 700), (1, 37), (40, 200), (7, 7), (64, 1100), (300, 2000)]
    batch = Batch(requests, head_size=head_size, block_size=16, seed=head_size + len(features))
    batch.scale = 4.0 / math.sqrt(head_size)  # logits of several units, so a cap of 3 bends them
    features = dict(features)
    if features.pop("sinks", False):
        features["sinks"] = _sinks(batch.q_heads, head_size)
    batch.features = features
    ref = batch.reference()
    window = features.get("sliding_window", 0)
    if window:
        for r, (n, c) in enumerate(requests):
            first_visible = max(0, c - n - window + 1)
            batch.pages[batch.block_table[r, :first_visible // 16].long()] = 0xFF
    metadata = NVFP4AttentionMetadata(batch.query_start_loc, batch.seq_lens, batch.block_table,
                                      torch.empty(0, dtype=torch.int64, device="cuda"), True, 300, 2000)
    plan = plan_kernel_batch(metadata, batch.query_start_loc.cpu(), batch.seq_lens.cpu(),
                             DequantPrefill(torch.device("cuda")), batch.q_heads, batch.layout.num_heads, head_size,
                             batch.scale, block_size=16, sliding_window=window,
                             logits_soft_cap=features.get("logits_soft_cap", 0.0), sinks="sinks" in features)
    assert plan.num_decode_tokens == 2
    out = torch.full_like(batch.query, float("nan"))
    cuda_paged_attention(batch.query, batch.cache, plan, batch.scale, batch.k_scale, batch.v_scale, 0.75, 1.25, out,
                         **features)
    batch.check(out, ref)
    with pytest.raises(ValueError, match="planned for"):
        cuda_paged_attention(batch.query, batch.cache, plan, batch.scale, batch.k_scale, batch.v_scale, 0.75, 1.25,
                             out, **{**features, "sliding_window": window + 1})
    other_sinks = {**features, "sinks": None if "sinks" in features else _sinks(batch.q_heads, 3)}
    with pytest.raises(ValueError, match="planned for"):
        cuda_paged_attention(batch.query, batch.cache, plan, batch.scale, batch.k_scale, batch.v_scale, 0.75, 1.25,
                             out, **other_sinks)
    if "sinks" in features:  # FlashInfer's sink variant reads float32 [heads] unchecked: the prefill checks first
        with pytest.raises(ValueError, match="sinks must be a contiguous float32"):
            plan.prefill.run(batch.query[2:], batch.cache, plan.prefill_block_table, batch.k_scale, batch.v_scale,
                             out[2:], features["sinks"].to(torch.bfloat16))


@pytest.mark.parametrize("head_size", [128, 256])
def test_kernel_batch_with_fa2_decodes(head_size):
    """The "fa2" reader on SM90: leading decodes through FlashInfer fa2, the rest dequantized + fa3."""
    pytest.importorskip("flashinfer")
    from vllm_nvfp4_plugin.attention import NVFP4AttentionMetadata
    from vllm_nvfp4_plugin.attention.flashinfer_reader import (DequantPrefill, FlashInferNVFP4Decoder,
                                                               cuda_paged_attention, plan_kernel_batch)

    batch = Batch([(1, 300), (1, 50), (64, 1000), (200, 200)], head_size=head_size, seed=13)
    metadata = NVFP4AttentionMetadata(batch.query_start_loc, batch.seq_lens, batch.block_table,
                                      torch.empty(0, dtype=torch.int64, device="cuda"), True, 200, 1000)
    decoder = FlashInferNVFP4Decoder(torch.device("cuda"), hnd=False)
    plan = plan_kernel_batch(metadata, batch.query_start_loc.cpu(), batch.seq_lens.cpu(),
                             DequantPrefill(torch.device("cuda")), batch.q_heads, batch.layout.num_heads, head_size,
                             batch.scale, torch.bfloat16, decoder, batch.layout.block_size)
    assert plan.decoder is decoder and plan.decodes is None and plan.num_decode_tokens == 2
    out = torch.full_like(batch.query, float("nan"))
    cuda_paged_attention(batch.query, batch.cache, plan, batch.scale, batch.k_scale, batch.v_scale, 0.75, 1.25, out)
    batch.check(out)


# --- FP8 E4M3 or INT8 keys, NVFP4 values (an fp8_keys or int8-key page) ---------------------------------------

BYTE_KEYS = pytest.mark.parametrize("key_format", ["fp8", "int8"], ids=["fp8_keys", "int8_keys"])


@BYTE_KEYS
@pytest.mark.parametrize("head_size", [64, 128, 256])
@pytest.mark.parametrize("hnd", [False, True], ids=["NHD", "HND"])
@pytest.mark.parametrize("swizzle", [False, True], ids=["linear", "swizzled"])
def test_byte_keys_decode_layouts(key_format, head_size, hnd, swizzle):
    batch = Batch(DECODES, head_size=head_size, hnd=hnd, swizzle=swizzle, key_format=key_format, seed=head_size + hnd)
    batch.check(batch.run())


@BYTE_KEYS
@pytest.mark.parametrize("head_size", [64, 128, 256])
@pytest.mark.parametrize("hnd", [False, True], ids=["NHD", "HND"])
def test_byte_keys_prefill_chunked_and_mixed(key_format, head_size, hnd):
    requests = [(1, 500), (1, 33), (200, 200), (77, 1000), (64, 64), (5, 130)]
    batch = Batch(requests, head_size=head_size, hnd=hnd, swizzle=hnd, key_format=key_format, seed=head_size + 1)
    batch.check(batch.run())


@BYTE_KEYS
@pytest.mark.parametrize("group,dtype,next_n", [(1, torch.float16, 1), (8, torch.bfloat16, 1), (4, torch.float16, 3),
                                                (8, torch.bfloat16, 2), (4, torch.bfloat16, 5)])
def test_byte_keys_groups_dtypes_and_multi_token(key_format, group, dtype, next_n):
    """Query rows of 1 to 40 a request: both n8 widths of the decode kernel and both warp splits of the fused one."""
    batch = Batch([(next_n, 40), (next_n, 1000), (next_n, next_n)], group=group, dtype=dtype, key_format=key_format,
                  seed=group + next_n)
    batch.check(batch.run())


@BYTE_KEYS
@pytest.mark.parametrize("block_size,split_sides,kv_heads", [(8, False, 2), (24, True, 2), (64, True, 2),
                                                             (24, False, 3)])
def test_byte_keys_block_sizes_and_side_strides(key_format, block_size, split_sides, kv_heads):
    """Blocks not a multiple of 16 (a table read a key; with 3 heads a block's tokens alternate between the halves of
    the INT8 scale words); K and V sides of different block strides."""
    batch = Batch(DECODES + [(2, 500), (40, 300)], block_size=block_size, kv_heads=kv_heads,
                  swizzle=block_size % 4 == 0, key_format=key_format, split_sides=split_sides, seed=block_size)
    assert batch.key_cache.stride(0) != batch.value_cache.stride(0) or not split_sides
    batch.check(batch.run())


@BYTE_KEYS
def test_byte_keys_long_context_splits_and_sinks(key_format):
    batch = Batch([(1, 40000), (1, 3)], kv_heads=1, group=8, key_format=key_format, seed=3)
    batch.check(batch.run())
    batch.features = {"sinks": _sinks(8, 11), "sliding_window": 4000}
    batch.check(batch.run())


@BYTE_KEYS
@pytest.mark.parametrize("batch_kind", list(FEATURE_BATCHES))
@pytest.mark.parametrize("head_size", [64, 128, 256])
def test_byte_keys_model_features(key_format, batch_kind, head_size):
    """Sliding window (pages wholly before it overwritten with 0xFF after the reference read them), soft-cap, sinks."""
    batch = Batch(FEATURE_BATCHES[batch_kind], head_size=head_size, block_size=16, swizzle=True, key_format=key_format,
                  seed=head_size)
    batch.scale = 4.0 / math.sqrt(head_size)  # logits of several units, so a cap of 3 bends them
    for features in ({"logits_soft_cap": 3.0}, {"sinks": _sinks(batch.q_heads, head_size)},
                     {"sliding_window": 37, "logits_soft_cap": 3.0, "sinks": _sinks(batch.q_heads, 1)}):
        batch.features = features
        batch.check(batch.run())
    window = 23
    batch.features = {"sliding_window": window}
    ref = batch.reference()
    for r, (n, c) in enumerate(batch.requests):
        batch.pages[batch.block_table[r, :max(0, c - n - window + 1) // 16].long()] = 0xFF
    batch.check(batch.run(), ref)


@BYTE_KEYS
@pytest.mark.parametrize("requests", [[(1, 300), (1, 2000), (40, 500)], [(1, 300), (1, 2000), (2, 77)]],
                         ids=["mixed", "decode"])
@pytest.mark.parametrize("kind", ["outliers", "zero_groups", "saturated", "zero_keys", "fp16_top"])
def test_byte_keys_adversarial_values(key_format, kind, requests):
    """Outlier channels, zero groups, all-zero keys (INT8 scale 0), keys past ±448 (saturated FP8) and past 127 · 65504
    (saturated INT8 scale and codes), with values past NVFP4's range."""
    batch = Batch(requests, kv=_adversarial_kv(kind), key_format=key_format, seed=7, k_scale=1.0, v_scale=1.0)
    if kind in ("outliers", "saturated", "fp16_top"):
        batch.scale = 1e-4 if kind != "fp16_top" else 1e-8
    batch.check(batch.run())


