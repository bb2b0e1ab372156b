"""Plain-torch reference of the ops and of NVFP4 encode/decode, written from docs/FORMATS.md.

It is the oracle of the CPU and CUDA tests and is deliberately slow and obvious. The cache ops are bit-exact
contracts: their arithmetic is float32, in the order docs/FORMATS.md gives. The indexer logits sum in any order, so
their reference is float64 and the tests compare with a tolerance.
"""

from __future__ import annotations

import torch

from .layout import INT8_KEY_SCALE_BYTES, NVFP4_GROUP, IndexerCacheLayout, NVFP4PageLayout

E4M3_MAX = 448.0
E2M1_MAX = 6.0
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
INT8_KEY_MAX = 127
FP16_MAX = 65504.0
FP16_NAN_BITS = 0x7E00  # the scale an int8 key with a NaN element stores
_F32 = torch.float32


def _f32(x) -> torch.Tensor:
    return torch.as_tensor(x, dtype=_F32).reshape(())


def e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round float32 to FP8 E4M3 (nearest even), saturating at ±448."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def e2m1_encode(v: torch.Tensor) -> torch.Tensor:
    """4-bit E2M1 codes (uint8) of float32 `v`: nearest, ties to the even code, saturating at ±6."""
    a = v.abs()
    # Each comparison adds one code step; `>` on a tie keeps the even (lower) code, `>=` moves to it.
    code = ((a > 0.25).to(torch.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75)
            + (a > 2.5) + (a >= 3.5) + (a > 5.0))
    return code | (torch.signbit(v).to(torch.uint8) << 3)


def e2m1_decode(code: torch.Tensor) -> torch.Tensor:
    mag = E2M1_VALUES.to(code.device)[(code & 7).long()]
    return torch.where((code & 8) != 0, -mag, mag)


def _nvfp4_candidate(groups: torch.Tensor, amax: torch.Tensor, inv_divisor: torch.Tensor, g: torch.Tensor):
    """E2M1 codes `[..., groups, 16]` and scales of `groups` with SF = e4m3(amax · inv_divisor / global)."""
    sf = e4m3(amax * inv_divisor * (1.0 / g))
    sf_f = sf.to(_F32)
    out_scale = torch.where(sf_f == 0, torch.zeros_like(sf_f), 1.0 / (sf_f * g))
    return e2m1_encode(groups * out_scale.unsqueeze(-1)), sf


def _squared_error(codes: torch.Tensor, sf: torch.Tensor, g: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """Σ ((e2m1 · SF) · global - x)² of each group in float32, summed in element order (as the kernels do)."""
    decoded = e2m1_decode(codes) * sf.to(_F32).unsqueeze(-1) * g
    err = torch.zeros(groups.shape[:-1], dtype=_F32, device=groups.device)
    for i in range(NVFP4_GROUP):
        d = decoded[..., i] - groups[..., i]
        err = err + d * d
    return err


def nvfp4_encode(x: torch.Tensor, global_scale, four_over_six: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize `[..., head_size]` → (packed codes uint8 `[..., head_size/2]`, scales e4m3 `[..., head_size/16]`).

    `global_scale` is the dequant scale: x ≈ e2m1(code) · SF · global. Plain NVFP4 takes SF from max/6; with
    `four_over_six` (vLLM's "nvfp4_4over6") each group takes the max/6 or the max/4 scale, whichever gives the
    smaller squared reconstruction error (max/6 on a tie or a NaN).
    """
    g = _f32(global_scale).to(x.device)
    groups = x.to(_F32).reshape(*x.shape[:-1], x.shape[-1] // NVFP4_GROUP, NVFP4_GROUP)
    amax = groups.abs().amax(-1)
    one_sixth = (_f32(1.0) / _f32(6.0)).to(x.device)
    codes, sf = _nvfp4_candidate(groups, amax, one_sixth, g)
    if four_over_six:
        codes4, sf4 = _nvfp4_candidate(groups, amax, _f32(0.25).to(x.device), g)
        four = _squared_error(codes4, sf4, g, groups) < _squared_error(codes, sf, g, groups)
        codes = torch.where(four.unsqueeze(-1), codes4, codes)
        sf = torch.where(four, sf4.view(torch.uint8), sf.view(torch.uint8)).view(torch.float8_e4m3fn)
    codes = codes.reshape(x.shape)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)  # low nibble = even element
    return packed, sf


def nvfp4_decode(packed: torch.Tensor, sf: torch.Tensor, global_scale, dtype=torch.float32) -> torch.Tensor:
    """Inverse of `nvfp4_encode`: (e2m1 · SF) · global in float32, then cast to `dtype`."""
    g = _f32(global_scale).to(packed.device)
    head_size = packed.shape[-1] * 2
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(*packed.shape[:-1], head_size)
    vals = e2m1_decode(codes).reshape(*packed.shape[:-1], head_size // NVFP4_GROUP, NVFP4_GROUP)
    vals = vals * sf.view(torch.float8_e4m3fn).to(_F32).unsqueeze(-1)
    return (vals * g).reshape(*codes.shape).to(dtype)


# --- NVFP4 KV cache ops ------------------------------------------------------------------------

def _entry_offsets(layout: NVFP4PageLayout, offsets: torch.Tensor, swizzled: bool):
    """Byte offsets `[n, heads, data_dim]` and `[n, heads, scale_dim]` inside a side for block offsets `offsets`."""
    t = offsets.view(-1, 1, 1)
    h = torch.arange(layout.num_heads, device=offsets.device).view(1, -1, 1)
    data = layout.data_offset(t, h) + torch.arange(layout.data_dim, device=offsets.device)
    s = torch.arange(layout.scale_dim, device=offsets.device).view(1, 1, -1)
    scale = layout.scale_offset(t, h, s, swizzled)
    return data, scale


def fp8_key_encode(key: torch.Tensor, k_scale) -> torch.Tensor:
    """FP8 keys of an `fp8_keys` page (uint8): e4m3(key / k_scale) in float32, as vLLM's FP8 cache stores them."""
    return e4m3(key.to(_F32) / _f32(k_scale).to(key.device)).view(torch.uint8)


def fp8_key_decode(codes: torch.Tensor, k_scale, dtype=torch.float32) -> torch.Tensor:
    return (codes.view(torch.float8_e4m3fn).to(_F32) * _f32(k_scale).to(codes.device)).to(dtype)


def int8_key_encode(key: torch.Tensor, k_scale) -> tuple[torch.Tensor, torch.Tensor]:
    """INT8 keys of an int8-key page: (codes uint8 `[..., head_size]`, fp16 scale bytes uint8 `[..., 2]`).

    Per (token, head), v = key / k_scale in float32, scale = fp16(min(max |v| / 127, 65504)) to nearest even, codes
    round-half-even(v / scale) clamped to ±127 (all 0 where the scale is 0). A NaN in v stores the fp16 NaN 0x7E00
    and all-zero codes (the entry decodes to NaN); ±inf saturates to ±127 · 65504.
    """
    v = key.to(_F32) / _f32(k_scale).to(key.device)
    amax = v.abs().amax(-1)
    nan = amax.isnan()
    scale = (amax / _f32(INT8_KEY_MAX).to(key.device)).clamp(max=FP16_MAX).to(torch.float16)
    scale_f = scale.to(_F32).unsqueeze(-1)
    codes = (v / scale_f).round().clamp(-INT8_KEY_MAX, INT8_KEY_MAX)
    codes = torch.where((scale_f == 0) | nan.unsqueeze(-1), torch.zeros_like(codes), codes)
    scale_bits = torch.where(nan, torch.tensor(FP16_NAN_BITS, dtype=torch.int16, device=key.device),
                             scale.view(torch.int16))
    scale_bytes = torch.stack([scale_bits & 0xFF, (scale_bits >> 8) & 0xFF], -1).to(torch.uint8)
    return codes.to(torch.int8).view(torch.uint8), scale_bytes


def int8_key_decode(codes: torch.Tensor, scale_bytes: torch.Tensor, k_scale, dtype=torch.float32) -> torch.Tensor:
    """code · scale · k_scale in float32 (left to right), then cast to `dtype`; a NaN is the positive quiet NaN (as
    the kernels' c10 conversions give it; torch's vector conversions may give another NaN)."""
    bits = scale_bytes[..., 0].to(torch.int32) | (scale_bytes[..., 1].to(torch.int32) << 8)
    scale = bits.to(torch.int16).view(torch.float16).to(_F32).unsqueeze(-1)
    decoded = codes.view(torch.int8).to(_F32) * scale * _f32(k_scale).to(codes.device)
    decoded = decoded.to(dtype)
    return torch.where(decoded.isnan(), torch.full_like(decoded, float("nan")), decoded)


def _int8_key_offsets(layout: NVFP4PageLayout, offsets: torch.Tensor):
    """Byte offsets `[n, heads, head_size]` of the codes and `[n, heads, 2]` of the scales at block offsets `offsets`
    inside a K side of an int8-key page."""
    t, h = offsets.view(-1, 1, 1), torch.arange(layout.num_heads, device=offsets.device).view(1, -1, 1)
    codes = layout.int8_key_offset(t, h) + torch.arange(layout.head_size, device=offsets.device)
    scales = layout.int8_key_scale_offset(t, h) + torch.arange(INT8_KEY_SCALE_BYTES, device=offsets.device)
    return codes, scales


def _fp8_key_offsets(layout: NVFP4PageLayout, offsets: torch.Tensor):
    """Byte offsets `[n, heads, head_size]` of the FP8 keys at block offsets `offsets` inside a K side."""
    h = torch.arange(layout.num_heads, device=offsets.device).view(1, -1, 1)
    return layout.fp8_key_offset(offsets.view(-1, 1, 1), h) + torch.arange(layout.head_size, device=offsets.device)


def reshape_and_cache_nvfp4(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale,
                            swizzle_v_scales: bool, four_over_six: bool = False) -> None:
    layout = NVFP4PageLayout.from_caches(key_cache, value_cache, swizzle_v_scales)
    slots = slot_mapping.long()
    valid = (slots >= 0).nonzero().flatten()
    slots = slots[valid]
    blocks, offsets = slots // layout.block_size, slots % layout.block_size
    sides = [(value_cache, value, v_scale, swizzle_v_scales)]
    if layout.fp8_keys:
        key_off = _fp8_key_offsets(layout, offsets)
        flat = layout.key_side_bytes_view(key_cache)
        flat[blocks.view(-1, 1, 1).expand_as(key_off), key_off] = fp8_key_encode(key[valid], k_scale)
    elif layout.int8_keys:
        code_off, scale_off = _int8_key_offsets(layout, offsets)
        flat, rows = layout.key_side_bytes_view(key_cache), blocks.view(-1, 1, 1)
        codes, scale_bytes = int8_key_encode(key[valid], k_scale)
        flat[rows.expand_as(code_off), code_off] = codes
        flat[rows.expand_as(scale_off), scale_off] = scale_bytes
    else:
        sides.insert(0, (key_cache, key, k_scale, False))
    for side_cache, x, g, swizzled in sides:
        packed, sf = nvfp4_encode(x[valid], g, four_over_six)
        data_off, scale_off = _entry_offsets(layout, offsets, swizzled)
        flat = layout.side_bytes_view(side_cache)
        rows = blocks.view(-1, 1, 1)
        flat[rows.expand_as(data_off), data_off] = packed
        flat[rows.expand_as(scale_off), scale_off] = sf.view(torch.uint8)


def reshape_and_cache_nvfp4_4over6(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale,
                                   swizzle_v_scales: bool) -> None:
    reshape_and_cache_nvfp4(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale, swizzle_v_scales,
                            four_over_six=True)


def _gather_positions(block_table, cu_seq_lens, block_size):
    """(destination row, physical block, block offset) of every cached token the gather must copy."""
    cu = cu_seq_lens.long().cpu()
    rows, blocks, offsets = [], [], []
    for b in range(cu.numel() - 1):
        p = torch.arange(int(cu[b + 1] - cu[b]))
        rows.append(cu[b] + p)
        blocks.append(block_table[b].long().cpu()[p // block_size])
        offsets.append(p % block_size)
    dev = block_table.device
    return (torch.cat(rows).to(dev), torch.cat(blocks).to(dev), torch.cat(offsets).to(dev))


def gather_nvfp4_kv_cache(key_cache, value_cache, block_table, cu_seq_lens, k_scale, v_scale,
                          swizzle_v_scales: bool, out_key, out_value) -> None:
    layout = NVFP4PageLayout.from_caches(key_cache, value_cache, swizzle_v_scales)
    rows, blocks, offsets = _gather_positions(block_table, cu_seq_lens, layout.block_size)
    sides = [(value_cache, out_value, v_scale, swizzle_v_scales)]
    if layout.fp8_keys:
        key_off = _fp8_key_offsets(layout, offsets)
        flat = layout.key_side_bytes_view(key_cache)
        out_key[rows] = fp8_key_decode(flat[blocks.view(-1, 1, 1).expand_as(key_off), key_off], k_scale, out_key.dtype)
    elif layout.int8_keys:
        code_off, scale_off = _int8_key_offsets(layout, offsets)
        flat, b = layout.key_side_bytes_view(key_cache), blocks.view(-1, 1, 1)
        out_key[rows] = int8_key_decode(flat[b.expand_as(code_off), code_off], flat[b.expand_as(scale_off), scale_off],
                                        k_scale, out_key.dtype)
    else:
        sides.insert(0, (key_cache, out_key, k_scale, False))
    for side_cache, out, g, swizzled in sides:
        data_off, scale_off = _entry_offsets(layout, offsets, swizzled)
        flat = layout.side_bytes_view(side_cache)
        b = blocks.view(-1, 1, 1)
        packed = flat[b.expand_as(data_off), data_off]
        sf = flat[b.expand_as(scale_off), scale_off]
        out[rows] = nvfp4_decode(packed, sf, g, out.dtype)


def nvfp4_paged_attention(query, key_cache, value_cache, block_table, query_start_loc, seq_lens, k_scale, v_scale,
                          scale: float, causal: bool, swizzle_v_scales: bool, max_query_len: int, max_seq_len: int,
                          out, sliding_window: int = 0, logits_soft_cap: float = 0.0, sinks=None) -> None:
    """fp32 attention over the dequantized cache, one request at a time (the kernels' oracle).

    A query sits at position c - n + i of its request's c keys. `sliding_window` w > 0 hides keys at positions
    <= p - w from the query at p; `logits_soft_cap` c > 0 maps a scaled logit s to c·tanh(s / c); `sinks` (one
    logit per query head) joins the softmax's denominator and is dropped from its output.
    """
    layout = NVFP4PageLayout.from_caches(key_cache, value_cache, swizzle_v_scales)
    starts, lens = query_start_loc.long().cpu().tolist(), seq_lens.long().cpu().tolist()
    group = query.size(1) // layout.num_heads
    for r, c in enumerate(lens):
        n = starts[r + 1] - starts[r]
        if n == 0:
            continue
        k = torch.empty(c, layout.num_heads, layout.head_size, dtype=_F32, device=query.device)
        v = torch.empty_like(k)
        cu = torch.tensor([0, c], dtype=torch.int32, device=query.device)
        gather_nvfp4_kv_cache(key_cache, value_cache, block_table[r:r + 1], cu, k_scale, v_scale,
                              swizzle_v_scales, k, v)
        q = query[starts[r]:starts[r + 1]].to(_F32)  # [n, Hq, D]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # [c, Hq, D]
        logits = torch.einsum("nhd,chd->hnc", q, k) * scale
        if logits_soft_cap > 0:
            logits = logits_soft_cap * torch.tanh(logits / logits_soft_cap)
        key_pos = torch.arange(c, device=q.device)
        query_pos = torch.arange(n, device=q.device)[:, None] + (c - n)
        visible = key_pos <= query_pos if causal else torch.ones(n, c, dtype=torch.bool, device=q.device)
        if sliding_window > 0:
            visible = visible & (key_pos > query_pos - sliding_window)
        logits = logits.masked_fill(~visible, float("-inf"))
        if sinks is not None:  # a sink column joins the softmax, then is dropped
            sink = sinks.to(_F32).view(-1, 1, 1).expand(-1, n, 1)
            probs = torch.cat([logits, sink], -1).softmax(-1)[..., :c]
        else:
            probs = logits.softmax(-1)
        out[starts[r]:starts[r + 1]] = torch.einsum("hnc,chd->nhd", probs, v).to(out.dtype)


# --- Sparse-indexer K cache ops -----------------------------------------------------------------

SCALE_FORMATS = ("", "ue8m0", "mxfp8")


def indexer_quantize(k: torch.Tensor, quant_block_size: int, scale_fmt: str):
    """`[n, head_dim]` → (fp8 values `[n, head_dim]` as uint8, scale bytes `[n, num_scales*4]`)."""
    if scale_fmt not in SCALE_FORMATS:
        raise ValueError(f"scale_fmt must be one of {SCALE_FORMATS}, got {scale_fmt!r}")
    n, head_dim = k.shape
    blocks = k.to(_F32).reshape(n, head_dim // quant_block_size, quant_block_size)
    amax = blocks.abs().amax(-1)
    scale = torch.maximum(amax, _f32(1e-4).to(k.device)) / _f32(E4M3_MAX).to(k.device)
    if scale_fmt:
        mant, exp = torch.frexp(scale)  # scale = mant · 2^exp, mant in [0.5, 1)
        exp = torch.where(mant == 0.5, exp - 1, exp)  # ceil(log2 scale), exact
        scale = torch.ldexp(torch.ones_like(scale), exp)
    values = e4m3(blocks / scale.unsqueeze(-1)).reshape(n, head_dim).view(torch.uint8)
    if scale_fmt == "mxfp8":  # the UE8M0 exponent byte, four times
        ue8m0 = (exp + 127).to(torch.uint8)
        scale_bytes = ue8m0.unsqueeze(-1).expand(n, ue8m0.shape[1], 4).reshape(n, ue8m0.shape[1] * 4)
    else:
        scale_bytes = scale.contiguous().view(torch.uint8).reshape(n, scale.shape[1] * 4)
    return values, scale_bytes


def indexer_k_quant_and_cache(k, kv_cache, slot_mapping, quant_block_size: int, scale_fmt: str) -> None:
    layout = IndexerCacheLayout.from_cache(kv_cache, quant_block_size)
    slots = slot_mapping.long()
    valid = (slots >= 0).nonzero().flatten()
    values, scale_bytes = indexer_quantize(k[valid], quant_block_size, scale_fmt)
    slots = slots[valid]
    blocks, offsets = (slots // layout.block_size).view(-1, 1), (slots % layout.block_size).view(-1, 1)
    flat = layout.block_bytes_view(kv_cache)
    vo = layout.value_offset(offsets) + torch.arange(layout.head_dim, device=k.device)
    so = layout.scale_offset(offsets) + torch.arange(layout.scale_bytes, device=k.device)
    flat[blocks.expand_as(vo), vo] = values
    flat[blocks.expand_as(so), so] = scale_bytes


def cp_gather_indexer_k_quant_cache(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens) -> None:
    row = kv_cache.size(2)
    head_dim = dst_k.size(1) * dst_k.element_size()
    layout = IndexerCacheLayout.from_cache(kv_cache, head_dim * 4 // (row - head_dim))
    rows, blocks, offsets = _gather_positions(block_table, cu_seq_lens, layout.block_size)
    flat = layout.block_bytes_view(kv_cache)
    b, t = blocks.view(-1, 1), offsets.view(-1, 1)
    vo = layout.value_offset(t) + torch.arange(layout.head_dim, device=kv_cache.device)
    so = layout.scale_offset(t) + torch.arange(layout.scale_bytes, device=kv_cache.device)
    dst_k.view(torch.uint8).view(dst_k.size(0), -1)[rows] = flat[b.expand_as(vo), vo]
    dst_scale.view(torch.uint8).view(dst_scale.size(0), -1)[rows] = flat[b.expand_as(so), so]


# --- Sparse-indexer MQA logits -------------------------------------------------------------------------

def _mqa_logits(q: torch.Tensor, weights: torch.Tensor, values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """`Σ_h w[r,h] · relu(Σ_b s[n,b] · q[r,h,block b] · k[n,block b])` in float64: q `[R, H, D]` FP8, weights
    `[R, H]`, values `[N, D]` FP8 bytes, scales `[N, D/qbs]` → `[R, N]`."""
    qbs = values.size(1) // scales.size(1)
    q_blocks = q.double().unflatten(-1, (-1, qbs))  # [R, H, S, qbs]
    k_blocks = values.view(torch.float8_e4m3fn).double().unflatten(-1, (-1, qbs))  # [N, S, qbs]
    per_block = torch.einsum("rhsd,nsd->rhns", q_blocks, k_blocks)
    scores = (per_block * scales.double()).sum(-1).relu()  # [R, H, N]
    return (scores * weights.double().unsqueeze(-1)).sum(1)


def indexer_mqa_logits(q, k, k_scale, weights, ks, ke, logits) -> None:
    """Logits of gathered keys (FP8 `k [N, D]`, float32 scales `k_scale [N, D/qbs]` or their bytes): row m sees
    keys `[ks[m], ke[m])`, clamped to `[0, N)`, and holds -inf elsewhere."""
    n = k.size(0)
    scales = k_scale.contiguous().view(torch.uint8).view(torch.float32).view(n, -1)
    values = k.contiguous().view(torch.uint8)
    result = _mqa_logits(q.cpu(), weights.cpu(), values.cpu(), scales.cpu())
    col = torch.arange(n)
    visible = (col >= ks.cpu().long().unsqueeze(1)) & (col < ke.cpu().long().unsqueeze(1))
    logits[:, :n] = result.masked_fill(~visible, float("-inf")).to(logits.device, torch.float32)


def indexer_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, quant_block_size: int, logits) -> None:
    """Logits straight from the paged indexer cache: row `b·n + j`, column c is key c of request b (token
    `c % block_size` of block `block_table[b, c // block_size]`) while `c < context_lens[b, j]`, else -inf."""
    layout = IndexerCacheLayout.from_cache(kv_cache, quant_block_size)
    batch, next_n = q.shape[:2]
    columns = logits.size(1)
    flat = layout.block_bytes_view(kv_cache).cpu()
    for b in range(batch):
        lens = context_lens[b].cpu().long().clamp(0, columns)
        visible = int(lens.max()) if next_n else 0
        c = torch.arange(visible)
        blocks = block_table[b, c // layout.block_size].cpu().long().view(-1, 1)
        t = (c % layout.block_size).view(-1, 1)
        values = flat[blocks, layout.value_offset(t) + torch.arange(layout.head_dim)]
        scale_bytes = flat[blocks, layout.scale_offset(t) + torch.arange(layout.scale_bytes)]
        result = torch.full((next_n, columns), float("-inf"), dtype=torch.float64)
        result[:, :visible] = _mqa_logits(q[b].cpu(), weights[b].cpu(), values, scale_bytes.view(torch.float32))
        result.masked_fill_(torch.arange(columns) >= lens.unsqueeze(1), float("-inf"))
        logits[b * next_n:(b + 1) * next_n] = result.to(logits.device, torch.float32)
