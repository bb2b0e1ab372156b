"""CPU attention: the plugin's `nvfp4_paged_attention` against vLLM's own CPU attention, in one run.

Each case is B requests × L cached tokens, one decode query a request (with `--prefill`: L causal query rows a
request, a prompt's prefill over its own L tokens), 32 query / 8 KV heads of 128 (`--heads`,
`--head-size`; SmolLM2-135M's attention is `--heads 9/3 --head-size 64`), pages of 128 tokens (vLLM's CPU block
size) in random order. The contenders read the same number of tokens:

- nvfp4: the plugin's op over an NVFP4 cache (HND, as the CPU backend allocates it), 72 bytes a token and head;
- bf16 and fp8: vLLM's `cpu_attention_with_kv_cache` (the op its `CPU_ATTN` backend runs) over a bf16 cache and,
  where vLLM allows it on this CPU (x86 with AVX-512 or AMX), an fp8 one, with the scheduler metadata and
  instruction set vLLM's metadata builder would pick;
- memcpy: a copy of a buffer as large as the bf16 cache, the machine's bandwidth ceiling (bytes read + written).

Calls alternate between the contenders, one warm-up each, so machine load hits all alike; a figure is the median
of `--repeats` wall times. With `--layers N` each contender has N caches of the case's shape and a timed call runs
the N of them in a row, as a decode step runs a model's layers (so one layer's cache is no longer in the core's
caches when its turn comes again); a figure is then that time / N. GB/s is the bytes of cache each one reads, per second. The cache holds random values:
the time of none of the kernels depends on them.

With `--avx2-host` both sides run as on an x86 CPU without AVX-512: the plugin's AVX2 variant
(`VLLM_NVFP4_CPU_ISA=avx2`) and the kernel library vLLM loads on such a CPU (`vllm._C_AVX2`, chosen by making torch
report no AVX-512 before vLLM loads its kernels; vLLM then refuses its fp8 cache, as it does there).

Options: `--batches 1 8`, `--contexts 2048 8192 32768`, `--heads 32/8`, `--head-size 128`, `--threads N` (default:
torch's), `--avx2-host`, `--repeats N` (default 9), `--layers N` (default 1), `--prefill`, `--append FILE.md` (appends the table with commit,
machine and date), `--note TEXT`.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from provenance import emit, stamp

from vllm_nvfp4_plugin import ops
from vllm_nvfp4_plugin.layout import NVFP4PageLayout

BLOCK_SIZE = 128


def time_call(fn, timings: list[float]) -> None:
    start = time.perf_counter()
    fn()
    timings.append((time.perf_counter() - start) * 1e3)


def queries(batch: int, context: int, q_heads: int, head_size: int, prefill: bool, g: torch.Generator):
    """bf16 queries, query_start_loc and the rows a request: one (decode) or its whole context (prefill)."""
    rows = context if prefill else 1
    query = torch.randn(batch * rows, q_heads, head_size, generator=g).bfloat16()
    return query, torch.arange(batch + 1, dtype=torch.int32) * rows, rows


def nvfp4_case(batch: int, context: int, heads: tuple[int, int, int], prefill: bool, g: torch.Generator):
    q_heads, kv_heads, head_size = heads
    layout = NVFP4PageLayout(head_size, BLOCK_SIZE, kv_heads, hnd=True)
    pages = context // BLOCK_SIZE
    cache = layout.allocate(batch * pages)
    data = torch.randint(0, 256, (cache.numel(),), generator=g, dtype=torch.uint8)
    cache.copy_(torch.where((data & 0x7F) == 0x7F, data - 1, data).view(cache.shape))  # no NaN block scale
    table = torch.randperm(batch * pages, generator=g).view(batch, pages).int()
    query, starts, rows = queries(batch, context, q_heads, head_size, prefill, g)
    out = torch.empty_like(query)
    lens = torch.full((batch,), context, dtype=torch.int32)
    one = torch.ones(1)

    def run():
        ops.nvfp4_paged_attention(query, cache[:, 0], cache[:, 1], table, starts, lens, one, one, head_size ** -0.5,
                                  True, False, rows, context, out)
    return run, batch * context * kv_heads * 2 * layout.full_dim


def vllm_case(batch: int, context: int, heads: tuple[int, int, int], kv_cache_dtype: str, prefill: bool,
              g: torch.Generator):
    """vLLM's CPU attention as its CPU_ATTN backend calls it, or the reason vLLM refuses the dtype here."""
    from vllm import _custom_ops as vllm_ops
    from vllm import envs
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    q_heads, kv_heads, head_size = heads
    try:
        isa = _get_attn_isa(torch.bfloat16, BLOCK_SIZE, head_size, kv_cache_dtype)
    except NotImplementedError as e:
        return str(e), 0
    if isa == "amx":
        torch._C._cpu._init_amx()  # as vLLM's CPU worker does at start: Linux grants the AMX tile state on request
    pages = context // BLOCK_SIZE
    kv_cache = torch.randn(batch * pages, kv_heads, 2 * BLOCK_SIZE, head_size, generator=g).bfloat16()
    if kv_cache_dtype != "auto":
        kv_cache = kv_cache.to(torch.float8_e4m3fn).view(torch.uint8)
    key_cache, value_cache = kv_cache.chunk(2, dim=2)
    table = torch.randperm(batch * pages, generator=g).view(batch, pages).int()
    query, starts, _ = queries(batch, context, q_heads, head_size, prefill, g)
    out = torch.empty_like(query)
    lens = torch.full((batch,), context, dtype=torch.int32)
    metadata = vllm_ops.cpu_attn_get_scheduler_metadata(batch, q_heads, kv_heads, head_size, lens, torch.bfloat16,
                                                        starts, True, -1, isa, envs.VLLM_CPU_ATTN_SPLIT_KV,
                                                        kv_cache_dtype=kv_cache_dtype)

    def run():
        vllm_ops.cpu_attention_with_kv_cache(query, key_cache, value_cache, out, starts, lens, head_size ** -0.5, True,
                                             None, -1, table, 0.0, metadata, None, kv_cache_dtype=kv_cache_dtype)
    return run, kv_cache.numel() * kv_cache.element_size()


def memcpy_case(nbytes: int):
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    return (lambda: dst.copy_(src)), 2 * nbytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192, 32768])
    parser.add_argument("--heads", default="32/8", help="query / KV heads")
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--layers", type=int, default=1, help="caches a contender runs in a row per timed call")
    parser.add_argument("--prefill", action="store_true", help="L causal query rows a request instead of one")
    parser.add_argument("--append", help="append the table to this markdown file")
    parser.add_argument("--note", help="a line added under the table")
    parser.add_argument("--avx2-host", action="store_true",
                        help="the plugin's AVX2 variant against vLLM's AVX2 kernel library")
    args = parser.parse_args()
    if args.avx2_host:
        os.environ["VLLM_NVFP4_CPU_ISA"] = "avx2"  # read when the plugin's first kernel runs
        torch.cpu._is_avx512_supported = lambda: False  # vLLM's CPU platform then loads vllm._C_AVX2
    torch.set_num_threads(args.threads)

    q_heads, kv_heads = (int(n) for n in args.heads.split("/"))
    heads = (q_heads, kv_heads, args.head_size)
    g = torch.Generator().manual_seed(0)
    rows, refused = [], {}

    def layers(make, *case):  # `--layers` cases of one contender, run in a row; (the reason, 0) where vLLM refuses
        made = [make(*case) for _ in range(args.layers)]
        if isinstance(made[0][0], str):
            return made[0]
        runs = [run for run, _ in made]
        return (lambda: [run() for run in runs]), made[0][1]

    for batch in args.batches:
        for context in args.contexts:
            contenders = {"nvfp4": layers(nvfp4_case, batch, context, heads, args.prefill, g)}
            for name, dtype in (("bf16", "auto"), ("fp8", "fp8")):
                run, nbytes = layers(vllm_case, batch, context, heads, dtype, args.prefill, g)
                if isinstance(run, str):
                    refused[name] = run
                else:
                    contenders[name] = (run, nbytes)
            contenders["memcpy"] = layers(memcpy_case, contenders["bf16"][1] if "bf16" in contenders else 1 << 28)
            timings = {name: [] for name in contenders}
            for run, _ in contenders.values():
                run()  # warm-up
            for _ in range(args.repeats):
                for name, (run, _) in contenders.items():
                    time_call(run, timings[name])
            ms = {name: sorted(t)[len(t) // 2] / args.layers for name, t in timings.items()}
            gbs = {name: contenders[name][1] / ms[name] / 1e6 for name in contenders}
            rows.append((batch, context, ms, gbs))
            print(f"B={batch} L={context}: " + ", ".join(f"{n} {ms[n]:.3f} ms ({gbs[n]:.1f} GB/s)" for n in ms),
                  flush=True)

    def cell(ms, gbs, name):
        return f"{ms[name]:.3f} ({gbs[name]:.1f})" if name in ms else "n/a"

    def ratio(ms, name):
        return f"{ms[name] / ms['nvfp4']:.2f}×" if name in ms else "n/a"

    lines = [
        f"{stamp()}; {args.threads} threads; {'AVX2 variants (plugin and vLLM); ' if args.avx2_host else ''}"
        f"{'causal prefill' if args.prefill else 'decode'}, {q_heads} query / {kv_heads} KV heads, head {args.head_size}, "
        f"block {BLOCK_SIZE}; median of {args.repeats}"
        + (f", {args.layers} layers' caches in a row, times a layer" if args.layers > 1 else ""),
        "",
        "| B | L | nvfp4 ms (GB/s) | vLLM bf16 ms (GB/s) | vLLM fp8 ms (GB/s) | nvfp4 speed-up vs bf16 | vs fp8 "
        "| memcpy GB/s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for batch, context, ms, gbs in rows:
        lines.append(f"| {batch} | {context} | {cell(ms, gbs, 'nvfp4')} | {cell(ms, gbs, 'bf16')} | "
                     f"{cell(ms, gbs, 'fp8')} | {ratio(ms, 'bf16')} | {ratio(ms, 'fp8')} | {gbs['memcpy']:.1f} |")
    for name, reason in refused.items():
        lines.append(f"\nvLLM {name}: refused on this CPU ({reason})")
    if args.note:
        lines.append(f"\n{args.note}")
    emit(lines, args.append)


if __name__ == "__main__":
    main()
