"""The main job: SmolLM2-135M-Instruct served by `vllm serve --kv-cache-dtype nvfp4` with this plugin.

    python -m vllm_nvfp4_plugin.tools.demo

Prepares the model offline (models.smollm2_path), starts `vllm serve` on 127.0.0.1 with an NVFP4 KV
cache, sends one chat completion and prints the answer, then does the same with a bf16 KV cache given
the same memory (VLLM_CPU_KVCACHE_SPACE) and prints the KV capacity vLLM computed for each: the
`kv_cache_size_tokens` of its `vllm:cache_config_info` metric, the figure it also logs as
"CPU KV cache size: N tokens". Each server is stopped before the next starts, also on errors.
"""

from __future__ import annotations

import argparse
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from .models import smollm2_path
from .server import VllmServer

DEFAULT_PROMPT = "What is the capital of France? Answer in one sentence."
# vLLM's log line (v1/core/kv_cache_utils.py, update_kv_cache_capacity); "CPU" on this platform.
KV_SIZE_LOG_LINE = re.compile(r"\b\w+(?: \+ host)? KV cache size: [\d,]+ tokens[^\n]*")
CACHE_CONFIG_METRIC = "vllm:cache_config_info{"


@dataclass
class ServedRun:
    kv_cache_dtype: str
    answer: str
    kv_cache_tokens: int
    kv_cache_memory_bytes: int
    vllm_log_line: str
    startup_s: float


def cache_config_labels(metrics_text: str) -> dict[str, str]:
    """The labels of the `vllm:cache_config_info` gauge in a Prometheus /metrics page."""
    for line in metrics_text.splitlines():
        if line.startswith(CACHE_CONFIG_METRIC):
            return dict(re.findall(r'(\w+)="([^"]*)"', line))
    raise RuntimeError("the server's /metrics has no vllm:cache_config_info")


def serve_and_chat(
    model: Path, kv_cache_dtype: str, prompt: str, max_tokens: int, kv_cache_gib: int, max_model_len: int, log_dir: Path
) -> ServedRun:
    """Start `vllm serve` with this KV-cache dtype, ask one question, read the KV capacity, stop it."""
    name = model.name
    args = [
        "--dtype", "bfloat16", "--kv-cache-dtype", kv_cache_dtype, "--max-model-len", str(max_model_len),
        "--served-model-name", name, "--enforce-eager",
    ]  # fmt: skip
    log_path = log_dir / f"vllm_serve_{kv_cache_dtype}.log"
    started = time.monotonic()
    with VllmServer(model, args, env={"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib)}, log_path=log_path) as server:
        startup_s = time.monotonic() - started
        labels = cache_config_labels(httpx.get(f"{server.base_url}/metrics", timeout=30).text)
        if labels.get("cache_dtype") != kv_cache_dtype:
            raise RuntimeError(f"asked for kv_cache_dtype={kv_cache_dtype}, the server runs {labels.get('cache_dtype')}")
        response = httpx.post(
            f"{server.base_url}/v1/chat/completions",
            json={
                "model": name,
                "messages": [{"role": "user", "content": prompt}],
                "temperature": 0.0,
                "max_tokens": max_tokens,
            },
            timeout=600,
        )
        response.raise_for_status()
        answer = response.json()["choices"][0]["message"]["content"]
        log_line = KV_SIZE_LOG_LINE.search(log_path.read_text(errors="replace"))
    return ServedRun(
        kv_cache_dtype=kv_cache_dtype,
        answer=answer,
        kv_cache_tokens=int(labels["kv_cache_size_tokens"]),
        kv_cache_memory_bytes=int(labels["kv_cache_memory_bytes"]),
        vllm_log_line=log_line.group(0) if log_line else "",
        startup_s=startup_s,
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m vllm_nvfp4_plugin.tools.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="model folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--kv-cache-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE for both servers")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument(
        "--baseline", default="bfloat16", help='KV-cache dtype to compare with, or "none" to serve nvfp4 only'
    )
    parser.add_argument("--log-dir", type=Path, default=None, help="where the servers' logs go (default: a temp dir)")
    args = parser.parse_args(argv)
    for flag in ("max_tokens", "kv_cache_gib", "max_model_len"):
        if getattr(args, flag) <= 0:
            parser.error(f"--{flag.replace('_', '-')} must be > 0, got {getattr(args, flag)}")
    if args.baseline == "nvfp4":
        parser.error("--baseline must differ from nvfp4 (e.g. bfloat16, auto, or none)")
    return args


def main(argv: list[str] | None = None) -> dict[str, ServedRun]:
    args = parse_args(argv)
    model = args.model or smollm2_path()
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="vllm_nvfp4_demo."))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"model: {model}\nserver logs: {log_dir}\nprompt: {args.prompt}", flush=True)

    dtypes = ["nvfp4"] + ([] if args.baseline == "none" else [args.baseline])
    runs: dict[str, ServedRun] = {}
    for dtype in dtypes:
        print(f"\n[{dtype}] starting vllm serve --kv-cache-dtype {dtype} ...", flush=True)
        run = serve_and_chat(model, dtype, args.prompt, args.max_tokens, args.kv_cache_gib, args.max_model_len, log_dir)
        runs[dtype] = run
        print(f"[{dtype}] ready in {run.startup_s:.0f} s; vLLM: {run.vllm_log_line}")
        print(f"[{dtype}] answer: {run.answer}", flush=True)

    print(f"\nKV cache capacity that vLLM reports, VLLM_CPU_KVCACHE_SPACE={args.kv_cache_gib} GiB:")
    for dtype, run in runs.items():
        print(f"  {dtype:>10}: {run.kv_cache_tokens:>10,} tokens ({run.kv_cache_memory_bytes / 2**30:.2f} GiB)")
    if len(runs) == 2:
        baseline = runs[dtypes[1]]
        print(f"  {'ratio':>10}: {runs['nvfp4'].kv_cache_tokens / baseline.kv_cache_tokens:.2f}x more tokens with nvfp4")
    return runs


if __name__ == "__main__":
    main()
