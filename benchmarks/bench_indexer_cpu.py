"""CPU timings of the indexer logits ops (`indexer_paged_mqa_logits`, `indexer_mqa_logits`) next to the FMA peak.

- decode: B=4 requests × 8,192 cached keys, next_n 1, 64 index heads, head 128, block 64 in random order, one
  float32 scale a key (quant block 128): paged logits straight from the cache.
- prefill: 256 query rows over 8,192 gathered keys, causal (row m sees keys [0, 7937 + m)).

GFLOP/s counts 2·heads·head_dim multiply-adds per visible (row, key) pair, the work the formula needs; the
peak to hold them against is the core's FMA throughput (Zen 4: two 256-bit FMAs a cycle, 116 GFLOP/s a core
measured on a Zen 4 core by a 12-chain register-only FMA loop at ~3.6 GHz). Times are medians of `--repeats` calls
after one warm-up, per thread count (`torch.set_num_threads`, which sets the ops' OpenMP team).

`--torch-core FILE` also times a torch-matmul implementation of the same logits for comparison: a Python file
defining `fp8_paged_mqa_logits` and `fp8_mqa_logits` (e.g. the plain-torch indexer core the ops replaced,
`git show 04411d3:vllm_nvfp4_plugin/indexer/core.py > /tmp/torch_core.py`), imported by path.
"""

from __future__ import annotations

import argparse
import importlib.util
import time

import torch

import vllm_nvfp4_plugin.ops  # noqa: F401  (registers torch.ops.vllm_nvfp4)
from vllm_nvfp4_plugin.layout import IndexerCacheLayout

LAYOUT = IndexerCacheLayout(128, 64, 128)
HEADS = 64
DECODE_BATCH, DECODE_CONTEXT = 4, 8192
PREFILL_ROWS, PREFILL_KEYS = 256, 8192
FP8 = torch.float8_e4m3fn


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def queries(g: torch.Generator, shape: tuple):
    q = (torch.randn(*shape, HEADS, LAYOUT.head_dim, generator=g) * 2).to(FP8)
    return q, torch.randn(*shape, HEADS, generator=g)


def decode_case(g: torch.Generator):
    """A cache holding DECODE_BATCH × DECODE_CONTEXT keys (written by the store op) in randomly ordered blocks."""
    pages = DECODE_CONTEXT // LAYOUT.block_size
    table = torch.randperm(DECODE_BATCH * pages, generator=g).view(DECODE_BATCH, pages).int()
    cache = LAYOUT.allocate(DECODE_BATCH * pages)
    pos = torch.arange(DECODE_CONTEXT)
    for b in range(DECODE_BATCH):
        slots = table[b, pos // LAYOUT.block_size].long() * LAYOUT.block_size + pos % LAYOUT.block_size
        k = torch.randn(DECODE_CONTEXT, LAYOUT.head_dim, generator=g, dtype=torch.bfloat16)
        torch.ops.vllm_nvfp4.indexer_k_quant_and_cache(k, cache, slots, LAYOUT.quant_block_size, "ue8m0")
    q, w = queries(g, (DECODE_BATCH, 1))
    context = torch.full((DECODE_BATCH, 1), DECODE_CONTEXT, dtype=torch.int32)
    return q, cache, w, context, table


def prefill_case(g: torch.Generator):
    k = torch.randn(PREFILL_KEYS, LAYOUT.head_dim, generator=g, dtype=torch.bfloat16)
    cache = LAYOUT.allocate(PREFILL_KEYS // LAYOUT.block_size)
    torch.ops.vllm_nvfp4.indexer_k_quant_and_cache(k, cache, torch.arange(PREFILL_KEYS), LAYOUT.quant_block_size,
                                                   "ue8m0")
    blocks = LAYOUT.block_bytes_view(cache)
    values = blocks[:, :LAYOUT.block_size * LAYOUT.head_dim].reshape(PREFILL_KEYS, LAYOUT.head_dim)
    scales = blocks[:, LAYOUT.block_size * LAYOUT.head_dim:].reshape(PREFILL_KEYS, LAYOUT.scale_bytes)
    q, w = queries(g, (PREFILL_ROWS,))
    ks = torch.zeros(PREFILL_ROWS, dtype=torch.int32)
    ke = torch.arange(PREFILL_KEYS - PREFILL_ROWS + 1, PREFILL_KEYS + 1, dtype=torch.int32)
    return q, values.contiguous(), scales.contiguous(), w, ks, ke


def load_torch_core(path: str):
    """indexer/core.py from another commit, imported under the package so its relative imports resolve."""
    spec = importlib.util.spec_from_file_location("vllm_nvfp4_plugin.indexer._torch_core", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--torch-core", help="path of a pre-op indexer/core.py to time as well")
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    q_d, cache, w_d, context, table = decode_case(g)
    q_p, values, scales, w_p, ks, ke = prefill_case(g)
    decode_flops = 2 * HEADS * LAYOUT.head_dim * DECODE_BATCH * DECODE_CONTEXT
    prefill_flops = 2 * HEADS * LAYOUT.head_dim * int((ke - ks).sum())
    decode_logits = torch.empty(DECODE_BATCH, DECODE_CONTEXT)
    prefill_logits = torch.empty(PREFILL_ROWS, PREFILL_KEYS)
    qbs = LAYOUT.quant_block_size
    cases = [
        ("decode op", decode_flops, lambda: torch.ops.vllm_nvfp4.indexer_paged_mqa_logits(
            q_d, cache, w_d, context, table, qbs, decode_logits)),
        ("prefill op", prefill_flops, lambda: torch.ops.vllm_nvfp4.indexer_mqa_logits(
            q_p, values, scales, w_p, ks, ke, prefill_logits)),
    ]
    if args.torch_core:
        old = load_torch_core(args.torch_core)
        cases += [
            ("decode, old torch core", decode_flops, lambda: old.fp8_paged_mqa_logits(
                q_d, cache, w_d, context, table, DECODE_CONTEXT, qbs)),
            ("prefill, old torch core", prefill_flops, lambda: old.fp8_mqa_logits(
                q_p, values, scales, w_p, ks, ke, qbs)),
        ]
    print(f"CPU threads {args.threads}, torch {torch.__version__}, {HEADS} heads, head {LAYOUT.head_dim}\n")
    print("| case | threads | median ms | GFLOP/s |")
    print("| --- | --- | --- | --- |")
    for name, flops, fn in cases:
        for threads in args.threads:
            torch.set_num_threads(threads)
            ms = median_ms(fn, args.repeats)
            print(f"| {name} | {threads} | {ms:.2f} | {flops / ms / 1e6:.1f} |", flush=True)


if __name__ == "__main__":
    main()
