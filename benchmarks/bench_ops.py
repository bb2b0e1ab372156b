"""Bandwidth of the four cache ops next to a same-run memcpy of the same bytes.

    python benchmarks/bench_ops.py [--device cpu|cuda] [--threads N] [--repeats N] [--append FILE.md] [--note TEXT]

For each op, "bytes" is what the op must read plus write (activations, cache entries, indices); the
memcpy row copies half that many bytes, so it moves the same total. Sizes are tens of MB, beyond any L2.
CPU: median wall time of repeated calls, and the median CPU time of the process per work item (a 16-element
group, an indexer token), which machine load barely moves (with one thread; with more it includes spin-waits). CUDA: each op is captured in a CUDA graph and the median of
event-timed replays is taken. Op and memcpy runs alternate, so machine load hits both alike. Another
writer can join a table as a peer `Bench` (see `benches`).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import platform
import statistics
import subprocess
import time
from dataclasses import dataclass
from typing import Callable

import torch

from vllm_nvfp4_plugin import ops
from vllm_nvfp4_plugin.layout import IndexerCacheLayout, NVFP4PageLayout

from cuda_timing import capture_graph


@dataclass
class Bench:
    name: str
    bytes: int  # read + written
    run: Callable[[], None]
    goal: float | None = None  # fraction of memcpy bandwidth aimed at
    units: int = 0  # work items of one call, for CPU time per item: 16-element groups or indexer tokens
    unit: str = ""


def block_major_slots(num_tokens: int, block_size: int, num_blocks: int, g: torch.Generator) -> torch.Tensor:
    """Slots as vLLM assigns them: consecutive tokens fill a block, blocks come in a shuffled order."""
    blocks = torch.randperm(num_blocks, generator=g)[: (num_tokens + block_size - 1) // block_size]
    t = torch.arange(num_tokens)
    return blocks[t // block_size] * block_size + t % block_size


def gather_tables(num_seqs: int, seq_len: int, block_size: int, num_blocks: int, g: torch.Generator):
    per_seq = (seq_len + block_size - 1) // block_size
    table = torch.randperm(num_blocks, generator=g)[: num_seqs * per_seq].view(num_seqs, per_seq).int()
    cu = torch.arange(num_seqs + 1, dtype=torch.int32) * seq_len
    return table, cu


def benches(device: str, dtype=torch.bfloat16) -> list[Bench]:
    g = torch.Generator().manual_seed(0)
    out = []

    # NVFP4 KV cache: 8 KV heads of 128, block 16, 16k tokens (64 MiB of bf16 K+V in, 18 MiB cache out).
    heads, head_size, block_size, tokens = 8, 128, 16, 16384
    layout = NVFP4PageLayout(head_size, block_size, heads)
    num_blocks = tokens // block_size
    kv_cache = layout.allocate(num_blocks, device, fill=0)
    key = torch.randn(tokens, heads, head_size, generator=g).to(dtype).to(device)
    value = torch.randn(tokens, heads, head_size, generator=g).to(dtype).to(device)
    slots = block_major_slots(tokens, block_size, num_blocks, g).to(device)
    scale = torch.ones(1, device=device)
    act_bytes = 2 * key.numel() * key.element_size()
    cache_bytes = tokens * layout.page_bytes // block_size
    out.append(Bench("reshape_and_cache_nvfp4", act_bytes + cache_bytes + slots.numel() * 8,
                     lambda: ops.reshape_and_cache_nvfp4(key, value, kv_cache[:, 0], kv_cache[:, 1], slots, scale,
                                                         scale, False), goal=0.5,
                     units=2 * key.numel() // 16, unit="group"))
    table, cu = gather_tables(8, tokens // 8, block_size, num_blocks, g)
    table, cu = table.to(device), cu.to(device)
    out_key, out_value = torch.empty_like(key), torch.empty_like(value)
    out.append(Bench("gather_nvfp4_kv_cache", act_bytes + cache_bytes + table.numel() * 4,
                     lambda: ops.gather_nvfp4_kv_cache(kv_cache[:, 0], kv_cache[:, 1], table, cu, scale, scale, False,
                                                       out_key, out_value), goal=0.7,
                     units=2 * key.numel() // 16, unit="group"))

    # Indexer K cache: head_dim 128, block 64, 128k tokens (32 MiB of bf16 in, 16.5 MiB cache out).
    ilayout = IndexerCacheLayout(128, 64, 128)
    itokens = 131072
    inum_blocks = itokens // ilayout.block_size
    icache = ilayout.allocate(inum_blocks, device, fill=0)
    k = torch.randn(itokens, ilayout.head_dim, generator=g).to(dtype).to(device)
    islots = block_major_slots(itokens, ilayout.block_size, inum_blocks, g).to(device)
    icache_bytes = itokens * ilayout.row_bytes
    out.append(Bench("indexer_k_quant_and_cache", k.numel() * k.element_size() + icache_bytes + islots.numel() * 8,
                     lambda: ops.indexer_k_quant_and_cache(k, icache, islots, 128, "ue8m0"), goal=0.5,
                     units=itokens, unit="token"))
    itable, icu = gather_tables(16, itokens // 16, ilayout.block_size, inum_blocks, g)
    itable, icu = itable.to(device), icu.to(device)
    dst_k = torch.empty(itokens, ilayout.head_dim, dtype=torch.uint8, device=device)
    dst_scale = torch.empty(itokens, ilayout.scale_bytes, dtype=torch.uint8, device=device)
    out.append(Bench("cp_gather_indexer_k_quant_cache", 2 * icache_bytes + itable.numel() * 4,
                     lambda: ops.cp_gather_indexer_k_quant_cache(icache, dst_k, dst_scale, itable, icu), goal=0.7,
                     units=itokens, unit="token"))
    return out


def memcpy_bench(total_bytes: int, device: str) -> Bench:
    """A copy of total_bytes / 2. CUDA: an SM kernel (int32 `bitwise_or` with 0), since the graph would run a
    `copy_` on the copy engines, which reach only 2.2-3.1 TB/s where an SM kernel copies at 4.2 (H200)."""
    src = torch.randint(0, 256, (total_bytes // 8 * 4,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    if device == "cpu":
        return Bench("memcpy", 2 * src.numel(), lambda: dst.copy_(src))
    src32, dst32 = src.view(torch.int32), dst.view(torch.int32)
    return Bench("memcpy", 2 * src.numel(), lambda: torch.bitwise_or(src32, 0, out=dst32))


def timer(fn: Callable[[], None], device: str) -> Callable[[], tuple[float, float]]:
    """A function that runs `fn` once and returns its (wall, CPU) seconds (CUDA: a replay of `fn` captured in a
    graph, CPU time NaN)."""
    fn()  # warm up (and first-touch the outputs)
    if device == "cpu":
        def run_cpu() -> tuple[float, float]:
            start, start_cpu = time.perf_counter(), time.process_time()
            fn()
            return time.perf_counter() - start, time.process_time() - start_cpu
        return run_cpu
    graph = capture_graph([fn])
    torch.cuda.synchronize()

    def run_cuda() -> tuple[float, float]:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3, float("nan")
    return run_cuda


def paired_medians(fn: Callable[[], None], copy: Callable[[], None], device: str, repeats: int):
    """Median (wall, CPU) seconds of `fn` and of `copy`, timed alternately so a busy machine slows both alike."""
    run, run_copy = timer(fn, device), timer(copy, device)
    pairs = [(run(), run_copy()) for _ in range(repeats)]
    return [tuple(statistics.median(p[which][clock] for p in pairs) for clock in (0, 1)) for which in (0, 1)]


def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                 platform.processor())
    return f"{model}, {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}"


def measure(device: str, repeats: int) -> list[tuple[Bench, float, float, float, float]]:
    """(bench, GB/s, memcpy GB/s of the same bytes, CPU ns per work item, op / memcpy by CPU time) for every op,
    the memcpy timed alternately with the op."""
    rows = []
    for bench in benches(device):
        copy = memcpy_bench(bench.bytes, device)
        (seconds, cpu_seconds), (copy_seconds, copy_cpu_seconds) = paired_medians(bench.run, copy.run, device, repeats)
        rows.append((bench, bench.bytes / seconds / 1e9, copy.bytes / copy_seconds / 1e9,
                     cpu_seconds / bench.units * 1e9 if bench.units else float("nan"),
                     copy_cpu_seconds / cpu_seconds * bench.bytes / copy.bytes))
        del copy
    return rows


def table(rows, device: str) -> str:
    """CPU rows add the op's CPU time per work item and its bandwidth by CPU time as a share of the memcpy's (the
    load of other processes moves it far less than the wall-time share)."""
    cpu = device == "cpu"
    lines = ["| op | MB read+written | GB/s | memcpy GB/s | % of memcpy | goal |"
             + (" CPU time per item | % of memcpy by CPU time |" if cpu else ""),
             "| --- | ---: | ---: | ---: | ---: | ---: |" + (" ---: | ---: |" if cpu else "")]
    for bench, gbps, copy_gbps, cpu_ns, cpu_share in rows:
        goal = f"{bench.goal:.0%}" if bench.goal else ""
        lines.append(f"| {bench.name} | {bench.bytes / 1e6:.1f} | {gbps:.2f} | {copy_gbps:.2f} | "
                     f"{gbps / copy_gbps:.0%} | {goal} |"
                     + (f" {cpu_ns:.2f} ns/{bench.unit} | {cpu_share:.0%} |" if cpu else ""))
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, help="CPU threads for the ops and the memcpy (default: torch's)")
    parser.add_argument("--append", metavar="RESULTS_MD", help="append the results block (commit, machine, date, table) to this markdown file")
    parser.add_argument("--note", default="", help="a line on the conditions (machine load, ...) for the block")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)  # also sets the OpenMP team size the CPU kernels use
    rows = measure(args.device, args.repeats)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or "unknown"
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    block = (f"### {args.device} · commit {commit} · {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC\n\n"
             f"{device_name(args.device)}; load average {load}; median of {args.repeats}."
             f"{' ' + args.note if args.note else ''}\n\n{table(rows, args.device)}\n")
    if args.device == "cuda":  # the target shapes, beside a copy and (when installed) FlashInfer's writer
        import bench_ops_cuda
        block += "\n" + bench_ops_cuda.report(importlib.util.find_spec("flashinfer") is not None, False) + "\n"
    print(block)
    if args.append:
        with open(args.append, "a") as f:
            f.write("\n" + block)


if __name__ == "__main__":
    main()
