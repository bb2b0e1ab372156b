"""Calibrate a model's NVFP4 KV cache and measure every mode in vLLM:

    python -m vllm_nvfp4_plugin.tools.calibrate MODEL [--out DIR]

1. Statistics: a bf16-cache engine runs calibration prompts (GSM8K questions from the end of the file, disjoint
   from the evaluation questions at its start) while the plugin's CPU backend shows it every layer's keys and
   values as the cache receives them (after RoPE): per-layer, per-channel |k| and |v| maxima, outlier channels.
2. Policies, per layer, from a sample of its queries, keys and values, the keys and values quantized by the
   reference encoder: for each store rule (nvfp4, nvfp4_4over6) and smoothing strength alpha (scales
   (channel max / median)^alpha per RoPE pair, powers of two; alpha 0 is no smoothing), the error of the attention
   logits q · (s ⊙ decode(encode(k / s))) against q · k, centred per query (softmax ignores a per-query constant),
   relative to the logits' own spread, and the values' relative squared error. "nvfp4 + smooth" takes each layer's
   best alpha under plain NVFP4; "nvfp4 auto" takes per layer the cheapest candidate (plain before 4over6, weaker
   smoothing before stronger) whose errors stay within `--error-budget` of the layer's best; "fp8 keys" keeps FP8
   E4M3 keys and "int8 keys" INT8 keys (one fp16 scale per token and head), each with the store rule of smaller
   error for each layer's values. The calibration files (format:
   vllm_nvfp4_plugin/kv_calibration.py) go to DIR.
3. Fidelity in vLLM: every mode, and vLLM's own FP8 cache, teacher-forced along the bf16 engine's greedy
   continuations of the evaluation questions (tools/fidelity.py): top-1 agreement, KL and perplexity against the bf16
   cache. `auto` is the page of most capacity among "nvfp4 auto", "fp8 keys" and "int8 keys" whose perplexity rises
   by at most `--ppl-budget` and whose top-1 is within `--top1-budget` of vLLM's FP8 K+V cache's; when none is, the
   one of least perplexity (vLLM gives a model's layers one page format, so the key format is the model's). Without
   the fidelity run, `auto` is "nvfp4 auto".
4. The KV capacity vLLM reports for a cache budget, from the page sizes.

Writes DIR/calibration_<policy>.json (engine input: `--additional-config '{"vllm_nvfp4_plugin":
{"kv_calibration": "DIR/calibration_auto.json"}}' --kv-cache-dtype nvfp4`), DIR/report.json, DIR/report.md and
DIR/frontier.png. Runs the engines in this process (it sets VLLM_ENABLE_V1_MULTIPROCESSING=0 itself).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from .. import kv_calibration, reference
from ..layout import NVFP4PageLayout

GSM8K = Path(__file__).resolve().parents[2] / "evals" / "data" / "test.jsonl"
SAMPLE_TOKENS = 4096  # keys and values kept per layer for the offline error estimates
OUTLIER_RATIO = 4.0  # a channel whose max |k| exceeds this many times its head's median channel max
SAMPLE_QUERIES = 256  # queries per layer for the logit errors
ALPHAS = (0.0, 0.25, 0.5, 0.75, 1.0)  # smoothing strengths tried; 0 is none
MODES = ("nvfp4", "nvfp4_4over6")
FP8_KEYS = "fp8 keys"
INT8_KEYS = "int8 keys"
KEY_FORMAT_OF = {FP8_KEYS: "fp8", INT8_KEYS: "int8"}  # policies whose pages keep byte keys; the others NVFP4 keys


def gsm8k_prompts(first: int, count: int) -> list[str]:
    rows = [json.loads(line) for line in GSM8K.read_text().splitlines()]
    if first < 0:
        first = len(rows) + first
    return [f"Question: {row['question']}\nAnswer:" for row in rows[first:first + count]]


class LayerStats:
    """Per-layer channel maxima of keys and values and a sample of their rows, from the observer hook."""

    def __init__(self):
        self.key_amax: dict[int, torch.Tensor] = {}
        self.value_amax: dict[int, torch.Tensor] = {}
        self.keys: dict[int, list[torch.Tensor]] = {}
        self.values: dict[int, list[torch.Tensor]] = {}
        self.queries: dict[int, list[torch.Tensor]] = {}

    def observe_query(self, layer_name: str, query: torch.Tensor) -> None:
        from vllm.model_executor.models.utils import extract_layer_index

        i = extract_layer_index(layer_name)
        kept = sum(len(t) for t in self.queries.get(i, []))
        if kept < SAMPLE_QUERIES:
            self.queries.setdefault(i, []).append(query[:SAMPLE_QUERIES - kept].detach().float().cpu())

    def observe(self, layer_name: str, key: torch.Tensor, value: torch.Tensor) -> None:
        from vllm.model_executor.models.utils import extract_layer_index

        i = extract_layer_index(layer_name)
        k, v = key.detach().float().cpu(), value.detach().float().cpu()
        k_amax, v_amax = k.abs().amax(0), v.abs().amax(0)
        self.key_amax[i] = torch.maximum(self.key_amax[i], k_amax) if i in self.key_amax else k_amax
        self.value_amax[i] = torch.maximum(self.value_amax[i], v_amax) if i in self.value_amax else v_amax
        kept = sum(len(t) for t in self.keys.get(i, []))
        if kept < SAMPLE_TOKENS:
            self.keys.setdefault(i, []).append(k[:SAMPLE_TOKENS - kept])
            self.values.setdefault(i, []).append(v[:SAMPLE_TOKENS - kept])


def restore_fp8(x: torch.Tensor) -> torch.Tensor:
    """decode(encode(x)) of FP8 keys at the layer's default global scale 1."""
    return reference.fp8_key_decode(reference.fp8_key_encode(x, 1.0), 1.0)


def restore_int8(x: torch.Tensor) -> torch.Tensor:
    """decode(encode(x)) of INT8 keys at the layer's default global scale 1."""
    return reference.int8_key_decode(*reference.int8_key_encode(x, 1.0), 1.0)


def restore(x: torch.Tensor, four_over_six: bool, scales: torch.Tensor | None = None) -> torch.Tensor:
    """s · decode(encode(x / s)) of `[tokens, heads, head]` (s = 1 without scales)."""
    s = torch.ones(x.shape[1:]) if scales is None else scales
    packed, sf = reference.nvfp4_encode(x / s, 1.0, four_over_six)
    return reference.nvfp4_decode(packed, sf, 1.0) * s


def logit_error(queries: torch.Tensor, keys: torch.Tensor, restored: torch.Tensor) -> float:
    """Mean squared error of q · k over every (query, key) pair, each query's errors centred (softmax ignores a
    per-query constant), relative to the centred logits' own mean square. Queries `[n, Hq, D]` attend to the keys
    `[m, H, D]` of KV head h // (Hq / H)."""
    group = queries.shape[1] // keys.shape[1]
    q = queries.unflatten(1, (keys.shape[1], group))  # [n, H, g, D]
    exact = torch.einsum("nhgd,mhd->nhgm", q, keys)
    error = torch.einsum("nhgd,mhd->nhgm", q, restored) - exact
    error = error - error.mean(-1, keepdim=True)
    exact = exact - exact.mean(-1, keepdim=True)
    return float(error.square().mean() / exact.square().mean().clamp(min=1e-30))


def smoothing_scales(key_amax: torch.Tensor, alpha: float) -> torch.Tensor:
    """Power-of-two scales per RoPE pair: (pair max / the head's median channel max)^alpha."""
    return kv_calibration.rope_pair_power_of_two_scales(key_amax, key_amax.median(-1).values.clamp(min=1e-6), alpha)


def layer_candidates(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     key_amax: torch.Tensor) -> list[dict]:
    """Every (store rule, alpha) with its errors, cheapest first: by alpha, then plain before 4over6."""
    rows = []
    value_error = {mode: float((restore(values, mode == "nvfp4_4over6") - values).square().sum()
                               / values.square().sum().clamp(min=1e-30)) for mode in MODES}
    for alpha in ALPHAS:
        scales = smoothing_scales(key_amax, alpha) if alpha else None
        for mode in MODES:
            rows.append({"mode": mode, "alpha": alpha,
                         "logit_error": logit_error(queries, keys, restore(keys, mode == "nvfp4_4over6", scales)),
                         "value_error": value_error[mode]})
    return rows


def choose_auto(candidates: list[dict], budget: float) -> dict:
    """The cheapest candidate whose logit and value errors are within (1 + budget) of the best ones."""
    best_logit = min(c["logit_error"] for c in candidates)
    best_value = min(c["value_error"] for c in candidates)
    for c in candidates:
        if c["logit_error"] <= best_logit * (1 + budget) and c["value_error"] <= best_value * (1 + budget):
            return c
    return min(candidates, key=lambda c: c["logit_error"])


def capacity_tokens(num_layers: int, num_kv_heads: int, head_size: int, budget_bytes: int, block_size: int,
                    bytes_per_token_per_head: float) -> int:
    """Tokens vLLM fits in `budget_bytes`: whole blocks of every layer's pages."""
    per_block = num_layers * num_kv_heads * block_size * bytes_per_token_per_head
    return int(budget_bytes // per_block) * block_size


def choose_page(by_name: dict, ppl_budget: float, top1_budget: float) -> str:
    """The policy of most capacity among the pages `auto` chooses from whose perplexity rises by at most
    `ppl_budget` and whose top-1 is within `top1_budget` of vLLM's FP8 K+V cache's; else the one of least
    perplexity."""
    pages = sorted(("nvfp4 auto", *KEY_FORMAT_OF), key=lambda name: -by_name[name]["capacity_tokens"])
    top1_floor = by_name["fp8 (vLLM)"]["top1"] - top1_budget
    within = [name for name in pages
              if by_name[name]["ppl_increase"] <= ppl_budget and by_name[name]["top1"] >= top1_floor]
    return within[0] if within else min(pages, key=lambda name: by_name[name]["perplexity"])


def write_markdown(path: Path, report: dict) -> None:
    lines = [f"# KV-cache modes of {report['model']}", "",
             f"{report['fidelity_positions']} decode positions ({report['eval_prompts']} GSM8K questions, bf16 greedy "
             f"continuations up to {report['continuation_tokens']} tokens), against the bf16 cache. Capacity: tokens "
             f"in {report['budget_bytes'] >> 20} MiB of cache as vLLM sizes it.", "",
             "| mode | capacity (tokens) | × bf16 | top-1 | mean KL | PPL | PPL Δ |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for row in report["modes"]:
        name = f"auto ({row['policy']})" if row["mode"] == "auto" else row["mode"]
        lines.append(f"| {name} | {row['capacity_tokens']} | {row['capacity_ratio']:.2f} | "
                     f"{row.get('top1', float('nan')):.3f} | {row.get('mean_kl', float('nan')):.4f} | "
                     f"{row.get('perplexity', float('nan')):.4f} | {100 * row.get('ppl_increase', float('nan')):+.2f}% |")
    lines += ["", "| layer | key max | value max | outlier channels | nvfp4 logit error | nvfp4 auto | "
              "its logit error | fp8 keys logit error | int8 keys logit error |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for layer in report["layers"]:
        auto, plain = layer["auto"], layer["candidates"][0]
        lines.append(f"| {layer['layer']} | {layer['key_max']:.1f} | {layer['value_max']:.1f} | "
                     f"{len(layer['outlier_channels'])} | {plain['logit_error']:.2e} | {auto['mode']}, alpha "
                     f"{auto['alpha']} | {auto['logit_error']:.2e} | {layer['fp8_key_logit_error']:.2e} | "
                     f"{layer['int8_key_logit_error']:.2e} |")
    path.write_text("\n".join(lines) + "\n")


def write_plot(path: Path, report: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for row in report["modes"]:
        if "perplexity" not in row:
            continue
        ax1.scatter(row["capacity_ratio"], 100 * row["ppl_increase"])
        ax1.annotate(row["mode"], (row["capacity_ratio"], 100 * row["ppl_increase"]), fontsize=8)
        ax2.scatter(row["capacity_ratio"], row["top1"])
        ax2.annotate(row["mode"], (row["capacity_ratio"], row["top1"]), fontsize=8)
    ax1.set(xlabel="KV capacity (× bf16)", ylabel="PPL increase vs bf16 KV (%)", title=report["model"])
    ax2.set(xlabel="KV capacity (× bf16)", ylabel="top-1 agreement with bf16 KV")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="model folder or name vLLM loads")
    parser.add_argument("--out", default="kv_calibration", help="output folder (default: ./kv_calibration)")
    parser.add_argument("--calibration-prompts", type=int, default=16)
    # 100 questions: a 1% perplexity difference is a few hundredths of a nat a token, and 20 questions (about 400
    # positions on SmolLM2) moved it by several points between runs.
    parser.add_argument("--eval-prompts", type=int, default=100, help="GSM8K questions the modes are measured on")
    parser.add_argument("--continuation-tokens", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--budget-mib", type=int, default=64, help="KV cache budget of the engines and the capacity")
    parser.add_argument("--error-budget", type=float, default=0.05,
                        help="auto: relative slack over the layer's best key/value error (default 0.05)")
    parser.add_argument("--ppl-budget", type=float, default=0.01,
                        help="auto: largest perplexity increase over bf16 that keeps NVFP4 keys (default 0.01)")
    parser.add_argument("--top1-budget", type=float, default=0.01,
                        help="auto: largest top-1 shortfall against vLLM's FP8 K+V cache a page may have (default 0.01)")
    parser.add_argument("--no-fidelity", action="store_true", help="statistics and policies only")
    args = parser.parse_args(argv)
    if args.calibration_prompts <= 0 or args.eval_prompts <= 0:
        parser.error("--calibration-prompts and --eval-prompts must be positive")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from tqdm import tqdm
    from vllm import LLM, SamplingParams

    from ..vllm_adapter.cpu_backend import KeyValueObserver
    from .fidelity import teacher_forced_comparison

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    engine = {"max_model_len": args.max_model_len, "kv_cache_memory_bytes": args.budget_mib << 20,
              "dtype": "bfloat16", "enforce_eager": True}
    candidates_order = ["nvfp4", "nvfp4_4over6", "nvfp4 + smooth", "nvfp4 auto", FP8_KEYS, INT8_KEYS]
    progress = tqdm(total=1 + (0 if args.no_fidelity else 2 + len(candidates_order)), desc="calibrate", unit="engine")

    stats = LayerStats()
    KeyValueObserver.observe, KeyValueObserver.observe_query = stats.observe, stats.observe_query
    try:
        llm = LLM(args.model, kv_cache_dtype="auto", **engine)
        llm.generate(gsm8k_prompts(-args.calibration_prompts, args.calibration_prompts),
                     SamplingParams(temperature=0.0, max_tokens=args.continuation_tokens), use_tqdm=False)
        model_config = llm.llm_engine.vllm_config.model_config
        num_layers = model_config.get_total_num_hidden_layers()
        num_kv_heads, head_size = model_config.get_total_num_kv_heads(), model_config.get_head_size()
        block_size = llm.llm_engine.vllm_config.cache_config.block_size
        del llm
    finally:
        KeyValueObserver.observe = KeyValueObserver.observe_query = None
    progress.update()
    if sorted(stats.key_amax) != list(range(num_layers)):
        raise RuntimeError(f"the statistics engine showed layers {sorted(stats.key_amax)}, expected 0..{num_layers - 1}"
                           " (statistics need the plugin's CPU backend: run on a CPU host)")

    layers, policies = [], {"nvfp4 + smooth": [], "nvfp4 auto": [], FP8_KEYS: [], INT8_KEYS: []}
    for i in range(num_layers):
        key_amax, value_amax = stats.key_amax[i], stats.value_amax[i]
        keys, values = torch.cat(stats.keys[i]), torch.cat(stats.values[i])
        queries = torch.cat(stats.queries[i])
        median = key_amax.median(-1, keepdim=True).values
        outliers = (key_amax > OUTLIER_RATIO * median).nonzero().tolist()
        candidates = layer_candidates(queries, keys, values, key_amax)
        auto = choose_auto(candidates, args.error_budget)
        smooth = min((c for c in candidates if c["mode"] == "nvfp4"), key=lambda c: c["logit_error"])
        layers.append({"layer": i, "key_max": float(key_amax.max()), "value_max": float(value_amax.max()),
                       "key_channel_max": key_amax.tolist(), "value_channel_max": value_amax.tolist(),
                       "outlier_channels": outliers, "candidates": candidates, "auto": auto,
                       "smooth_alpha": smooth["alpha"],
                       "fp8_key_logit_error": logit_error(queries, keys, restore_fp8(keys)),
                       "int8_key_logit_error": logit_error(queries, keys, restore_int8(keys))})
        policies["nvfp4 + smooth"].append({"mode": "nvfp4", "alpha": smooth["alpha"], "key_scales":
                                           smoothing_scales(key_amax, smooth["alpha"]) if smooth["alpha"] else None})
        policies["nvfp4 auto"].append({"mode": auto["mode"], "alpha": auto["alpha"], "key_scales":
                                       smoothing_scales(key_amax, auto["alpha"]) if auto["alpha"] else None})
        value_mode = min(MODES, key=lambda m: next(c["value_error"] for c in candidates if c["mode"] == m))
        policies[FP8_KEYS].append({"mode": value_mode, "key_scales": None})
        policies[INT8_KEYS].append({"mode": value_mode, "key_scales": None})
    files = {name: out / f"calibration_{name.replace(' + ', '_').replace(' ', '_')}.json" for name in policies}

    def save(name: str, path: Path) -> None:
        kv_calibration.save(path, str(args.model), num_kv_heads, head_size, policies[name],
                            KEY_FORMAT_OF.get(name, "nvfp4"))

    for name, path in files.items():
        save(name, path)

    budget = args.budget_mib << 20

    def capacity(bytes_per_token_per_head: float) -> int:
        return capacity_tokens(num_layers, num_kv_heads, head_size, budget, block_size, bytes_per_token_per_head)

    bf16_tokens = capacity(4 * head_size)
    page_bytes = {name: NVFP4PageLayout(head_size, 1, 1, key_format=KEY_FORMAT_OF.get(name, "nvfp4")).page_bytes
                  for name in candidates_order}
    page_bytes["fp8 (vLLM)"] = 2 * head_size
    modes = [{"mode": "bf16", "capacity_tokens": bf16_tokens, "capacity_ratio": 1.0}]
    modes += [{"mode": name, "capacity_tokens": capacity(page_bytes[name]),
               "capacity_ratio": capacity(page_bytes[name]) / bf16_tokens} for name in page_bytes]
    report = {"model": Path(args.model).name or str(args.model), "num_layers": num_layers,
              "num_kv_heads": num_kv_heads,
              "head_size": head_size, "block_size": block_size, "budget_bytes": budget,
              "calibration_prompts": args.calibration_prompts, "eval_prompts": args.eval_prompts,
              "continuation_tokens": args.continuation_tokens, "error_budget": args.error_budget,
              "calibration_files": {k: str(v) for k, v in files.items()}, "modes": modes, "layers": layers,
              "fidelity_positions": 0}
    if not args.no_fidelity:
        engines = {"nvfp4": {"kv_cache_dtype": "nvfp4"}, "nvfp4_4over6": {"kv_cache_dtype": "nvfp4_4over6"},
                   "fp8 (vLLM)": {"kv_cache_dtype": "fp8"}}
        for name in ("nvfp4 + smooth", "nvfp4 auto", FP8_KEYS, INT8_KEYS):
            engines[name] = {"kv_cache_dtype": "nvfp4",
                             "additional_config": {"vllm_nvfp4_plugin": {"kv_calibration": str(files[name])}}}
        results = teacher_forced_comparison(args.model, gsm8k_prompts(0, args.eval_prompts), engines,
                                            max_continuation_tokens=args.continuation_tokens,
                                            on_engine_done=progress.update, **engine)
        for row in modes[1:]:
            r = results[row["mode"]]
            row.update(top1=r.top1_agreement, mean_kl=r.mean_kl, max_kl=r.max_kl, perplexity=r.perplexity,
                       ppl_increase=r.perplexity / r.reference_perplexity - 1)
            report["fidelity_positions"] = r.num_positions
            modes[0].update(top1=1.0, mean_kl=0.0, perplexity=r.reference_perplexity, ppl_increase=0.0)
    by_name = {row["mode"]: row for row in modes}
    chosen = "nvfp4 auto" if args.no_fidelity else choose_page(by_name, args.ppl_budget, args.top1_budget)
    files["auto"] = out / "calibration_auto.json"
    save(chosen, files["auto"])
    modes.append({**by_name[chosen], "mode": "auto", "policy": chosen})
    report["auto"] = chosen
    report["calibration_files"] = {k: str(v) for k, v in files.items()}
    progress.close()
    (out / "report.json").write_text(json.dumps(report, indent=1))
    write_markdown(out / "report.md", report)
    if not args.no_fidelity:
        write_plot(out / "frontier.png", report)
    print((out / "report.md").read_text())
    return report


if __name__ == "__main__":
    main()
