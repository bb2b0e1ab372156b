"""FlashInfer reader views (CPU) and the CUDA attention paths (GPU) against fp32 attention over the dequantized cache."""

import pytest
import torch

from vllm_nvfp4_plugin import reference
from vllm_nvfp4_plugin.attention import NVFP4AttentionMetadata, paged_attention, store_kv
from vllm_nvfp4_plugin.attention.flashinfer_reader import (
    FlashInferNVFP4Decoder, cuda_paged_attention, flashinfer_decode_unavailable_reason, nvfp4_flashinfer_views,
    add_sinks, plan_batch, window_first_blocks)
from vllm_nvfp4_plugin.layout import NVFP4PageLayout
from vllm_nvfp4_plugin.tools.paged_case import PagedCase

K_SCALE, V_SCALE = 0.75, 1.25  # non-unit global dequant scales, as a checkpoint may give


def _random_cache(layout, num_blocks, num_tokens, device, gen):
    """A cache with `num_tokens` tokens written by the reference store at shuffled slots; returns (cache, k, v, slots)."""
    cache = layout.allocate(num_blocks, device, fill=0)
    k = torch.randn(num_tokens, layout.num_heads, layout.head_size, generator=gen).to(device, torch.bfloat16)
    v = torch.randn(num_tokens, layout.num_heads, layout.head_size, generator=gen).to(device, torch.bfloat16)
    slots = torch.randperm(num_blocks * layout.block_size, generator=gen)[:num_tokens].to(device)
    reference.reshape_and_cache_nvfp4(k, v, cache[:, 0], cache[:, 1], slots, torch.tensor(K_SCALE),
                                      torch.tensor(V_SCALE), False)
    return cache, k, v, slots


@pytest.mark.parametrize("hnd", [False, True])
@pytest.mark.parametrize("head_size", [64, 128])
def test_flashinfer_views_address_every_entry(hnd, head_size):
    """The strided data/scale views FlashInfer gets decode to exactly what the reference store encoded."""
    gen = torch.Generator().manual_seed(0)
    layout = NVFP4PageLayout(head_size, block_size=16, num_heads=3, hnd=hnd)
    cache, k, v, slots = _random_cache(layout, num_blocks=5, num_tokens=50, device="cpu", gen=gen)
    blocks, offsets = slots // layout.block_size, slots % layout.block_size
    for side, x, g in ((0, k, K_SCALE), (1, v, V_SCALE)):
        data, sf = nvfp4_flashinfer_views(cache[:, side], layout)
        assert data.dtype == torch.uint8 and sf.dtype == torch.float8_e4m3fn
        if hnd:  # FlashInfer's HND page is [head, token]; compare in token-major order
            data, sf = data.transpose(1, 2), sf.transpose(1, 2)
        packed, scales = reference.nvfp4_encode(x, g)
        assert torch.equal(data[blocks, offsets], packed)
        assert torch.equal(sf[blocks, offsets].view(torch.uint8), scales.view(torch.uint8))


@pytest.mark.parametrize("window", [0, 1, 5, 16, 17, 100])
def test_window_first_blocks_hold_the_first_visible_key(window):
    """The dequantized prefill gathers from the block of the first key any of a request's queries sees: no block
    before it holds a visible key, and it holds one."""
    block = 16
    requests = [(1, 1), (1, 40), (5, 5), (30, 33), (7, 160), (64, 1000), (100, 100)]  # (query_len, context_len)
    query_lens = torch.tensor([n for n, _ in requests])
    seq_lens = torch.tensor([c for _, c in requests], dtype=torch.int32)
    first = window_first_blocks(query_lens, seq_lens, window, block)
    for (n, c), b in zip(requests, first.tolist()):
        queries = torch.arange(c - n, c)
        keys = torch.arange(c)
        visible = keys[None, :] <= queries[:, None]
        if window:
            visible &= keys[None, :] > queries[:, None] - window
        first_key = int(keys[visible.any(0)].min())
        assert b == first_key // block, (n, c, b, first_key)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_sinks_matches_a_softmax_with_a_sink_column(dtype):
    """Rows normalized over the keys alone plus their log2 log-sum-exp (what fa3 returns), then add_sinks, equal
    attention whose softmax has each head's sink logit as one more column, dropped from the output."""
    gen = torch.Generator().manual_seed(0)
    tokens, heads, keys, d = 5, 4, 9, 16
    logits = torch.randn(tokens, heads, keys, generator=gen) * 3
    values = torch.randn(keys, heads, d, generator=gen)
    sinks = torch.randn(heads, generator=gen) * 2
    sinks[0] += 6.0  # a head whose sink outweighs every key
    out = torch.einsum("thk,khd->thd", logits.softmax(-1), values).to(dtype)
    lse = torch.logsumexp(logits, -1) / torch.log(torch.tensor(2.0))
    with_sink = torch.cat([logits, sinks.view(1, heads, 1).expand(tokens, heads, 1)], -1).softmax(-1)[..., :keys]
    want = torch.einsum("thk,khd->thd", with_sink, values)
    got = add_sinks(out, lse, sinks)
    assert got.data_ptr() == out.data_ptr()
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert torch.allclose(got.float(), want, rtol=tol, atol=tol)


def test_head_64_and_cpu_are_not_flashinfer():
    assert "head sizes" in flashinfer_decode_unavailable_reason(64, torch.device("cpu"))
    assert "not CUDA" in flashinfer_decode_unavailable_reason(128, torch.device("cpu"))


# --- GPU -----------------------------------------------------------------------------------------

# (query_len, context_len): three decodes, a fresh prompt, a chunk over a cached prefix; decodes first, as vLLM orders.
REQUESTS = [(1, 1), (1, 300), (1, 1025), (7, 7), (16, 200)]
NUM_Q_HEADS, NUM_KV_HEADS, BLOCK_SIZE, NUM_PADDING = 8, 2, 16, 2


class DeviceBatch(PagedCase):
    """A PagedCase on the GPU: each request's earlier tokens stored in an earlier step, this step's tokens stored
    now (by the compiled CUDA op), blocks shuffled, garbage in unused bytes."""

    def __init__(self, layout, device, gen):
        super().__init__(REQUESTS, layout, NUM_Q_HEADS, gen, k_scale=K_SCALE, v_scale=V_SCALE, spare_blocks=3)
        self.cache = layout.allocate(self.num_blocks, device, fill=0xFF)
        self.k_scale, self.v_scale = torch.tensor(K_SCALE, device=device), torch.tensor(V_SCALE, device=device)
        _, key, value, slot_mapping = self.step()
        for k, v, slots in (self.earlier_tokens(), (key, value, slot_mapping)):
            store_kv(k.to(device), v.to(device), self.cache, slots.to(device), self.k_scale, self.v_scale)
        self.query = self.step(NUM_PADDING)[0].to(device)
        self.metadata = NVFP4AttentionMetadata.from_lengths(self.query_lens, self.seq_lens,
                                                            self.block_table.to(device), slot_mapping.to(device))
        self.query_start_cpu = self.metadata.query_start_loc.cpu()
        self.seq_lens_cpu = self.metadata.seq_lens.cpu()

    def check(self, out, scale, label):
        """rel-L2 of each request's output against fp32 attention over the reference-dequantized K/V."""
        errors = self.errors(out, scale)
        for (n, c), err in zip(REQUESTS, errors):
            print(f"{label} request (q={n}, ctx={c}) rel_l2={err:.2e}")
        assert max(errors) <= 1e-2, f"{label}: rel-L2 per request {errors}"
        assert torch.all(out[sum(self.query_lens):].cpu() == 7.0), f"{label}: padding rows must stay untouched"


@pytest.mark.gpu
@pytest.mark.parametrize("hnd", [False, True])
@pytest.mark.parametrize("head_size", [64, 128, 256])
def test_core_on_cuda_matches_fp32_attention(head_size, hnd):
    """The core (CUDA store, CUDA gather+dequantize, SDPA) for decodes, a prompt and a chunk over a prefix."""
    gen = torch.Generator().manual_seed(head_size + hnd)
    batch = DeviceBatch(NVFP4PageLayout(head_size, BLOCK_SIZE, NUM_KV_HEADS, hnd=hnd), "cuda", gen)
    out = torch.full_like(batch.query, 7.0)
    scale = head_size ** -0.5
    paged_attention(batch.query, batch.cache, batch.metadata, scale, batch.k_scale, batch.v_scale, out)
    batch.check(out, scale, f"core head={head_size} {'HND' if hnd else 'NHD'}")


@pytest.mark.gpu
@pytest.mark.parametrize("hnd", [False, True])
@pytest.mark.parametrize("head_size", [128, 256])
def test_flashinfer_decode_plus_core_prefill_matches_fp32_attention(head_size, hnd):
    """The CUDA backend's path: the three leading decodes through FlashInfer fa2, the rest through the core."""
    pytest.importorskip("flashinfer")
    reason = flashinfer_decode_unavailable_reason(head_size, torch.device("cuda"))
    if reason:
        pytest.skip(reason)
    gen = torch.Generator().manual_seed(head_size + hnd)
    batch = DeviceBatch(NVFP4PageLayout(head_size, BLOCK_SIZE, NUM_KV_HEADS, hnd=hnd), "cuda", gen)
    scale = head_size ** -0.5
    decoder = FlashInferNVFP4Decoder(torch.device("cuda"), hnd)
    cuda_batch = plan_batch(batch.metadata, batch.query_start_cpu, batch.seq_lens_cpu, decoder, NUM_Q_HEADS,
                            NUM_KV_HEADS, head_size, BLOCK_SIZE, torch.bfloat16, scale)
    assert cuda_batch.num_decodes == 3 and cuda_batch.rest.num_reqs == 2
    out = torch.full_like(batch.query, 7.0)
    cuda_paged_attention(batch.query, batch.cache, cuda_batch, scale, batch.k_scale, batch.v_scale, K_SCALE,
                         V_SCALE, out)
    batch.check(out, scale, f"flashinfer+core head={head_size} {'HND' if hnd else 'NHD'}")


@pytest.mark.gpu
def test_flashinfer_decoder_refuses_head_64():
    """fa2 misreads NVFP4 at head 64: the decoder refuses it, so the backend leaves head 64 to the core."""
    pytest.importorskip("flashinfer")
    assert "head sizes" in flashinfer_decode_unavailable_reason(64, torch.device("cuda"))
    decoder = FlashInferNVFP4Decoder(torch.device("cuda"), hnd=False)
    table = torch.zeros(1, 1, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="head sizes"):
        decoder.plan(table, torch.tensor([1], dtype=torch.int32), 8, 2, 64, 16, torch.bfloat16, 0.125)
