"""vLLM (CPU) with the plugin: discovery, the NVFP4 KV cache it allocates, and generation.

Each engine runs in a fresh interpreter (tests/vllm_jobs.py); all but the spawned-engine test run
vLLM's engine core in that interpreter (VLLM_ENABLE_V1_MULTIPROCESSING=0), which starts faster.
"""

import json
import os
import re
import subprocess
import sys

import pytest
from vllm_jobs import run_job

from vllm_nvfp4_plugin.layout import NVFP4PageLayout
from vllm_nvfp4_plugin.tools.models import smollm2_path, tiny_llama_path
from vllm_nvfp4_plugin.vllm_adapter import CPU_BACKEND

KV_CACHE_BYTES = 16 << 20  # the same cache budget for every engine here
REGISTERED = "vllm_nvfp4_plugin registered attention backends"
NVFP4_LAYERS = "NVFP4 KV cache attention on CPU"


def engine_env(multiprocessing: bool = False) -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               VLLM_ENABLE_V1_MULTIPROCESSING="1" if multiprocessing else "0")
    for name in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_PLUGINS", "VLLM_KV_CACHE_LAYOUT"):
        env.pop(name, None)  # the jobs set the cache budget themselves and load every plugin
    return env


def llm_args(**overrides) -> dict:
    return {"enforce_eager": True, "max_model_len": 1024, "kv_cache_memory_bytes": KV_CACHE_BYTES,
            "dtype": "bfloat16", **overrides}


def expected_kv_tokens(model_dir, bytes_per_token_per_layer: int, block_size: int) -> int:
    config = json.loads((model_dir / "config.json").read_text())
    per_block = config["num_hidden_layers"] * bytes_per_token_per_layer * block_size
    return KV_CACHE_BYTES // per_block * block_size


def nvfp4_page_bytes_per_token(model_dir) -> int:
    config = json.loads((model_dir / "config.json").read_text())
    head = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return NVFP4PageLayout(head, 1, config["num_key_value_heads"]).page_bytes


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama_path(head_dim=64)


@pytest.mark.parametrize("allowed,expected_path", [
    ("nvfp4", CPU_BACKEND),
    ("some_other_plugin", "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend"),
])
def test_vllm_plugins_decides_whether_the_plugin_loads(allowed, expected_path):
    """vLLM filters entry points by VLLM_PLUGINS; our entry point is named "nvfp4"."""
    script = ("from vllm.plugins import load_general_plugins; load_general_plugins()\n"
              "from vllm.v1.attention.backends.registry import AttentionBackendEnum\n"
              "print('CPU_ATTN', AttentionBackendEnum.CPU_ATTN.get_path())")
    env = dict(engine_env(), VLLM_PLUGINS=allowed)
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"CPU_ATTN {expected_path}" in proc.stdout.splitlines()


def test_spawned_engine_loads_the_plugin_and_packs_nvfp4_pages(tiny):
    """Default multiprocessing: the engine core and its worker are spawned processes, and each loads the
    plugin through its entry point. The KV size the engine core reports is that of NVFP4 pages, so the
    worker's layers really used the plugin's spec."""
    job = {"model": str(tiny), "llm": llm_args(kv_cache_dtype="nvfp4"), "max_tokens": 8,
           "batches": [["The quick brown fox jumps over the lazy dog."]]}
    result = run_job(job, engine_env(multiprocessing=True), timeout=900)
    log = result["log"]
    registered_in = {m.group(1) for m in re.finditer(rf"\((\w+)[-\w]* pid=\d+\).*{REGISTERED}", log)}
    assert {"EngineCore", "VllmWorker"} <= registered_in, f"plugin registered in {registered_in}"
    assert re.search(rf"\(Worker[-\w]* pid=\d+\).*{NVFP4_LAYERS}", log), "worker layers did not use the plugin"
    reported = int(re.search(r"KV cache size: ([\d,]+) tokens", log).group(1).replace(",", ""))
    block_size = 128  # vLLM's CPU default
    assert reported == expected_kv_tokens(tiny, nvfp4_page_bytes_per_token(tiny), block_size)
    assert len(result["outputs"][0]["token_ids"]) == 8


def test_kv_capacity_is_3_5x_bf16_for_the_same_budget(tiny):
    capacity = {}
    for dtype in ("nvfp4", "auto"):
        job = {"model": str(tiny), "llm": llm_args(kv_cache_dtype=dtype), "max_tokens": 4,
               "batches": [["Once upon a time"]]}
        result = run_job(job, engine_env(), timeout=600)
        capacity[dtype] = result["kv_tokens"]
        assert len(result["outputs"][0]["token_ids"]) == 4
    ratio = capacity["nvfp4"] / capacity["auto"]
    print(f"\nKV tokens for {KV_CACHE_BYTES >> 20} MiB: nvfp4 {capacity['nvfp4']}, bf16 {capacity['auto']}, "
          f"ratio {ratio:.3f}")
    assert capacity["nvfp4"] == expected_kv_tokens(tiny, nvfp4_page_bytes_per_token(tiny), 128)
    assert ratio >= 3.5


# A system prompt of ~500 tokens: longer than a prefill chunk, and four prefix-cache blocks long.
SYSTEM = ("You are a careful geography tutor. Answer every question with the name of the city first, "
          "then one short sentence of explanation. ") + " ".join(
    f"Fact {i}: the river, mountain and coastline records of region {i} were checked by the survey team."
    for i in range(1, 25))
CHUNK = 64  # max_num_batched_tokens: every prompt here is prefilled in several chunks


def conversation(question):
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def test_tiny_model_chunked_prefill_and_prefix_cache(tiny):
    job = {"model": str(tiny), "llm": llm_args(kv_cache_dtype="nvfp4", max_num_batched_tokens=CHUNK,
                                               max_num_seqs=8),
           "max_tokens": 16, "batches": [[SYSTEM + " First question."], [SYSTEM + " Second.", SYSTEM + " Third."]]}
    first, *later = run_job(job, engine_env(), timeout=600)["outputs"]
    assert first["prompt_len"] > 4 * CHUNK and first["num_cached_tokens"] == 0
    for out in later:  # the shared system prompt's full blocks come from the NVFP4 prefix cache
        assert out["num_cached_tokens"] >= 256
        assert len(out["token_ids"]) > 0


def test_smollm2_answers_with_nvfp4_cache_chunked_prefill_and_prefix_cache():
    """A real model, its prompts prefilled in chunks that attend to earlier chunks through the NVFP4
    cache, the later questions reusing the system prompt's cached NVFP4 blocks, still answers right."""
    job = {"model": str(smollm2_path()),
           "llm": llm_args(kv_cache_dtype="nvfp4", max_num_batched_tokens=CHUNK, max_num_seqs=8),
           "max_tokens": 20,
           "batches": [[conversation("What is the capital of France?")],
                       [conversation("What is the capital of Italy?"), conversation("What is the capital of Japan?")]]}
    outputs = run_job(job, engine_env(), timeout=900)["outputs"]
    for out, city in zip(outputs, ("Paris", "Rome", "Tokyo")):
        print(f"\n{out['num_cached_tokens']:4d} cached of {out['prompt_len']}: {out['text']!r}")
        assert city in out["text"]
    assert outputs[0]["prompt_len"] > 4 * CHUNK
    assert all(out["num_cached_tokens"] >= 256 for out in outputs[1:])


def test_unsupported_head_size_fails_at_engine_start():
    job = {"model": str(tiny_llama_path(head_dim=96)), "llm": llm_args(kv_cache_dtype="nvfp4"), "max_tokens": 1,
           "batches": [["hello"]]}
    with pytest.raises(RuntimeError, match=r"NVFP4 KV cache attention supports head_size in \(64, 128, 256\), got 96"):
        run_job(job, engine_env(), timeout=600)
