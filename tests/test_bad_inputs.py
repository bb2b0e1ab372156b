"""Bad inputs, one table row each: every one must raise an error naming the argument and the rule.

A `meta` tensor among CPU tensors checks device agreement on any machine (the op dispatches to its fake
implementation); the CUDA rows check the C++ checks of the CUDA kernels and run only with a GPU.
"""

import pytest
import torch

from vllm_nvfp4_plugin import ops
from vllm_nvfp4_plugin.layout import IndexerCacheLayout, NVFP4PageLayout

OPS = {
    "store": ops.reshape_and_cache_nvfp4,
    "gather": ops.gather_nvfp4_kv_cache,
    "indexer_store": ops.indexer_k_quant_and_cache,
    "indexer_gather": ops.cp_gather_indexer_k_quant_cache,
}


def valid_args(op: str, device="cpu") -> dict:
    """Arguments that succeed: 4 blocks of 8 tokens, 2 heads of 128 (NVFP4), head_dim 128 (indexer)."""
    scale = torch.ones(1, device=device)
    block_table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=device)
    cu_seq_lens = torch.tensor([0, 10, 16], dtype=torch.int32, device=device)
    if op in ("store", "gather"):
        kv_cache = NVFP4PageLayout(128, 8, 2).allocate(4, device, fill=0)
        caches = dict(key_cache=kv_cache[:, 0], value_cache=kv_cache[:, 1])
        if op == "store":
            x = torch.randn(5, 2, 128, dtype=torch.bfloat16, device=device)
            return dict(key=x, value=x.clone(), **caches, slot_mapping=torch.tensor([0, 9, -1, 17, 31], device=device),
                        k_scale=scale, v_scale=scale.clone(), swizzle_v_scales=True)
        out = torch.empty(16, 2, 128, dtype=torch.bfloat16, device=device)
        return dict(**caches, block_table=block_table, cu_seq_lens=cu_seq_lens, k_scale=scale, v_scale=scale.clone(),
                    swizzle_v_scales=True, out_key=out, out_value=out.clone())
    kv_cache = IndexerCacheLayout(128, 8, 128).allocate(4, device, fill=0)
    if op == "indexer_store":
        return dict(k=torch.randn(5, 128, dtype=torch.bfloat16, device=device), kv_cache=kv_cache,
                    slot_mapping=torch.tensor([0, 9, -1, 17, 31], device=device), quant_block_size=128, scale_fmt="")
    return dict(kv_cache=kv_cache, dst_k=torch.empty(16, 128, dtype=torch.uint8, device=device),
                dst_scale=torch.empty(16, 4, dtype=torch.uint8, device=device), block_table=block_table,
                cu_seq_lens=cu_seq_lens)


def nvfp4_cache(head_size=128, block_size=8, hnd=False):
    kv_cache = NVFP4PageLayout(head_size, block_size, 2, hnd).allocate(4, fill=0)
    return dict(key_cache=kv_cache[:, 0], value_cache=kv_cache[:, 1])


def meta(t):
    return t.to("meta")


# (case id, op, argument changes: name -> value or function of the valid args, expected message regex)
CASES = [
    # reshape_and_cache_nvfp4
    ("key_dtype", "store", {"key": lambda a: a["key"].to(torch.int32)}, r"key: dtype must be bfloat16, float16 or float32"),
    ("key_cache_dtype", "store", {"key_cache": lambda a: a["key_cache"].view(torch.int8)},
     r"key_cache: dtype must be uint8"),
    ("key_cache_rank", "store", {"key_cache": lambda a: a["key_cache"][0]}, r"key_cache: must be 4-D"),
    ("key_head_size_72", "store", {"key": lambda a: torch.zeros(5, 2, 72, dtype=torch.bfloat16)},
     r"key: head size 72 is not a multiple of 16"),
    ("cache_last_dim_not_nvfp4", "store", {"key_cache": lambda a: a["key_cache"][..., :40]},
     r"key_cache: last dim 40 is not head_size/2 \+ head_size/16"),
    ("key_head_size_mismatch", "store", {"key": lambda a: torch.zeros(5, 2, 64, dtype=torch.bfloat16)},
     r"key: shape \[5, 2, 64\] does not match key_cache's 2 heads of size 128"),
    ("key_heads_mismatch", "store", {"key": lambda a: a["key"][:, :1]}, r"key: shape \[5, 1, 128\] does not match"),
    ("key_head_dim_strided", "store", {"key": lambda a: torch.zeros(5, 2, 256, dtype=torch.bfloat16)[..., ::2]},
     r"key: the head dim must be contiguous"),
    ("value_shape", "store", {"value": lambda a: a["value"][:3]}, r"value: must have key's shape"),
    ("value_dtype", "store", {"value": lambda a: a["value"].half()}, r"value: must have key's shape .* and dtype"),
    ("swizzle_block_size_6", "store", lambda a: {**nvfp4_cache(block_size=6)},
     r"key_cache: block size 6 is not a multiple of 4, which swizzle_v_scales needs"),
    ("swizzle_head_size_32", "store",
     lambda a: {**nvfp4_cache(head_size=32), "key": a["key"][..., :32], "value": a["value"][..., :32]},
     r"key_cache: head size 32 is not a multiple of 64"),
    ("value_cache_other_layout", "store", {"value_cache": lambda a: nvfp4_cache(hnd=True)["value_cache"]},
     r"value_cache: must have key_cache's shape"),
    ("cache_heads_not_adjacent", "store",
     {"key_cache": lambda a: NVFP4PageLayout(256, 8, 2).allocate(4)[:, 0, :, :, :72]},
     r"key_cache: each block side must be contiguous NHD or HND bytes"),
    ("slot_dtype", "store", {"slot_mapping": lambda a: a["slot_mapping"].int()}, r"slot_mapping: dtype must be int64"),
    ("slot_rank", "store", {"slot_mapping": lambda a: a["slot_mapping"].view(5, 1)}, r"slot_mapping: must be 1-D"),
    ("more_slots_than_tokens", "store", {"slot_mapping": lambda a: torch.zeros(6, dtype=torch.int64)},
     r"slot_mapping: 6 slots for only 5 tokens"),
    ("slot_beyond_cache", "store", {"slot_mapping": lambda a: torch.tensor([0, 1, 2, 32, 3])},
     r"slot_mapping: slot 32 of token 3 is beyond the cache's 32 slots"),
    ("k_scale_dtype", "store", {"k_scale": lambda a: a["k_scale"].double()}, r"k_scale: dtype must be float32"),
    ("v_scale_numel", "store", {"v_scale": lambda a: torch.ones(2)}, r"v_scale: must hold one float32"),
    ("store_meta_slots", "store", {"slot_mapping": lambda a: meta(a["slot_mapping"])},
     r"slot_mapping: must be on key_cache's device \(cpu\), got meta"),
    ("store_meta_key", "store", {"key": lambda a: meta(a["key"])}, r"key: must be on key_cache's device"),
    # gather_nvfp4_kv_cache
    ("table_entry_out_of_range", "gather", {"block_table": lambda a: torch.tensor([[0, 4], [2, 3]], dtype=torch.int32)},
     r"block_table: entry \[0, 1\] = 4 is not a block of the cache \(4 blocks\)"),
    ("table_entry_negative", "gather", {"block_table": lambda a: torch.tensor([[0, 1], [-1, 3]], dtype=torch.int32)},
     r"block_table: entry \[1, 0\] = -1 is not a block"),
    ("table_too_narrow", "gather", {"block_table": lambda a: a["block_table"][:, :1]},
     r"block_table: sequence 0 of 10 tokens needs 2 blocks, but block_table has 1 columns"),
    ("table_dtype", "gather", {"block_table": lambda a: a["block_table"].long()}, r"block_table: dtype must be int32"),
    ("cu_seq_lens_dtype", "gather", {"cu_seq_lens": lambda a: a["cu_seq_lens"].long()}, r"cu_seq_lens: dtype must be int32"),
    ("cu_seq_lens_length", "gather", {"cu_seq_lens": lambda a: a["cu_seq_lens"][:2]},
     r"cu_seq_lens: must have batch \+ 1 = 3 entries"),
    ("cu_seq_lens_decreasing", "gather", {"cu_seq_lens": lambda a: torch.tensor([0, 10, 4], dtype=torch.int32)},
     r"cu_seq_lens: must be non-decreasing"),
    ("cu_seq_lens_past_output", "gather", {"cu_seq_lens": lambda a: torch.tensor([0, 10, 17], dtype=torch.int32)},
     r"cu_seq_lens: 17 tokens do not fit the output's 16 rows"),
    ("cu_seq_lens_start", "gather", {"cu_seq_lens": lambda a: torch.tensor([1, 10, 16], dtype=torch.int32)},
     r"cu_seq_lens: must start at 0"),
    ("out_key_dtype", "gather", {"out_key": lambda a: a["out_key"].view(torch.int16)}, r"out_key: dtype must be"),
    ("out_value_head_size", "gather", {"out_value": lambda a: torch.empty(16, 2, 64, dtype=torch.bfloat16)},
     r"out_value: shape \[16, 2, 64\] does not match"),
    ("out_value_rows", "gather", {"out_value": lambda a: a["out_value"][:8]}, r"out_value: must have out_key's 16 rows"),
    ("gather_swizzle_block_size", "gather", lambda a: {**nvfp4_cache(block_size=6)},
     r"key_cache: block size 6 is not a multiple of 4"),
    ("gather_meta_out", "gather", {"out_key": lambda a: meta(a["out_key"])}, r"out_key: must be on key_cache's device"),
    # indexer_k_quant_and_cache
    ("scale_fmt_unknown", "indexer_store", {"scale_fmt": "fp8"},
     r'scale_fmt: must be "", "ue8m0" or "mxfp8", got "fp8"'),
    ("k_dtype", "indexer_store", {"k": lambda a: a["k"].to(torch.int8)}, r"k: dtype must be"),
    ("k_rank", "indexer_store", {"k": lambda a: a["k"].view(5, 1, 128)}, r"k: must be 2-D"),
    ("quant_block_size_not_dividing", "indexer_store", {"quant_block_size": 48},
     r"quant_block_size: head_dim 128 must be a positive multiple of quant_block_size 48"),
    ("quant_block_size_mismatch", "indexer_store", {"quant_block_size": 64},
     r"kv_cache: last dim 132 is not head_dim \+ head_dim/quant_block_size\*4 = 136"),
    ("indexer_cache_dtype", "indexer_store", {"kv_cache": lambda a: a["kv_cache"].view(torch.int8)},
     r"kv_cache: dtype must be uint8"),
    ("indexer_block_stride_small", "indexer_store",
     {"kv_cache": lambda a: a["kv_cache"].as_strided(a["kv_cache"].shape, (1000, 132, 1))},
     r"kv_cache: blocks must be contiguous rows of 132 bytes"),
    ("indexer_slot_beyond_cache", "indexer_store", {"slot_mapping": lambda a: torch.tensor([40, 1, 2, 3, 4])},
     r"slot_mapping: slot 40 of token 0 is beyond the cache's 32 slots"),
    ("indexer_slot_dtype", "indexer_store", {"slot_mapping": lambda a: a["slot_mapping"].int()},
     r"slot_mapping: dtype must be int64"),
    ("indexer_meta_k", "indexer_store", {"k": lambda a: meta(a["k"])}, r"k: must be on kv_cache's device"),
    # cp_gather_indexer_k_quant_cache
    ("dst_k_dtype", "indexer_gather", {"dst_k": lambda a: a["dst_k"].view(torch.int8)},
     r"dst_k: dtype must be uint8 or float8_e4m3fn"),
    ("dst_scale_dtype", "indexer_gather", {"dst_scale": lambda a: a["dst_scale"].view(torch.int16)},
     r"dst_scale: dtype must be uint8 or float32"),
    ("dst_scale_rows", "indexer_gather", {"dst_scale": lambda a: a["dst_scale"][:4]},
     r"dst_scale: must have dst_k's 16 rows"),
    ("dst_scale_bytes", "indexer_gather", {"dst_scale": lambda a: torch.empty(16, 3, dtype=torch.uint8)},
     r"dst_scale: 3 scale bytes a row"),
    ("dst_k_head_dim", "indexer_gather", {"dst_k": lambda a: torch.empty(16, 64, dtype=torch.uint8)},
     r"kv_cache: last dim 132 is not head_dim \+ head_dim/quant_block_size\*4 = 68"),
    ("indexer_table_out_of_range", "indexer_gather",
     {"block_table": lambda a: torch.tensor([[0, 1], [99, 3]], dtype=torch.int32)},
     r"block_table: entry \[1, 0\] = 99 is not a block of the cache \(4 blocks\)"),
    ("indexer_cu_past_output", "indexer_gather", {"cu_seq_lens": lambda a: torch.tensor([0, 10, 20], dtype=torch.int32)},
     r"cu_seq_lens: 20 tokens do not fit the output's 16 rows"),
    ("indexer_meta_table", "indexer_gather", {"block_table": lambda a: meta(a["block_table"])},
     r"block_table: must be on kv_cache's device"),
]


def apply_changes(args: dict, changes) -> dict:
    if callable(changes):
        changes = changes(args)
    return {**args, **{name: value(args) if callable(value) else value for name, value in changes.items()}}


@pytest.mark.parametrize("op,changes,message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_raises_naming_the_argument(op, changes, message):
    args = valid_args(op)
    OPS[op](**args)  # the valid arguments pass
    with pytest.raises(RuntimeError, match=message):
        OPS[op](**apply_changes(args, changes))


# One argument on the CPU while the cache is on the GPU: the CUDA kernels' C++ checks must reject it.
CUDA_CASES = [
    ("store", "slot_mapping", r"slot_mapping: must be on key_cache's device \(cuda:0\), got cpu"),
    ("store", "k_scale", r"k_scale: must be on key_cache's device \(cuda:0\), got cpu"),
    ("gather", "block_table", r"block_table: must be on key_cache's device \(cuda:0\), got cpu"),
    ("indexer_store", "k", r"k: must be on kv_cache's device \(cuda:0\), got cpu"),
    ("indexer_gather", "cu_seq_lens", r"cu_seq_lens: must be on kv_cache's device \(cuda:0\), got cpu"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("op,name,message", CUDA_CASES, ids=[f"{c[0]}-{c[1]}" for c in CUDA_CASES])
def test_cpu_argument_with_cuda_cache_raises(op, name, message):
    args = valid_args(op, "cuda")
    with pytest.raises(RuntimeError, match=message):
        OPS[op](**{**args, name: args[name].cpu()})
