"""What the attention core needs to know about one batch: plain tensors, no vLLM types."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class NVFP4AttentionMetadata:
    """One batch of requests over a paged cache.

    Request `r` owns query tokens `query_start_loc[r] : query_start_loc[r + 1]`; they are the LAST
    `query_len` positions of its context of `seq_lens[r]` tokens (cached prefix + earlier chunks + this
    step's tokens), whose pages are `block_table[r]`. `slot_mapping[i]` is the cache slot of query token
    `i` (negative: padding, not stored). `causal` masks each query token to the context up to its own
    position; decoder attention is causal, a False means every query sees the whole context.
    """

    query_start_loc: torch.Tensor  # int32 [num_reqs + 1]
    seq_lens: torch.Tensor  # int32 [num_reqs]
    block_table: torch.Tensor  # int32 [num_reqs, max_blocks_per_req]
    slot_mapping: torch.Tensor  # int64 [num_tokens]
    causal: bool = True
    # Host-side upper bounds of the query and context lengths, for kernel launch planning without reading
    # the device tensors back (what CUDA-graph capture needs).
    max_query_len: int = 0
    max_seq_len: int = 0

    def __post_init__(self):
        num_reqs = self.seq_lens.numel()
        if self.query_start_loc.dim() != 1 or self.query_start_loc.numel() != num_reqs + 1:
            raise ValueError(f"query_start_loc must be 1-D with num_reqs + 1 = {num_reqs + 1} entries, "
                             f"got shape {tuple(self.query_start_loc.shape)}")
        if self.block_table.dim() != 2 or self.block_table.size(0) < num_reqs:
            raise ValueError(f"block_table must be 2-D with at least num_reqs = {num_reqs} rows, "
                             f"got shape {tuple(self.block_table.shape)}")
        if not isinstance(self.causal, bool):
            raise ValueError(f"causal must be a bool (one value for the batch), got {type(self.causal).__name__}")

    @property
    def num_reqs(self) -> int:
        return self.seq_lens.numel()

    @property
    def num_query_tokens(self) -> int:
        """Query tokens of real requests; rows past it (padding) are neither stored nor attended."""
        return int(self.query_start_loc[-1])

    @classmethod
    def from_lengths(cls, query_lens: list[int], seq_lens: list[int], block_table: torch.Tensor,
                     slot_mapping: torch.Tensor, causal: bool = True) -> "NVFP4AttentionMetadata":
        device = block_table.device
        query_start_loc = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
        query_start_loc[1:] = torch.cumsum(torch.tensor(query_lens, dtype=torch.int32), 0)
        return cls(query_start_loc.to(device), torch.tensor(seq_lens, dtype=torch.int32, device=device),
                   block_table, slot_mapping, causal, max(query_lens, default=0), max(seq_lens, default=0))
