"""Random paged-attention batches over an NVFP4 cache, and the float32 attention they must produce.

Shared by the doctor and the tests of every attention path. A batch is a list of requests given as
(query_len, context_len): the first context_len - query_len tokens of a request were cached by earlier steps (a
prefix or earlier prefill chunks), and this step brings its query_len newest tokens. Each request's pages are
blocks in random order, so a reader that ignores the block table, or mixes up requests, reads the wrong tokens.
Tensors are made on the CPU from a seeded generator; callers move them to the device they test.
"""

from __future__ import annotations

import torch

from .. import reference
from ..layout import NVFP4PageLayout


def dequantized(x: torch.Tensor, global_scale: float) -> torch.Tensor:
    """`x` rounded through the reference NVFP4 encode and decode, in float32: what the cache gives back."""
    return reference.nvfp4_decode(*reference.nvfp4_encode(x, global_scale), global_scale)


def fp32_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool = True):
    """float32 attention of `q [n, Hq, D]` as the last n positions of the context `k`, `v` `[c, Hkv, D]` (GQA)."""
    n, heads, _ = q.shape
    c, kv_heads, _ = k.shape
    k = k.float().repeat_interleave(heads // kv_heads, dim=1)
    v = v.float().repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("nhd,chd->hnc", q.float(), k) * scale
    if causal:  # query i sits at position c - n + i
        visible = torch.arange(c, device=q.device)[None, :] <= torch.arange(n, device=q.device)[:, None] + (c - n)
        scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hnc,chd->nhd", scores.softmax(-1), v)


def shuffled_block_table(seq_lens, block_size: int, gen: torch.Generator, *, spare_blocks: int = 2,
                         extra_columns: int = 0, unused_entry: int = 0) -> tuple[torch.Tensor, int]:
    """(block_table, num_blocks): int32 `[len(seq_lens), max blocks + extra_columns]` giving each sequence its own
    blocks, in random order among `num_blocks` = the blocks needed + `spare_blocks`; unused entries `unused_entry`."""
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    order = torch.randperm(num_blocks, generator=gen)
    table = torch.full((len(blocks_per_seq), max(blocks_per_seq) + extra_columns), unused_entry, dtype=torch.int32)
    used = 0
    for r, blocks in enumerate(blocks_per_seq):
        table[r, :blocks] = order[used:used + blocks]
        used += blocks
    return table, num_blocks


def table_slots(block_table: torch.Tensor, block_size: int, r: int, lo: int, hi: int) -> torch.Tensor:
    """int64 slots of positions `[lo, hi)` of sequence `r` of `block_table`."""
    pos = torch.arange(lo, hi)
    return block_table[r, pos // block_size].long() * block_size + pos % block_size


def relative_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().float().cpu(), want.detach().float().cpu()
    return ((got - want).norm() / want.norm()).item()


class PagedCase:
    """Requests `(query_len, context_len)` over `layout`'s pages, with `num_q_heads` query heads.

    `block_table` (int32 `[requests, max blocks + extra_table_columns]`, unused entries `unused_entry`) gives
    each request its own blocks, shuffled among `num_blocks` = the blocks needed + `spare_blocks`. `q`, `k`, `v`
    hold each request's query rows and whole-context keys and values (`dtype`, CPU).
    """

    def __init__(self, requests, layout: NVFP4PageLayout, num_q_heads: int, gen: torch.Generator, *,
                 dtype=torch.bfloat16, k_scale: float = 1.0, v_scale: float = 1.0, spare_blocks: int = 2,
                 extra_table_columns: int = 0, unused_entry: int = 0):
        for n, c in requests:
            if not 0 <= n <= c:
                raise ValueError(f"requests: (query_len, context_len) needs 0 <= query_len <= context_len, "
                                 f"got ({n}, {c})")
        self.requests, self.layout, self.num_q_heads = list(requests), layout, num_q_heads
        self.k_scale, self.v_scale = k_scale, v_scale
        self.block_table, self.num_blocks = shuffled_block_table(
            self.seq_lens, layout.block_size, gen, spare_blocks=spare_blocks, extra_columns=extra_table_columns,
            unused_entry=unused_entry)
        heads, kv_heads, d = num_q_heads, layout.num_heads, layout.head_size
        self.k = [torch.randn(c, kv_heads, d, generator=gen).to(dtype) for _, c in self.requests]
        self.v = [torch.randn(c, kv_heads, d, generator=gen).to(dtype) for _, c in self.requests]
        self.q = [torch.randn(n, heads, d, generator=gen).to(dtype) for n, _ in self.requests]

    @property
    def query_lens(self) -> list[int]:
        return [n for n, _ in self.requests]

    @property
    def seq_lens(self) -> list[int]:
        return [c for _, c in self.requests]

    def query_start_loc(self) -> torch.Tensor:
        starts = torch.zeros(len(self.requests) + 1, dtype=torch.int32)
        starts[1:] = torch.tensor(self.query_lens, dtype=torch.int32).cumsum(0)
        return starts

    def slots(self, r: int, lo: int, hi: int) -> torch.Tensor:
        """int64 slots of positions `[lo, hi)` of request `r`."""
        return table_slots(self.block_table, self.layout.block_size, r, lo, hi)

    def _tokens(self, spans):
        """Concatenated (key, value, slots) of the positions `spans[r] = (lo, hi)` of every request."""
        key = torch.cat([k[lo:hi] for k, (lo, hi) in zip(self.k, spans)])
        value = torch.cat([v[lo:hi] for v, (lo, hi) in zip(self.v, spans)])
        slots = torch.cat([self.slots(r, lo, hi) for r, (lo, hi) in enumerate(spans)])
        return key, value, slots

    def earlier_tokens(self):
        """(key, value, slots) of the tokens earlier steps cached: each request's first context - query tokens."""
        return self._tokens([(0, c - n) for n, c in self.requests])

    def context_tokens(self):
        """(key, value, slots) of every request's whole context, request after request."""
        return self._tokens([(0, c) for _, c in self.requests])

    def step(self, num_padding: int = 0):
        """This step's (query, key, value, slot_mapping): the query_len newest tokens of each request, then
        `num_padding` zero rows whose slot is -1 (skipped by the store)."""
        key, value, slots = self._tokens([(c - n, c) for n, c in self.requests])
        d, dtype = self.layout.head_size, key.dtype
        query = torch.cat(self.q + [torch.zeros(num_padding, self.num_q_heads, d, dtype=dtype)])
        key = torch.cat([key, torch.zeros(num_padding, self.layout.num_heads, d, dtype=dtype)])
        value = torch.cat([value, torch.zeros(num_padding, self.layout.num_heads, d, dtype=dtype)])
        return query, key, value, torch.cat([slots, torch.full((num_padding,), -1)])

    def expected(self, r: int, scale: float, causal: bool = True) -> torch.Tensor:
        """float32 attention of request `r`'s queries over its context as the cache holds it (NVFP4-rounded)."""
        return fp32_attention(self.q[r], dequantized(self.k[r], self.k_scale), dequantized(self.v[r], self.v_scale),
                              scale, causal)

    def errors(self, out: torch.Tensor, scale: float, causal: bool = True) -> list[float]:
        """Relative L2 error of each request's rows of `out` (this step's query order) against `expected`."""
        starts = self.query_start_loc().tolist()
        return [relative_l2(out[starts[r]:starts[r + 1]], self.expected(r, scale, causal))
                for r in range(len(self.requests))]
