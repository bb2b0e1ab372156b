"""Self-check of the plugin on this machine: `python -m vllm_nvfp4_plugin.tools.doctor [--device cpu|cuda|all]`.

On every available device it runs each compiled op on small random inputs against the plain-torch reference
(the cache ops bit for bit, NHD and HND, linear and swizzled V scales; the indexer logits within 1e-4 of the
largest logit, as their float32 sums run in the kernel's own order), then writes an NVFP4 cache with the plugin's store
and reads it back through the plugin's paged-attention kernel, the default reader of both attention backends. The read-back is compared with exact float32 attention
over the reference-dequantized cache. A last row reads a cache with swizzled V scales through the linear
reader and must see the damage (a V-scale order mix-up corrupts V silently: docs/FORMATS.md §1), which proves
the read-back check can fail.

Prints a pass/fail table with the layout detected from the cache strides (a cache read with the wrong one is
garbage) and the V-scale order, and exits non-zero if any row fails.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass

import torch

from .. import ops, reference
from ..attention.flashinfer_reader import SWIZZLE_V_SCALES
from ..layout import IndexerCacheLayout, NVFP4PageLayout
from .paged_case import PagedCase, fp32_attention, shuffled_block_table, table_slots

HEAD_SIZE, KV_HEADS, Q_HEADS, BLOCK_SIZE = 128, 2, 8, 16
K_SCALE, V_SCALE = 0.5, 2.0  # non-unit global scales, as a checkpoint may give
SEQ_LENS = (1, 17, 300)
READ_BACK_TOLERANCE = 2e-2  # rel. L2 of bf16 attention vs float32 over the same dequantized values
LOGITS_TOLERANCE = 1e-4  # of the largest |logit|: the kernels' float32 sums, in their own order, vs float64
INDEXER_HEADS = 64


@dataclass
class Row:
    device: str
    check: str
    layout: str
    v_scales: str
    ok: bool
    detail: str


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(torch.uint8)


def _layout_name(w: dict) -> str:
    """The layout detected from the caches' strides and shapes (a cache read with the wrong one is garbage)."""
    layout = NVFP4PageLayout.from_caches(*w["sides"])
    return ("HND" if layout.hnd else "NHD") + ("" if layout.key_format == "nvfp4" else f", {layout.key_format.upper()} keys")


def _order(swizzle: bool) -> str:
    return "swizzled" if swizzle else "linear"


def _written_cache(device, hnd: bool, swizzle: bool, gen: torch.Generator, key_format: str = "nvfp4"):
    """A cache (its (key_cache, value_cache) pair) holding SEQ_LENS tokens (shuffled blocks) written by the plugin's
    store on `device`, with its inputs and one decode query per sequence."""
    layout = NVFP4PageLayout(HEAD_SIZE, BLOCK_SIZE, KV_HEADS, hnd, swizzle, key_format)
    case = PagedCase([(1, n) for n in SEQ_LENS], layout, Q_HEADS, gen, k_scale=K_SCALE, v_scale=V_SCALE,
                     unused_entry=-1)
    key, value, slots = case.context_tokens()
    cu = torch.zeros(len(SEQ_LENS) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(SEQ_LENS).cumsum(0)
    slots[torch.randperm(len(slots), generator=gen)[:3]] = -1  # padding tokens: skipped
    sides = layout.allocate_sides(case.num_blocks, device, fill=0)
    scales = torch.tensor([K_SCALE]), torch.tensor([V_SCALE])
    ops.reshape_and_cache_nvfp4(key.to(device), value.to(device), *sides, slots.to(device),
                                scales[0].to(device), scales[1].to(device), swizzle)
    return dict(layout=layout, sides=sides, table=case.block_table, cu=cu, key=key, value=value, slots=slots,
                scales=scales, q=torch.cat(case.q))


def _cpu_sides(w: dict):
    """The written cache's pages copied to the CPU, as a (key_cache, value_cache) pair."""
    layout, key_cache = w["layout"], w["sides"][0]
    pages = key_cache.as_strided((key_cache.size(0), layout.page_bytes), (key_cache.stride(0), 1)).cpu()
    return layout.side_views(pages)


def check_store(device, hnd: bool, swizzle: bool, gen: torch.Generator, key_format: str = "nvfp4") -> Row:
    w = _written_cache(device, hnd, swizzle, gen, key_format)
    expected = w["layout"].allocate_sides(w["sides"][0].size(0), "cpu", fill=0)
    reference.reshape_and_cache_nvfp4(w["key"], w["value"], *expected, w["slots"], *w["scales"], swizzle)
    differing = sum(int((_bits(got) != _bits(want)).sum()) for got, want in zip(_cpu_sides(w), expected))
    total = w["layout"].page_bytes * expected[0].size(0)
    return Row(str(device), "reshape_and_cache_nvfp4 == reference", _layout_name(w), _order(swizzle),
               differing == 0, f"{differing} of {total} bytes differ")


def check_gather(device, hnd: bool, swizzle: bool, gen: torch.Generator, key_format: str = "nvfp4") -> Row:
    w = _written_cache(device, hnd, swizzle, gen, key_format)
    total = int(w["cu"][-1])
    outs = [torch.full((total + 4, KV_HEADS, HEAD_SIZE), 7.0, dtype=torch.bfloat16, device=device) for _ in range(2)]
    ops.gather_nvfp4_kv_cache(*w["sides"], w["table"].to(device), w["cu"].to(device),
                              w["scales"][0].to(device), w["scales"][1].to(device), swizzle, *outs)
    expected = [torch.full_like(o, 7.0, device="cpu") for o in outs]
    reference.gather_nvfp4_kv_cache(*_cpu_sides(w), w["table"], w["cu"], *w["scales"], swizzle, *expected)
    differing = sum(int((_bits(o) != _bits(e)).sum()) for o, e in zip(outs, expected))
    return Row(str(device), "gather_nvfp4_kv_cache == reference", _layout_name(w), _order(swizzle),
               differing == 0, f"{differing} output bytes differ")


def check_indexer_store(device, scale_fmt: str, gen: torch.Generator) -> Row:
    layout = IndexerCacheLayout(128, 64, 128)
    n, num_blocks = 150, 4
    k = (torch.randn(n, 128, generator=gen) * torch.rand(n, 1, generator=gen) * 10).to(torch.bfloat16)
    slots = torch.randperm(num_blocks * layout.block_size, generator=gen)[:n]
    slots[:5] = -1
    cache = layout.allocate(num_blocks, device, fill=0)
    ops.indexer_k_quant_and_cache(k.to(device), cache, slots.to(device), 128, scale_fmt)
    expected = layout.allocate(num_blocks, "cpu", fill=0)
    reference.indexer_k_quant_and_cache(k, expected, slots, 128, scale_fmt)
    differing = int((_bits(cache) != _bits(expected)).sum())
    return Row(str(device), f"indexer_k_quant_and_cache({scale_fmt or 'float32'}) == reference", "-", "-",
               differing == 0, f"{differing} of {expected.numel()} bytes differ")


def check_indexer_gather(device, gen: torch.Generator) -> Row:
    layout = IndexerCacheLayout(128, 64, 128)
    seq_lens = (5, 0, 130, 64)
    num_blocks = 8
    block_stride = layout.block_bytes + 4  # a padded block: rows are not 16-byte aligned across blocks
    cache = layout.allocate(num_blocks, "cpu", fill=0, block_stride=block_stride)
    cache.as_strided((num_blocks * block_stride,), (1,)).copy_(
        torch.randint(0, 256, (num_blocks * block_stride,), generator=gen, dtype=torch.uint8))
    table = torch.randint(0, num_blocks, (len(seq_lens), 3), generator=gen, dtype=torch.int32)
    cu = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(seq_lens).cumsum(0)
    rows = int(cu[-1]) + 3
    device_cache = layout.allocate(num_blocks, device, fill=0, block_stride=block_stride)
    device_cache.as_strided((num_blocks * block_stride,), (1,)).copy_(cache.as_strided((num_blocks * block_stride,), (1,)))
    outs = [torch.full((rows, w), 0xC3, dtype=torch.uint8, device=device) for w in (128, 4)]
    ops.cp_gather_indexer_k_quant_cache(device_cache, *outs, table.to(device), cu.to(device))
    expected = [torch.full((rows, w), 0xC3, dtype=torch.uint8) for w in (128, 4)]
    reference.cp_gather_indexer_k_quant_cache(cache, *expected, table, cu)
    differing = sum(int((o.cpu() != e).sum()) for o, e in zip(outs, expected))
    return Row(str(device), "cp_gather_indexer_k_quant_cache == reference", "-", "-", differing == 0,
               f"{differing} output bytes differ")


def _indexer_queries(gen: torch.Generator, *shape: int):
    q = (torch.randn(*shape, INDEXER_HEADS, 128, generator=gen) * 3).to(torch.float8_e4m3fn)
    return q, torch.randn(*shape, INDEXER_HEADS, generator=gen)


def _logits_row(device, name: str, got: torch.Tensor, want: torch.Tensor) -> Row:
    got, want = got.cpu().double(), want.double()
    same_inf = torch.equal(got == float("-inf"), want == float("-inf"))
    finite = want.isfinite()
    err = float((got - want)[finite].abs().max() / want[finite].abs().max())
    detail = f"max error {err:.1e} of the largest logit (tolerance {LOGITS_TOLERANCE:g})"
    return Row(str(device), f"{name} == reference", "-", "-", same_inf and err <= LOGITS_TOLERANCE,
               detail if same_inf else detail + "; -inf places differ")


def check_indexer_logits(device, gen: torch.Generator) -> Row:
    """Prefill-chunk logits over gathered keys, causal key ranges."""
    rows, keys = 40, 200
    k = (torch.randn(keys, 128, generator=gen) * torch.rand(keys, 1, generator=gen) * 10).to(torch.bfloat16)
    values, scale_bytes = reference.indexer_quantize(k, 128, "ue8m0")
    q, w = _indexer_queries(gen, rows)
    ke = torch.randint(1, keys + 1, (rows,), generator=gen, dtype=torch.int32)
    ks = (ke - 100).clamp(min=0)
    got = torch.empty(rows, keys, device=device)
    ops.indexer_mqa_logits(*(t.to(device) for t in (q, values, scale_bytes, w, ks, ke)), got)
    want = torch.empty(rows, keys, dtype=torch.float64)
    reference.indexer_mqa_logits(q, values, scale_bytes, w, ks, ke, want)
    return _logits_row(device, "indexer_mqa_logits", got, want)


def check_indexer_paged_logits(device, gen: torch.Generator) -> Row:
    """Decode logits (2 tokens a request) straight from an indexer cache the plugin's store wrote."""
    layout = IndexerCacheLayout(128, BLOCK_SIZE, 128)
    table, num_blocks = shuffled_block_table(SEQ_LENS, BLOCK_SIZE, gen, unused_entry=-1)
    slots = torch.cat([table_slots(table, BLOCK_SIZE, r, 0, n) for r, n in enumerate(SEQ_LENS)])
    k = (torch.randn(slots.numel(), 128, generator=gen) * torch.rand(slots.numel(), 1, generator=gen) * 10)
    cache = layout.allocate(num_blocks, device, fill=0)
    ops.indexer_k_quant_and_cache(k.to(device, torch.bfloat16), cache, slots.to(device), 128, "")
    context_lens = torch.tensor([[n - 1, n] for n in SEQ_LENS], dtype=torch.int32)
    q, w = _indexer_queries(gen, len(SEQ_LENS), 2)
    columns = max(SEQ_LENS)
    got = torch.empty(2 * len(SEQ_LENS), columns, device=device)
    ops.indexer_paged_mqa_logits(q.to(device), cache, w.to(device), context_lens.to(device), table.to(device), 128,
                                 got)
    want = torch.empty(2 * len(SEQ_LENS), columns, dtype=torch.float64)
    reference.indexer_paged_mqa_logits(q, cache.cpu(), w, context_lens, table, 128, want)
    return _logits_row(device, "indexer_paged_mqa_logits", got, want)


def _exact_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """float32 attention of one decode query `[q_heads, d]` over `[L, kv_heads, d]` (GQA)."""
    return fp32_attention(q.unsqueeze(0), k, v, 1 / math.sqrt(q.shape[-1]))[0]


READER = "plugin paged attention"


def _read_attention(device, w: dict, q: torch.Tensor, swizzle_read: bool) -> torch.Tensor:
    """Decode attention of `q` `[batch, q_heads, d]` over the cache through `nvfp4_paged_attention` on `device`."""
    table = w["table"].to(device)
    query_start_loc = torch.arange(len(SEQ_LENS) + 1, dtype=torch.int32, device=device)
    seq_lens = torch.tensor(SEQ_LENS, dtype=torch.int32, device=device)
    out = torch.empty_like(q)
    ops.nvfp4_paged_attention(q, *w["sides"], table, query_start_loc, seq_lens,
                              w["scales"][0].to(device), w["scales"][1].to(device), 1 / math.sqrt(HEAD_SIZE), True,
                              swizzle_read, 1, max(SEQ_LENS), out)
    return out.float().cpu()


def _exact_read_back(w: dict, q: torch.Tensor, swizzle: bool) -> torch.Tensor:
    """Float32 attention over the cache as the reference dequantizes it (with the order it was written in)."""
    cu = w["cu"]
    total = int(cu[-1])
    k, v = torch.empty(total, KV_HEADS, HEAD_SIZE), torch.empty(total, KV_HEADS, HEAD_SIZE)
    reference.gather_nvfp4_kv_cache(*_cpu_sides(w), w["table"], cu, *w["scales"], swizzle, k, v)
    return torch.stack([_exact_attention(q[b].cpu(), k[cu[b]:cu[b + 1]], v[cu[b]:cu[b + 1]])
                        for b in range(len(SEQ_LENS))])


def check_read_back(device, hnd: bool, gen: torch.Generator, written_swizzled: bool = False,
                    key_format: str = "nvfp4") -> Row:
    """Store with the plugin, decode through the backend's reader (linear V scales), compare with exact attention.

    With `written_swizzled` the cache is written in trtllm-gen's V-scale order instead: the linear reader must
    then be off by far more than the tolerance, or the check could not catch a V-scale order mix-up.
    """
    w = _written_cache(device, hnd, written_swizzled, gen, key_format)
    q = w["q"].to(device)
    got = _read_attention(device, w, q, SWIZZLE_V_SCALES)
    exact = _exact_read_back(w, q, written_swizzled)
    rel_l2 = ((got - exact).norm() / exact.norm()).item()
    reader = READER
    if written_swizzled:
        return Row(str(device), f"{reader} misreads a swizzled-V cache", _layout_name(w),
                   "swizzled→linear", rel_l2 > 10 * READ_BACK_TOLERANCE,
                   f"rel. L2 {rel_l2:.3g} (must exceed {10 * READ_BACK_TOLERANCE:g})")
    return Row(str(device), f"store → {reader} == exact attention", _layout_name(w),
               _order(SWIZZLE_V_SCALES), math.isfinite(rel_l2) and rel_l2 <= READ_BACK_TOLERANCE,
               f"rel. L2 {rel_l2:.2e} (tolerance {READ_BACK_TOLERANCE:g})")


def run_checks(device) -> list[Row]:
    gen = torch.Generator().manual_seed(2026)
    checks = []  # (name, function, arguments)
    for hnd in (False, True):
        for swizzle in (False, True):
            checks += [("reshape_and_cache_nvfp4", check_store, (device, hnd, swizzle, gen)),
                       ("gather_nvfp4_kv_cache", check_gather, (device, hnd, swizzle, gen))]
    checks += [("indexer_k_quant_and_cache", check_indexer_store, (device, fmt, gen)) for fmt in reference.SCALE_FORMATS]
    checks.append(("cp_gather_indexer_k_quant_cache", check_indexer_gather, (device, gen)))
    checks += [("indexer_mqa_logits", check_indexer_logits, (device, gen)),
               ("indexer_paged_mqa_logits", check_indexer_paged_logits, (device, gen))]
    checks += [("read-back", check_read_back, (device, hnd, gen)) for hnd in (False, True)]
    checks.append(("swizzled-V read-back", check_read_back, (device, False, gen, True)))
    for hnd in (False, True):  # the FP8-key page (docs/FORMATS.md §1)
        checks += [("reshape_and_cache_nvfp4, FP8 keys", check_store, (device, hnd, hnd, gen, "fp8")),
                   ("gather_nvfp4_kv_cache, FP8 keys", check_gather, (device, hnd, hnd, gen, "fp8")),
                   ("read-back, FP8 keys", check_read_back, (device, hnd, gen, False, "fp8"))]
    for hnd in (False, True) if str(device) == "cpu" else ():  # the INT8-key page: CPU kernels only
        checks += [("reshape_and_cache_nvfp4, INT8 keys", check_store, (device, hnd, hnd, gen, "int8")),
                   ("gather_nvfp4_kv_cache, INT8 keys", check_gather, (device, hnd, hnd, gen, "int8")),
                   ("read-back, INT8 keys", check_read_back, (device, hnd, gen, False, "int8"))]
    rows = []
    for name, check, check_args in checks:
        try:
            rows.append(check(*check_args))
        except Exception as exc:  # a crash is a failed row, and the other checks still run
            rows.append(Row(str(device), name, "-", "-", False, f"{type(exc).__name__}: {exc}"))
    return rows


def available_devices(which: str) -> list[str]:
    cuda = [f"cuda:{i}" for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    if which == "cpu":
        return ["cpu"]
    if which == "cuda":
        if not cuda:
            raise SystemExit("doctor: --device cuda: no CUDA device is available")
        return cuda
    return ["cpu", *cuda]


def format_table(rows: list[Row]) -> str:
    lines = ["| device | check | layout | V scales | result | detail |", "| --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r.device} | {r.check} | {r.layout} | {r.v_scales} | {'pass' if r.ok else 'FAIL'} | {r.detail} |"
              for r in rows]
    return "\n".join(lines)


def device_summary(device: str) -> str:
    if device == "cpu":
        return f"cpu: torch {torch.__version__}; reader: {READER}"
    props = torch.cuda.get_device_properties(device)
    return (f"{device}: {props.name} (SM{props.major}{props.minor}), torch {torch.__version__}; "
            f"reader: {READER}; V scales written {_order(SWIZZLE_V_SCALES)}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vllm_nvfp4_plugin.tools.doctor", description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("all", "cpu", "cuda"), default="all")
    args = parser.parse_args(argv)
    rows = []
    for device in available_devices(args.device):
        print(device_summary(device))
        rows += run_checks(device)
    print(format_table(rows))
    failed = sum(not r.ok for r in rows)
    print(f"{len(rows) - failed} passed, {failed} failed")
    return exit_code(rows)


def exit_code(rows: list[Row]) -> int:
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
