"""NVFP4 decode on one GPU: FlashInfer fa2 reading the plugin's page vs the attention core's path.

Shape (GPU.md's reference point): B=32 requests × 8192 cached tokens, 32 query / 8 KV heads, head 128, page 16,
blocks in random order (a 302 MB NVFP4 cache, 5× the L2). Times are medians of CUDA-event timings; where a path
can be captured (FlashInfer's run, the core's gather op) a CUDA graph replays it so launch overhead stays out.
The core's whole path (`paged_attention`) reads lengths on the host, so it is timed eagerly, as it runs in vLLM.
Prints a markdown table; `--out FILE` also writes it there.
"""

from __future__ import annotations

import argparse

import torch

from vllm_nvfp4_plugin import ops
from vllm_nvfp4_plugin.attention import DequantWorkspace, NVFP4AttentionMetadata, paged_attention, store_kv
from vllm_nvfp4_plugin.attention.flashinfer_reader import FlashInferNVFP4Decoder
from vllm_nvfp4_plugin.layout import NVFP4PageLayout

from cuda_timing import capture_graph, event_median_ms as _median_ms

COPY_BANDWIDTH = 4.2e12  # bytes/s, device-to-device copy measured on this H200 (GPU.md)


def graph_median_ms(fn, calls=20, reps=15) -> float:
    """Median time of one `fn()` from replays of a CUDA graph holding `calls` calls."""
    return _median_ms(capture_graph([fn], calls, warmup_rounds=3).replay, reps) / calls


def captured_median_ms(fn) -> tuple[float, str]:
    """Graph-replayed median, or the eager one (labelled so) if `fn` cannot be captured."""
    try:
        return graph_median_ms(fn), "graph"
    except RuntimeError as e:
        print(f"graph capture failed ({e}); timing eagerly")
        torch.cuda.synchronize()
        return eager_median_ms(fn), "eager"


def eager_median_ms(fn, reps=15) -> float:
    for _ in range(3):
        fn()
    return _median_ms(fn, reps)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--out")
    args = parser.parse_args()
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    B, L, d, bs = args.batch, args.context, args.head_size, args.block_size
    layout = NVFP4PageLayout(d, bs, args.kv_heads)
    blocks_per_req = L // bs
    num_blocks = B * blocks_per_req
    cache = layout.allocate(num_blocks, device)
    block_table = torch.randperm(num_blocks, device=device, generator=gen).to(torch.int32).view(B, blocks_per_req)
    k_scale = torch.tensor(1.0, device=device)
    v_scale = torch.tensor(1.0, device=device)
    # Fill the cache through the plugin's store op (random bf16 K/V, every slot), a chunk of requests at a time.
    positions = torch.arange(L, device=device)
    for b in range(B):
        slots = block_table[b, positions // bs].long() * bs + positions % bs
        kv = torch.randn(2, L, args.kv_heads, d, device=device, generator=gen, dtype=torch.bfloat16)
        store_kv(kv[0], kv[1], cache, slots, k_scale, v_scale)
    query = torch.randn(B, args.q_heads, d, device=device, generator=gen, dtype=torch.bfloat16)
    out = torch.empty_like(query)
    scale = d ** -0.5
    seq_lens_cpu = torch.full((B,), L, dtype=torch.int32)
    cache_bytes = num_blocks * layout.page_bytes
    rows = []

    decoder = FlashInferNVFP4Decoder(device, hnd=False)
    decoder.plan(block_table, seq_lens_cpu, args.q_heads, args.kv_heads, d, bs, torch.bfloat16, scale)
    ms, how = captured_median_ms(lambda: decoder.run(query, cache[:, 0], cache[:, 1], 1.0, 1.0, out))
    rows.append((f"FlashInfer fa2 NVFP4 decode over the plugin's page ({how})", ms, cache_bytes))

    metadata = NVFP4AttentionMetadata.from_lengths([1] * B, [L] * B, block_table,
                                                   torch.full((B,), -1, dtype=torch.int64, device=device))
    workspace = DequantWorkspace()
    ms = eager_median_ms(lambda: paged_attention(query, cache, metadata, scale, k_scale, v_scale, out,
                                                 workspace=workspace))
    rows.append(("core: gather+dequantize (fp32) + SDPA (eager)", ms, cache_bytes))

    key, value = workspace.get(B * L, args.kv_heads, d, device)
    cu_seq_lens = torch.arange(0, B * L + 1, L, dtype=torch.int32, device=device)
    ms, how = captured_median_ms(lambda: ops.gather_nvfp4_kv_cache(cache[:, 0], cache[:, 1], block_table,
                                                                    cu_seq_lens, k_scale, v_scale, False, key, value))
    rows.append((f"core: its gather op alone, fp32 out ({how})", ms, cache_bytes + 2 * key.numel() * 4))
    key16 = torch.empty(key.shape, dtype=torch.bfloat16, device=device)
    value16 = torch.empty_like(key16)
    ms, how = captured_median_ms(lambda: ops.gather_nvfp4_kv_cache(cache[:, 0], cache[:, 1], block_table,
                                                                    cu_seq_lens, k_scale, v_scale, False, key16,
                                                                    value16))
    rows.append((f"core: its gather op alone, bf16 out ({how})", ms, cache_bytes + 2 * key16.numel() * 2))

    header = (f"decode, B={B}, L={L}, {args.q_heads}/{args.kv_heads} heads, head {d}, page {bs}, "
              f"NVFP4 cache {cache_bytes / 1e6:.0f} MB ({torch.cuda.get_device_name()})")
    lines = [header, "", "| path | median ms | effective TB/s (bytes it must move / time) |", "| --- | --- | --- |"]
    for name, ms, nbytes in rows:
        lines.append(f"| {name} | {ms:.3f} | {nbytes / (ms * 1e-3) / 1e12:.2f} (copy ceiling {COPY_BANDWIDTH / 1e12}) |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
