"""Models that need the CPU kernel's model features, end to end on vLLM's CPU engine: NVFP4 KV cache against bf16.

Gemma 3 270M (`python -m vllm_nvfp4_plugin.tools.models gemma3`; 15 of its 18 layers slide a 512-token window) at
a max_model_len beyond its window, so vLLM gives the local layers `SlidingWindowSpec` pages and the plugin's kernel
masks their windows. Prompts are few-shot GSM8K (evals/data), longer than the window.

- capacity: `vllm serve MODEL --kv-cache-dtype nvfp4`, then `auto` (bf16), each with `VLLM_CPU_KVCACHE_SPACE`
  GiB: the `kv_cache_size_tokens` of the server's `vllm:cache_config_info`, and one greedy completion;
- fidelity: teacher-forced top-1 agreement and KL(bf16 || nvfp4) along the bf16 engine's greedy continuations
  (`vllm_nvfp4_plugin.tools.fidelity`), every measured decode step reading more keys than the window holds, beside
  the format's own cost on the same tokens (`fidelity.format_fidelity`: transformers with NVFP4-rounded K/V).

Then the same fidelity pair for the tiny random gpt-oss (`tools/models.py tiny-gpt-oss`: attention sinks in both
layers, a 128-token window in the first), on prompts longer than its window.

Decode speed is `python benchmarks/bench_vllm_cpu.py --model gemma3`. Options: `--max-model-len 2048`,
`--prompts 20`, `--shots 8`, `--kv-cache-gib 1`, `--append FILE.md`.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import httpx
from provenance import emit, stamp

ROOT = Path(__file__).resolve().parents[1]
GSM8K = ROOT / "evals" / "data"  # MIT, see evals/data/LICENSE
WINDOW = 512  # Gemma 3's local layers
CONTINUATION_TOKENS = 64


def few_shot_prompts(num_prompts: int, shots: int) -> list[str]:
    """`shots` solved training questions, then one test question, per prompt."""
    train = [json.loads(line) for line in (GSM8K / "train.jsonl").read_text().splitlines()[:shots]]
    test = [json.loads(line) for line in (GSM8K / "test.jsonl").read_text().splitlines()[:num_prompts]]
    prefix = "".join(f"Question: {row['question']}\nAnswer: {row['answer']}\n\n" for row in train)
    return [f"{prefix}Question: {row['question']}\nAnswer:" for row in test]


def serve(model: Path, kv_cache_dtype: str, prompt: str, args, log_dir: Path) -> dict:
    """Capacity and one greedy completion from `vllm serve` with this KV-cache dtype."""
    from vllm_nvfp4_plugin.tools.demo import cache_config_labels
    from vllm_nvfp4_plugin.tools.server import VllmServer

    serve_args = ["--dtype", "bfloat16", "--kv-cache-dtype", kv_cache_dtype, "--max-model-len",
                  str(args.max_model_len), "--served-model-name", "gemma3", "--enforce-eager"]
    with VllmServer(model, serve_args, env={"VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib)},
                    log_path=log_dir / f"serve_{kv_cache_dtype}.log") as server:
        labels = cache_config_labels(httpx.get(f"{server.base_url}/metrics", timeout=30).text)
        response = httpx.post(f"{server.base_url}/v1/completions", timeout=600, json={
            "model": "gemma3", "prompt": prompt, "max_tokens": 32, "temperature": 0.0})
        response.raise_for_status()
        choice = response.json()
    return {"cache_dtype": labels["cache_dtype"], "tokens": int(labels["kv_cache_size_tokens"]),
            "prompt_tokens": choice["usage"]["prompt_tokens"], "text": choice["choices"][0]["text"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--shots", type=int, default=8)
    parser.add_argument("--kv-cache-gib", type=int, default=1)
    parser.add_argument("--append", help="append the block to this markdown file")
    args = parser.parse_args()

    from vllm_nvfp4_plugin.tools.models import gemma3_path

    model = gemma3_path()
    prompts = few_shot_prompts(args.prompts, args.shots)
    log_dir = Path(tempfile.mkdtemp(prefix="model_coverage."))
    served = {dtype: serve(model, dtype, prompts[0], args, log_dir) for dtype in ("nvfp4", "auto")}
    for dtype, run in served.items():
        print(f"[serve {dtype}] {run}", flush=True)

    # The engines of the fidelity measurement run in this process (their logits processor records the logits).
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from transformers import AutoTokenizer

    from vllm_nvfp4_plugin.tools.fidelity import format_fidelity, teacher_forced_agreement
    from vllm_nvfp4_plugin.tools.models import TINY_SLIDING_WINDOW, tiny_gpt_oss_path

    def measure(model: Path, prompts: list[str], window: int, eager: bool) -> list[str]:
        """Table rows: the plugin against bf16 in vLLM, and the format's own cost on the same tokens."""
        lengths = [len(ids) for ids in AutoTokenizer.from_pretrained(model)(prompts)["input_ids"]]
        if min(lengths) <= window or max(lengths) + CONTINUATION_TOKENS > args.max_model_len:
            raise SystemExit(f"prompts of {min(lengths)}-{max(lengths)} tokens: they must exceed the {window}-token "
                             f"window and fit --max-model-len with {CONTINUATION_TOKENS} more")
        plugin = teacher_forced_agreement(str(model), prompts, kv_cache_dtype="nvfp4", reference_kv_cache_dtype="auto",
                                          max_continuation_tokens=CONTINUATION_TOKENS,
                                          max_model_len=args.max_model_len, kv_cache_memory_bytes=args.kv_cache_gib << 30,
                                          dtype="bfloat16", enforce_eager=True)
        agreement, kl = format_fidelity(model, prompts, plugin.continuations, eager=eager)
        agree = [a for row in agreement for a in row]
        kls = [k for row in kl for k in row]
        return [f"| teacher-forced top-1 agreement with bf16 KV, {plugin.num_prompts} prompts of {min(lengths)}–"
                f"{max(lengths)} tokens, {plugin.num_positions} decode positions | 1 | {plugin.top1_agreement:.3f} | "
                f"{sum(agree) / len(agree):.3f} |",
                f"| mean KL(bf16 ‖ nvfp4), same positions (nats) | 0 | {plugin.mean_kl:.4f} | "
                f"{sum(kls) / len(kls):.4f} |",
                f"| perplexity of the continuations at those positions | {plugin.reference_perplexity:.4f} | "
                f"{plugin.perplexity:.4f} | |"]

    gemma_rows = measure(model, prompts, WINDOW, eager=False)
    gpt_oss_rows = measure(tiny_gpt_oss_path(), few_shot_prompts(args.prompts, 2), TINY_SLIDING_WINDOW,
                           eager=True)
    nvfp4, bf16 = served["nvfp4"], served["auto"]
    lines = [
        f"{stamp()}; Gemma 3 270M bf16, vllm serve / LLM, max_model_len {args.max_model_len} (window {WINDOW}), "
        f"{args.kv_cache_gib} GiB KV cache",
        "",
        "| Gemma 3 270M | bf16 KV | NVFP4 KV (the plugin in vLLM) | the format (transformers) |",
        "| --- | ---: | ---: | ---: |",
        f"| KV tokens vLLM reports (`vllm serve`, `kv_cache_size_tokens`) | {bf16['tokens']:,} | {nvfp4['tokens']:,} "
        f"({nvfp4['tokens'] / bf16['tokens']:.2f}×) | |",
        *gemma_rows,
        "",
        f"| tiny gpt-oss (sinks; window {TINY_SLIDING_WINDOW} in layer 0) | bf16 KV | NVFP4 KV (the plugin "
        "in vLLM) | the format (transformers) |",
        "| --- | ---: | ---: | ---: |",
        *gpt_oss_rows,
        "",
        f"`vllm serve` greedy completion of the first prompt ({nvfp4['prompt_tokens']} tokens), bf16: "
        f"{json.dumps(bf16['text'][:80])}; nvfp4: {json.dumps(nvfp4['text'][:80])}",
    ]
    emit(lines, args.append)


if __name__ == "__main__":
    main()
