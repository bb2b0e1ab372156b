"""CUDA timings of the sparse indexer's compute core at DeepSeek-V3.2 shapes, next to its floors.

- decode: B=64 requests × 32,768 cached keys, 64 index heads, head 128, block 64, top-k 2048, next_n 1:
  the paged logits op straight from the cache (through indexer/core.py), alone and with torch's top-k.
  Captured in a CUDA graph of several calls, replayed.
- prefill: one chunk of 8,192 query tokens (positions 24,576..32,767) over its 32,768-token context: the
  logits op alone (graph), and gather op + logits + top-k eager, as the indexer op runs it.

Floors, from ceilings measured in the same run: bytes at the same-run copy bandwidth (an SM kernel copy of
2 GiB: read + written; decode: the FP8 cache it reads + the logits it writes; prefill: the float32 logits written,
and read back by the top-k) and the visible q·k FLOPs at the same-run dense FP8 matmul rate (torch._scaled_mm,
cuBLAS on wgmma: the FP8 tensor cores' ceiling, above what mma.sync reaches); the larger of the two bounds the
step. Blocks are a random permutation; the 277 MB decode cache is 4.6× an H200's 60 MB L2. A spot check compares one
decode row and one prefill row with reference.py's float64 logits. Prints a markdown table; `--out FILE` writes
it there too.
"""

from __future__ import annotations

import argparse

import torch

import vllm_nvfp4_plugin.ops  # noqa: F401  (registers torch.ops.vllm_nvfp4)
from vllm_nvfp4_plugin import reference
from vllm_nvfp4_plugin.indexer import core
from vllm_nvfp4_plugin.layout import IndexerCacheLayout

from cuda_timing import capture_graph, print_report, event_median_ms as median_ms

BATCH, CONTEXT, HEADS, TOPK, QUERY = 64, 32768, 64, 2048, 8192
LAYOUT = IndexerCacheLayout(128, 64, 128)
DEVICE = torch.device("cuda")


def graph_ms(fn, repeat: int = 4) -> float:
    """Median time of one call, from replays of a CUDA graph of `repeat` calls."""
    return median_ms(capture_graph([fn], repeat).replay, 7) / repeat


def eager_ms(fn) -> float:
    fn()
    return median_ms(fn, reps=5)


def copy_bandwidth() -> float:
    """Bytes/s of an SM kernel copying 2 GiB (read + written), in a graph."""
    src = torch.randint(0, 1 << 30, (1 << 28,), dtype=torch.int32, device=DEVICE)
    dst = torch.empty_like(src)
    ms = graph_ms(lambda: torch.bitwise_or(src, 0, out=dst), repeat=2)
    return 2 * src.numel() * 4 / ms * 1e3


def fp8_matmul_flops(n: int = 8192) -> float:
    """FLOP/s of a dense n³ FP8 E4M3 matmul (torch._scaled_mm, bf16 out)."""
    a = torch.randn(n, n, device=DEVICE).to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device=DEVICE).to(torch.float8_e4m3fn).t()  # column-major, as cuBLAS wants it
    one = torch.ones((), device=DEVICE)
    ms = graph_ms(lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16), repeat=4)
    return 2 * n ** 3 / ms * 1e3


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


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got − want| over the finite places, over max |want|; inf if the -inf places differ."""
    got, want = got.double().cpu(), want.double().cpu()
    if not torch.equal(got.isinf(), want.isinf()):
        return float("inf")
    finite = want.isfinite()
    return float((got - want)[finite].abs().max() / want[finite].abs().max())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    args = parser.parse_args()
    bandwidth, fp8_flops = copy_bandwidth(), fp8_matmul_flops()

    def row(name: str, ms: float, bytes_moved: float, flops: float) -> str:
        floor_bw, floor_flops = bytes_moved / bandwidth * 1e3, flops / fp8_flops * 1e3
        floor = max(floor_bw, floor_flops)
        return (f"| {name} | {ms:.3f} | {floor_bw:.3f} | {floor_flops:.3f} | {floor / ms:.1%} | "
                f"{bytes_moved / ms / 1e9:.2f} | {flops / ms / 1e9:.0f} |")

    g = torch.Generator(DEVICE).manual_seed(0)
    cache, table = filled_cache(g)
    lines = [(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}; same-run ceilings: SM copy "
              f"{bandwidth / 1e12:.2f} TB/s, dense FP8 matmul (torch._scaled_mm 8192³) {fp8_flops / 1e12:.0f} "
              "TFLOP/s"),
             "", ("| step | median ms | bandwidth floor ms | FLOP floor ms | floor / time | effective TB/s "
                  "| effective TFLOP/s |"),
             "| --- | --- | --- | --- | --- | --- | --- |"]

    # Decode: B × 1 token, each over its whole context.
    q, w = queries(g, BATCH)
    q, w = q.view(BATCH, 1, HEADS, -1), w.view(BATCH, 1, HEADS)
    context = torch.full((BATCH, 1), CONTEXT, dtype=torch.int32, device=DEVICE)
    out = torch.empty(BATCH, TOPK, dtype=torch.int32, device=DEVICE)

    def decode_logits():
        return core.fp8_paged_mqa_logits(q, cache, w, context, table, CONTEXT, LAYOUT.quant_block_size)

    def decode():
        core.topk_per_row(decode_logits(), TOPK, out)

    logits = decode_logits()
    want = torch.empty(1, CONTEXT, dtype=torch.float64)
    reference.indexer_paged_mqa_logits(q[:1], cache, w[:1], context[:1], table[:1], LAYOUT.quant_block_size, want)
    decode_error = relative_error(logits[:1], want)
    cache_bytes = BATCH * CONTEXT * LAYOUT.row_bytes
    logits_bytes = logits.numel() * 4
    decode_flops = 2 * BATCH * HEADS * CONTEXT * LAYOUT.head_dim
    lines.append(row(f"decode logits, B={BATCH}, context {CONTEXT} (graph)", graph_ms(decode_logits),
                     cache_bytes + logits_bytes, decode_flops))
    lines.append(row("decode logits + top-k (graph)", graph_ms(decode), cache_bytes + 2 * logits_bytes,
                     decode_flops))
    lines.append(row("  decode top-k alone (graph)", graph_ms(lambda: core.topk_per_row(logits, TOPK, out)),
                     logits_bytes, 0))

    # Prefill: request 0's last QUERY tokens, keys gathered from its blocks.
    q, w = queries(g, QUERY)
    dst_k = torch.empty(CONTEXT, LAYOUT.head_dim, dtype=torch.uint8, device=DEVICE)
    dst_scale = torch.empty(CONTEXT, LAYOUT.scale_bytes, dtype=torch.uint8, device=DEVICE)
    cu = torch.tensor([0, CONTEXT], dtype=torch.int32, device=DEVICE)
    ks = torch.zeros(QUERY, dtype=torch.int32, device=DEVICE)
    ke = torch.arange(CONTEXT - QUERY + 1, CONTEXT + 1, dtype=torch.int32, device=DEVICE)
    out = torch.empty(QUERY, TOPK, dtype=torch.int32, device=DEVICE)
    gather = torch.ops.vllm_nvfp4.cp_gather_indexer_k_quant_cache

    def prefill_logits():
        return core.fp8_mqa_logits(q, dst_k, dst_scale, w, ks, ke)

    def prefill():
        gather(cache, dst_k, dst_scale, table[:1], cu)
        core.topk_per_row(prefill_logits(), TOPK, out, row_starts=ks)

    gather(cache, dst_k, dst_scale, table[:1], cu)
    want = torch.empty(1, CONTEXT, dtype=torch.float64)
    reference.indexer_mqa_logits(q[-1:], dst_k, dst_scale, w[-1:], ks[-1:], ke[-1:], want)
    prefill_error = relative_error(prefill_logits()[-1:], want)
    logits_bytes = QUERY * CONTEXT * 4
    visible_flops = 2 * HEADS * LAYOUT.head_dim * int(ke.sum())
    lines.append(row(f"prefill chunk logits, {QUERY} tokens over {CONTEXT} (graph)", graph_ms(prefill_logits, 2),
                     logits_bytes, visible_flops))
    lines.append(row("prefill chunk: gather + logits + top-k (eager)", eager_ms(prefill), 2 * logits_bytes,
                     visible_flops))
    lines.append(row("  gather op alone (graph)", graph_ms(lambda: gather(cache, dst_k, dst_scale, table[:1], cu)),
                     2 * CONTEXT * LAYOUT.row_bytes, 0))
    lines += ["", (f"Spot check against reference.py's float64 logits (max |error| / max |logit|): decode row 0 "
                   f"{decode_error:.1e}, prefill row {QUERY - 1} {prefill_error:.1e}")]
    print_report("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
