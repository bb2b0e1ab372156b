"""Indexer backend and metadata builder: vLLM's `CommonAttentionMetadata` → decode and prefill-chunk metadata.

A sibling of vLLM's `DeepseekV32IndexerMetadataBuilder` that fills the same metadata classes without
Triton or DeepGEMM scheduling (so it also runs on the CPU). Prefill chunks are planned on the host from
the CPU copies of the query and sequence lengths, bounded by two budgets: keys gathered per chunk
(`max_k_rows`) and float32 logits per chunk (`max_logits_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import vllm.envs as envs
from vllm.v1.attention.backend import AttentionCGSupport, AttentionMetadataBuilder, CommonAttentionMetadata
from vllm.v1.attention.backends.mla.indexer import (
    DeepSeekV32IndexerDecodeMetadata,
    DeepseekV32IndexerBackend,
    DeepseekV32IndexerMetadata,
    DeepseekV32IndexerPrefillChunkMetadata,
    DeepseekV32IndexerPrefillMetadata,
    get_max_prefill_buffer_size,
)
from vllm.v1.attention.backends.utils import split_decodes_and_prefills

from .compat import prefill_chunk_extra_fields


@dataclass(kw_only=True)
class IndexerDecodeMetadata(DeepSeekV32IndexerDecodeMetadata):
    """`seq_lens` is `[num_decodes, max_decode_len]`: the context length of each decode token (0 for padding).
    Decode token t is token `token_pos[t]` of request `token_req[t]`."""

    token_req: torch.Tensor
    token_pos: torch.Tensor
    max_context: int  # host upper bound of every decode token's context


@dataclass(kw_only=True)
class IndexerMetadata(DeepseekV32IndexerMetadata):
    block_size: int  # the cache block size the block tables and slot mapping were built for


@dataclass(frozen=True)
class ChunkPlan:
    """Prefill requests `[req_start, req_end)` (indices among the prefill requests) and the rows
    `[row_start, row_end)` of their concatenated query tokens that the chunk scores."""

    req_start: int
    req_end: int
    row_start: int
    row_end: int


def plan_prefill_chunks(query_lens: list[int], seq_lens: list[int], max_k_rows: int,
                        max_logits_elems: int) -> list[ChunkPlan]:
    """Greedy split: whole requests while the chunk's keys fit `max_k_rows` and rows × keys fit
    `max_logits_elems`; a request too big alone is split by query rows (each part needs only the keys up
    to its last row)."""
    plans: list[ChunkPlan] = []
    r, n = 0, len(query_lens)
    while r < n:
        end, rows, keys = r, 0, 0
        while end < n and keys + seq_lens[end] <= max_k_rows and \
                (rows + query_lens[end]) * (keys + seq_lens[end]) <= max_logits_elems:
            rows, keys, end = rows + query_lens[end], keys + seq_lens[end], end + 1
        if end > r:
            plans.append(ChunkPlan(r, end, 0, rows))
            r = end
            continue
        if seq_lens[r] > max_k_rows:
            raise ValueError(f"a prefill over {seq_lens[r]} keys does not fit the indexer workspace of "
                             f"max_k_rows={max_k_rows} keys")
        step = max(1, max_logits_elems // seq_lens[r])
        for row in range(0, query_lens[r], step):
            plans.append(ChunkPlan(r, r + 1, row, min(query_lens[r], row + step)))
        r += 1
    return plans


class IndexerMetadataBuilder(AttentionMetadataBuilder[IndexerMetadata]):
    # The op reads host-side chunk plans and sizes every step: it runs eagerly, outside CUDA graphs.
    _cudagraph_support = AttentionCGSupport.NEVER
    # Like vLLM's indexer builder, leave the decode/prefill reordering to the MLA backend's vote.
    reorder_batch_threshold = None

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device, *, max_k_rows: int | None = None,
                 max_logits_bytes: int | None = None):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.decode_threshold = 1 + vllm_config.num_speculative_tokens
        if max_k_rows is None:
            if vllm_config.model_config is None:
                raise ValueError("max_k_rows must be given when vllm_config has no model_config")
            max_k_rows = get_max_prefill_buffer_size(vllm_config)
        self.max_k_rows = max_k_rows
        self.max_logits_bytes = max_logits_bytes or envs.VLLM_SPARSE_INDEXER_MAX_LOGITS_MB << 20
        if self.max_k_rows < 1 or self.max_logits_bytes < 4:
            raise ValueError(f"budgets must be positive, got max_k_rows={self.max_k_rows}, "
                             f"max_logits_bytes={self.max_logits_bytes}")

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> IndexerMetadata:
        cm = common_attn_metadata
        num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens = split_decodes_and_prefills(
            cm, decode_threshold=self.decode_threshold)
        return IndexerMetadata(
            seq_lens=cm.seq_lens, max_seq_len=cm.max_seq_len, slot_mapping=cm.slot_mapping,
            num_decodes=num_decodes, num_decode_tokens=num_decode_tokens,
            num_prefills=num_prefills, num_prefill_tokens=num_prefill_tokens,
            decode=self._build_decode(cm, num_decodes, num_decode_tokens) if num_decodes else None,
            prefill=self._build_prefill(cm, num_decodes, num_prefills) if num_prefills else None,
            block_table=cm.block_table_tensor, block_size=self.kv_cache_spec.block_size)

    def _build_decode(self, cm: CommonAttentionMetadata, num_decodes: int, num_tokens: int) -> IndexerDecodeMetadata:
        decode_lens_cpu = torch.diff(cm.query_start_loc_cpu[:num_decodes + 1])
        max_len = int(decode_lens_cpu.max())
        token_req_cpu = torch.repeat_interleave(torch.arange(num_decodes), decode_lens_cpu)
        token_pos_cpu = torch.arange(num_tokens) - cm.query_start_loc_cpu[token_req_cpu]
        token_req = token_req_cpu.to(self.device, non_blocking=True)
        token_pos = token_pos_cpu.to(self.device, non_blocking=True)
        # Context of each token from the device lengths (exact also when the host's are upper bounds).
        decode_lens = torch.diff(cm.query_start_loc[:num_decodes + 1])
        context = cm.seq_lens[token_req] - decode_lens[token_req] + token_pos + 1
        seq_lens = torch.zeros(num_decodes, max_len, dtype=torch.int32, device=self.device)
        seq_lens[token_req, token_pos] = context.to(torch.int32)
        return IndexerDecodeMetadata(
            block_table=cm.block_table_tensor[:num_decodes], seq_lens=seq_lens, decode_lens=decode_lens,
            requires_padding=int(decode_lens_cpu.min()) != max_len,
            schedule_metadata=torch.empty(0, dtype=torch.int32, device=self.device),
            token_req=token_req, token_pos=token_pos, max_context=cm.max_seq_len)

    def _build_prefill(self, cm: CommonAttentionMetadata, num_decodes: int,
                       num_prefills: int) -> DeepseekV32IndexerPrefillMetadata:
        qsl = cm.query_start_loc_cpu[num_decodes:num_decodes + num_prefills + 1]
        seq_cpu = cm.seq_lens_cpu_upper_bound if cm.seq_lens_cpu_upper_bound is not None else cm.seq_lens.cpu()
        query_lens = torch.diff(qsl).tolist()
        seq_lens = seq_cpu[num_decodes:num_decodes + num_prefills].tolist()
        plans = plan_prefill_chunks(query_lens, seq_lens, self.max_k_rows, self.max_logits_bytes // 4)
        chunks = [self._build_chunk(cm, plan, num_decodes, int(qsl[plan.req_start]), query_lens, seq_lens)
                  for plan in plans]
        return DeepseekV32IndexerPrefillMetadata(chunks, max_prefill_seq_len=max(seq_lens))

    def _build_chunk(self, cm: CommonAttentionMetadata, plan: ChunkPlan, num_decodes: int, first_token: int,
                     query_lens: list[int], seq_lens: list[int]) -> DeepseekV32IndexerPrefillChunkMetadata:
        reqs = range(plan.req_start, plan.req_end)
        # Keys each request contributes: all of them, or for a row-split request those up to its last row.
        key_lens = [seq_lens[r] - query_lens[r] + min(query_lens[r], plan.row_end) for r in reqs]
        cu_seq_lens = torch.tensor([0] + key_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        row_ks, row_ke = [], []
        for i, r in enumerate(reqs):
            positions = torch.arange(query_lens[r]) + seq_lens[r] - query_lens[r]  # of the query tokens
            row_ks.append(torch.full_like(positions, int(cu_seq_lens[i])))
            row_ke.append(cu_seq_lens[i] + positions + 1)
        ks = torch.cat(row_ks)[plan.row_start:plan.row_end]
        ke = torch.cat(row_ke)[plan.row_start:plan.row_end]
        total = int(cu_seq_lens[-1])
        first_req = num_decodes + plan.req_start

        def to_device(t: torch.Tensor) -> torch.Tensor:
            return t.to(self.device, torch.int32, non_blocking=True)

        cu_dev = to_device(cu_seq_lens)
        return DeepseekV32IndexerPrefillChunkMetadata(
            block_table=cm.block_table_tensor[first_req:num_decodes + plan.req_end],
            cu_seqlen_ks=to_device(ks), cu_seqlen_ke=to_device(ke), cu_seq_lens=cu_dev,
            token_to_seq=to_device(torch.repeat_interleave(torch.arange(len(key_lens)), torch.tensor(key_lens))),
            total_seq_lens=total, token_start=first_token + plan.row_start, token_end=first_token + plan.row_end,
            num_reqs=len(key_lens), local_cu_seq_lens=cu_dev, local_total_seq_lens=total,
            max_local_total_seq_lens=total,
            **prefill_chunk_extra_fields(DeepseekV32IndexerPrefillChunkMetadata, ks, ke))


class IndexerBackend(DeepseekV32IndexerBackend):
    """vLLM's indexer backend (same name, block sizes, head sizes) with the plugin's metadata builder."""

    @staticmethod
    def get_builder_cls() -> type[IndexerMetadataBuilder]:
        return IndexerMetadataBuilder
