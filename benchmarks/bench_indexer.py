"""CUDA timings of the sparse indexer's compute core at DeepSeek-V3.2 shapes, next to its floors.

- decode: B=64 requests × 32,768 cached keys, 64 index heads, head 128, block 64, top-k 2048, next_n 1:
  paged logits straight from the cache + top-k. Captured in a CUDA graph of several calls, replayed.
- prefill: one chunk of 8,192 query tokens (positions 24,576..32,767) over its 32,768-token context: the
  compiled gather op + logits + top-k, eager (as the op runs it), CUDA-event medians.

Floors: the bytes the step must move at the measured 4.2 TB/s copy bandwidth (decode: the FP8 cache it reads;
prefill: the float32 logits the top-k must write and read back) and the visible q·k FLOPs at ~790 TFLOP/s
dense bf16; the larger of the two bounds the step. Blocks are a random permutation; the 277 MB decode
cache is 4.6× the 60 MB L2. Prints a markdown table; `--out FILE` writes it there too.
"""

from __future__ import annotations

import argparse

import torch

import vllm_nvfp4_plugin.ops  # noqa: F401  (registers torch.ops.vllm_nvfp4)
from vllm_nvfp4_plugin.indexer import core
from vllm_nvfp4_plugin.layout import IndexerCacheLayout

from cuda_timing import event_median_ms as median_ms

BATCH, CONTEXT, HEADS, TOPK, QUERY = 64, 32768, 64, 2048, 8192
LAYOUT = IndexerCacheLayout(128, 64, 128)
BANDWIDTH, BF16_FLOPS = 4.2e12, 790e12
DEVICE = torch.device("cuda")


def graph_ms(fn, repeat: int = 4) -> float:
    """Median time of one call, from replays of a CUDA graph of `repeat` calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeat):
            fn()
    graph.replay()
    return median_ms(graph.replay, 7) / repeat


def eager_ms(fn) -> float:
    fn()
    return median_ms(fn, reps=5)


def filled_cache(g: torch.Generator):
    """A cache of BATCH × CONTEXT keys in randomly ordered blocks, written by the store op."""
    pages = CONTEXT // LAYOUT.block_size
    table = torch.randperm(BATCH * pages, device=DEVICE, generator=g).view(BATCH, pages).int()
    cache = LAYOUT.allocate(BATCH * pages, DEVICE)
    pos = torch.arange(CONTEXT, device=DEVICE)
    for b in range(BATCH):
        slots = table[b, pos // LAYOUT.block_size].long() * LAYOUT.block_size + pos % LAYOUT.block_size
        k = torch.randn(CONTEXT, LAYOUT.head_dim, device=DEVICE, generator=g, dtype=torch.bfloat16)
        torch.ops.vllm_nvfp4.indexer_k_quant_and_cache(k, cache, slots, LAYOUT.quant_block_size, "ue8m0")
    return cache, table


def queries(g: torch.Generator, tokens: int):
    q = (torch.randn(tokens, HEADS, LAYOUT.head_dim, device=DEVICE, generator=g) * 2).to(torch.float8_e4m3fn)
    return q, torch.randn(tokens, HEADS, device=DEVICE, generator=g)


def row(name: str, ms: float, bytes_moved: float, flops: float) -> str:
    floor_bw, floor_flops = bytes_moved / BANDWIDTH * 1e3, flops / BF16_FLOPS * 1e3
    floor = max(floor_bw, floor_flops)
    return (f"| {name} | {ms:.3f} | {floor_bw:.3f} | {floor_flops:.3f} | {floor / ms:.1%} | "
            f"{bytes_moved / ms / 1e9:.2f} | {flops / ms / 1e9:.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    args = parser.parse_args()
    g = torch.Generator(DEVICE).manual_seed(0)
    cache, table = filled_cache(g)
    lines = [f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}", "",
             "| step | median ms | bandwidth floor ms | FLOP floor ms | floor / time | effective TB/s "
             "| effective TFLOP/s |",
             "| --- | --- | --- | --- | --- | --- | --- |"]

    # Decode: B × 1 token, each over its whole context.
    q, w = queries(g, BATCH)
    q, w = q.view(BATCH, 1, HEADS, -1), w.view(BATCH, 1, HEADS)
    context = torch.full((BATCH, 1), CONTEXT, dtype=torch.int32, device=DEVICE)
    out = torch.empty(BATCH, TOPK, dtype=torch.int32, device=DEVICE)
    logits = core.fp8_paged_mqa_logits(q, cache, w, context, table, CONTEXT, LAYOUT.quant_block_size)

    def decode_logits():
        return core.fp8_paged_mqa_logits(q, cache, w, context, table, CONTEXT, LAYOUT.quant_block_size)

    def decode():
        core.topk_per_row(decode_logits(), TOPK, out)

    cache_bytes = BATCH * CONTEXT * LAYOUT.row_bytes
    decode_flops = 2 * BATCH * HEADS * CONTEXT * LAYOUT.head_dim
    lines.append(row(f"decode logits + top-k, B={BATCH}, context {CONTEXT} (graph)", graph_ms(decode),
                     cache_bytes, decode_flops))
    lines.append(row("  decode logits alone (graph)", graph_ms(decode_logits), cache_bytes, decode_flops))
    lines.append(row("  decode top-k alone (graph)", graph_ms(lambda: core.topk_per_row(logits, TOPK, out)),
                     logits.numel() * 4, 0))

    # Prefill: request 0's last QUERY tokens, keys gathered from its blocks.
    q, w = queries(g, QUERY)
    dst_k = torch.empty(CONTEXT, LAYOUT.head_dim, dtype=torch.uint8, device=DEVICE)
    dst_scale = torch.empty(CONTEXT, LAYOUT.scale_bytes, dtype=torch.uint8, device=DEVICE)
    cu = torch.tensor([0, CONTEXT], dtype=torch.int32, device=DEVICE)
    ks = torch.zeros(QUERY, dtype=torch.int32, device=DEVICE)
    ke = torch.arange(CONTEXT - QUERY + 1, CONTEXT + 1, dtype=torch.int32, device=DEVICE)
    out = torch.empty(QUERY, TOPK, dtype=torch.int32, device=DEVICE)

    def prefill(tile_bytes=core.DEFAULT_TILE_BYTES):
        torch.ops.vllm_nvfp4.cp_gather_indexer_k_quant_cache(cache, dst_k, dst_scale, table[:1], cu)
        logits = core.fp8_mqa_logits(q, dst_k, dst_scale, w, ks, ke, LAYOUT.quant_block_size, tile_bytes)
        core.topk_per_row(logits, TOPK, out, row_starts=ks)

    logits_bytes = 2 * QUERY * CONTEXT * 4  # written by the logits, read by the top-k
    visible_flops = 2 * HEADS * LAYOUT.head_dim * int(ke.sum())
    lines.append(row(f"prefill chunk: gather + logits + top-k, {QUERY} tokens over {CONTEXT} (eager)",
                     eager_ms(prefill), logits_bytes, visible_flops))
    lines.append(row("  same, 1 GiB score tiles (eager)", eager_ms(lambda: prefill(1 << 30)), logits_bytes,
                     visible_flops))
    gather = torch.ops.vllm_nvfp4.cp_gather_indexer_k_quant_cache
    lines.append(row("  gather op alone (graph)", graph_ms(lambda: gather(cache, dst_k, dst_scale, table[:1], cu)),
                     2 * CONTEXT * LAYOUT.row_bytes, 0))
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
