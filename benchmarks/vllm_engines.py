"""vLLM's engine on one GPU with the plugin: the CUSTOM backend serving an NVFP4 KV cache, end to end.

For tiny random Llamas of head size 64, 128 and 256 (`tools.models.tiny_llama_path`), each engine in its own
interpreter (tests/vllm_jobs.py), eager, on vLLM's PyTorch/Triton code paths (`custom_ops=["none"]`, native IR
ops, the V1 model runner), so no compiled vLLM kernel is needed:
- `nvfp4`: `kv_cache_dtype="nvfp4"`, `attention_backend="CUSTOM"`: with FlashInfer importable, heads 128/256
  decode through FlashInfer's fa2 and prefill through the core; head 64 always goes through the core;
- `nvfp4-core` (heads 128/256, only with `--flashinfer-path`): the same with FlashInfer left off the path, so
  every request goes through the core;
- `bf16`: the same model with a bf16 KV cache on vLLM's TRITON_ATTN backend, the reference.
Every engine runs the same greedy requests: prompts prefilled in chunks of 64 tokens (so later chunks attend
to earlier ones through the cache), then two prompts sharing a ~500-token prefix (prefix cache hits), then a
batch of short prompts. Prints a markdown table: the KV capacity vLLM reports for the same cache budget, the
path each engine's log names, and greedy agreement of each engine's tokens with the bf16 engine's and of
FlashInfer's with the core's. `--cpu` runs the same requests on vLLM's CPU platform instead. Score the outputs
with benchmarks/score_engines.py: greedy texts of random models say little by themselves.

`--cudagraphs` runs, for heads 64 and 128 (`--heads`), the nvfp4 CUSTOM engine (the plugin's kernel decodes) eager,
with FULL CUDA graphs of uniform decode batches (`FULL_DECODE_ONLY`) and with `FULL_AND_PIECEWISE` (vLLM's breakable
graphs), and vLLM's TRITON_ATTN bf16 engine eager and with `FULL_AND_PIECEWISE` (`--modes` picks among them). It reports which graphs vLLM captured (its
log), whether each engine's tokens equal the same engine's eager tokens, and the decode step time of 8 requests
(tests/vllm_jobs.py's `decode_timing`).

    python benchmarks/vllm_engines.py [--flashinfer-path DIR] [--cpu | --cudagraphs] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from vllm_jobs import run_job  # noqa: E402

from vllm_nvfp4_plugin.tools.models import tiny_llama_path  # noqa: E402

KV_CACHE_BYTES = 64 << 20
CHUNK = 64  # max_num_batched_tokens: the long prompts are prefilled in several chunks
MAX_TOKENS = 32
SYSTEM = ("You are a careful geography tutor. Answer every question with the name of the city first, "
          "then one short sentence of explanation. ") + " ".join(
    f"Fact {i}: the river, mountain and coastline records of region {i} were checked by the survey team."
    for i in range(1, 25))
BATCHES = [[SYSTEM + " First question."],
           [SYSTEM + " Second.", SYSTEM + " Third."],
           ["The quick brown fox", "Once upon a time", "The capital of France is", "1, 2, 3, 4,"]]
# The plugin's "registered attention backends" line is not in an in-process engine's log (it is logged before
# vLLM's handler exists); vLLM's backend line and the plugin backend's own lines show the registration.
LOG_LINES = {
    "custom_backend": "Using AttentionBackendEnum.CUSTOM backend",
    "custom_layers": "NVFP4 KV cache attention on CUDA",
    "flashinfer_decode": "NVFP4 decode through FlashInfer fa2",
    "core_only": "NVFP4 attention through the core only",
}


# --cudagraphs: per mode, vLLM's compilation settings and environment. torch.compile is left out: vLLM's compile
# passes import its compiled CUDA ops, which these engines run without. FULL_AND_PIECEWISE then takes vLLM's breakable
# CUDA graphs, which break at attention instead of at torch.compile's split points.
GRAPH_MODES = {
    "eager": (None, {}),
    "full-decode": ({"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}, {}),
    "full+piecewise": ({"mode": 0, "cudagraph_mode": "FULL_AND_PIECEWISE"}, {"VLLM_USE_BREAKABLE_CUDAGRAPH": "1"}),
}
DECODE_TIMING = {"batch": 8, "tokens": 64, "repeats": 5}


def llm_args(kv_cache_dtype: str, backend: str | None, graphs: dict | None = None) -> dict:
    """`backend` None: vLLM's choice (on the CPU platform, CPU_ATTN, which the plugin overrides). `graphs`: the
    compilation settings of a GRAPH_MODES entry (None: eager)."""
    compilation = {"custom_ops": ["none"], **(graphs or {})}
    return {"enforce_eager": graphs is None, "max_model_len": 1024, "kv_cache_memory_bytes": KV_CACHE_BYTES,
            "gpu_memory_utilization": 0.05, "dtype": "bfloat16", "max_num_batched_tokens": CHUNK,
            "max_num_seqs": 8, "kv_cache_dtype": kv_cache_dtype, "attention_backend": backend or "auto",
            "compilation_config": compilation,
            # vLLM's PyTorch RMSNorm, so the run does not depend on vLLM's compiled kernels.
            "kernel_config": {"ir_op_priority": {"rms_norm": ["native"], "fused_add_rms_norm": ["native"]}}}


def engine_env(python_path: str) -> dict[str, str]:
    # Model Runner V2 (vLLM's default on CUDA) maps host buffers into the GPU with a compiled kernel of vLLM's
    # own: the V1 runner. Greedy sampling needs no FlashInfer sampler.
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0",
               VLLM_USE_V2_MODEL_RUNNER="0", VLLM_USE_FLASHINFER_SAMPLER="0", PYTHONPATH=python_path)
    env.pop("VLLM_PLUGINS", None)
    return env


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def agreement(run: dict, ref: dict) -> str:
    """`exact/requests, mean common-prefix fraction` of greedy tokens."""
    pairs = list(zip(run["outputs"], ref["outputs"]))
    exact = sum(a["token_ids"] == b["token_ids"] for a, b in pairs)
    prefix = sum(common_prefix(a["token_ids"], b["token_ids"]) / max(len(b["token_ids"]), 1) for a, b in pairs)
    return f"{exact}/{len(pairs)} identical, prefix {prefix / len(pairs):.2f}"


def engine_jobs(cpu: bool, has_flashinfer_path: bool, base_path: str, with_flashinfer: str) -> dict:
    """The default run's engines: {(head, name): (job, PYTHONPATH)}."""
    jobs = {}
    for head in (64, 128, 256):
        job = {"model": str(tiny_llama_path(head_dim=head)), "max_tokens": MAX_TOKENS, "batches": BATCHES}
        if cpu:
            jobs[(head, "cpu-nvfp4")] = ({**job, "llm": llm_args("nvfp4", None)}, base_path)
            jobs[(head, "cpu-bf16")] = ({**job, "llm": llm_args("auto", None)}, base_path)
            continue
        jobs[(head, "nvfp4")] = ({**job, "llm": llm_args("nvfp4", "CUSTOM")}, with_flashinfer)
        if head != 64 and has_flashinfer_path:
            jobs[(head, "nvfp4-core")] = ({**job, "llm": llm_args("nvfp4", "CUSTOM")}, base_path)
        jobs[(head, "bf16")] = ({**job, "llm": llm_args("auto", "TRITON_ATTN")}, with_flashinfer)
    return jobs


def engine_table(results: dict, cpu: bool) -> str:
    rows = ["| head | engine | KV tokens | log says | greedy vs bf16 | FlashInfer vs core |",
            "| --- | --- | --- | --- | --- | --- |"]
    for (head, name), result in results.items():
        if "error" in result:
            rows.append(f"| {head} | {name} | failed | {result['error'].splitlines()[-1][:150]} | | |")
            continue
        said = ", ".join(k for k, line in LOG_LINES.items() if line in result["log"])
        ref = results.get((head, "cpu-bf16" if cpu else "bf16"), {})
        vs_bf16 = agreement(result, ref) if "outputs" in ref and not name.endswith("bf16") else ""
        core = results.get((head, "nvfp4-core"), {})
        vs_core = agreement(result, core) if name == "nvfp4" and "outputs" in core else ""
        rows.append(f"| {head} | {name} | {result['kv_tokens']} | {said} | {vs_bf16} | {vs_core} |")
    return "\n".join(rows)


def captured_graphs(log: str) -> str:
    """The CUDA graphs vLLM's log says it captured (its progress bars), e.g. "decode FULL, mixed PIECEWISE"."""
    found = re.findall(r"Capturing CUDA graphs \((decode|mixed prefill-decode), (FULL|PIECEWISE)\)", log)
    return ", ".join(sorted({f"{kind.split()[0]} {mode}" for kind, mode in found})) or "none"


def cudagraph_jobs(with_flashinfer: str, heads: list[int], modes: list[str]) -> dict:
    lock = str(Path(tempfile.gettempdir()) / "vllm_engines_timing.lock")
    jobs = {}
    for head in heads:
        job = {"model": str(tiny_llama_path(head_dim=head)), "max_tokens": MAX_TOKENS, "batches": BATCHES,
               "decode_timing": {**DECODE_TIMING, "lock": lock}}
        for name, dtype, backend, engine_modes in (("nvfp4", "nvfp4", "CUSTOM", GRAPH_MODES),
                                                   ("bf16", "auto", "TRITON_ATTN", ("eager", "full+piecewise"))):
            for mode in (m for m in engine_modes if m in modes):
                graphs, env = GRAPH_MODES[mode]
                jobs[(head, name, mode)] = ({**job, "llm": llm_args(dtype, backend, graphs), "env": env},
                                            with_flashinfer)
    return jobs


def cudagraph_table(results: dict) -> str:
    rows = ["| head | engine | mode | graphs captured | tokens vs the same engine eager | "
            f"decode step, {DECODE_TIMING['batch']} requests (ms) |",
            "| --- | --- | --- | --- | --- | ---: |"]
    for (head, name, mode), result in results.items():
        if "error" in result:
            rows.append(f"| {head} | {name} | {mode} | failed: {result['error'].splitlines()[-1][:150]} | | |")
            continue
        eager = results.get((head, name, "eager"), {})
        same = agreement(result, eager) if mode != "eager" and "outputs" in eager else ""
        rows.append(f"| {head} | {name} | {mode} | {captured_graphs(result['log'])} | {same} | "
                    f"{result['decode_step_ms']:.2f} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flashinfer-path",
                        help="folder holding FlashInfer outside the default path: the nvfp4 engines get it, and "
                             "nvfp4-core engines run without it")
    parser.add_argument("--cpu", action="store_true",
                        help="run the same requests on vLLM's CPU platform instead (engines cpu-nvfp4, cpu-bf16): "
                             "the plugin's CPU path, which calibrates benchmarks/score_engines.py's scores")
    parser.add_argument("--cudagraphs", action="store_true",
                        help="the nvfp4 and bf16 engines eager and with CUDA graphs (see above)")
    parser.add_argument("--heads", default="64,128", help="--cudagraphs: the head sizes (default 64,128)")
    parser.add_argument("--modes", default=",".join(GRAPH_MODES),
                        help=f"--cudagraphs: the modes (default {','.join(GRAPH_MODES)})")
    parser.add_argument("--out", help="folder: engine.md (the table), engine.json (the outputs), engine_*.log")
    args = parser.parse_args()
    base_path = os.environ.get("PYTHONPATH", "")
    with_flashinfer = os.pathsep.join(p for p in (args.flashinfer_path or "", base_path) if p)

    if args.cudagraphs:
        jobs = cudagraph_jobs(with_flashinfer, [int(h) for h in args.heads.split(",")], args.modes.split(","))
    else:
        jobs = engine_jobs(args.cpu, bool(args.flashinfer_path), base_path, with_flashinfer)

    def run(key):
        job, path = jobs[key]
        try:
            result = run_job(job, engine_env(path), timeout=400)
        except (RuntimeError, subprocess.TimeoutExpired) as e:  # reported; the other engines still run
            result = {"error": str(e)[-4000:]}
        print(key, "failed" if "error" in result else "done", flush=True)
        return key, result

    # CPU engines share the host's cores; GPU engines start side by side (--cudagraphs: and time their decodes one
    # at a time).
    with ThreadPoolExecutor(2 if args.cpu else len(jobs)) as pool:
        results = dict(pool.map(run, jobs))
    table = cudagraph_table(results) if args.cudagraphs else engine_table(results, args.cpu)
    report(table, results, args.out)


def report(table: str, results: dict, out_dir: str | None) -> None:
    """Prints the table; with `out_dir`, writes engine.md, engine.json and one log an engine. Exits 1 if one failed."""
    print(table)
    if out_dir:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "engine.md").write_text(table + "\n")
        names = {key: "_".join(str(part) for part in key) for key in results}
        raw = {names[key]: {k: v for k, v in r.items() if k != "log"} for key, r in results.items()}
        (out / "engine.json").write_text(json.dumps(raw, indent=1))
        for key, r in results.items():
            (out / f"engine_{names[key]}.log").write_text(r.get("log") or r["error"])
    if any("error" in r for r in results.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
