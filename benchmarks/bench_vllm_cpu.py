"""End to end on vLLM's CPU engine: prefill and decode throughput with an NVFP4 KV cache against bf16.

The embedded model (SmolLM2-135M-Instruct, bf16; `python -m vllm_nvfp4_plugin.tools.models` prepares it), or with
`--model gemma3` Gemma 3 270M (15 of 18 layers slide a 512-token window, so longer prompts exercise the window),
runs in vLLM's offline `LLM`, once with `kv_cache_dtype="nvfp4"` (the plugin's CPU backend and its attention
kernel) and once with bf16 (vLLM's own CPU attention), each engine in its own interpreter. For each batch size B, B distinct
prompts of `--prompt-len` random tokens (prefix caching off, so every prompt is prefilled):

- prefill tokens/s: B · prompt_len / the time of `generate(max_tokens=1)`;
- decode tokens/s: B · decode_tokens / (the time of `generate(max_tokens=1 + decode_tokens)`, on other prompts of
  the same length, minus the prefill time), greedy with `ignore_eos`.

Each time is the faster of two calls on fresh prompts.

Options: `--model smollm2|gemma3`, `--batches 1 8`, `--prompt-len 2048`, `--decode-tokens 64`, `--threads N`
(OMP_NUM_THREADS and VLLM_CPU_OMP_THREADS_BIND of the engines; default all CPUs), `--compile` (vLLM's default
torch.compile instead of eager mode, which starts faster), `--append FILE.md`, `--note TEXT`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from provenance import emit, stamp

KV_CACHE_BYTES = 1 << 30
MODEL_NAMES = {"smollm2": "SmolLM2-135M-Instruct", "gemma3": "Gemma 3 270M"}


def engine(args) -> dict:
    """One engine (this interpreter): {batch: (prefill seconds, prefill + decode seconds)}."""
    import torch
    from vllm import LLM, SamplingParams

    from vllm_nvfp4_plugin.tools.models import gemma3_path, smollm2_path

    model = gemma3_path() if args.model == "gemma3" else smollm2_path()
    llm = LLM(str(model), kv_cache_dtype=args.engine, dtype="bfloat16", enforce_eager=not args.compile,
              max_model_len=args.prompt_len + args.decode_tokens + 16, max_num_seqs=max(args.batches),
              enable_prefix_caching=False, kv_cache_memory_bytes=KV_CACHE_BYTES, seed=0)
    g = torch.Generator().manual_seed(0)
    vocab = llm.get_tokenizer().vocab_size

    def prompts(n: int, length: int):
        return [{"prompt_token_ids": torch.randint(100, vocab, (length,), generator=g).tolist()} for _ in range(n)]

    def timed(batch: int, max_tokens: int) -> float:
        """The faster of two runs on new prompts (the first of a shape also pays one-time setup)."""
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        times = []
        for _ in range(2):
            start = time.perf_counter()
            llm.generate(prompts(batch, args.prompt_len), params, use_tqdm=False)
            times.append(time.perf_counter() - start)
        return min(times)

    return {batch: (timed(batch, 1), timed(batch, 1 + args.decode_tokens)) for batch in args.batches}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(MODEL_NAMES), default="smollm2")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--append", help="append the table to this markdown file")
    parser.add_argument("--note", help="a line added under the table")
    parser.add_argument("--engine", help=argparse.SUPPRESS)  # internal: run one engine, print its times as JSON
    args = parser.parse_args()
    if args.engine:
        print("TIMES " + json.dumps(engine(args)), flush=True)
        return

    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0",
               OMP_NUM_THREADS=str(args.threads), VLLM_CPU_OMP_THREADS_BIND=f"0-{args.threads - 1}")
    times = {}
    for dtype in ("nvfp4", "bfloat16"):
        command = [sys.executable, os.path.abspath(__file__), "--engine", dtype, "--model", args.model,
                   "--batches", *map(str, args.batches),
                   "--prompt-len", str(args.prompt_len), "--decode-tokens", str(args.decode_tokens)]
        if args.compile:
            command.append("--compile")
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        lines = [line for line in done.stdout.splitlines() if line.startswith("TIMES ")]
        if done.returncode or not lines:
            sys.exit(f"the {dtype} engine failed:\n{done.stderr[-4000:]}")
        times[dtype] = {int(b): t for b, t in json.loads(lines[-1][6:]).items()}
        print(f"{dtype}: {times[dtype]}", flush=True)

    lines = [
        f"{stamp()}; {args.threads} threads; {MODEL_NAMES[args.model]} bf16, {'torch.compile' if args.compile else 'eager'}, "
        f"prompts of {args.prompt_len} tokens, {args.decode_tokens} decode tokens",
        "",
        "| B | prefill tok/s nvfp4 | bf16 | nvfp4 / bf16 | decode tok/s nvfp4 | bf16 | nvfp4 / bf16 |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for batch in args.batches:
        prefill = {d: batch * args.prompt_len / times[d][batch][0] for d in times}
        decode = {d: batch * args.decode_tokens / (times[d][batch][1] - times[d][batch][0]) for d in times}
        lines.append(f"| {batch} | {prefill['nvfp4']:.0f} | {prefill['bfloat16']:.0f} | "
                     f"{prefill['nvfp4'] / prefill['bfloat16']:.2f} | {decode['nvfp4']:.1f} | {decode['bfloat16']:.1f} | "
                     f"{decode['nvfp4'] / decode['bfloat16']:.2f} |")
    if args.note:
        lines.append(f"\n{args.note}")
    emit(lines, args.append)


if __name__ == "__main__":
    main()
