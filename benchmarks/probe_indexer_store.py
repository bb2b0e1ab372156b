"""Why the CUDA indexer store reads slower inside the full benchmark than when it runs first (issue 4).

262,144 tokens x 128 bf16, ue8m0 scales, random slots, timed as bench_ops_cuda.py times it: a CUDA graph of the
4 input sets in turn (4 x 104 MB, so no set is still in the L2 when its turn comes again), median of 20 replays.

Default: readings with a time stamp each (to line up with an `nvidia-smi` log):
- A: sets allocated first in the process;
- B: sets allocated after the full benchmark's earlier cases (copy, NVFP4 stores, NVFP4 gathers), as there;
  A again at that point (same buffers, later in the process); both again after a 3 s pause;
- C: sets allocated after `torch.cuda.empty_cache()`;
- for A and B, two L2 readings: one set replayed (its inputs partly still in the L2), and a 256 MB read before
  every call (the difference of two graphs: the read then also writes back the store's dirty lines).
`--timeline`: the time of every replay of a measurement, on fresh and reused allocations, after a pause, with
random instead of zero-filled caches, with one of k / cache / slots newly allocated, and call by call.
`--ncu`: one eager call on A, the same earlier cases, then one on B and one on A, for Nsight Compute.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench_ops_cuda import DEVICE, INDEXER, Results, bench_copy, bench_gather, bench_store, capture, graph_ms
from cuda_timing import event_median_ms
from vllm_nvfp4_plugin import ops

TOKENS = 262144
SETS = 4
GBYTES = TOKENS * (INDEXER.head_dim * 2 + 8 + INDEXER.row_bytes) / 1e9
T0 = time.time()


def make_sets(cache_fill: str = "zeros"):
    """SETS inputs as the benchmark makes them: bf16 k, a cache filled with zeros (or random bytes), slots."""
    sets = []
    for _ in range(SETS):
        cache = INDEXER.allocate(TOKENS // INDEXER.block_size, DEVICE, fill=0)
        if cache_fill == "random":
            cache.random_(0, 256)
        sets.append((torch.randn(TOKENS, INDEXER.head_dim, device=DEVICE, dtype=torch.bfloat16), cache,
                     torch.randperm(TOKENS, device=DEVICE)))
    return sets


def store(inputs):
    k, cache, slots = inputs
    ops.indexer_k_quant_and_cache(k, cache, slots, 128, "ue8m0")


def calls_of(sets):
    return [lambda s=s: store(s) for s in sets]


def record(label: str, us: float):
    print(f"t={time.time() - T0:7.2f}s  {label:<34} {us:7.2f} us  {GBYTES / us * 1e3:5.2f} TB/s", flush=True)


def rotated_us(sets) -> float:
    return 1e3 * graph_ms(calls_of(sets))


def one_set_us(sets) -> float:
    return 1e3 * graph_ms([lambda: store(sets[0])], repeat=16)


def flushed_us(sets, flush: torch.Tensor) -> float:
    """A read of `flush` (4x the L2) before every call; the reads alone are timed and subtracted."""
    def read():
        torch.amax(flush)

    pairs = [fn for call in calls_of(sets) for fn in (read, call)]
    both = graph_ms(pairs, repeat=2) * 2 * len(pairs)
    reads = graph_ms([read] * len(sets), repeat=2) * 2 * len(sets)
    return 1e3 * (both - reads) / (2 * len(sets))


def addresses(name: str, sets):
    print(name, " ".join(f"k {k.data_ptr():#x} cache {c.data_ptr():#x} slots {s.data_ptr():#x};" for k, c, s in sets))


def earlier_cases():
    """The full benchmark's cases before the indexer store (without FlashInfer), in its order."""
    results = Results()
    bench_copy(results)
    bench_store(results, None, 262144, 262144)
    bench_store(results, None, 262144, 262144, whole_blocks=True)
    bench_store(results, None, 262144, 262144, hnd=True)
    bench_store(results, None, 256, 262144)
    bench_gather(results, 16, 65536)
    bench_gather(results, 128, 8192)


def probe():
    props = torch.cuda.get_device_properties(DEVICE)
    print(f"{props.name}, {props.multi_processor_count} SMs, L2 {props.L2_cache_size / 2**20:.0f} MiB")
    torch.manual_seed(0)
    a = make_sets()
    flush = torch.ones(256 << 20 >> 2, dtype=torch.int32, device=DEVICE)
    for _ in range(3):
        record("A first (rotating sets)", rotated_us(a))
    record("A first, one set (L2-warm)", one_set_us(a))
    record("A first, L2 flushed", flushed_us(a, flush))
    earlier_cases()
    b = make_sets()
    for _ in range(3):
        record("B after gathers (rotating)", rotated_us(b))
        record("A after gathers (rotating)", rotated_us(a))
    record("B after, one set (L2-warm)", one_set_us(b))
    record("B after, L2 flushed", flushed_us(b, flush))
    time.sleep(3)
    record("B after 3 s idle", rotated_us(b))
    record("A after 3 s idle", rotated_us(a))
    addresses("A", a)
    addresses("B", b)
    del b
    torch.cuda.empty_cache()
    c = make_sets()
    addresses("C", c)
    record("C after empty_cache", rotated_us(c))
    record("A after empty_cache", rotated_us(a))


def replay_us(sets, replays: int) -> list[float]:
    """Per-call time (µs) of each of `replays` replays of the benchmark's graph, from its capture on."""
    graph = capture(calls_of(sets))
    return [1e3 * event_median_ms(graph.replay, 1) / (4 * len(sets)) for _ in range(replays)]


def show(label: str, times: list[float]):
    spans = [(0, 10), (10, 20), (20, 40), (40, 60)]
    medians = " ".join(f"[{lo}:{hi}] {statistics.median(times[lo:hi]):6.2f}" for lo, hi in spans if hi <= len(times))
    first = " ".join(f"{t:6.2f}" for t in times[:5])
    print(f"t={time.time() - T0:7.2f}s  {label:<44} first {first} | medians {medians}", flush=True)


def call_by_call_us(sets, calls: int) -> list[float]:
    """Each eager call's time (µs), calls queued back to back behind a 1 ms sleep so the GPU never waits."""
    events = [torch.cuda.Event(enable_timing=True) for _ in range(calls + 1)]
    torch.cuda._sleep(2_000_000)
    for i in range(calls):
        events[i].record()
        store(sets[i % len(sets)])
    events[-1].record()
    events[-1].synchronize()
    return [1e3 * events[i].elapsed_time(events[i + 1]) for i in range(calls)]


def timeline():
    torch.manual_seed(0)
    x = make_sets()
    show("fresh allocation, first in the process", replay_us(x, 40))
    del x
    x = make_sets()
    show("reused blocks, nothing heavy before", replay_us(x, 40))
    earlier_cases()
    b = make_sets()
    time.sleep(1.0)
    show("after gathers, allocated, 1 s idle", replay_us(b, 60))
    show("after gathers, allocated just now", replay_us(make_sets(), 60))
    show("after gathers, random-filled caches", replay_us(make_sets("random"), 60))
    fresh = make_sets()
    show("only k new (caches, slots used before)", replay_us([(f[0], w[1], w[2]) for f, w in zip(fresh, x)], 40))
    fresh = make_sets()
    show("only caches new", replay_us([(w[0], f[1], w[2]) for f, w in zip(fresh, x)], 40))
    fresh = make_sets()
    show("only slots new", replay_us([(w[0], w[1], f[2]) for f, w in zip(fresh, x)], 40))
    show("the sets used before (x), again", replay_us(x, 40))
    times = call_by_call_us(make_sets(), 128)
    print("eager, call by call on new sets (µs):", " ".join(f"{t:.1f}" for t in times[:16]), "...",
          " ".join(f"{t:.1f}" for t in times[-8:]))
    print(f"  medians of calls [0:16] {statistics.median(times[:16]):.2f} [16:64] {statistics.median(times[16:64]):.2f}"
          f" [64:128] {statistics.median(times[64:]):.2f}")


def for_ncu():
    torch.manual_seed(0)
    a = make_sets()
    store(a[0])
    earlier_cases()
    b = make_sets()
    store(b[0])
    store(a[0])
    torch.cuda.synchronize()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--timeline", action="store_true", help="every replay's time, fresh vs reused allocations")
    parser.add_argument("--ncu", action="store_true", help="eager calls only, for Nsight Compute")
    args = parser.parse_args()
    if args.ncu:
        for_ncu()
    elif args.timeline:
        timeline()
    else:
        probe()


if __name__ == "__main__":
    main()
