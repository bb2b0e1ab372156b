"""CUDA timings of the four cache ops at their target shapes, beside a same-run copy and FlashInfer's writer.

`python benchmarks/bench_ops.py --device cuda` appends this report to its own table; alone:
`python benchmarks/bench_ops_cuda.py [--flashinfer] [--reference] [--out FILE]`.

Shapes: bf16, head 128, 8 KV heads, NVFP4 page 16, indexer block 64. Each op is
captured in a CUDA graph of several calls and the graph replayed; the median replay time per call is
reported with the effective bandwidth: the bytes the op must read plus the bytes it must write, over that
time. Slots and blocks are random permutations; inputs that fit in an L2 (60 MB on an H200) rotate over four copies.
The torch reference runs eagerly (it syncs on the host) as the speed floor. `--settle-ms MS` adds a second
reading of every graph-timed row, after MS ms of further replays (on an H200 the random-slot NVFP4
store reads ~4% slower after 200 ms of continuous replays; the other rows stay within 1%).

FlashInfer (`--flashinfer`) writes the same inputs into the same page bytes (strided views of the
[DATA | SCALES] sides); its bytes are compared with ours and every differing nibble is classified.
Prints a markdown table; `--out FILE` writes it there too.
"""

from __future__ import annotations

import argparse
from collections import Counter

import torch

from vllm_nvfp4_plugin import ops, reference
from vllm_nvfp4_plugin.attention.flashinfer_reader import nvfp4_flashinfer_views
from vllm_nvfp4_plugin.layout import IndexerCacheLayout, NVFP4PageLayout

from cuda_timing import capture_graph, print_report, event_median_ms as median_ms

HEADS, HEAD, PAGE = 8, 128, 16
INDEXER = IndexerCacheLayout(128, 64, 128)
DEVICE = torch.device("cuda")


def graph_ms(calls: list, repeat: int = 4, reps: int = 20) -> float:
    """Median time of one call, from replays of a graph holding `repeat` rounds of `calls` (rotating inputs)."""
    return median_ms(capture_graph(calls, repeat).replay, reps) / (repeat * len(calls))


def replay_for(graph: torch.cuda.CUDAGraph, ms: float):
    """Replays `graph` until `ms` milliseconds of device time have passed."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    while True:
        for _ in range(8):
            graph.replay()
        end.record()
        end.synchronize()
        if start.elapsed_time(end) >= ms:
            return


def eager_ms(fn, reps: int = 3) -> float:
    fn()
    return median_ms(fn, reps)


def random_bf16(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, device=DEVICE, dtype=torch.bfloat16)


def scalar(x: float) -> torch.Tensor:
    return torch.tensor([x], device=DEVICE)


class Results:
    """The table's rows. With `settle_ms`, each graph-timed row is timed twice: over the replays right after
    capture (the usual reading) and again after `settle_ms` of further replays of the same graph."""

    def __init__(self, settle_ms: float = 0.0):
        self.settle_ms = settle_ms
        self.rows: list[tuple[str, str, float, float, float | None]] = []  # (case, impl, ms, bytes, settled ms)

    def add(self, case: str, impl: str, ms: float, nbytes: float, settled_ms: float | None = None):
        self.rows.append((case, impl, ms, nbytes, settled_ms))
        settled = f"  settled {settled_ms * 1e3:10.2f} us" if settled_ms is not None else ""
        print(f"{case:<48} {impl:<22} {ms * 1e3:10.2f} us {nbytes / ms / 1e9:8.3f} TB/s{settled}", flush=True)

    def add_graph(self, case: str, impl: str, calls: list, nbytes: float, repeat: int = 4, reps: int = 20) -> float:
        """Times `calls` by graph replay, adds the row and returns its time (ms) (see cuda_timing.capture_graph)."""
        graph = capture_graph(calls, repeat)
        per_call = repeat * len(calls)
        ms = median_ms(graph.replay, reps) / per_call
        settled_ms = None
        if self.settle_ms:
            replay_for(graph, self.settle_ms)
            settled_ms = median_ms(graph.replay, reps) / per_call
        self.add(case, impl, ms, nbytes, settled_ms)
        return ms

    def table(self, copy_tbs: float) -> str:
        settled = any(row[4] is not None for row in self.rows)
        extra = f" after {self.settle_ms:g} ms of replays | effective |" if settled else ""
        lines = [f"Same-run device-to-device copy: {copy_tbs:.2f} TB/s (bytes read + written).", "",
                 "| case | implementation | median time | effective | of copy |" + extra,
                 "| --- | --- | --- | --- | --- |" + (" --- | --- |" if settled else "")]
        for case, impl, ms, nbytes, settled_ms in self.rows:
            tbs = nbytes / ms / 1e9
            line = f"| {case} | {impl} | {duration(ms)} | {tbs:.2f} TB/s | {tbs / copy_tbs:.0%} |"
            if settled:
                line += f" {duration(settled_ms)} | {nbytes / settled_ms / 1e9:.2f} TB/s |" if settled_ms else " | |"
            lines.append(line)
        return "\n".join(lines)


def duration(ms: float) -> str:
    return f"{ms * 1e3:.1f} µs" if ms < 1 else f"{ms:.3f} ms"


def bench_copy(results: Results) -> float:
    """The better of cudaMemcpy (eager: captured in a graph it runs on the slower copy engines) and an SM kernel."""
    src = torch.empty(2 << 30, dtype=torch.uint8, device=DEVICE).random_()
    dst = torch.empty_like(src)
    src32, dst32 = src.view(torch.int32), dst.view(torch.int32)
    memcpy_ms = eager_ms(lambda: dst.copy_(src), reps=10)
    results.add("copy 2 GiB", "cudaMemcpy (eager)", memcpy_ms, 2 * src.numel())
    kernel_ms = results.add_graph("copy 2 GiB", "torch elementwise kernel",
                                  [lambda: torch.bitwise_or(src32, 0, out=dst32)], 2 * src.numel(), repeat=2)
    # A write-only stream: the NVFP4 gather's bytes are 78% writes.
    results.add_graph("write 2 GiB", "torch fill_", [lambda: dst32.fill_(7)], dst.numel(), repeat=2)
    return 2 * src.numel() / min(memcpy_ms, kernel_ms) / 1e9


def nvfp4_store_inputs(num_tokens: int, num_slots: int, hnd: bool = False, whole_blocks: bool = False):
    """Slots in random order, or (`whole_blocks`, as vLLM fills a prompt's blocks) blocks in random order."""
    layout = NVFP4PageLayout(HEAD, PAGE, HEADS, hnd)
    cache = layout.allocate(num_slots // PAGE, DEVICE, fill=0)
    key, value = random_bf16(num_tokens, HEADS, HEAD), random_bf16(num_tokens, HEADS, HEAD)
    if whole_blocks:
        blocks = torch.randperm(num_slots // PAGE, device=DEVICE)
        slots = (blocks.view(-1, 1) * PAGE + torch.arange(PAGE, device=DEVICE)).flatten()[:num_tokens]
    else:
        slots = torch.randperm(num_slots, device=DEVICE)[:num_tokens]
    return layout, cache, key, value, slots


def store_bytes(num_tokens: int) -> float:
    return num_tokens * (2 * HEADS * HEAD * 2 + 8 + 2 * HEADS * (HEAD // 2 + HEAD // 16))


def bench_store(results: Results, flashinfer, num_tokens: int, num_slots: int, hnd: bool = False,
                whole_blocks: bool = False, with_reference: bool = False):
    layout, cache, key, value, slots = nvfp4_store_inputs(num_tokens, num_slots, hnd, whole_blocks)
    k_scale, v_scale = scalar(1.0), scalar(1.0)
    order = "random blocks" if whole_blocks else "random slots"
    case = f"NVFP4 store, {num_tokens} tokens, {'HND' if hnd else 'NHD'}, {order}"
    nbytes = store_bytes(num_tokens)

    def ours():
        ops.reshape_and_cache_nvfp4(key, value, cache[:, 0], cache[:, 1], slots, k_scale, v_scale, False)

    repeat = 4 if num_tokens >= 4096 else 50  # a decode step is a few µs: average over more calls per replay
    results.add_graph(case, "plugin CUDA", [ours], nbytes, repeat)
    if flashinfer is not None:
        (k_data, k_sf), (v_data, v_sf) = (nvfp4_flashinfer_views(cache[:, s], layout) for s in (0, 1))
        layout_name = "HND" if hnd else "NHD"

        def theirs():
            flashinfer.nvfp4_quantize_append_paged_kv_cache_with_slot_mapping(
                key, value, slots, (k_data, v_data), (k_sf, v_sf), k_scale, v_scale, layout_name)

        results.add_graph(case, "FlashInfer writer", [theirs], nbytes, repeat)
    if with_reference:
        def torch_reference():
            reference.reshape_and_cache_nvfp4(key, value, cache[:, 0], cache[:, 1], slots, k_scale, v_scale, False)

        results.add(case, "torch reference", eager_ms(torch_reference), nbytes)


def bench_gather(results: Results, seqs: int, seq_len: int):
    layout = NVFP4PageLayout(HEAD, PAGE, HEADS)
    blocks_per_seq = seq_len // PAGE
    cache = layout.allocate(seqs * blocks_per_seq, DEVICE)
    cache.view(torch.uint8).random_(0, 0x7E)  # random codes and finite scales
    table = torch.randperm(seqs * blocks_per_seq, device=DEVICE, dtype=torch.int32).view(seqs, blocks_per_seq)
    cu = torch.arange(0, seqs + 1, device=DEVICE, dtype=torch.int32) * seq_len
    total = seqs * seq_len
    out_key, out_value = (torch.empty(total, HEADS, HEAD, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
    k_scale, v_scale = scalar(0.5), scalar(2.0)
    nbytes = total * 2 * HEADS * ((HEAD // 2 + HEAD // 16) + HEAD * 2) + table.numel() * 4

    def ours():
        ops.gather_nvfp4_kv_cache(cache[:, 0], cache[:, 1], table, cu, k_scale, v_scale, False, out_key, out_value)

    results.add_graph(f"NVFP4 gather, {seqs} x {seq_len} tokens", "plugin CUDA", [ours], nbytes, repeat=2)


def bench_indexer_store(results: Results, num_tokens: int, scale_fmt: str, sets: int = 4,
                        with_reference: bool = False):
    num_blocks = num_tokens // INDEXER.block_size
    inputs = [(random_bf16(num_tokens, INDEXER.head_dim), INDEXER.allocate(num_blocks, DEVICE, fill=0),
               torch.randperm(num_tokens, device=DEVICE)) for _ in range(sets)]
    nbytes = num_tokens * (INDEXER.head_dim * 2 + 8 + INDEXER.row_bytes)
    calls = [lambda k=k, c=c, s=s: ops.indexer_k_quant_and_cache(k, c, s, 128, scale_fmt) for k, c, s in inputs]
    case = f"indexer store, {num_tokens} x 128, {scale_fmt or 'float32'} scales"
    results.add_graph(case, "plugin CUDA", calls, nbytes)
    if with_reference:
        k, c, s = inputs[0]
        results.add(case, "torch reference",
                    eager_ms(lambda: reference.indexer_k_quant_and_cache(k, c, s, 128, scale_fmt)), nbytes)


def bench_indexer_gather(results: Results, seqs: int, seq_len: int):
    blocks_per_seq = seq_len // INDEXER.block_size
    cache = INDEXER.allocate(seqs * blocks_per_seq, DEVICE)
    cache.random_(0, 256)
    table = torch.randperm(seqs * blocks_per_seq, device=DEVICE, dtype=torch.int32).view(seqs, blocks_per_seq)
    cu = torch.arange(0, seqs + 1, device=DEVICE, dtype=torch.int32) * seq_len
    total = seqs * seq_len
    dst_k = torch.empty(total, INDEXER.head_dim, device=DEVICE, dtype=torch.uint8)
    dst_scale = torch.empty(total, INDEXER.scale_bytes, device=DEVICE, dtype=torch.uint8)
    nbytes = 2 * total * INDEXER.row_bytes + table.numel() * 4

    def ours():
        ops.cp_gather_indexer_k_quant_cache(cache, dst_k, dst_scale, table, cu)

    results.add_graph(f"indexer gather, {seqs} x {seq_len} tokens", "plugin CUDA", [ours], nbytes)


def compare_with_flashinfer(flashinfer, num_tokens: int = 8192) -> str:
    """Bytes of both writers on the same inputs (NHD, linear V scales, a non-unit V global scale)."""
    layout, ours, key, value, slots = nvfp4_store_inputs(num_tokens, num_tokens)
    # Edge values: whole zero groups, -0, tiny and huge magnitudes, ties of the E2M1 grid.
    key[: num_tokens // 8, :, :16] = 0.0
    key[num_tokens // 8: num_tokens // 4, :, :16] = -0.0
    value[: num_tokens // 8] *= 1e-30
    value[num_tokens // 8: num_tokens // 4] *= 1e4
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -5.0, 6.0, 0.0, -0.0, 0.1, -0.1, 0.5, -1.0])
    key[num_tokens // 4: num_tokens // 2, :, 16:32] = ties.to(DEVICE, torch.bfloat16)
    k_scale, v_scale = scalar(1.0), scalar(1.7)  # unit K scale: the ties above stay exact ties
    theirs = layout.allocate(ours.size(0), DEVICE, fill=0)
    ops.reshape_and_cache_nvfp4(key, value, ours[:, 0], ours[:, 1], slots, k_scale, v_scale, False)
    views = [nvfp4_flashinfer_views(theirs[:, s], layout) for s in (0, 1)]
    flashinfer.nvfp4_quantize_append_paged_kv_cache_with_slot_mapping(
        key, value, slots, (views[0][0], views[1][0]), (views[0][1], views[1][1]), k_scale, v_scale, "NHD")
    torch.cuda.synchronize()
    lines = []
    for side, name in ((0, "K"), (1, "V")):
        a, b = (layout.side_bytes_view(c[:, side]).cpu() for c in (ours, theirs))
        data_a, data_b = a[:, :layout.data_region_bytes], b[:, :layout.data_region_bytes]
        scale_a, scale_b = a[:, layout.data_region_bytes:], b[:, layout.data_region_bytes:]
        nibbles = Counter()
        for shift in (0, 4):
            na, nb = (data_a >> shift) & 0xF, (data_b >> shift) & 0xF
            diff = na != nb
            nibbles.update(zip(na[diff].tolist(), nb[diff].tolist()))
        lines.append(f"- {name}: {int((scale_a != scale_b).sum())} of {scale_a.numel()} scale bytes differ; "
                     f"{sum(nibbles.values())} of {2 * data_a.numel()} E2M1 codes differ"
                     + (f" (plugin code → FlashInfer code: count) {dict(nibbles.most_common(8))}" if nibbles else ""))
    return "\n".join(lines)


def run_once_each():
    """One call of each op at its target shape, for a profiler (`ncu ... bench_ops_cuda.py --once`)."""
    layout, cache, key, value, slots = nvfp4_store_inputs(262144, 262144)
    one = scalar(1.0)
    ops.reshape_and_cache_nvfp4(key, value, cache[:, 0], cache[:, 1], slots, one, one, False)
    table = torch.randperm(16384, device=DEVICE, dtype=torch.int32).view(16, 1024)
    cu = torch.arange(0, 17, device=DEVICE, dtype=torch.int32) * 16384
    out_key, out_value = (torch.empty(262144, HEADS, HEAD, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
    ops.gather_nvfp4_kv_cache(cache[:, 0], cache[:, 1], table, cu, one, one, False, out_key, out_value)
    k, indexer_cache = random_bf16(262144, 128), INDEXER.allocate(4096, DEVICE, fill=0)
    ops.indexer_k_quant_and_cache(k, indexer_cache, torch.randperm(262144, device=DEVICE), 128, "ue8m0")
    table = torch.randperm(4096, device=DEVICE, dtype=torch.int32).view(16, 256)
    dst_k = torch.empty(262144, 128, device=DEVICE, dtype=torch.uint8)
    dst_scale = torch.empty(262144, 4, device=DEVICE, dtype=torch.uint8)
    ops.cp_gather_indexer_k_quant_cache(indexer_cache, dst_k, dst_scale, table, cu)
    torch.cuda.synchronize()


def report(with_flashinfer: bool, with_reference: bool, settle_ms: float = 0.0) -> str:
    """The markdown table of every target shape (and, with FlashInfer, the writers' byte comparison)."""
    flashinfer = None
    if with_flashinfer:
        import flashinfer
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(DEVICE)
    header = f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}"
    print(header)
    results = Results(settle_ms)
    copy_tbs = bench_copy(results)
    bench_store(results, flashinfer, 262144, 262144, with_reference=with_reference)
    bench_store(results, flashinfer, 262144, 262144, whole_blocks=True)
    bench_store(results, None, 262144, 262144, hnd=True)
    bench_store(results, flashinfer, 256, 262144)
    bench_gather(results, 16, 65536)
    bench_gather(results, 128, 8192)
    for fmt in ("ue8m0", ""):
        bench_indexer_store(results, 262144, fmt, with_reference=with_reference and fmt == "")
    bench_indexer_gather(results, 16, 65536)
    bench_indexer_gather(results, 128, 8192)
    text = header + "\n\n" + results.table(copy_tbs)
    if flashinfer is not None:
        text += "\n\nFlashInfer's writer vs the plugin's on the same inputs (NHD, linear V scales):\n"
        text += compare_with_flashinfer(flashinfer)
    return text


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--once", action="store_true", help="run each op once (for a profiler) and exit")
    parser.add_argument("--flashinfer", action="store_true", help="time and compare FlashInfer's NVFP4 writer")
    parser.add_argument("--reference", action="store_true", help="also time the torch reference (eager)")
    parser.add_argument("--out", help="also write the markdown table to this file")
    parser.add_argument("--settle-ms", type=float, default=0.0,
                        help="also time each graph again after this many ms of further replays")
    args = parser.parse_args()
    if args.once:
        return run_once_each()
    print_report(report(args.flashinfer, args.reference, args.settle_ms), args.out)


if __name__ == "__main__":
    main()
