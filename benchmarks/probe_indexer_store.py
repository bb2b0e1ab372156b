"""Why the CUDA indexer store read 31.7 µs in the full benchmark and 29 µs alone (issue 4; RESULTS.md, sixth pass).

262,144 tokens x 128 bf16, ue8m0 scales, random slots, 4 input sets in turn (as bench_ops_cuda.py times it).
Each line is a timeline of single graph replays (16 calls each), as medians of replays [0:10], [10:20], [20:40]:
- a graph captured by `torch.cuda.graph` right after the NVFP4 gather cases: its capture empties the caching
  allocator (the gathers' ~5 GiB go back to the driver) and the first ~10 ms read slow;
- the same capture without emptying the cache (cuda_timing.capture_graph): no slow start;
- emptied, then 100 ms idle, then captured: no slow start (the driver's work on the freed memory is done);
- a graph captured earlier, replayed right after an explicit `empty_cache()`: slow again, so the freeing is the
  cause, not the capture;
- a 256 MiB copy right after `empty_cache()`: slow too, so the freed memory costs every HBM-bound kernel, not
  only the store.
"""

from __future__ import annotations

import time

import torch

from bench_ops_cuda import DEVICE, INDEXER, Results, bench_gather
from cuda_timing import capture_graph, event_median_ms
from vllm_nvfp4_plugin import ops

TOKENS = 262144
SETS = 4


def make_sets():
    return [(torch.randn(TOKENS, INDEXER.head_dim, device=DEVICE, dtype=torch.bfloat16),
             INDEXER.allocate(TOKENS // INDEXER.block_size, DEVICE, fill=0), torch.randperm(TOKENS, device=DEVICE))
            for _ in range(SETS)]


def torch_graph(calls: list, repeat: int = 4) -> torch.cuda.CUDAGraph:
    """The capture the benchmarks used before: `with torch.cuda.graph(...)`, which first empties the cache."""
    for fn in calls:  # the same warm-up round
        fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeat):
            for fn in calls:
                fn()
    graph.replay()
    return graph


def timeline(graph: torch.cuda.CUDAGraph, calls_per_replay: int, replays: int = 40) -> list[float]:
    return [1e3 * event_median_ms(graph.replay, 1) / calls_per_replay for _ in range(replays)]


def show(label: str, times: list[float]):
    def median(lo, hi):
        part = sorted(times[lo:hi])
        return f"{part[len(part) // 2]:7.2f}" if part else "      -"
    print(f"{label:<58} [0:10] {median(0, 10)} [10:20] {median(10, 20)} [20:40] {median(20, 40)} µs", flush=True)


def main():
    props = torch.cuda.get_device_properties(DEVICE)
    print(f"{props.name}, torch {torch.__version__}; per-call µs of single replays")
    torch.manual_seed(0)
    sets = make_sets()
    calls = [lambda s=s: ops.indexer_k_quant_and_cache(*s, 128, "ue8m0") for s in sets]
    src = torch.empty(256 << 20, dtype=torch.uint8, device=DEVICE).random_()
    dst = torch.empty_like(src)
    copy = capture_graph([lambda: dst.view(torch.int32).copy_(src.view(torch.int32))], repeat=4)
    results = Results()

    def gathers():
        bench_gather(results, 16, 65536)
        bench_gather(results, 128, 8192)
        torch.cuda.synchronize()

    def reserved():
        return f"{torch.cuda.memory_reserved() / 2**30:.1f} GiB"

    for rnd in range(2):
        gathers()
        before = reserved()
        graph = torch_graph(calls)
        show(f"r{rnd} torch.cuda.graph after gathers (reserved {before} -> {reserved()})", timeline(graph, 16))
        gathers()
        show(f"r{rnd} capture_graph after gathers (reserved {reserved()})", timeline(capture_graph(calls, 4), 16))
        gathers()
        torch.cuda.empty_cache()
        time.sleep(0.1)
        show(f"r{rnd} empty_cache, 100 ms idle, capture_graph", timeline(capture_graph(calls, 4), 16))
        gathers()
        show(f"r{rnd} graph captured before the gathers", timeline(graph, 16, 10))
        torch.cuda.empty_cache()
        show(f"r{rnd} the same graph right after empty_cache", timeline(graph, 16))
        gathers()
        torch.cuda.empty_cache()
        show(f"r{rnd} copy 256 MiB right after empty_cache", timeline(copy, 4))
        show(f"r{rnd} copy 256 MiB after that", timeline(copy, 4))


if __name__ == "__main__":
    main()
