"""Soak: mixed-length traffic against `vllm serve` with an NVFP4 KV cache for a set duration.

Starts a server on 127.0.0.1 (or uses `--url`), then keeps `--clients` concurrent clients busy until
`--duration-s` has passed: each sends a completion whose prompt length (4 to 1,024 words) and
max_tokens (1 to 128) are drawn from a seeded generator; one request in eight streams. Every 5 s it samples
the resident memory of the server's whole process tree. Reports requests per second, p50/p99 latency, errors,
the memory timeline, and the KV-cache usage after the traffic stops (it must return to idle).

    python benchmarks/soak.py --duration-s 1800 --json out/soak.json        # a 30-minute run
    python benchmarks/soak.py --duration-s 120                              # what CI runs (tests/test_reliability.py)
    python benchmarks/soak.py --url http://127.0.0.1:8000 --model NAME      # an already running server

The load is bounded in count and time and goes to 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import psutil

WORDS = ("river valley mountain harbor lantern orchard meadow glacier canyon forest island desert village "
         "market bridge castle garden library kitchen window").split()
SAMPLE_PERIOD_S = 5.0
PROMPT_WORDS = (4, 16, 64, 256, 1024)  # prompt lengths drawn from, in words (about one token each)


@dataclass
class SoakReport:
    duration_s: float
    clients: int
    requests: int
    errors: int
    error_samples: list[str]
    requests_per_s: float
    latency_p50_s: float
    latency_p99_s: float
    generated_tokens: int
    rss_mib: list[tuple[float, float]] = field(default_factory=list)  # (seconds since start, MiB)
    kv_cache_usage_after: float | None = None

    @property
    def rss_growth_mib(self) -> float:
        """Median RSS of the last quarter of the samples minus that of the first quarter."""
        values = [mib for _, mib in self.rss_mib]
        quarter = max(1, len(values) // 4)
        return statistics.median(values[-quarter:]) - statistics.median(values[:quarter])


def tree_rss_mib(pid: int) -> float:
    """Resident memory of `pid` and all its descendants (the API server, engine core and workers)."""
    root = psutil.Process(pid)
    total = 0
    for proc in [root, *root.children(recursive=True)]:
        try:
            total += proc.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total / 2**20


def kv_cache_usage(client: httpx.Client) -> float:
    text = client.get("/metrics").text
    match = re.search(r"^vllm:kv_cache_usage_perc\{[^}]*\} (\S+)$", text, re.MULTILINE)
    if not match:
        raise RuntimeError("vllm:kv_cache_usage_perc missing from /metrics")
    return float(match.group(1))


def make_request(rng: random.Random, model: str, prompt_words: tuple[int, ...]) -> dict:
    return {"model": model, "prompt": " ".join(rng.choice(WORDS) for _ in range(rng.choice(prompt_words))),
            "max_tokens": rng.choice((1, 8, 32, 128)), "temperature": rng.choice((0.0, 0.8)),
            "ignore_eos": True, "stream": rng.random() < 0.125}


def send(client: httpx.Client, body: dict) -> int:
    """One completion; returns the generated token count (raises on an HTTP error or a broken stream)."""
    if not body["stream"]:
        response = client.post("/v1/completions", json=body)
        response.raise_for_status()
        return response.json()["usage"]["completion_tokens"]
    chunks = 0
    with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks += 1
    if chunks == 0:
        raise RuntimeError("stream ended without a chunk")
    return chunks


def soak(base_url: str, model: str, server_pid: int | None, duration_s: float, clients: int,
         prompt_words: tuple[int, ...] = PROMPT_WORDS, seed: int = 0) -> SoakReport:
    latencies: list[float] = []
    errors: list[str] = []
    tokens = [0]
    rss: list[tuple[float, float]] = []
    lock = threading.Lock()
    start = time.monotonic()
    deadline = start + duration_s

    def client_loop(index: int) -> None:
        rng = random.Random(seed * 1000 + index)
        with httpx.Client(base_url=base_url, timeout=600.0) as client:
            while time.monotonic() < deadline:
                body = make_request(rng, model, prompt_words)
                t0 = time.monotonic()
                try:
                    n = send(client, body)
                except Exception as e:  # counted and reported, the soak goes on
                    with lock:
                        errors.append(f"{type(e).__name__}: {e}"[:300])
                    continue
                with lock:
                    latencies.append(time.monotonic() - t0)
                    tokens[0] += n

    def sample_memory() -> None:
        while time.monotonic() < deadline:
            if server_pid is not None:
                rss.append((round(time.monotonic() - start, 1), round(tree_rss_mib(server_pid), 1)))
            time.sleep(SAMPLE_PERIOD_S)

    threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(clients)]
    threads.append(threading.Thread(target=sample_memory))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - start
    with httpx.Client(base_url=base_url, timeout=60.0) as client:
        usage = kv_cache_usage(client)
    latencies.sort()

    def quantile(q: float) -> float:
        return latencies[min(len(latencies) - 1, int(q * len(latencies)))] if latencies else float("nan")

    return SoakReport(duration_s=round(elapsed, 1), clients=clients, requests=len(latencies), errors=len(errors),
                      error_samples=errors[:5], requests_per_s=round(len(latencies) / elapsed, 3),
                      latency_p50_s=round(quantile(0.50), 3), latency_p99_s=round(quantile(0.99), 3),
                      generated_tokens=tokens[0], rss_mib=rss, kv_cache_usage_after=usage)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration-s", type=float, default=120.0)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--kv-cache-dtype", default="nvfp4")
    parser.add_argument("--kv-cache-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE of a started server")
    parser.add_argument("--url", help="use this running server instead of starting one")
    parser.add_argument("--model", help="model path (started server) or served name (--url)")
    parser.add_argument("--json", type=Path, help="also write the report here")
    parser.add_argument("--log", type=Path, default=Path("soak_server.log"))
    args = parser.parse_args()
    if args.duration_s <= 0 or args.clients <= 0:
        parser.error("--duration-s and --clients must be positive")

    if args.url:
        if not args.model:
            parser.error("--url needs --model (the served model name)")
        report = soak(args.url, args.model, None, args.duration_s, args.clients)
    else:
        from vllm_nvfp4_plugin.tools.models import smollm2_path
        from vllm_nvfp4_plugin.tools.server import VllmServer

        model = args.model or str(smollm2_path())
        server = VllmServer(model, ["--kv-cache-dtype", args.kv_cache_dtype, "--served-model-name", "soak",
                                    "--max-model-len", "2048", "--dtype", "bfloat16"],
                            env={"VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib)}, log_path=args.log)
        with server:
            report = soak(server.base_url, "soak", server.process.pid, args.duration_s, args.clients)

    summary = {k: v for k, v in asdict(report).items() if k != "rss_mib"}
    summary["rss_first_last_mib"] = [report.rss_mib[0][1], report.rss_mib[-1][1]] if report.rss_mib else None
    summary["rss_growth_mib"] = round(report.rss_growth_mib, 1) if report.rss_mib else None
    print(json.dumps(summary, indent=1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({**asdict(report), "rss_growth_mib": summary["rss_growth_mib"]}, indent=1))
    sys.exit(1 if report.errors else 0)


if __name__ == "__main__":
    main()
