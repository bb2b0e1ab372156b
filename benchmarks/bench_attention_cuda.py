"""NVFP4 paged attention on one CUDA GPU: the plugin's kernels against FlashInfer bf16, fp8 and NVFP4, same run.

Decode (one query token a request, FlashInfer's tensor-core decode for the peers): every B×L in --decode, at the
--heads head counts and head 128, plus heads 64 and 256 at the first shape (effective bandwidth). Prefill (causal):
each --prefill case as `[count×]query_len[+cached]` (e.g. `4x8192`, `2048+30720` = a 2,048-token chunk after
30,720 cached tokens), the plugin's fused kernel and its dequantize-to-bf16 + FlashInfer fa3 path against FlashInfer
bf16 fa3 prefill over the same lengths; --prefill-features adds rows with a layer's model features (sliding window,
logit soft-cap, sinks), the bf16 peer planned with the same window and soft-cap, and the same sinks through fa3's
sink variant where there is no soft-cap (that variant has none).

Times: medians of CUDA-event timings of a CUDA graph replaying each call --calls times (launch overhead out),
caches of random bytes (no E4M3 NaN scale) in shuffled pages, 16-token pages. `floor` is the bytes the call must
move (the NVFP4 cache it reads, the queries and outputs) over --bandwidth (the H200's measured device copy,
4.2 TB/s); prefill reports TFLOP/s over its causal pairs. --fp8-keys adds a decode column: the plugin over an
fp8_keys page (FP8 E4M3 keys, NVFP4 values) of the same shape; --int8-keys one over an int8-key page (INT8 keys with
an fp16 scale each, finite, NVFP4 values). Prints a markdown table; --out FILE writes it too.

    python benchmarks/bench_attention_cuda.py [--decode 32x8192,8x32768,1x32768,128x2048] [--heads 32/8,64/8]
        [--prefill 4096,4x8192,2048+30720] [--prefill-features window128+sinks,window4096+cap50]
        [--peers bf16,fp8,nvfp4] [--fp8-keys] [--int8-keys] [--calls 20] [--reps 15] [--out FILE]
    python benchmarks/bench_attention_cuda.py --warm-flashinfer   # build FlashInfer's JIT modules first
"""

from __future__ import annotations

import argparse
import importlib.util
import sys

import torch

# Plain torch and FlashInfer: --warm-flashinfer needs no extension.
from vllm_nvfp4_plugin.flashinfer_variants import fa3_sink_jit_args
from vllm_nvfp4_plugin.layout import NVFP4PageLayout

from cuda_timing import capture_graph, event_median_ms

BLOCK_SIZE = 16
FLASHINFER_WORKSPACE = 128 << 20


def graph_ms(fn, calls: int, reps: int) -> float:
    return event_median_ms(capture_graph([fn], calls, warmup_rounds=2).replay, reps) / calls


def random_nvfp4_cache(layout: NVFP4PageLayout, num_blocks: int, gen: torch.Generator) -> torch.Tensor:
    """The cache (NVFP4 keys) or, for an FP8- or INT8-key layout, its `[num_blocks, page_bytes]` pages; no E4M3 NaN,
    no fp16 inf or NaN key scale."""
    cache = (layout.allocate(num_blocks, "cuda") if layout.key_format == "nvfp4"
             else torch.empty((num_blocks, layout.page_bytes), dtype=torch.uint8, device="cuda"))
    data = torch.randint(0, 256, cache.shape, dtype=torch.uint8, device="cuda", generator=gen)
    cache.copy_(torch.where((data & 0x7F) == 0x7F, data - 1, data))
    if layout.int8_keys:  # the scales' sign and exponent bytes: exponent 31 (inf, NaN) made finite
        high = cache[:, layout.int8_key_scale_offset(0, 0) + 1:layout.key_side_bytes:2]
        high.copy_(torch.where((high & 0x7C) == 0x7C, high ^ 0x40, high))
    return cache


def paged_tables(seq_lens: list[int], gen: torch.Generator):
    """(block_table int32 [B, max pages] over shuffled pages, FlashInfer's indptr / indices / last_page_len)."""
    pages = [-(-c // BLOCK_SIZE) for c in seq_lens]
    order = torch.randperm(sum(pages), device="cuda", generator=gen).to(torch.int32)
    table = torch.zeros(len(seq_lens), max(pages), dtype=torch.int32, device="cuda")
    indptr = [0]
    for r, n in enumerate(pages):
        table[r, :n] = order[indptr[-1]:indptr[-1] + n]
        indptr.append(indptr[-1] + n)
    last = torch.tensor([c - (n - 1) * BLOCK_SIZE for c, n in zip(seq_lens, pages)], dtype=torch.int32)
    return table, torch.tensor(indptr, dtype=torch.int32), order, last, sum(pages)


def starts_of(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)


class Case:
    """Requests `(query_len, seq_len)` over a random NVFP4 cache; the op's arguments for them."""

    def __init__(self, requests, q_heads, kv_heads, head, gen, key_format="nvfp4"):
        self.requests, self.q_heads, self.kv_heads, self.head = requests, q_heads, kv_heads, head
        seq_lens = [c for _, c in requests]
        self.layout = NVFP4PageLayout(head, BLOCK_SIZE, kv_heads, key_format=key_format)
        self.table, self.indptr, self.indices, self.last_page_len, num_blocks = paged_tables(seq_lens, gen)
        self.cache = random_nvfp4_cache(self.layout, num_blocks, gen)
        self.key_cache, self.value_cache = (self.layout.side_views(self.cache) if key_format != "nvfp4"
                                            else (self.cache[:, 0], self.cache[:, 1]))
        self.num_blocks = num_blocks
        tokens = sum(n for n, _ in requests)
        self.query = torch.randn(tokens, q_heads, head, device="cuda", dtype=torch.bfloat16, generator=gen)
        self.out = torch.empty_like(self.query)
        self.qo_indptr = starts_of([n for n, _ in requests])
        self.kv_indptr = starts_of(seq_lens)
        self.query_start_loc = self.qo_indptr.cuda()
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
        self.k_scale = torch.ones(1, device="cuda")
        self.v_scale = torch.ones(1, device="cuda")
        self.scale = head ** -0.5

    def plugin(self, sliding_window=0, logits_soft_cap=0.0, sinks=None):
        from vllm_nvfp4_plugin import ops

        ops.nvfp4_paged_attention(self.query, self.key_cache, self.value_cache, self.table, self.query_start_loc,
                                  self.seq_lens, self.k_scale, self.v_scale, self.scale, True, False,
                                  max(n for n, _ in self.requests), max(c for _, c in self.requests), self.out,
                                  sliding_window, logits_soft_cap, sinks)

    def nvfp4_bytes(self) -> int:
        cached = sum(c for _, c in self.requests) * self.kv_heads * (self.layout.key_dim + self.layout.full_dim)
        return cached + 2 * self.query.numel() * self.query.element_size()

    def causal_flops(self, sliding_window: int = 0) -> float:
        """Flops of the (query, key) pairs the causal mask and `sliding_window` (0: none) leave visible."""
        pairs = 0
        for n, c in self.requests:
            seen = torch.arange(c - n, c) + 1  # keys up to each query's position
            if sliding_window:
                seen = seen.clamp(max=sliding_window)
            pairs += int(seen.sum())
        return 4.0 * pairs * self.q_heads * self.head


def flashinfer_decode(case: Case, kv_dtype: torch.dtype, gen):
    """FlashInfer tensor-core decode over a paged cache of `kv_dtype` with the case's shape and page order."""
    import flashinfer

    ws = torch.empty(FLASHINFER_WORKSPACE, dtype=torch.uint8, device="cuda")
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
    wrapper.plan(case.indptr, case.indices, case.last_page_len, case.q_heads, case.kv_heads, case.head, BLOCK_SIZE,
                 q_data_type=torch.bfloat16, kv_data_type=kv_dtype, sm_scale=case.scale)
    shape = (case.num_blocks, 2, BLOCK_SIZE, case.kv_heads, case.head)
    kv = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen).to(kv_dtype)
    return lambda: wrapper.run(case.query, kv, out=case.out), kv.numel() * kv.element_size()


def flashinfer_nvfp4_decode(case: Case):
    from vllm_nvfp4_plugin.attention.flashinfer_reader import FlashInferNVFP4Decoder

    decoder = FlashInferNVFP4Decoder(torch.device("cuda"), hnd=False)
    decoder.plan(case.table, torch.tensor([c for _, c in case.requests], dtype=torch.int32), case.q_heads,
                 case.kv_heads, case.head, BLOCK_SIZE, torch.bfloat16, case.scale)
    return lambda: decoder.run(case.query, case.cache[:, 0], case.cache[:, 1], 1.0, 1.0, case.out)


def fa3_ragged_wrapper(ws: torch.Tensor, head: int, window: int, sinks: bool):
    """FlashInfer's fa3 ragged prefill wrapper, its sink variant if `sinks`."""
    import flashinfer

    jit = dict(zip(("jit_args", "jit_kwargs"), fa3_sink_jit_args(torch.bfloat16, head, window > 0))) if sinks else {}
    return flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend="fa3", **jit)


def flashinfer_ragged_prefill(case: Case, sliding_window=0, logits_soft_cap=0.0, sinks=None):
    """FlashInfer's fa3 ragged prefill planned for the case (with its window, soft-cap, and `sinks` through the sink
    variant); returns run(k, v)."""
    ws = torch.empty(FLASHINFER_WORKSPACE, dtype=torch.uint8, device="cuda")
    wrapper = fa3_ragged_wrapper(ws, case.head, sliding_window, sinks is not None)
    wrapper.plan(case.qo_indptr, case.kv_indptr, case.q_heads, case.kv_heads, case.head, causal=True,
                 sm_scale=case.scale, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16,
                 window_left=sliding_window - 1 if sliding_window else -1, logits_soft_cap=logits_soft_cap)
    if sinks is not None:
        return lambda k, v: wrapper.run(case.query, k, v, sinks, case.scale, out=case.out)
    return lambda k, v: wrapper.run(case.query, k, v, out=case.out)


# (window, soft-cap, sinks): fa3 builds one module each
PREFILL_VARIANTS = ((0, 0.0, False), (128, 0.0, False), (0, 30.0, False), (128, 30.0, False), (0, 0.0, True),
                    (128, 0.0, True))


def warm_module(task: tuple) -> str:
    """Builds one FlashInfer JIT module on a tiny shape: ("decode", head, kv dtype) or ("prefill", head, window,
    soft-cap, sinks)."""
    import flashinfer

    ws = torch.empty(FLASHINFER_WORKSPACE, dtype=torch.uint8, device="cuda")
    if task[0] == "prefill":
        _, head, window, cap, sinks = task
        w = fa3_ragged_wrapper(ws, head, window, sinks)
        w.plan(torch.tensor([0, 4], dtype=torch.int32), torch.tensor([0, 4], dtype=torch.int32), 8, 2, head,
               causal=True, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16,
               window_left=window - 1 if window else -1, logits_soft_cap=cap)
        kv = torch.zeros(4, 2, head, dtype=torch.bfloat16, device="cuda")
        sink_args = (torch.zeros(8, device="cuda"), 1.0) if sinks else ()
        w.run(torch.zeros(4, 8, head, dtype=torch.bfloat16, device="cuda"), kv, kv, *sink_args)
    else:
        _, head, kv_dtype = task
        indptr, last = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([1], dtype=torch.int32)
        q = torch.zeros(1, 8, head, dtype=torch.bfloat16, device="cuda")
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
        w.plan(indptr, torch.zeros(1, dtype=torch.int32, device="cuda"), last, 8, 2, head, BLOCK_SIZE,
               q_data_type=torch.bfloat16, kv_data_type=kv_dtype)
        if kv_dtype == torch.uint8:
            data = torch.zeros(2, 1, BLOCK_SIZE, 2, head // 2, dtype=torch.uint8, device="cuda")
            sf = torch.zeros(2, 1, BLOCK_SIZE, 2, head // 16, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
            w.run(q, (data[0], data[1]), kv_cache_sf=(sf[0], sf[1]))
        else:
            w.run(q, torch.zeros(1, 2, BLOCK_SIZE, 2, head, device="cuda").to(kv_dtype))
    torch.cuda.synchronize()
    return " ".join(map(str, task))


def warm_flashinfer(head_sizes: list[int], jobs: int, decode: bool) -> None:
    """Builds FlashInfer's JIT modules this benchmark and the tests use (bf16/fp8/NVFP4 decode if `decode`; fa3
    prefill, plain, windowed, soft-capped and with sinks) in `jobs` processes; needs no plugin extension, so it can
    run while the extension builds."""
    from concurrent.futures import ProcessPoolExecutor
    import multiprocessing

    tasks = [("decode", head, kv_dtype) for head in head_sizes if decode
             for kv_dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.uint8) if head == 128 or kv_dtype == torch.bfloat16]
    tasks += [("prefill", head, *variant) for head in head_sizes for variant in PREFILL_VARIANTS]
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        for built in pool.map(warm_module, tasks):
            print("FlashInfer module built:", built, flush=True)


def parse_shape(text: str) -> tuple[int, int]:
    count, _, rest = text.rpartition("x")
    return int(count or 1), rest


def parse_features(text: str) -> dict:
    """A model-feature set such as `window128+sinks` or `window4096+cap50` as the op's keyword arguments."""
    features = {}
    for part in filter(None, text.split("+")):
        if part == "sinks":
            features["sinks"] = True
        elif part.startswith("window"):
            features["sliding_window"] = int(part[len("window"):])
        elif part.startswith("cap"):
            features["logits_soft_cap"] = float(part[len("cap"):])
        else:
            raise ValueError(f"unknown model feature {part!r}: use windowN, capX and sinks joined by '+'")
    return features


def prefill_row(text: str, t, gen, have_flashinfer: bool, feature_text: str = "") -> str:
    """One causal prefill case: the fused kernel, dequantize + fa3, FlashInfer bf16 fa3 (same lengths, same window
    and soft-cap, the same sinks through fa3's sink variant; with a soft-cap too the bf16 peer runs without the
    sinks, which cost the plugin one pass over the output)."""
    count, rest = parse_shape(text)
    n, _, cached = rest.partition("+")
    n, cached = int(n), int(cached or 0)
    case = Case([(n, n + cached)] * count, 32, 8, 128, gen)
    features = parse_features(feature_text)
    if features.pop("sinks", False):
        features["sinks"] = torch.randn(32, device="cuda", generator=gen)
    window, cap = features.get("sliding_window", 0), features.get("logits_soft_cap", 0.0)
    fused = t(lambda: case.plugin(**features))
    row = [f"{count}×{n}" + (f" over {cached} cached" if cached else ""), feature_text or "none", f"{fused:.3f}"]
    flops = case.causal_flops(window)
    rates = [flops / (fused * 1e-3) / 1e12]
    if have_flashinfer:
        from vllm_nvfp4_plugin.attention.flashinfer_reader import DequantPrefill

        dequant = DequantPrefill(torch.device("cuda"))
        sinks = features.get("sinks")
        dequant.plan(case.qo_indptr, case.kv_indptr[1:] - case.kv_indptr[:-1], 32, 8, 128, True, case.scale,
                     sliding_window=window, logits_soft_cap=cap, sinks=sinks is not None, block_size=BLOCK_SIZE)
        table = dequant.visible_table(case.table)
        ms = t(lambda: dequant.run(case.query, case.cache, table, case.k_scale, case.v_scale, case.out, sinks))
        gather_ms = t(lambda: dequant.gather(case.cache, table, case.k_scale, case.v_scale))
        run = flashinfer_ragged_prefill(case, window, cap, None if cap else sinks)
        shape = (int(case.kv_indptr[-1]), 8, 128)
        ref_k = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen)
        ref_v = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen)
        bf16 = t(lambda: run(ref_k, ref_v))
        row += [f"{ms:.3f}", f"{gather_ms:.3f}", f"{bf16:.3f}", f"{ms / bf16:.2f}"]
        rates += [flops / (ms * 1e-3) / 1e12, flops / (bf16 * 1e-3) / 1e12]
    else:
        row += ["", "", "", ""]
    row.append(" / ".join(f"{r:.0f}" for r in rates))
    return "| " + " | ".join(row) + " |"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--decode", default="32x8192,8x32768,1x32768,128x2048", help="decode shapes BxL")
    parser.add_argument("--heads", default="32/8,64/8", help="query/KV head counts of the decode shapes")
    parser.add_argument("--head-sizes", default="64,256", help="extra head sizes, timed at the first decode shape")
    parser.add_argument("--prefill", default="4096,4x8192,2048+30720",
                        help="causal prefill cases [count x]query_len[+cached tokens]; '' for none")
    parser.add_argument("--prefill-features", default="",
                        help="model-feature sets the prefill cases also run with, comma-separated, each windowN, "
                             "capX and sinks joined by '+' (e.g. window128+sinks,window4096+cap50)")
    parser.add_argument("--peers", default="bf16,fp8,nvfp4", help="FlashInfer decode peers")
    parser.add_argument("--fp8-keys", action="store_true", help="also time decode over an fp8_keys page")
    parser.add_argument("--int8-keys", action="store_true", help="also time decode over an int8-key page")
    parser.add_argument("--calls", type=int, default=20, help="calls per captured graph")
    parser.add_argument("--reps", type=int, default=15, help="graph replays timed (median)")
    parser.add_argument("--bandwidth", type=float, default=4.2e12, help="bytes/s of the byte floor")
    parser.add_argument("--out", help="also write the table here")
    parser.add_argument("--once", action="store_true",
                        help="call the plugin's decode once per shape, eagerly, and time nothing (for a profiler)")
    parser.add_argument("--warm-flashinfer", action="store_true",
                        help="only build FlashInfer's JIT modules for these head sizes (128 and --head-sizes; decode "
                             "modules unless --peers is ''), then exit")
    parser.add_argument("--jobs", type=int, default=4, help="processes building FlashInfer's modules at once")
    args = parser.parse_args(argv)
    if args.warm_flashinfer:
        return warm_flashinfer([128] + [int(d) for d in args.head_sizes.split(",") if d], args.jobs, bool(args.peers))
    gen = torch.Generator(device="cuda").manual_seed(0)
    have_flashinfer = importlib.util.find_spec("flashinfer") is not None
    peers = [p for p in args.peers.split(",") if p] if have_flashinfer else []
    t = lambda fn: graph_ms(fn, args.calls, args.reps)  # noqa: E731
    key_formats = ["fp8"] * args.fp8_keys + ["int8"] * args.int8_keys  # extra decode columns

    lines = [f"{torch.cuda.get_device_name()}, torch {torch.version.__version__}"
             + (f", FlashInfer {__import__('flashinfer').__version__}" if have_flashinfer else ", no FlashInfer"), "",
             "| decode B×L, heads, head size | plugin ms | floor ms | plugin TB/s | "
             + "".join(f"plugin {k}-keys ms | {k}-keys TB/s | " for k in key_formats)
             + " | ".join(f"FlashInfer {p} ms" for p in peers) + " |",
             "| --- | ---: | ---: | ---: |" + " ---: |" * (len(peers) + 2 * len(key_formats))]
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.decode.split(",") if s]
    heads = [tuple(int(x) for x in h.split("/")) for h in args.heads.split(",") if h]
    cases = [(b, l, hq, hkv, 128) for hq, hkv in heads for b, l in shapes]
    cases += [(*shapes[0], *heads[0], int(d)) for d in args.head_sizes.split(",") if d and shapes]
    for b, l, hq, hkv, d in cases:
        case = Case([(1, l)] * b, hq, hkv, d, gen)
        if args.once:
            case.plugin()
            torch.cuda.synchronize()
            continue
        ms = t(case.plugin)
        row = [f"{b}×{l}, {hq}/{hkv}, {d}", f"{ms:.4f}", f"{case.nvfp4_bytes() / args.bandwidth * 1e3:.4f}",
               f"{case.nvfp4_bytes() / (ms * 1e-3) / 1e12:.2f}"]
        for key_format in key_formats:
            other = Case([(1, l)] * b, hq, hkv, d, gen, key_format=key_format)
            other.query.copy_(case.query)
            other_ms = t(other.plugin)
            row += [f"{other_ms:.4f}", f"{other.nvfp4_bytes() / (other_ms * 1e-3) / 1e12:.2f}"]
            del other
        for peer in peers:
            if peer == "nvfp4" and d == 64:
                row.append("misreads head 64")
                continue
            if peer == "nvfp4":
                fn = flashinfer_nvfp4_decode(case)
            else:
                fn, _ = flashinfer_decode(case, torch.bfloat16 if peer == "bf16" else torch.float8_e4m3fn, gen)
            row.append(f"{t(fn):.4f}")
        lines.append("| " + " | ".join(row) + " |")
        print(lines[-1], flush=True)
        del case
        torch.cuda.empty_cache()

    prefill = [p for p in args.prefill.split(",") if p]
    if prefill:
        lines += ["", "| causal prefill, 32/8 heads, head 128 | model features | plugin fused ms | "
                  "plugin dequant+fa3 ms | of which the gather ms | FlashInfer bf16 fa3 ms | dequant+fa3 ÷ bf16 | "
                  "fused / dequant+fa3 / bf16 TFLOP/s |", "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    feature_sets = [""] + [f for f in args.prefill_features.split(",") if f]
    for text in prefill:
        for feature_text in feature_sets:
            lines.append(prefill_row(text, t, gen, have_flashinfer, feature_text))
            print(lines[-1], flush=True)
            torch.cuda.empty_cache()

    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    sys.exit(main())
