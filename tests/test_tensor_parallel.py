"""Tensor parallelism 2 on the CPU with an NVFP4 KV cache: two worker processes, one core each.

Each engine runs in its own Python process (this file run as a script), so the two engines never
share a process and every worker they spawn is gone when the script exits. The script asks every
worker, through `LLM.collective_rpc`, what it really holds: its rank, its thread binding, whether the
plugin registered in that process, the attention backend and impl classes of its layers, and its
KV cache tensors. The test then checks:
- the plugin loaded in both TP workers, and both layers of both workers use the plugin's backend;
- each rank's cache holds half the KV heads (the tiny model has 2 KV heads, one per rank);
- each rank stored its own heads: the first layer's K/V that rank r wrote, dequantized, equal the
  slice of heads that the TP=1 engine wrote for the same tokens (the first layer's K/V do not depend
  on the all-reduce, so they are the same numbers on both sides);
- greedy tokens under TP=2 equal TP=1.

The model runs in float32 (its KV cache is NVFP4 all the same). The tiny model is random, so its
next-token distribution is nearly flat: seen here, its top-2 log-probabilities can lie 0.007 apart,
and in bfloat16 the all-reduce's rounding alone (TP=2 sums two partial products that TP=1 computes
in one GEMM) flips such argmaxes even with a bf16 KV cache (prompt 4, token 7: -6.97 vs -7.03).
In float32 they are ~1e-6, far below those gaps. What remains is NVFP4's own sensitivity: an
ulp-sized difference can still flip one 4-bit code in a layer past the first (see test_serving.py);
on this machine the 4 x 24 greedy tokens came out identical, and the run is deterministic.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

KV_CACHE_DTYPE = "nvfp4"
BLOCK_SIZE = 32
MAX_TOKENS = 24
ENGINE_TIMEOUT_S = 420
PROMPTS = [
    "The history of the printing press begins",
    "The history of the printing press begins in China, where",
    "Water boils at",
    "def add(a, b):\n    return",
]


def describe_worker(worker) -> dict:
    """Runs inside each worker process (sent by `collective_rpc`); `worker` is vLLM's CPUWorker."""
    import vllm_nvfp4_plugin
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
    from vllm_nvfp4_plugin.reference import gather_nvfp4_kv_cache
    from vllm_nvfp4_plugin.vllm_adapter.spec import page_view

    context = worker.vllm_config.compilation_config.static_forward_context
    layers = {name: layer for name, layer in context.items() if hasattr(layer, "impl")}
    first = layers["model.layers.0.self_attn.attn"]
    cache = page_view(first.kv_cache, first.num_kv_heads)  # [blocks, 2, block_size, kv_heads, bytes]
    # The cache starts zeroed, so the blocks with a nonzero byte are the ones the requests wrote.
    written = cache.flatten(1).ne(0).any(dim=1).nonzero().flatten()
    num_tokens = written.numel() * cache.size(2)
    key, value = (torch.empty(num_tokens, first.num_kv_heads, first.head_size) for _ in range(2))
    # Dequantize with the plain-torch oracle, independent of the backend's own read path.
    gather_nvfp4_kv_cache(cache[:, 0], cache[:, 1], written.to(torch.int32).view(1, -1),
                          torch.tensor([0, num_tokens], dtype=torch.int32), first._k_scale, first._v_scale,
                          False, key, value)  # fmt: skip
    return {
        "rank": get_tensor_model_parallel_rank(),
        "world_size": get_tensor_model_parallel_world_size(),
        "pid": os.getpid(),
        "cpu_affinity": sorted(os.sched_getaffinity(0)),
        "torch_threads": torch.get_num_threads(),
        "plugin_registered": vllm_nvfp4_plugin._registered,
        "backends": sorted({f"{l.attn_backend.__module__}.{l.attn_backend.__qualname__}" for l in layers.values()}),
        "impls": sorted({f"{type(l.impl).__module__}.{type(l.impl).__qualname__}" for l in layers.values()}),
        "num_kv_heads": sorted({l.num_kv_heads for l in layers.values()}),
        "kv_cache_dtype": sorted({l.kv_cache_dtype for l in layers.values()}),
        "cache_shape": list(cache.shape),
        "cache_dtype": str(cache.dtype),
        "written_blocks": written.tolist(),
        "first_layer_kv": torch.stack([key, value]),  # [K/V, tokens, kv_heads, head_size]
    }


def run_engine(model: str, tensor_parallel_size: int) -> dict:
    from vllm import LLM, SamplingParams

    llm = LLM(
        model,
        tensor_parallel_size=tensor_parallel_size,
        distributed_executor_backend="mp",
        kv_cache_dtype=KV_CACHE_DTYPE,
        dtype="float32",  # see the module docstring
        block_size=BLOCK_SIZE,
        max_model_len=512,
        enforce_eager=True,
        seed=0,
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params)
    return {
        "token_ids": [list(o.outputs[0].token_ids) for o in outputs],
        "texts": [o.outputs[0].text for o in outputs],
        "workers": llm.collective_rpc(describe_worker),
    }


# The CPUs this process may run on; rank r is bound to the r-th of them.
ALLOWED_CPUS = sorted(os.sched_getaffinity(0))


def engine_env(tensor_parallel_size: int) -> dict:
    return {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        # One core per worker, "0|1" style (vLLM's auto binding wants one NUMA node per rank).
        "VLLM_CPU_OMP_THREADS_BIND": "|".join(str(cpu) for cpu in ALLOWED_CPUS[:tensor_parallel_size]),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        # Engine core inside the script's process; the mp executor still spawns one process per rank.
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    }


def run_engine_process(model: Path, tensor_parallel_size: int, out: Path) -> dict:
    command = [sys.executable, __file__, str(model), str(tensor_parallel_size), str(out)]
    result = subprocess.run(
        command, env=engine_env(tensor_parallel_size), capture_output=True, text=True, timeout=ENGINE_TIMEOUT_S
    )
    assert result.returncode == 0, f"TP={tensor_parallel_size} engine failed:\n{result.stderr[-8000:]}"
    return torch.load(out)


@pytest.fixture(scope="module")
def engines(tmp_path_factory) -> dict[int, dict]:
    from vllm_nvfp4_plugin.tools.models import tiny_llama_path

    if len(ALLOWED_CPUS) < 2:
        pytest.skip(f"TP=2 with one core per rank needs 2 CPUs, this process may use {ALLOWED_CPUS}")

    model = tiny_llama_path()
    out = tmp_path_factory.mktemp("tp")
    return {tp: run_engine_process(model, tp, out / f"tp{tp}.pt") for tp in (1, 2)}


def test_plugin_loads_in_every_worker(engines):
    workers = engines[2]["workers"]
    assert sorted(w["rank"] for w in workers) == [0, 1]
    assert len({w["pid"] for w in workers}) == 2, "the two ranks must be separate processes"
    assert sorted(w["cpu_affinity"] for w in workers) == [[cpu] for cpu in ALLOWED_CPUS[:2]], "one core per rank"
    for w in workers:
        assert w["world_size"] == 2
        assert w["torch_threads"] == 1
        assert w["plugin_registered"], f"rank {w['rank']}: register() did not run in the worker"
        assert w["kv_cache_dtype"] == [KV_CACHE_DTYPE]
        assert all(b.startswith("vllm_nvfp4_plugin.") for b in w["backends"]), w["backends"]
        assert all(i.startswith("vllm_nvfp4_plugin.") for i in w["impls"]), w["impls"]


def test_each_rank_holds_half_the_kv_heads(engines):
    [full] = engines[1]["workers"]
    assert full["num_kv_heads"] == [2]
    for w in engines[2]["workers"]:
        assert w["num_kv_heads"] == [1]
        assert w["cache_dtype"] == full["cache_dtype"] == "torch.uint8"
        # [blocks, K/V, block_size, kv_heads, bytes]: same pages, half the heads.
        assert w["cache_shape"][1:] == [2, BLOCK_SIZE, 1, full["cache_shape"][4]]


def test_each_rank_stores_its_own_heads(engines):
    [full] = engines[1]["workers"]
    for w in engines[2]["workers"]:
        assert w["written_blocks"] == full["written_blocks"], "same requests, same block ids"
        assert w["first_layer_kv"].abs().amax() > 0
        torch.testing.assert_close(w["first_layer_kv"][:, :, 0], full["first_layer_kv"][:, :, w["rank"]], rtol=0, atol=0)


def test_greedy_output_equals_tp1(engines):
    tp1, tp2 = engines[1], engines[2]
    print("\nTP=1:", tp1["texts"], "\nTP=2:", tp2["texts"])
    assert tp2["token_ids"] == tp1["token_ids"]
    assert all(len(ids) == MAX_TOKENS for ids in tp1["token_ids"])


if __name__ == "__main__":
    model_arg, tp_arg, out_arg = sys.argv[1:]
    torch.save(run_engine(model_arg, int(tp_arg)), out_arg)
