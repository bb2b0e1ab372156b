"""Reliability of the NVFP4 cache under pressure, on vLLM's CPU engine with SmolLM2-135M-Instruct.

Preemption: a KV cache of a few blocks makes vLLM preempt running requests (their blocks are freed and handed to
others) and recompute them later as a prefill of prompt + generated tokens. A recompute's bits differ from
decode's, for an unquantized cache as for NVFP4, so exact equality with an unpressured run is not the bar. The bar:
under the same pressure NVFP4 diverges from its unpressured run no more than vLLM's own cache (fp32 here, as the
weights: fp32 weights with oneDNN capped at AVX2 keep batch composition out of the bits) does, and every divergence
is a near-tie (the unpressured run's two best tokens were within NEAR_TIE_NATS). A request that read a stale,
freed or foreign page would diverge grossly; a planted foreign page shows the check catches that.

Serving: clients that disconnect mid-stream, requests vLLM must refuse, and a short soak (benchmarks/soak.py).
"""

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from vllm_nvfp4_plugin.tools.models import smollm2_path, tiny_llama_path

sys.path.insert(0, str(Path(__file__).parent))
from vllm_jobs import run_job  # noqa: E402

pytestmark = pytest.mark.e2e

MAX_TOKENS = 48
BLOCK_SIZE = 32  # vLLM's CPU attention takes multiples of 32
PRESSURE_BLOCKS = 6  # vLLM keeps one block back: 5 usable blocks of 32, two or three of the requests below at once
MAX_MODEL_LEN = 128
# Bound of a near-tie. Measured here: in this configuration no request diverged under pressure (8 of 8 identical,
# NVFP4 and fp32 caches alike); with bf16 weights (batch-dependent GEMMs) divergences were top-2 swaps with gaps up
# to 0.75 nats for NVFP4 and 0.13 for bf16; the planted foreign page's first divergence is no top-2 swap and has a
# 1.0-nat gap.
NEAR_TIE_NATS = 0.5
# oneDNN capped at AVX2 makes vLLM's fp32 CPU linears row-invariant (tests/test_serving.py): a request's tokens do
# not depend on which others share its batch, so what differs under pressure is the recompute alone.
SERVE_ENV = {"ONEDNN_MAX_CPU_ISA": "AVX2", "VLLM_CPU_KVCACHE_SPACE": "1"}
ALLOWED_CPUS = sorted(os.sched_getaffinity(0))
PROMPTS = [f"Write a short story about a {who} who" for who in
           ("cat", "robot", "sailor", "baker", "wizard", "farmer", "pilot", "poet")]


def generate(kv_cache_dtype: str, blocks: int | None, model: Path | None = None, tensor_parallel_size: int = 1,
             **job_options) -> dict:
    llm = {"kv_cache_dtype": kv_cache_dtype, "dtype": "float32", "block_size": BLOCK_SIZE, "seed": 0,
           "max_model_len": MAX_MODEL_LEN, "enforce_eager": True, "kv_cache_memory_bytes": 64 << 20,
           "disable_log_stats": False, "enable_prefix_caching": True}
    if blocks is not None:
        llm["num_gpu_blocks_override"] = blocks
    env = os.environ | SERVE_ENV | {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1",
                                    "TRANSFORMERS_OFFLINE": "1"}
    if tensor_parallel_size > 1:  # one core a rank, the ranks in processes of vLLM's mp executor
        llm |= {"tensor_parallel_size": tensor_parallel_size, "distributed_executor_backend": "mp"}
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(cpu) for cpu in ALLOWED_CPUS[:tensor_parallel_size])
    job = {"model": str(model or smollm2_path()), "llm": llm, "max_tokens": MAX_TOKENS, "batches": [PROMPTS],
           "logprobs": 2, "ignore_eos": True, **job_options}
    return run_job(job, env, timeout=1500)


@dataclass
class Divergence:
    request: int
    position: int  # first generated token that differs
    top2_swap: bool  # each run's pick is the other's runner-up
    gaps: tuple[float, float]  # top-2 log-probability gap there: reference run, pressured run
    drift: float  # largest |difference| of the chosen token's log-probability over the tokens before it

    @property
    def near_tie(self) -> bool:
        return self.top2_swap and max(self.gaps) < NEAR_TIE_NATS and self.drift < NEAR_TIE_NATS


def divergences(reference: dict, pressured: dict) -> list[Divergence]:
    found = []
    for r, (ref, out) in enumerate(zip(reference["outputs"], pressured["outputs"])):
        pos = next((k for k, (a, b) in enumerate(zip(ref["token_ids"], out["token_ids"])) if a != b), None)
        if pos is None:
            continue
        (a1, a1_lp), (a2, a2_lp) = ref["logprobs"][pos][:2]
        (b1, b1_lp), (b2, b2_lp) = out["logprobs"][pos][:2]
        drift = max((abs(x[0][1] - y[0][1]) for x, y in zip(ref["logprobs"][:pos], out["logprobs"][:pos])),
                    default=0.0)
        found.append(Divergence(r, pos, {a1, a2} == {b1, b2}, (a1_lp - a2_lp, b1_lp - b2_lp), drift))
    return found


@pytest.fixture(scope="module")
def runs() -> dict[str, dict]:
    results = {f"{dtype}/{mode}": generate(dtype, None if mode == "free" else PRESSURE_BLOCKS)
               for dtype in ("auto", "nvfp4") for mode in ("free", "pressured")}
    for name, result in results.items():
        print(name, "preemptions:", result["num_preemptions"], "KV tokens:", result["kv_tokens"])
    return results


def test_pressure_preempts(runs):
    for dtype in ("auto", "nvfp4"):
        assert runs[f"{dtype}/free"]["num_preemptions"] == 0
        assert runs[f"{dtype}/pressured"]["num_preemptions"] > 0
        assert runs[f"{dtype}/pressured"]["kv_tokens"] == PRESSURE_BLOCKS * BLOCK_SIZE


def test_nvfp4_under_pressure_diverges_no_more_than_an_unquantized_cache(runs):
    bf16 = divergences(runs["auto/free"], runs["auto/pressured"])
    nvfp4 = divergences(runs["nvfp4/free"], runs["nvfp4/pressured"])
    print(f"unquantized: {len(bf16)} of {len(PROMPTS)} diverged {bf16}\nnvfp4: {len(nvfp4)} of {len(PROMPTS)} diverged {nvfp4}")
    assert len(nvfp4) <= len(bf16)
    assert min((d.position for d in nvfp4), default=MAX_TOKENS) >= min((d.position for d in bf16), default=MAX_TOKENS)
    for divergence in bf16 + nvfp4:
        assert divergence.near_tie, divergence


def test_a_foreign_page_is_a_gross_divergence(runs):
    planted = generate("nvfp4", None, plant_foreign_block_after=3)
    found = divergences(runs["nvfp4/free"], planted)
    print("planted foreign page:", found)
    assert any(d.request == 0 and not d.near_tie for d in found), found


@pytest.fixture(scope="module")
def tp_runs() -> dict[str, dict]:
    """TP=1 unpressured against TP=2 under the same pressure, each cache dtype. SmolLM2's 3 KV heads do not split
    in two, so this runs the tiny random Llama (2 KV heads of 128, SmolLM2's tokenizer)."""
    if len(ALLOWED_CPUS) < 2:
        pytest.skip(f"TP=2 with one core per rank needs 2 CPUs, this process may use {ALLOWED_CPUS}")
    model = tiny_llama_path(128)
    results = {f"{dtype}/tp{tp}": generate(dtype, None if tp == 1 else PRESSURE_BLOCKS, model, tp)
               for dtype in ("auto", "nvfp4") for tp in (1, 2)}
    for name, result in results.items():
        print(name, "preemptions:", result["num_preemptions"], "KV tokens:", result["kv_tokens"])
    return results


def test_tensor_parallel_under_pressure_diverges_no_more_than_an_unquantized_cache(tp_runs):
    for dtype in ("auto", "nvfp4"):
        assert tp_runs[f"{dtype}/tp2"]["num_preemptions"] > 0
    unquantized = divergences(tp_runs["auto/tp1"], tp_runs["auto/tp2"])
    nvfp4 = divergences(tp_runs["nvfp4/tp1"], tp_runs["nvfp4/tp2"])
    print(f"TP=2 under pressure vs TP=1: unquantized {len(unquantized)} of {len(PROMPTS)} diverged {unquantized}\n"
          f"nvfp4: {len(nvfp4)} of {len(PROMPTS)} diverged {nvfp4}")
    assert len(nvfp4) <= len(unquantized)
    for divergence in unquantized + nvfp4:
        assert divergence.near_tie, divergence


# --- Serving: aborts, hostile requests, soak --------------------------------------------------------------

SERVE_ARGS = ["--served-model-name", "smollm2", "--block-size", "32", "--max-model-len", "2048",
              "--max-num-seqs", "16", "--enforce-eager", "--seed", "0", "--max-logprobs", "20"]
KV_CACHE_BLOCKS = 65  # one kept back, 64 of 32 tokens: a cache as long as max_model_len, so one request fills it


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    import contextlib

    from vllm_nvfp4_plugin.tools.server import VllmServer

    logs = tmp_path_factory.mktemp("reliability")
    with contextlib.ExitStack() as stack:
        started = {}
        # The NVFP4 server runs fp32 weights (row-invariant, for the exact comparisons); the bf16 one serves its
        # weights and cache in bf16 (vLLM's CPU attention takes no bf16 cache under fp32 weights).
        for dtype, weights in (("nvfp4", "float32"), ("bfloat16", "bfloat16")):
            args = [*SERVE_ARGS, "--kv-cache-dtype", dtype, "--dtype", weights,
                    "--num-gpu-blocks-override", str(KV_CACHE_BLOCKS)]
            started[dtype] = stack.enter_context(VllmServer(smollm2_path(), args, env=SERVE_ENV,
                                                            log_path=logs / f"{dtype}.log"))
        yield started


def completion(client, prompt: str, max_tokens: int = 24, **extra):
    return client.post("/v1/completions", json={"model": "smollm2", "prompt": prompt, "max_tokens": max_tokens,
                                                "temperature": 0.0, "ignore_eos": True, **extra})


def kv_usage(client) -> float:
    import re

    text = client.get("/metrics").text
    return float(re.search(r"^vllm:kv_cache_usage_perc\{[^}]*\} (\S+)$", text, re.MULTILINE).group(1))


def test_clients_that_disconnect_mid_stream_leave_others_unchanged_and_no_blocks(servers):
    import random
    import threading
    import time

    import httpx

    server = servers["nvfp4"]
    prompts = [f"List {n} facts about the {topic}:" for n, topic in
               zip(range(3, 11), ("moon", "ocean", "desert", "forest", "river", "volcano", "glacier", "city"))]
    victims = [f"Tell me everything about {thing}." for thing in ("trains", "bees", "clocks", "salt", "ships",
                                                                 "paper", "glass", "rain")]
    with httpx.Client(base_url=server.base_url, timeout=600.0) as client:
        idle = kv_usage(client)
        alone = [completion(client, p).json()["choices"][0]["text"] for p in prompts]
        rng = random.Random(0)
        kept: dict[int, str] = {}
        cancelled = []

        def keep(i: int) -> None:
            kept[i] = completion(client, prompts[i]).json()["choices"][0]["text"]

        def abandon(prompt: str, after_chunks: int) -> None:
            body = {"model": "smollm2", "prompt": prompt, "max_tokens": 64, "temperature": 0.0, "stream": True}
            with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=600.0) as response:
                for k, _ in enumerate(response.iter_lines()):
                    if k >= after_chunks:
                        break  # leaving the block closes the connection mid-stream
            cancelled.append(after_chunks)

        threads = [threading.Thread(target=keep, args=(i,)) for i in range(len(prompts))]
        threads += [threading.Thread(target=abandon, args=(v, rng.randint(1, 30))) for v in victims]
        rng.shuffle(threads)
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(cancelled) == len(victims)
        assert [kept[i] for i in range(len(prompts))] == alone
        deadline = time.monotonic() + 60
        while kv_usage(client) != idle and time.monotonic() < deadline:
            time.sleep(0.5)
        assert kv_usage(client) == idle, "KV blocks leaked by aborted requests"
        assert client.get("/health").status_code == 200


HOSTILE = {
    "prompt longer than max_model_len": {"prompt": "word " * 2100},
    "max_tokens 0": {"prompt": "Hello", "max_tokens": 0},
    "max_tokens huge": {"prompt": "Hello", "max_tokens": 10**9},
    "empty prompt": {"prompt": ""},
    "n > 1": {"prompt": "Hello", "n": 3, "temperature": 0.8},
    "best_of": {"prompt": "Hello", "n": 1, "best_of": 3},
    "logprobs 20": {"prompt": "Hello", "logprobs": 20},
    "prompt that fills the whole cache": {"prompt": "word " * 2000, "max_tokens": 16},
}


def shape_of(answer: dict) -> list[tuple[int, int]]:
    """Per choice: generated tokens and candidates per token (the parts the request's arguments fix)."""
    return [(answer["usage"]["completion_tokens"] // len(answer["choices"]),
             len(c["logprobs"]["top_logprobs"][0]) if c.get("logprobs") else 0) for c in answer["choices"]]


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_request_gets_the_bf16_answer_and_the_server_survives(servers, case):
    import httpx

    answers = {}
    for dtype, server in servers.items():
        with httpx.Client(base_url=server.base_url, timeout=600.0) as client:
            body = {"model": "smollm2", "max_tokens": 8, "temperature": 0.0, "ignore_eos": True, **HOSTILE[case]}
            response = client.post("/v1/completions", json=body)
            answers[dtype] = (response.status_code, response.json().get("error", {}).get("message")
                              if response.status_code >= 400 else shape_of(response.json()))
            assert client.get("/health").status_code == 200
            assert completion(client, "The capital of France is", max_tokens=4).status_code == 200
    print(case, answers)
    assert answers["nvfp4"] == answers["bfloat16"]


def test_soak_has_no_errors_and_bounded_memory(servers):
    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    from soak import soak

    server = servers["nvfp4"]
    report = soak(server.base_url, "smollm2", server.process.pid, duration_s=120, clients=3,
                  prompt_words=(4, 16, 64, 256))
    print(report)
    assert report.errors == 0, report.error_samples
    assert report.requests > 0
    assert report.kv_cache_usage_after == 0.0
    assert report.rss_growth_mib < 256, f"resident memory grew by {report.rss_growth_mib:.0f} MiB in 2 minutes"
