"""Preemption pressure with bf16 weights: NVFP4 against vLLM's bf16 and FP8 caches over many workloads.

The harness of tests/test_reliability.py (SmolLM2-135M-Instruct, vLLM's CPU engine, greedy, block size 32, prefix
caching on, 5 log-probabilities a token): every workload runs with a free cache and under a cache of a few blocks
(`num_gpu_blocks_override`), once per KV-cache dtype (vLLM's bf16 cache, vLLM's FP8 cache, NVFP4), and each
pressured run is compared with its own cache's free run. With bf16 weights vLLM's CPU GEMMs give bits that depend on
the batch, so a request recomputed beside others can take the other token at a near-tie, with any cache; one
workload's counts are a handful of such flips. vLLM's FP8 cache (`kv_cache_dtype="fp8"`: E4M3, scale 1, on CPU it
needs AVX-512 or AMX) is the peer quantized cache: a cache that re-quantizes a recompute's slightly different keys
and values, as NVFP4 does, with a finer step. This runs many workloads and pools them:

- per workload and pooled: requests diverged, their first-divergence positions and gaps, for each cache;
- paired comparisons over requests (exact McNemar: of the requests where one cache diverged and the other did not,
  how many were each one's) and over workloads (sign test): FP8 and NVFP4 against bf16, NVFP4 against FP8;
- the first-divergence positions compared (Mann-Whitney U, one-sided: are the second cache's earlier?);
- the gaps at the divergences against the near-tie bound (tests/test_reliability.py's NEAR_TIE_NATS, Divergence);
- how far a recompute moves each cache's best log-probability before any divergence, and, for scale, how far each
  quantized cache's free run is from the bf16 cache's free run.

    python benchmarks/pressure_divergence.py                                  # instructed workloads 0-15, 6 blocks, + 2
    python benchmarks/pressure_divergence.py --instructed 0-5                 # instructed 0-5, the stories, short
    python benchmarks/pressure_divergence.py --caches auto nvfp4              # bf16 and NVFP4 only
    python benchmarks/pressure_divergence.py --instructed 0-7 --blocks 5 7    # other pressure levels
    python benchmarks/pressure_divergence.py --raw runs.json                  # keep every run's outputs
    python benchmarks/pressure_divergence.py --from-raw a.json b.json         # analyse earlier runs, pooled
    python benchmarks/pressure_divergence.py --requantization                 # the mechanism alone (seconds)

Each cache needs one engine for the free runs and one per pressure level (the prefix cache is reset between
workloads). Instructed 0-5 with the stories and short, three caches, took 9 minutes on 2 shared cores at load
average 2.5; a pressured run costs about twice a free one (requests run one or two at a time and are recomputed).
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
    BATCHES, CANDIDATES, MAX_TOKENS, NEAR_TIE_NATS, PRESSURE_BLOCKS, PROMPTS, STORIES, STORY_PRESSURE_BLOCKS,
    STORY_TOKENS, divergences, instructed, pressure_runs_together)


CACHES = {"auto": "bf16", "fp8": "FP8", "nvfp4": "NVFP4"}  # vLLM's kv_cache_dtype: label


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
    if not ranked:
        return {"tokens": 0, "moved": 0.0, "mean": 0.0, "p99": 0.0, "max": 0.0}
    return {"tokens": len(ranked), "moved": sum(v > 0 for v in ranked) / len(ranked),
            "mean": sum(ranked) / len(ranked), "p99": ranked[int(0.99 * (len(ranked) - 1))], "max": ranked[-1]}


def paired(a: list[bool], b: list[bool]) -> dict:
    """Exact McNemar over paired outcomes: requests where only b's cache diverged against only a's; one-sided p that
    b's diverge more, and two-sided."""
    only_a = sum(x and not y for x, y in zip(a, b))
    only_b = sum(y and not x for x, y in zip(a, b))
    trials = only_a + only_b
    return {"only_a": only_a, "only_b": only_b, "both": sum(x and y for x, y in zip(a, b)),
            "p_more": binomial_tail(only_b, trials),
            "p_two": min(1.0, 2 * min(binomial_tail(only_b, trials), binomial_tail(only_a, trials)))}


def largest_gap(d) -> float | None:
    """The larger of a divergence's two gaps; None if either run's pick is not among the other's candidates."""
    return None if None in d.gaps else max(d.gaps)


def analyse(runs: dict[str, dict[str, dict]]) -> dict:
    caches = [c for c in CACHES if all(f"{c}/pressured" in run for run in runs.values())]
    rows, diverged = [], {c: [] for c in caches}
    for name, run in runs.items():
        n = len(run["auto/free"]["outputs"])
        found = {c: divergences(run[f"{c}/free"], run[f"{c}/pressured"]) for c in caches}
        rows.append({"workload": name, "requests": n, "found": found,
                     "preemptions": {c: run[f"{c}/pressured"]["num_preemptions"] for c in caches},
                     "free preemptions": {c: run[f"{c}/free"]["num_preemptions"] for c in caches}})
        for c in caches:
            ids = {d.request for d in found[c]}
            diverged[c] += [r in ids for r in range(n)]
    positions = {c: sorted(d.position for row in rows for d in row["found"][c]) for c in caches}
    comparisons = {}
    for a, b in [("auto", q) for q in caches if q != "auto"] + ([("fp8", "nvfp4")] if {"fp8", "nvfp4"} <= set(caches)
                                                                 else []):
        if a not in caches:
            continue
        more = sum(len(r["found"][b]) > len(r["found"][a]) for r in rows)
        fewer = sum(len(r["found"][b]) < len(r["found"][a]) for r in rows)
        u, p_positions = mann_whitney_less(positions[b], positions[a])
        comparisons[(a, b)] = paired(diverged[a], diverged[b]) | {
            "workloads_more": more, "workloads_fewer": fewer, "p_sign": binomial_tail(more, more + fewer),
            "u": u, "p_positions": p_positions}
    # Before any divergence: how far the pressured run's best log-probability moved from its free run's.
    per_request = {c: [r for run in runs.values() for r in drifts(run[f"{c}/free"], run[f"{c}/pressured"])]
                   for c in caches}
    drift = {c: summary([v for r in per_request[c] for v in r]) for c in caches}
    largest = {c: [max(r, default=0.0) for r in per_request[c]] for c in caches}
    over = {c: [x > 0.1 for x in largest[c]] for c in caches}
    drift_tests = {q: paired(over["auto"], over[q]) for q in caches if q != "auto" and "auto" in caches}
    # The format's own error: each quantized cache's free run against the bf16 cache's free run, the best
    # log-probability's |difference| at every token before the two free runs part.
    format_error = {q: summary([v for run in runs.values() for r in drifts(run["auto/free"], run[f"{q}/free"])
                                for v in r]) for q in caches if q != "auto" and "auto" in caches}
    free_parted = {q: sum(len(divergences(run["auto/free"], run[f"{q}/free"])) for run in runs.values())
                   for q in format_error}
    gaps = {}
    for c in caches:
        found = [d for row in rows for d in row["found"][c]]
        known = [g for g in map(largest_gap, found) if g is not None]
        gaps[c] = {"largest": max(known, default=0.0), "outside": sum(largest_gap(d) is None for d in found),
                   "over_bound": sum(g is None or g > NEAR_TIE_NATS for g in map(largest_gap, found)),
                   "not_near_tie": sum(not d.near_tie for d in found),
                   "largest_drift": max((d.drift for d in found), default=0.0),
                   "sorted": sorted(known)}
    return {"caches": caches, "rows": rows, "requests": len(diverged[caches[0]]),
            "diverged": {c: sum(diverged[c]) for c in caches}, "positions": positions,
            "comparisons": comparisons, "drift": drift, "over_0.1": {c: sum(over[c]) for c in caches},
            "drift_tests": drift_tests, "format_error": format_error, "free_parted": free_parted, "gaps": gaps}


def number(x: float) -> str:
    return f"{x:.4f}".rstrip("0").rstrip(".") if x else "0"


def fmt(found) -> str:
    return ", ".join(f"{d.request} @ {d.position} ({' / '.join('—' if g is None else number(g) for g in d.gaps)})"
                     for d in found) or "—"


def table(result: dict, header: str) -> list[str]:
    caches = result["caches"]
    label = {c: CACHES[c] for c in caches}
    names = " / ".join(label[c] for c in caches)
    lines = [header, "",
             f"| workload | requests | preemptions {names} | " + " | ".join(f"{label[c]} diverged" for c in caches)
             + " | " + " | ".join(f"{label[c]}: request @ token (gaps free / pressured)" for c in caches) + " |",
             "| --- | ---: | ---: | " + "---: | " * len(caches) + "--- | " * len(caches)]
    lines[-1] = lines[-1].rstrip()
    for r in result["rows"]:
        lines.append(f"| {r['workload']} | {r['requests']} | {' / '.join(str(r['preemptions'][c]) for c in caches)} | "
                     + " | ".join(str(len(r["found"][c])) for c in caches) + " | "
                     + " | ".join(fmt(r["found"][c]) for c in caches) + " |")
    n = result["requests"]
    lines.append(f"| **pooled** | {n} | | " + " | ".join(f"**{result['diverged'][c]}**" for c in caches) + " | "
                 + " | ".join(f"tokens {', '.join(map(str, result['positions'][c])) or '—'}" for c in caches) + " |")
    lines.append("")
    for (a, b), t in result["comparisons"].items():
        lines.append(
            f"- {label[b]} against {label[a]}, paired over the requests: {label[b]} only {t['only_b']}, {label[a]} only "
            f"{t['only_a']}, both {t['both']}; exact McNemar, one-sided P({label[b]} only ≥ {t['only_b']}) = "
            f"{t['p_more']:.3g} (two-sided {t['p_two']:.3g}). Workloads where {label[b]} diverged in more requests: "
            f"{t['workloads_more']}, fewer: {t['workloads_fewer']} (sign test, one-sided p = {t['p_sign']:.3g}). "
            f"First-divergence positions: Mann-Whitney U = {t['u']}, one-sided p ({label[b]} earlier) = "
            f"{t['p_positions']:.3g}.")
    lines += ["", f"Gaps at the divergences (nats; the larger of the two, '—' in the table: the other run's pick not "
              f"among the {CANDIDATES} candidates kept), against the near-tie bound NEAR_TIE_NATS = {NEAR_TIE_NATS}:", "",
              "| cache | divergences | largest gap | picks outside the other run's candidates | gaps over the bound | not near-ties (gap or drift over the bound) | largest drift before one | gaps, sorted |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for c in caches:
        g = result["gaps"][c]
        lines.append(f"| {label[c]} | {result['diverged'][c]} | {number(g['largest']) if g['sorted'] else '—'} | {g['outside']} | "
                     f"{g['over_bound']} | {g['not_near_tie']} | {g['largest_drift']:.3f} | "
                     f"{', '.join(map(number, g['sorted'])) or '—'} |")
    lines += ["", "Before any divergence: how far the pressured run's best log-probability moved from its free run's, "
              "per generated token (and, per request, how many moved by more than 0.1 nats at some token):", "",
              "| cache | tokens compared | tokens that moved | mean \\|Δ\\| (nats) | 99th percentile | largest | requests over 0.1 nats |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for c in caches:
        d = result["drift"][c]
        lines.append(f"| {label[c]} | {d['tokens']:,} | {d['moved']:.1%} | {d['mean']:.4f} | {d['p99']:.3f} | "
                     f"{d['max']:.3f} | {result['over_0.1'][c]} of {n} |")
    if result["drift_tests"]:
        lines += ["", "Requests over 0.1 nats, paired with the bf16 cache's (exact McNemar): " + "; ".join(
            f"{label[q]} only {t['only_b']}, bf16 only {t['only_a']}, one-sided p = {t['p_more']:.2g}"
            for q, t in result["drift_tests"].items()) + "."]
    if result["format_error"]:
        lines += ["", "The format's own error, no pressure: each quantized cache's free run against the bf16 cache's "
                  "free run, the best log-probability's |difference| per token before the two part:", "",
                  "| cache | tokens compared | mean \\|Δ\\| (nats) | 99th percentile | largest | requests whose free run parts from bf16's |",
                  "| --- | ---: | ---: | ---: | ---: | ---: |"]
        for q, d in result["format_error"].items():
            lines.append(f"| {label[q]} | {d['tokens']:,} | {d['mean']:.4f} | {d['p99']:.3f} | {d['max']:.3f} | "
                         f"{result['free_parted'][q]} of {n} |")
    return lines


def requantization(fractions: tuple[float, ...] = (0.05, 0.3)) -> list[str]:
    """The mechanism in isolation: SmolLM2's bf16 keys and values (every layer's k_proj and v_proj outputs over
    BATCHES' prompts, through transformers), a last-bit perturbation (±1 bf16 ulp on a random fraction of the
    elements, as a recompute's GEMM may give), and how far that moves what each cache stores: bf16 as is, FP8 E4M3
    with scale 1 (vLLM's CPU cache) and NVFP4 with global scale 1 (reference encode/decode, group max / 6)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_nvfp4_plugin.reference import nvfp4_decode, nvfp4_encode
    from vllm_nvfp4_plugin.tools.models import smollm2_path

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path())
    model = AutoModelForCausalLM.from_pretrained(smollm2_path(), dtype=torch.bfloat16)
    rows = []
    with torch.no_grad():
        for prompt in [p for batch in BATCHES for p in batch]:
            hidden = model(tokenizer(prompt, return_tensors="pt").input_ids, output_hidden_states=True).hidden_states
            for layer, h in zip(model.model.layers, hidden):
                x = layer.input_layernorm(h)[0]
                rows += [layer.self_attn.k_proj(x).reshape(-1, 64), layer.self_attn.v_proj(x).reshape(-1, 64)]
    x = torch.cat(rows)
    stores = {"bf16": lambda t: t, "FP8": lambda t: t.to(torch.float8_e4m3fn).float(),
              "NVFP4": lambda t: nvfp4_decode(*nvfp4_encode(t, 1.0), 1.0)}
    lines = [f"Last-bit perturbations re-quantized ({x.numel():,} key (before the rotary embedding) and value elements "
             "of SmolLM2, bf16 weights, BATCHES' prompts; "
             "each cache's stored value after the perturbation against before; RMS relative to bf16's):", "",
             "| perturbed | cache | elements whose stored value changed | mean \\|Δ\\| | RMS Δ | RMS Δ / bf16's |",
             "| ---: | --- | ---: | ---: | ---: | ---: |"]
    for fraction in fractions:
        flip = (torch.rand(x.shape) < fraction) & (x != 0)
        sign = torch.where(torch.rand(x.shape) < 0.5, 1, -1).to(torch.int16)
        y = torch.where(flip, x.view(torch.int16) + sign, x.view(torch.int16)).view(torch.bfloat16)
        base = None
        for name, store in stores.items():
            d = store(x.float()) - store(y.float())
            rms = d.pow(2).mean().sqrt().item()
            base = base or rms
            lines.append(f"| {fraction:.0%} | {name} | {(d != 0).float().mean().item():.2%} | "
                         f"{d.abs().mean().item():.2e} | {rms:.2e} | {rms / base:.1f} |")
        scales = [nvfp4_encode(t.float(), 1.0)[1].view(torch.uint8) for t in (x, y)]
        lines.append(f"| {fraction:.0%} | NVFP4 group scales | {(scales[0] != scales[1]).float().mean().item():.2%} "
                     "| | | |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--instructed", default="0-15", help="instructed workload ids (test_reliability.instructed)")
    parser.add_argument("--blocks", type=int, nargs="+", default=[6], help="pressured cache sizes, in blocks")
    parser.add_argument("--no-extras", action="store_true", help="leave out the stories and short workloads")
    parser.add_argument("--raw", help="write every run's outputs to this JSON file")
    parser.add_argument("--from-raw", nargs="+", help="analyse the runs of earlier --raw files instead of running")
    parser.add_argument("--caches", nargs="+", default=list(CACHES), choices=list(CACHES),
                        help="KV-cache dtypes to run (auto: vLLM's bf16 cache under bf16 weights)")
    parser.add_argument("--append", help="append the table to this markdown file")
    parser.add_argument("--requantization", action="store_true",
                        help="only the re-quantization of last-bit perturbations of SmolLM2's keys and values")
    args = parser.parse_args()

    if args.requantization:
        emit(requantization(), args.append)
        return

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
        runs = pressure_runs_together("bfloat16", workloads, timeout=6 * 3600, caches=tuple(args.caches))
        seconds = time.monotonic() - started
        header = f"`python benchmarks/pressure_divergence.py` ({stamp()}; {seconds / 60:.0f} min):"
        if args.raw:
            Path(args.raw).write_text(json.dumps({"stamp": stamp(), "seconds": seconds, "runs": runs}))
    emit(table(analyse(runs), header), args.append)

if __name__ == "__main__":
    main()
