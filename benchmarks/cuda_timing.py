"""Device timing shared by the CUDA benchmarks."""

import statistics

import torch


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
