"""Reliability of the NVFP4 cache under pressure, on vLLM's CPU engine with SmolLM2-135M-Instruct.

Preemption and eviction: a KV cache of a few blocks makes vLLM preempt running requests (their blocks are freed and
handed to others) and recompute them later as a prefill of prompt + generated tokens, and evict prefix-cache blocks
that a later request then recomputes. A recompute's bits may differ from decode's, for an unquantized cache as for
NVFP4, so exact equality with an unpressured run is not the bar. The bar: under the same pressure NVFP4 diverges
from its unpressured run no more than vLLM's own cache does (count and first-divergence positions), and every
divergence is a near-tie (each run's pick was within NEAR_TIE_NATS of the other run's best there). Two
configurations: fp32 weights with oneDNN capped at AVX2, which keep batch composition out of the bits (vLLM's own
cache is then fp32), and bf16 weights with vLLM's bf16 cache, whose batch-dependent GEMMs make divergences happen.
A request that read a stale, freed or foreign page would diverge grossly; a planted foreign page shows the check
catches that.

Serving: clients that disconnect mid-stream, requests vLLM must refuse, and a short soak (benchmarks/soak.py).
"""

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from vllm_jobs import run_job

from vllm_nvfp4_plugin.tools.models import smollm2_path, tiny_llama_path

pytestmark = pytest.mark.e2e

MAX_TOKENS = 48
BLOCK_SIZE = 32  # vLLM's CPU attention takes multiples of 32
PRESSURE_BLOCKS = 6  # vLLM keeps one block back: 5 usable blocks of 32, one or two of BATCHES' requests at once
MAX_MODEL_LEN = 128
CANDIDATES = 5  # log-probabilities kept per generated token
# Bound of a near-tie. Measured here: fp32 weights, no request diverged under pressure (NVFP4 and fp32 caches
# alike); bf16 weights (WORKLOADS and PROMPTS), every divergence picked a token within 0.375 nats of the other run's
# best (bf16 logits move in steps of 0.125 there), the chosen tokens' log-probabilities up to 0.43 nats apart before
# it. The planted foreign page's first divergence picks a token outside the other run's 5 best.
NEAR_TIE_NATS = 0.5
# oneDNN capped at AVX2 makes vLLM's fp32 CPU linears row-invariant (tests/test_serving.py): a request's tokens do
# not depend on which others share its batch, so what differs under pressure is the recompute alone.
SERVE_ENV = {"ONEDNN_MAX_CPU_ISA": "AVX2", "VLLM_CPU_KVCACHE_SPACE": "1"}
ALLOWED_CPUS = sorted(os.sched_getaffinity(0))
WHO = ("cat", "robot", "sailor", "baker", "wizard", "farmer", "pilot", "poet",
       "doctor", "painter", "miner", "knight", "gardener", "teacher", "clown", "diver")
PROMPTS = [f"Write a short story about a {who} who" for who in WHO[:8]]
# Two instructions of over two blocks each. Batch 1 caches the storyteller's two blocks, batch 2's requests need the
# whole pressured cache and evict them, batch 3 comes back to the storyteller: the free run reads its blocks from
# the prefix cache, the pressured run recomputes them.
STORYTELLER = ("You are a careful storyteller. Every story you write has a clear beginning, a middle with one "
               "surprising turn, and an ending that looks back at the beginning. Use plain words, short sentences "
               "and no lists. Give every character a name and a wish, and let the weather change once before the "
               "very last line. ")
TEACHER = ("You are a patient science teacher. Every answer you give starts from something a child can see at home, "
           "names the idea behind it, and ends with one small experiment to try. Use plain words and no formulas. "
           "Keep each answer under two hundred words and never talk down to the reader, the child or the parent. ")
SHARED_PREFIX_TOKENS = 2 * BLOCK_SIZE  # the full blocks of each instruction (65 tokens)
BATCHES = [[STORYTELLER + prompt for prompt in PROMPTS[:4]],
           [TEACHER + f"Explain to a {who} why the sea is salty." for who in WHO[:4]],
           [STORYTELLER + prompt for prompt in PROMPTS[4:]]]
RETURNING = len(BATCHES[0]) + len(BATCHES[1])  # the first request back to the storyteller
# The stories: 16 requests of 96 tokens in an 8-block cache (7 usable; a request takes up to 4).
STORIES = [f"Write a short story about a {who} who" for who in WHO]
STORY_TOKENS = 96
STORY_PRESSURE_BLOCKS = 8


def generate(kv_cache_dtype: str, blocks: int | None, model: Path | None = None, tensor_parallel_size: int = 1,
             dtype: str = "float32", **job_options) -> dict:
    llm = {"kv_cache_dtype": kv_cache_dtype, "dtype": dtype, "block_size": BLOCK_SIZE, "seed": 0,
           "max_model_len": MAX_MODEL_LEN, "enforce_eager": True, "kv_cache_memory_bytes": 64 << 20,
           "disable_log_stats": False, "enable_prefix_caching": True}
    if blocks is not None:
        llm["num_gpu_blocks_override"] = blocks
    env = os.environ | SERVE_ENV | {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1",
                                    "TRANSFORMERS_OFFLINE": "1"}
    if dtype != "float32":  # the AVX2 cap is for fp32's row invariance; bf16 GEMMs want AVX-512's bf16 units
        env.pop("ONEDNN_MAX_CPU_ISA")
    if tensor_parallel_size > 1:  # one core a rank, the ranks in processes of vLLM's mp executor
        llm |= {"tensor_parallel_size": tensor_parallel_size, "distributed_executor_backend": "mp"}
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(cpu) for cpu in ALLOWED_CPUS[:tensor_parallel_size])
    job = {"model": str(model or smollm2_path()), "llm": llm, "max_tokens": MAX_TOKENS, "batches": [PROMPTS],
           "logprobs": CANDIDATES, "ignore_eos": True, **job_options}
    return run_job(job, env, timeout=1500)


@dataclass
class Divergence:
    request: int
    position: int  # first generated token that differs
    # There, in the reference run and in the pressured run: its best log-probability minus that of the other run's
    # pick (None: the other's pick is not among its CANDIDATES). A top-2 swap's gaps are the top-2 gaps.
    gaps: tuple[float | None, float | None]
    drift: float  # largest |difference| of the chosen token's log-probability over the tokens before it

    @property
    def near_tie(self) -> bool:
        return all(g is not None and g < NEAR_TIE_NATS for g in self.gaps) and self.drift < NEAR_TIE_NATS


def divergences(reference: dict, pressured: dict) -> list[Divergence]:
    found = []
    for r, (ref, out) in enumerate(zip(reference["outputs"], pressured["outputs"])):
        pos = next((k for k, (a, b) in enumerate(zip(ref["token_ids"], out["token_ids"])) if a != b), None)
        if pos is None:
            continue
        gaps = []
        for run, other in ((ref, out), (out, ref)):
            candidates = dict(map(tuple, run["logprobs"][pos]))
            pick = other["token_ids"][pos]
            gaps.append(max(candidates.values()) - candidates[pick] if pick in candidates else None)
        drift = max((abs(x[0][1] - y[0][1]) for x, y in zip(ref["logprobs"][:pos], out["logprobs"][:pos])),
                    default=0.0)
        found.append(Divergence(r, pos, tuple(gaps), drift))
    return found


def both_caches(runs: dict[str, dict]) -> tuple[list[Divergence], list[Divergence]]:
    """Divergences of vLLM's own cache and of NVFP4 under pressure, each from its own free run."""
    own = divergences(runs["auto/free"], runs["auto/pressured"])
    nvfp4 = divergences(runs["nvfp4/free"], runs["nvfp4/pressured"])
    n = len(runs["auto/free"]["outputs"])
    print(f"vLLM's own cache: {len(own)} of {n} diverged {own}\nnvfp4: {len(nvfp4)} of {n} diverged {nvfp4}")
    return own, nvfp4


WORKLOADS = {  # batches, tokens generated, blocks of the pressured cache
    "instructed": (BATCHES, MAX_TOKENS, PRESSURE_BLOCKS),
    "stories": ([STORIES], STORY_TOKENS, STORY_PRESSURE_BLOCKS),
}


def pressure_runs(weights: str, workload: str) -> dict[str, dict]:
    batches, max_tokens, blocks = WORKLOADS[workload]
    results = {f"{cache}/{mode}": generate(cache, None if mode == "free" else blocks, dtype=weights,
                                           batches=batches, max_tokens=max_tokens)
               for cache in ("auto", "nvfp4") for mode in ("free", "pressured")}
    for name, result in results.items():
        print(weights, workload, name, "preemptions:", result["num_preemptions"], "KV tokens:", result["kv_tokens"],
              "prefix-cache hits/queries:", result["counters"]["vllm:prefix_cache_hits"],
              result["counters"]["vllm:prefix_cache_queries"],
              "cached tokens per request:", [o["num_cached_tokens"] for o in result["outputs"]])
    return results


def assert_preempts(runs: dict[str, dict], blocks: int) -> None:
    for cache in ("auto", "nvfp4"):
        assert runs[f"{cache}/free"]["num_preemptions"] == 0
        assert runs[f"{cache}/pressured"]["num_preemptions"] > 0
        assert runs[f"{cache}/pressured"]["kv_tokens"] == blocks * BLOCK_SIZE


def assert_evicts(runs: dict[str, dict]) -> None:
    # vLLM's own account: the request back to the storyteller found its blocks in the free run's prefix cache
    # and none in the pressured one's, and the pressured run's prefix-cache hit rate is lower over the same
    # prompts (vLLM counts hits of requests that were never preempted only, so recomputes do not mask it).
    for cache in ("auto", "nvfp4"):
        free, pressured = runs[f"{cache}/free"], runs[f"{cache}/pressured"]
        assert free["outputs"][RETURNING]["num_cached_tokens"] == SHARED_PREFIX_TOKENS
        assert pressured["outputs"][RETURNING]["num_cached_tokens"] == 0
        hit_rate = {name: run["counters"]["vllm:prefix_cache_hits"] / run["counters"]["vllm:prefix_cache_queries"]
                    for name, run in (("free", free), ("pressured", pressured))}
        assert hit_rate["pressured"] < hit_rate["free"], hit_rate


@pytest.fixture(scope="module")
def runs() -> dict[str, dict]:
    return pressure_runs("float32", "instructed")


def test_pressure_preempts(runs):
    assert_preempts(runs, PRESSURE_BLOCKS)


def test_pressure_evicts_prefix_cache_blocks(runs):
    assert_evicts(runs)


def test_nvfp4_under_pressure_diverges_no_more_than_an_unquantized_cache(runs):
    # Batch 3 reads the storyteller's prefix as the pressured run recomputed it after eviction; it is held to the
    # same bar as the rest.
    own, nvfp4 = both_caches(runs)
    assert len(nvfp4) <= len(own)
    assert min((d.position for d in nvfp4), default=MAX_TOKENS) >= min((d.position for d in own), default=MAX_TOKENS)
    for divergence in own + nvfp4:
        assert divergence.near_tie, divergence


def test_a_foreign_page_is_a_gross_divergence(runs):
    planted = generate("nvfp4", None, batches=BATCHES, plant_foreign_block_after=3)
    found = divergences(runs["nvfp4/free"], planted)
    print("planted foreign page:", found)
    assert any(d.request == 0 and not d.near_tie for d in found), found


@pytest.fixture(scope="module")
def bf16_runs() -> dict[str, dict[str, dict]]:
    """bf16 weights, vLLM's bf16 cache against NVFP4, each workload. The GEMMs' bits depend on the batch, so a
    request recomputed beside other requests may take the other path at a near-tie, with either cache."""
    return {workload: pressure_runs("bfloat16", workload) for workload in WORKLOADS}


def test_under_pressure_with_bf16_weights_every_divergence_is_a_near_tie(bf16_runs):
    # Which cache diverges in more requests flips with the workload here (measured: the stories, bf16 3 of 16 and
    # NVFP4 none; the instructed batches, bf16 none and NVFP4 2 of 12), so the count is reported, not asserted: the
    # deterministic count bar is the fp32 test above.
    for workload, runs in bf16_runs.items():
        assert_preempts(runs, WORKLOADS[workload][2])
        if workload == "instructed":
            assert_evicts(runs)
        own, nvfp4 = both_caches(runs)
        for divergence in own + nvfp4:
            assert divergence.near_tie, (workload, divergence)


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
