"""Device timing and report output shared by the CUDA benchmarks."""

import statistics

import torch


def capture_graph(calls: list, repeat: int = 1, warmup_rounds: int = 1) -> torch.cuda.CUDAGraph:
    """A CUDA graph of `repeat` rounds of `calls`, captured on a side stream after `warmup_rounds` eager rounds
    there, and replayed once.

    Not `with torch.cuda.graph(...)`: that empties the caching allocator first, handing the earlier cases' memory
    back to the driver, and the driver's own work on freed memory then takes HBM bandwidth during the first ~10 ms
    of the timing (after 5 GiB freed, a copy read 11% and the indexer store 9% slower on an H200; docs/GPU.md)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        for _ in range(warmup_rounds):
            for fn in calls:
                fn()
        stream.synchronize()
        graph.capture_begin()
        try:
            for _ in range(repeat):
                for fn in calls:
                    fn()
        finally:  # a call that cannot be captured raises here, with the stream out of capture mode
            graph.capture_end()
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    return graph


def event_median_ms(fn, reps: int) -> float:
    """Median of `reps` runs of `fn`, each timed with CUDA events on the current stream."""
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def print_report(text: str, out: str | None) -> None:
    """Print a benchmark's markdown report, and write it to `out` too when given."""
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")
