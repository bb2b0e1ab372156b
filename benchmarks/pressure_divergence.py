"""Preemption pressure with bf16 weights: NVFP4 against vLLM's bf16 cache over many workloads.

The harness of tests/test_reliability.py (SmolLM2-135M-Instruct, vLLM's CPU engine, greedy, block size 32, prefix
caching on, 5 log-probabilities a token): every workload runs with a free cache and under a cache of a few blocks
(`num_gpu_blocks_override`), once with vLLM's bf16 cache and once with NVFP4, and each pressured run is compared with
its own cache's free run. With bf16 weights vLLM's CPU GEMMs give bits that depend on the batch, so a request
recomputed beside others can take the other token at a near-tie, with either cache; one workload's counts are a
handful of such flips. This runs many workloads and pools them:

- per workload and pooled: requests diverged and their first-divergence positions, for both caches;
- the paired comparison over requests (exact McNemar: of the requests where one cache diverged and the other did
  not, how many were NVFP4's) and over workloads (sign test);
- the first-divergence positions compared (Mann-Whitney U, one-sided: are NVFP4's earlier?);
- the largest near-tie gap and drift (tests/test_reliability.py's Divergence).

    python benchmarks/pressure_divergence.py                                  # instructed workloads 0-15, 6 blocks, + 2
    python benchmarks/pressure_divergence.py --instructed 0-3 --no-extras     # four workloads (what results/ holds)
    python benchmarks/pressure_divergence.py --instructed 0-7 --blocks 5 7    # other pressure levels
    python benchmarks/pressure_divergence.py --raw runs.json                  # keep every run's outputs
    python benchmarks/pressure_divergence.py --from-raw runs.json --append benchmarks/results/reliability.md

Each cache needs one engine for the free runs and one per pressure level (the prefix cache is reset between
workloads). Four workloads took 13 minutes on 2 shared cores at load average 4-5; a pressured run costs about twice
a free one (requests run one or two at a time and are recomputed).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from provenance import emit, stamp  # noqa: E402
from test_reliability import (  # noqa: E402
    BATCHES, MAX_TOKENS, PRESSURE_BLOCKS, PROMPTS, STORIES, STORY_PRESSURE_BLOCKS, STORY_TOKENS, divergences,
    instructed, pressure_runs_together)


def parse_range(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


def workload_set(instructed_ids: list[int], levels: list[int], extras: bool) -> dict[str, tuple[list, int, int]]:
    workloads = {f"instructed {k} @{blocks}": (instructed(k), MAX_TOKENS, blocks)
                 for blocks in levels for k in instructed_ids}
    if extras:
        workloads["stories @8"] = ([STORIES], STORY_TOKENS, STORY_PRESSURE_BLOCKS)
        workloads["short @6"] = ([PROMPTS], MAX_TOKENS, PRESSURE_BLOCKS)
    assert BATCHES == instructed(0)
    return workloads


def binomial_tail(successes: int, trials: int) -> float:
    """P(X >= successes) for X ~ Binomial(trials, 1/2)."""
    return sum(math.comb(trials, k) for k in range(successes, trials + 1)) / 2**trials if trials else 1.0


def mann_whitney_less(xs: list[int], ys: list[int]) -> tuple[float, float]:
    """U of xs against ys (ties count one half) and its one-sided p that xs tend to be smaller (exact by
    enumeration of the pooled ranks' permutations would be large; normal approximation with tie correction)."""
    if not xs or not ys:
        return float("nan"), float("nan")
    u = sum((x > y) + 0.5 * (x == y) for x in xs for y in ys)
    n1, n2 = len(xs), len(ys)
    pooled = sorted(xs + ys)
    ties = sum(c**3 - c for c in (pooled.count(v) for v in set(pooled)))
    n = n1 + n2
    var = n1 * n2 / 12 * ((n + 1) - ties / (n * (n - 1)))
    if var <= 0:
        return u, 0.5
    z = (u - n1 * n2 / 2 + 0.5) / math.sqrt(var)  # small U: xs smaller; continuity-corrected
    return u, 0.5 * math.erfc(-z / math.sqrt(2))


def drifts(free: dict, pressured: dict) -> list[list[float]]:
    """Per request: |difference| of the best log-probability between the free and the pressured run, at every
    generated token before the request's first divergence (all of them where it did not diverge)."""
    out = []
    for ref, run in zip(free["outputs"], pressured["outputs"]):
        out.append([])
        for a, b, x, y in zip(ref["token_ids"], run["token_ids"], ref["logprobs"], run["logprobs"]):
            if a != b:
                break
            out[-1].append(abs(x[0][1] - y[0][1]))
    return out


def summary(values: list[float]) -> dict:
    ranked = sorted(values)
    return {"tokens": len(ranked), "moved": sum(v > 0 for v in ranked) / len(ranked),
            "mean": sum(ranked) / len(ranked), "p99": ranked[int(0.99 * (len(ranked) - 1))], "max": ranked[-1]}


def analyse(runs: dict[str, dict[str, dict]]) -> dict:
    rows, pairs = [], []
    for name, run in runs.items():
        own = divergences(run["auto/free"], run["auto/pressured"])
        nvfp4 = divergences(run["nvfp4/free"], run["nvfp4/pressured"])
        n = len(run["auto/free"]["outputs"])
        returning = [o["num_cached_tokens"] for o in run["auto/pressured"]["outputs"]]
        rows.append({"workload": name, "requests": n,
                     "preemptions": (run["auto/pressured"]["num_preemptions"],
                                     run["nvfp4/pressured"]["num_preemptions"]),
                     "free preemptions": (run["auto/free"]["num_preemptions"], run["nvfp4/free"]["num_preemptions"]),
                     "own": own, "nvfp4": nvfp4, "cached tokens under pressure": returning})
        own_ids, nv_ids = {d.request for d in own}, {d.request for d in nvfp4}
        pairs += [(r in own_ids, r in nv_ids) for r in range(n)]
    everything = [d for row in rows for d in row["own"] + row["nvfp4"]]
    own_positions = sorted(d.position for row in rows for d in row["own"])
    nv_positions = sorted(d.position for row in rows for d in row["nvfp4"])
    only_own = sum(a and not b for a, b in pairs)
    only_nv = sum(b and not a for a, b in pairs)
    more_nv = sum(len(r["nvfp4"]) > len(r["own"]) for r in rows)
    more_own = sum(len(r["nvfp4"]) < len(r["own"]) for r in rows)
    u, p_positions = mann_whitney_less(nv_positions, own_positions)
    per_request = {cache: [r for run in runs.values() for r in drifts(run[f"{cache}/free"], run[f"{cache}/pressured"])]
                   for cache in ("auto", "nvfp4")}
    drift = {cache: summary([v for r in per_request[cache] for v in r]) for cache in per_request}
    # Paired over requests: the largest move of each request's best log-probability before any divergence.
    largest = [(max(a, default=0.0), max(b, default=0.0)) for a, b in zip(per_request["auto"], per_request["nvfp4"])]
    drift["nvfp4_larger"] = sum(b > a for a, b in largest)
    drift["auto_larger"] = sum(a > b for a, b in largest)
    drift["p_sign"] = binomial_tail(drift["nvfp4_larger"], drift["nvfp4_larger"] + drift["auto_larger"])
    drift["over_0.1"] = {cache: sum(max(r, default=0.0) > 0.1 for r in per_request[cache]) for cache in per_request}
    only = [sum(x > 0.1 >= y for x, y in pairs) for pairs in (largest, [(b, a) for a, b in largest])]
    drift["p_over_0.1"] = binomial_tail(only[1], sum(only))  # exact McNemar over requests
    return {
        "drift": drift,
        "rows": rows, "requests": len(pairs), "own": len(own_positions), "nvfp4": len(nv_positions),
        "both": sum(a and b for a, b in pairs), "only_own": only_own, "only_nvfp4": only_nv,
        "p_mcnemar": binomial_tail(only_nv, only_nv + only_own),
        "workloads_more_nvfp4": more_nv, "workloads_more_own": more_own,
        "p_sign": binomial_tail(more_nv, more_nv + more_own),
        "own_positions": own_positions, "nvfp4_positions": nv_positions, "u": u, "p_positions": p_positions,
        "largest_gap": max((g for d in everything for g in d.gaps if g is not None), default=0.0),
        "gross": [d for d in everything if not d.near_tie],
        "largest_drift": max((d.drift for d in everything), default=0.0),
    }


def fmt(found) -> str:
    return ", ".join(f"{d.request} @ {d.position}" for d in found) or "—"


def table(result: dict, header: str) -> list[str]:
    lines = [header, "",
             "| workload | requests | preemptions bf16 / NVFP4 | bf16 cache diverged | NVFP4 diverged | bf16 first divergences (request @ token) | NVFP4 first divergences |",
             "| --- | ---: | ---: | ---: | ---: | --- | --- |"]
    for r in result["rows"]:
        lines.append(f"| {r['workload']} | {r['requests']} | {r['preemptions'][0]} / {r['preemptions'][1]} | "
                     f"{len(r['own'])} | {len(r['nvfp4'])} | {fmt(r['own'])} | {fmt(r['nvfp4'])} |")
    n = result["requests"]
    lines += [
        f"| **pooled** | {n} | | **{result['own']}** | **{result['nvfp4']}** | "
        f"positions {result['own_positions']} | positions {result['nvfp4_positions']} |", "",
        f"Requests where exactly one cache diverged: bf16 only {result['only_own']}, NVFP4 only {result['only_nvfp4']} "
        f"(both: {result['both']}); exact McNemar, one-sided P(NVFP4 only ≥ {result['only_nvfp4']}) = "
        f"{result['p_mcnemar']:.3f}. Workloads where NVFP4 diverged in more requests: {result['workloads_more_nvfp4']}, "
        f"fewer: {result['workloads_more_own']} (sign test, one-sided p = {result['p_sign']:.3f}). First-divergence "
        f"positions, NVFP4 against bf16: Mann-Whitney U = {result['u']}, one-sided p (NVFP4 earlier) = "
        f"{result['p_positions']:.3f}. Largest gap at a divergence {result['largest_gap']:.3f} nats, largest drift "
        f"before one {result['largest_drift']:.3f}; divergences beyond the 0.5-nat near-tie bound: "
        f"{len(result['gross'])}.", "",
        "Before any divergence: how far the pressured run's best log-probability moved from the free run's, per "
        "generated token:", "",
        "| cache | tokens compared | tokens that moved | mean |Δ| (nats) | 99th percentile | largest |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for cache, label in (("auto", "bf16"), ("nvfp4", "NVFP4")):
        d = result["drift"][cache]
        lines.append(f"| {label} | {d['tokens']} | {d['moved']:.1%} | {d['mean']:.4f} | {d['p99']:.3f} | "
                     f"{d['max']:.3f} |")
    d = result["drift"]
    lines += ["", f"Per request, the largest such move: larger with NVFP4 in {d['nvfp4_larger']} requests, larger with "
              f"bf16 in {d['auto_larger']} (sign test, one-sided p = {d['p_sign']:.2g} if neither cache's tended to be "
              f"larger); over 0.1 nats in {d['over_0.1']['auto']} requests with the bf16 cache and "
              f"{d['over_0.1']['nvfp4']} with NVFP4 (exact McNemar, one-sided p = {d['p_over_0.1']:.2g})."]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--instructed", default="0-15", help="instructed workload ids (test_reliability.instructed)")
    parser.add_argument("--blocks", type=int, nargs="+", default=[6], help="pressured cache sizes, in blocks")
    parser.add_argument("--no-extras", action="store_true", help="leave out the stories and short workloads")
    parser.add_argument("--raw", help="write every run's outputs to this JSON file")
    parser.add_argument("--from-raw", nargs="+", help="analyse the runs of earlier --raw files instead of running")
    parser.add_argument("--append", help="append the table to this markdown file")
    args = parser.parse_args()

    if args.from_raw:
        runs, stamps = {}, []
        for path in args.from_raw:
            raw = json.loads(Path(path).read_text())
            runs |= raw["runs"]
            stamps.append(f"{raw['stamp']}; {raw['seconds'] / 60:.0f} min")
        header = f"`python benchmarks/pressure_divergence.py` runs of {' and of '.join(stamps)}:"
    else:
        started = time.monotonic()
        workloads = workload_set(parse_range(args.instructed), args.blocks, not args.no_extras)
        runs = pressure_runs_together("bfloat16", workloads, timeout=6 * 3600)
        seconds = time.monotonic() - started
        header = f"`python benchmarks/pressure_divergence.py` ({stamp()}; {seconds / 60:.0f} min):"
        if args.raw:
            Path(args.raw).write_text(json.dumps({"stamp": stamp(), "seconds": seconds, "runs": runs}))
    emit(table(analyse(runs), header), args.append)

if __name__ == "__main__":
    main()
