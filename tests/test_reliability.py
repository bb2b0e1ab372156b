"""Reliability of the NVFP4 cache under pressure, on vLLM's CPU engine with SmolLM2-135M-Instruct.

Preemption and eviction: a KV cache of a few blocks makes vLLM preempt running requests (their blocks are freed and
handed to others) and recompute them later as a prefill of prompt + generated tokens, and evict prefix-cache blocks
that a later request then recomputes. A recompute's bits may differ from decode's, for an unquantized cache as for
NVFP4, so exact equality with an unpressured run is not the bar. The bar: under the same pressure NVFP4 diverges
from its unpressured run no more than vLLM's own cache does (count and first-divergence positions), and every
divergence is a near-tie (each run's pick was within NEAR_TIE_NATS of the other run's best there). Two
configurations: fp32 weights with oneDNN capped at AVX2, which keep batch composition out of the bits (vLLM's own
cache is then fp32), and bf16 weights with vLLM's bf16 cache, whose batch-dependent GEMMs make divergences happen.
With bf16 weights the bar is not met (NVFP4 diverges more on workloads preempted mid-generation); that test is a
strict expected failure.
A request that read a stale, freed or foreign page would diverge grossly; a planted foreign page shows the check
catches that.

Serving: clients that disconnect mid-stream, requests vLLM must refuse, and a short soak (benchmarks/soak.py).
"""

import json
import os
import random
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
# alike); bf16 weights (BF16_WORKLOADS, benchmarks/pressure_divergence.py, PROMPTS), the bf16 cache's divergences
# picked a token within 0.25 nats of the other run's best, vLLM's FP8 cache's and NVFP4's within 0.5, the chosen
# tokens' log-probabilities up to 0.43 nats apart before it. bf16 logits move in steps of 0.0625 or 0.125 nats there:
# a gap is a whole number of steps plus float32 noise (a 0.5 comes out 0.49999994 or 0.50000006), so the bound takes
# up to four steps with that noise allowed. The planted foreign page's first divergence picks a token outside the
# other run's 5 best.
NEAR_TIE_NATS = 0.5 + 1e-3
# oneDNN capped at AVX2 makes vLLM's fp32 CPU linears row-invariant (tests/test_serving.py): a request's tokens do
# not depend on which others share its batch, so what differs under pressure is the recompute alone.
SERVE_ENV = {"ONEDNN_MAX_CPU_ISA": "AVX2", "VLLM_CPU_KVCACHE_SPACE": "1"}


def engine_env(weights: str) -> dict[str, str]:
    """SERVE_ENV for an engine of these weights. The AVX2 cap is for fp32's row invariance only: bf16 GEMMs want
    AVX-512's bf16 units, and on a CPU with AMX, under the cap, vLLM's bf16 attention runs AMX tiles that nothing
    asked Linux for (oneDNN requests the tile state, the cap stops it) and the worker dies on its first step."""
    return SERVE_ENV if weights == "float32" else {k: v for k, v in SERVE_ENV.items() if k != "ONEDNN_MAX_CPU_ISA"}


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
# More workloads of BATCHES' shape, for the comparison with bf16 weights: an instruction of two full blocks (64-66
# tokens) with its task, four requests; four of another instruction, which evict the first one's blocks under
# pressure; four more of the first instruction, which read it recomputed.
INSTRUCTIONS = {
    "storyteller": (STORYTELLER, "Write a short story about a {} who"),
    "teacher": (TEACHER, "Explain to a {} why the sea is salty."),
    "cook": ("You are a friendly home cook who writes for busy families. Every recipe you describe uses what most "
             "kitchens already have, takes less than forty minutes, and says how to tell when each step is done. Use "
             "plain words, name every pot and pan, and end with one way to use the leftovers the next day. ",
             "Describe a simple dinner for a {}."),
    "guide": ("You are an experienced travel guide who knows every old street of the city. Every plan you give starts "
              "early in the morning, mixes one famous sight with two quiet places, and leaves time for a long lunch. "
              "Use plain words, give walking times between stops, and end with a good place to watch the sunset. ",
              "Plan a day in the city for a {}."),
    "historian": ("You are a historian who loves the everyday lives of ordinary people. Every answer you give "
                  "describes one real object, the people who made it and the people who used it, and how it changed "
                  "over the years. Use plain words, no dates without a story, and end with something we still do the "
                  "same way. ", "Tell a {} how bread was made long ago."),
    "coach": ("You are a running coach for people who have never run before. Every plan you give always starts with "
              "walking, adds a little running each week, and names one sign that the body needs a rest day. Use plain "
              "words and short steps, never promise fast results, and end with one kind sentence about keeping "
              "going. ", "Give a {} a plan to run for thirty minutes."),
    "gardener": ("You are a gardener who grows food in small spaces: balconies, window boxes and shared yards. Every "
                 "answer you give says which pot to use, how much sun and water the plant needs, and what usually "
                 "goes wrong. Use plain words, one short list of tools at most, and end with the first step. ",
                 "Tell a {} how to grow tomatoes."),
    "letters": ("You are a letter writer who helps people say thank you. Every letter you write names the gift or the "
                "help, says how it changed the writer's week, and recalls one shared moment. Use plain words and a "
                "warm tone, keep it under one page, and end with a warm wish for the reader and their family. ",
                "Write a thank-you note from a {}."),
}
SUBJECTS = WHO + ("nurse", "astronaut", "fisherman", "librarian", "dragon", "grandmother", "firefighter", "musician")


def instructed(k: int) -> list[list[str]]:
    """The k-th instructed workload; 0 is BATCHES. Instruction k mod 8 around instruction k + 3 mod 8, twelve
    subjects drawn with seed k."""
    if k == 0:
        return BATCHES
    names = list(INSTRUCTIONS)
    (first, task), (between, other_task) = INSTRUCTIONS[names[k % 8]], INSTRUCTIONS[names[(k + 3) % 8]]
    who = random.Random(k).sample(SUBJECTS, 12)
    return [[first + task.format(w) for w in who[:4]], [between + other_task.format(w) for w in who[4:8]],
            [first + task.format(w) for w in who[8:]]]
# The stories: 16 requests of 96 tokens in an 8-block cache (7 usable; a request takes up to 4).
STORIES = [f"Write a short story about a {who} who" for who in WHO]
STORY_TOKENS = 96
STORY_PRESSURE_BLOCKS = 8


def generate(kv_cache_dtype: str, blocks: int | None, model: Path | None = None, tensor_parallel_size: int = 1,
             dtype: str = "float32", timeout: float = 1500, **job_options) -> dict:
    llm = {"kv_cache_dtype": kv_cache_dtype, "dtype": dtype, "block_size": BLOCK_SIZE, "seed": 0,
           "max_model_len": MAX_MODEL_LEN, "enforce_eager": True, "kv_cache_memory_bytes": 64 << 20,
           "disable_log_stats": False, "enable_prefix_caching": True}
    if blocks is not None:
        llm["num_gpu_blocks_override"] = blocks
    env = os.environ | engine_env(dtype) | {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1",
                                            "TRANSFORMERS_OFFLINE": "1"}
    if tensor_parallel_size > 1:  # one core a rank, the ranks in processes of vLLM's mp executor
        llm |= {"tensor_parallel_size": tensor_parallel_size, "distributed_executor_backend": "mp"}
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(cpu) for cpu in ALLOWED_CPUS[:tensor_parallel_size])
    job = {"model": str(model or smollm2_path()), "llm": llm, "max_tokens": MAX_TOKENS, "batches": [PROMPTS],
           "logprobs": CANDIDATES, "ignore_eos": True, **job_options}
    return run_job(job, env, timeout=timeout)


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
        return all(g is not None and g <= NEAR_TIE_NATS for g in self.gaps) and self.drift <= NEAR_TIE_NATS


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


def pressure_runs_together(weights: str, workloads: dict[str, tuple[list, int, int]], timeout: float = 1500,
                           caches: tuple[str, ...] = ("auto", "nvfp4")) -> dict[str, dict[str, dict]]:
    """`pressure_runs` for many workloads (name: batches, tokens generated, blocks of the pressured cache) with few
    engines: per cache (`caches`: kv_cache_dtype values) one engine runs every workload free and one per pressure
    level runs that level's workloads, vLLM's prefix cache reset between workloads (tests/vllm_jobs.py).
    {name: {"auto/free": run, ...}}"""
    runs = {name: {} for name in workloads}
    for cache in caches:
        for blocks in [None, *sorted({w[2] for w in workloads.values()})]:
            mode = "free" if blocks is None else "pressured"
            names = [n for n, w in workloads.items() if blocks in (None, w[2])]
            distinct = {}  # a free run serves every pressure level of the same batches
            for name in names:
                distinct.setdefault(json.dumps(workloads[name][:2]), []).append(name)
            result = generate(cache, blocks, dtype=weights, timeout=timeout,
                              workloads=[{"batches": batches, "max_tokens": tokens}
                                         for batches, tokens in map(json.loads, distinct)])
            for same, run in zip(distinct.values(), result["workloads"]):
                for name in same:
                    runs[name][f"{cache}/{mode}"] = run | {"kv_tokens": result["kv_tokens"]}
    return runs


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


# bf16 weights: the instructed workloads 0-5 and the stories, 88 requests a cache (benchmarks/pressure_divergence.py
# runs more of them).
BF16_WORKLOADS = {**{f"instructed {k}": (instructed(k), MAX_TOKENS, PRESSURE_BLOCKS) for k in range(6)},
                  "stories": ([STORIES], STORY_TOKENS, STORY_PRESSURE_BLOCKS)}


@pytest.fixture(scope="module")
def bf16_runs() -> dict[str, dict[str, dict]]:
    """bf16 weights, vLLM's bf16 cache against NVFP4, each workload. The GEMMs' bits depend on the batch, so a
    request recomputed beside other requests may take the other path at a near-tie, with either cache."""
    return pressure_runs_together("bfloat16", BF16_WORKLOADS)


def bf16_divergences(bf16_runs) -> tuple[list[Divergence], list[Divergence]]:
    own, nvfp4 = [], []
    for workload, runs in bf16_runs.items():
        print(workload)
        found = both_caches(runs)
        own += found[0]
        nvfp4 += found[1]
    return own, nvfp4


def test_under_pressure_with_bf16_weights_no_divergence_reads_a_wrong_page(bf16_runs):
    # Preemption and eviction happen; the bf16 cache's divergences are near-ties; at NVFP4's first divergences at
    # least one run's pick is among the other run's CANDIDATES best. A wrong page makes neither be: a foreign page
    # planted at step 3 of instructed 0 and 2 with bf16 weights diverged at token 2 with neither pick among the
    # other's 5 best. A recompute alone can push one pick out: its bf16 GEMMs give other bits, which round to other
    # E2M1 codes (stories, request 2, token 55, on a Xeon with AMX: the free run's " you" at -0.63 is not among the
    # pressured run's 5 best, whose " day" at -1.40 is the free run's 4th at -3.38; a bf16 cache there has " loved"
    # -1.26, " you" -1.64). The near-tie bound for NVFP4 is part of the bar below, which it does not meet.
    for workload, runs in bf16_runs.items():
        assert_preempts(runs, BF16_WORKLOADS[workload][2])
        if workload.startswith("instructed"):
            assert_evicts(runs)
    own, nvfp4 = bf16_divergences(bf16_runs)
    for divergence in own:
        assert divergence.near_tie, divergence
    for divergence in nvfp4:
        assert divergence.gaps != (None, None), divergence


# Measured (benchmarks/results/reliability.md), instructed 0-5: NVFP4 diverged in 12 of 72 requests, the bf16 cache in
# 2 (exact McNemar over the requests, one-sided p = 0.003), NVFP4's largest gap 0.5 nats against 0.25. Over 30
# workloads (benchmarks/pressure_divergence.py, 360 requests) NVFP4 34, the bf16 cache 18 (p = 0.011) and vLLM's FP8
# cache 22; before any divergence a recompute moves the best log-probability by more than 0.1 nats in 136, 12 and 56
# requests. A systematic excess, not tie-flip noise: the bar is not met with bf16 weights.
XFAIL_REASON = ("with bf16 weights NVFP4 under pressure diverges in more requests than vLLM's bf16 cache "
                "on workloads preempted mid-generation (benchmarks/results/reliability.md)")


def diverged_by(found: list[Divergence], token: int) -> int:
    return sum(d.position <= token for d in found)


@pytest.mark.xfail(strict=True, reason=XFAIL_REASON)
def test_under_pressure_with_bf16_weights_nvfp4_diverges_no_more_than_bf16(bf16_runs):
    # The pressure bar, pooled over the workloads: by every generated token, no more NVFP4 requests have diverged
    # from their free run than bf16-cache requests (so no more in all, and none earlier in distribution), and every
    # NVFP4 divergence is a near-tie.
    own, nvfp4 = bf16_divergences(bf16_runs)
    print(f"pooled: bf16 cache {len(own)} at {sorted(d.position for d in own)}, "
          f"NVFP4 {len(nvfp4)} at {sorted(d.position for d in nvfp4)}")
    for token in range(STORY_TOKENS):
        assert diverged_by(nvfp4, token) <= diverged_by(own, token), token
    for divergence in nvfp4:
        assert divergence.near_tie, divergence


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
            started[dtype] = stack.enter_context(VllmServer(smollm2_path(), args, env=engine_env(weights),
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
