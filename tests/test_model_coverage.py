"""Models that need the CPU kernel's model features, end to end through vLLM with an NVFP4 KV cache.

- Gemma 3 270M (15 of its 18 layers slide a 512-token window; `tools/models.py gemma3`, which scripts/install.sh
  prepares) at a max_model_len beyond the window: served by `vllm serve --kv-cache-dtype nvfp4`, then teacher-forced
  against a bf16 cache along prompts longer than the window.
- The tiny random gpt-oss (attention sinks in both layers, a 128-token window in the first): teacher-forced against a
  bf16 cache along prompts longer than its window.
- The tiny random Granite with the same sinks and window (dense, so it runs on CUDA without vLLM's compiled
  kernels): on CPU and on CUDA (the CUSTOM backend against vLLM's TRITON_ATTN on a bf16 cache), teacher-forced the
  same way; the two devices' plugins must cost the same.

Each continuation is the bf16 engine's greedy text (vLLM's own CPU attention, which applies windows and sinks
itself); the NVFP4 engine is forced along it, so the two differ only in the cache and the kernel that reads it. The
plugin must cost what the format costs on the same tokens (`fidelity.format_fidelity`: transformers with NVFP4-rounded
K/V), as tests/test_kv_fidelity.py asks of SmolLM2: a window the kernel ignored or shifted by one key, or sinks it
dropped, give KLs many times the format's (measured below).
"""

import json
from pathlib import Path

import httpx
import pytest
from test_vllm_engine import NVFP4_LAYERS, engine_env
from conftest import DEVICES
from vllm_jobs import run_job

from vllm_nvfp4_plugin.tools import models
from vllm_nvfp4_plugin.tools.fidelity import format_fidelity

GSM8K = Path(__file__).resolve().parents[1] / "evals" / "data"  # MIT, see evals/data/LICENSE
CONTINUATION_TOKENS = 64
GRANITE_CPU_KL = 3.8e-4  # the tiny Granite's mean KL against a bf16 cache on CPU (test below)


def few_shot_prompts(num_prompts: int, shots: int) -> list[str]:
    train = [json.loads(line) for line in (GSM8K / "train.jsonl").read_text().splitlines()[:shots]]
    test = [json.loads(line) for line in (GSM8K / "test.jsonl").read_text().splitlines()[:num_prompts]]
    prefix = "".join(f"Question: {row['question']}\nAnswer: {row['answer']}\n\n" for row in train)
    return [f"{prefix}Question: {row['question']}\nAnswer:" for row in test]


@pytest.fixture(scope="module")
def gemma3() -> Path:
    try:
        models.gemma3_gguf_chunks()
    except RuntimeError as missing:
        pytest.skip(f"Gemma 3 270M is not installed (scripts/install.sh installs it): {missing}")
    return models.gemma3_path()


def fidelity(model: Path, prompts: list[str], max_model_len: int) -> dict:
    job = {"fidelity": {"model": str(model), "prompts": prompts, "kv_cache_dtype": "nvfp4",
                        "reference_kv_cache_dtype": "auto", "max_continuation_tokens": CONTINUATION_TOKENS,
                        "max_model_len": max_model_len, "kv_cache_memory_bytes": 256 << 20, "dtype": "bfloat16",
                        "enforce_eager": True}}
    return run_job(job, engine_env(), timeout=1200)


def test_gemma3_served_with_a_window_shorter_than_max_model_len(gemma3, tmp_path):
    from vllm_nvfp4_plugin.tools.demo import cache_config_labels
    from vllm_nvfp4_plugin.tools.server import VllmServer

    prompt = few_shot_prompts(1, 4)[0]  # about 600 tokens: the local layers' windows leave the first ones behind
    args = ["--dtype", "bfloat16", "--kv-cache-dtype", "nvfp4", "--max-model-len", "1024", "--served-model-name",
            "gemma3", "--enforce-eager"]
    log = tmp_path / "serve.log"
    with VllmServer(gemma3, args, env={"VLLM_CPU_KVCACHE_SPACE": "1"}, log_path=log) as server:
        labels = cache_config_labels(httpx.get(f"{server.base_url}/metrics", timeout=30).text)
        response = httpx.post(f"{server.base_url}/v1/completions", timeout=600, json={
            "model": "gemma3", "prompt": prompt, "max_tokens": 16, "temperature": 0.0})
    response.raise_for_status()
    body = response.json()
    assert body["usage"]["prompt_tokens"] > models.GEMMA3_SLIDING_WINDOW
    assert body["usage"]["completion_tokens"] == 16 and body["choices"][0]["text"].strip()
    assert labels["cache_dtype"] == "nvfp4" and int(labels["kv_cache_size_tokens"]) > 0
    assert NVFP4_LAYERS in log.read_text(errors="replace")


def plugin_and_format(model: Path, prompts: list[str], eager: bool) -> tuple[dict, float, float]:
    """The plugin against a bf16 cache in vLLM, and the format's own (top-1, mean KL) on the same tokens."""
    plugin = fidelity(model, prompts, 1024)
    agreement, kl = format_fidelity(model, prompts, plugin["continuations"], eager=eager)
    agree, kls = [a for row in agreement for a in row], [k for row in kl for k in row]
    return plugin, sum(agree) / len(agree), sum(kls) / len(kls)


def test_gemma3_beyond_its_window_costs_what_the_format_costs(gemma3):
    """Measured (4 prompts of 593-678 tokens, 252 decode positions): the plugin top-1 0.940, mean KL 0.068; the
    format 0.940, 0.063. With the window ignored by the kernel: 0.520, 1.84; one key too many (window 513): 0.583,
    2.06."""
    plugin, format_top1, format_kl = plugin_and_format(gemma3, few_shot_prompts(4, 4), eager=False)
    assert plugin["num_positions"] >= 200
    assert abs(plugin["top1_agreement"] - format_top1) <= 0.03 and plugin["top1_agreement"] >= 0.9, plugin
    assert 0.7 * format_kl <= plugin["mean_kl"] <= 1.3 * format_kl and plugin["mean_kl"] <= 0.15, plugin


def test_tiny_gpt_oss_with_sinks_costs_what_the_format_costs():
    """Measured (4 prompts of 243-282 tokens, 252 decode positions): the plugin top-1 0.810, mean KL 0.0016; the
    format 0.802, 0.0018. With the sinks dropped by the kernel: 0.091, 0.031; with the window ignored: 0.333, 0.012.
    (A random model's next-token distributions are flat, so top-1 flips easily; KL is the measure.)"""
    plugin, format_top1, format_kl = plugin_and_format(models.tiny_gpt_oss_path(), few_shot_prompts(4, 2),
                                                       eager=True)
    assert plugin["num_positions"] >= 200
    assert abs(plugin["top1_agreement"] - format_top1) <= 0.05, plugin
    assert 0.7 * format_kl <= plugin["mean_kl"] <= 1.3 * format_kl and plugin["mean_kl"] <= 0.005, plugin


# vLLM on CUDA without its compiled kernels: PyTorch RMSNorm and rotary, the V1 model runner, no FlashInfer sampler.
CUDA_ENGINE = {"compilation_config": {"custom_ops": ["none"]}, "gpu_memory_utilization": 0.05,
               "kernel_config": {"ir_op_priority": {"rms_norm": ["native"], "fused_add_rms_norm": ["native"]}}}
CUDA_ENV = {"VLLM_USE_V2_MODEL_RUNNER": "0", "VLLM_USE_FLASHINFER_SAMPLER": "0"}


@pytest.mark.parametrize("device", DEVICES)
def test_tiny_granite_with_sinks_costs_the_same_on_cpu_and_cuda(device):
    """Measured, 4 prompts of 243-282 tokens, 252 decode positions: CPU top-1 0.802, KL 3.83e-4; H200 0.786,
    3.78e-4. The CPU kernel's sinks and window are checked against the format on the tiny gpt-oss above; the bound
    here is twice its KL."""
    candidate = {"kv_cache_dtype": "nvfp4"}
    engine = {"max_model_len": 1024, "kv_cache_memory_bytes": 256 << 20, "dtype": "bfloat16", "enforce_eager": True}
    env = engine_env()
    if device == "cuda":
        engine |= {**CUDA_ENGINE, "attention_backend": "TRITON_ATTN"}
        candidate["attention_backend"] = "CUSTOM"
        env |= CUDA_ENV
    job = {"comparison": {"model": str(models.tiny_granite_path()), "prompts": few_shot_prompts(4, 2),
                          "candidates": {"nvfp4": candidate}, "max_continuation_tokens": CONTINUATION_TOKENS,
                          **engine}}
    result = run_job(job, env, timeout=1200)["nvfp4"]
    print(device, result["num_positions"], result["top1_agreement"], result["mean_kl"])
    assert result["num_positions"] >= 200
    assert result["mean_kl"] <= 2 * GRANITE_CPU_KL, result


@pytest.mark.gpu
def test_cuda_graphs_replay_the_eager_attention():
    """The CUSTOM backend under vLLM's compiled model with FULL_AND_PIECEWISE CUDA graphs (decode batches replay a
    full graph, attention included) against the same engine eager, teacher-forced along the eager text: the graphs
    must reproduce eager's next-token distributions (the tiny Granite: sinks and a window on the kernel's path)."""
    engine = {**CUDA_ENGINE, "max_model_len": 1024, "kv_cache_memory_bytes": 256 << 20, "dtype": "bfloat16",
              "enforce_eager": True, "attention_backend": "CUSTOM"}
    graphs = {"kv_cache_dtype": "nvfp4", "enforce_eager": False,
              "compilation_config": {"custom_ops": ["none"], "cudagraph_mode": "FULL_AND_PIECEWISE"}}
    job = {"comparison": {"model": str(models.tiny_granite_path()), "prompts": few_shot_prompts(4, 2),
                          "candidates": {"graphs": graphs}, "reference_kv_cache_dtype": "nvfp4",
                          "max_continuation_tokens": CONTINUATION_TOKENS, **engine}}
    result = run_job(job, engine_env() | CUDA_ENV, timeout=1200)
    graph_lines = [line for line in result["log"].splitlines() if "graph" in line.lower()]
    print("\n".join(graph_lines[-12:]))
    graphs_result = result["graphs"]
    print(graphs_result["num_positions"], graphs_result["top1_agreement"], graphs_result["mean_kl"])
    assert any("Graph capturing finished" in line for line in graph_lines), graph_lines
    assert not any("FULL_AND_PIECEWISE" in line and "not supported" in line for line in graph_lines), graph_lines
    assert graphs_result["num_positions"] >= 200
    assert graphs_result["top1_agreement"] >= 0.98 and graphs_result["mean_kl"] <= 1e-3, graphs_result
