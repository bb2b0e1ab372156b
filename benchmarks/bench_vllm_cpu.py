"""End to end on vLLM's CPU engine: prefill and decode throughput with an NVFP4 KV cache against bf16.

The embedded model (SmolLM2-135M-Instruct, bf16; `python -m vllm_nvfp4_plugin.tools.models` prepares it), or with
`--model gemma3` Gemma 3 270M (15 of 18 layers slide a 512-token window, so longer prompts exercise the window),
runs in vLLM's offline engine, once with `kv_cache_dtype="nvfp4"` (the plugin's CPU backend and its attention
kernel) and once with bf16 (vLLM's own CPU attention), each engine in its own interpreter. Both engines start
first and then take turns, one generation each, `--rounds` times, so that load from other jobs on the machine hits
both alike. A generation is B distinct prompts of `--prompt-len` random tokens (prefix caching off, so every
prompt is prefilled), greedy with `ignore_eos`, `--decode-tokens` tokens after the first, its engine stepped
directly and each step timed:

- prefill tokens/s: B · prompt_len / the time until every request has its first token (chunked prefill may
  already decode the first requests in that time);
- decode tokens/s: the tokens of the steps that start once every request has its first token (pure decode
  steps, B rows each), over those steps' time.

A figure is the median over the rounds; the first generation of each engine and batch size is a warm-up.

Options: `--model smollm2|gemma3`, `--batches 1 8`, `--prompt-len 2048`, `--decode-tokens 64`, `--rounds 3`,
`--threads N` (OMP_NUM_THREADS and VLLM_CPU_OMP_THREADS_BIND of the engines; default all CPUs), `--compile`
(vLLM's default torch.compile instead of eager mode, which starts faster), `--avx2-host`, `--append FILE.md`,
`--note TEXT`.

`--avx2-host` runs both engines as on an x86 CPU without AVX-512: the plugin's AVX2 kernels
(`VLLM_NVFP4_CPU_ISA=avx2`), vLLM's AVX2 kernel library (`vllm._C_AVX2`, loaded because torch is made to report no
AVX-512 before vLLM loads its kernels), and torch's and oneDNN's kernels capped at AVX2 (`ATEN_CPU_CAPABILITY=avx2`,
`ONEDNN_MAX_CPU_ISA=AVX2`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from provenance import emit, stamp

KV_CACHE_BYTES = 1 << 30
MODEL_NAMES = {"smollm2": "SmolLM2-135M-Instruct", "gemma3": "Gemma 3 270M"}
DTYPES = ("nvfp4", "bfloat16")


def engine(args) -> None:
    """One engine (this interpreter): for each batch size read from stdin, one generation, its times on stdout."""
    import torch

    if args.avx2_host:
        torch.cpu._is_avx512_supported = lambda: False  # vLLM's CPU platform then loads vllm._C_AVX2
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import RequestOutputKind

    from vllm_nvfp4_plugin.tools.models import gemma3_path, smollm2_path

    model = gemma3_path() if args.model == "gemma3" else smollm2_path()
    llm = LLM(str(model), kv_cache_dtype=args.engine, dtype="bfloat16", enforce_eager=not args.compile,
              max_model_len=args.prompt_len + args.decode_tokens + 16, max_num_seqs=max(args.batches),
              enable_prefix_caching=False, kv_cache_memory_bytes=KV_CACHE_BYTES, seed=0)
    engine = llm.llm_engine
    g = torch.Generator().manual_seed(0)
    vocab = llm.get_tokenizer().vocab_size
    params = SamplingParams(max_tokens=1 + args.decode_tokens, temperature=0.0, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    count = 0

    def generation(batch: int) -> tuple[float, float, int]:
        """(seconds until every request has its first token, seconds of the pure decode steps, their tokens)."""
        nonlocal count
        for _ in range(batch):
            prompt = torch.randint(100, vocab, (args.prompt_len,), generator=g).tolist()
            engine.add_request(str(count), {"prompt_token_ids": prompt}, params)
            count += 1
        started, waiting = set(), batch
        prefill = decode = 0.0
        tokens = 0
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            decoding = len(started) == batch
            step_start = time.perf_counter()
            outputs = engine.step()
            if decoding:
                decode += time.perf_counter() - step_start
                tokens += sum(len(o.outputs[0].token_ids) for o in outputs)
            started.update(o.request_id for o in outputs if o.outputs[0].token_ids)
            if waiting and len(started) == batch:
                prefill, waiting = time.perf_counter() - start, 0
        return prefill, decode, tokens

    print("READY", flush=True)
    for line in sys.stdin:
        print("TIMES " + json.dumps(generation(int(line))), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(MODEL_NAMES), default="smollm2")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--avx2-host", action="store_true", help="both engines on their AVX2 kernels")
    parser.add_argument("--append", help="append the table to this markdown file")
    parser.add_argument("--note", help="a line added under the table")
    parser.add_argument("--engine", help=argparse.SUPPRESS)  # internal: serve one engine's generations
    args = parser.parse_args()
    if args.engine:
        engine(args)
        return

    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0",
               OMP_NUM_THREADS=str(args.threads), VLLM_CPU_OMP_THREADS_BIND=f"0-{args.threads - 1}")
    if args.avx2_host:
        env.update(VLLM_NVFP4_CPU_ISA="avx2", ATEN_CPU_CAPABILITY="avx2", ONEDNN_MAX_CPU_ISA="AVX2")
    engines = {}
    for dtype in DTYPES:
        command = [sys.executable, os.path.abspath(__file__), "--engine", dtype, "--model", args.model,
                   "--batches", *map(str, args.batches),
                   "--prompt-len", str(args.prompt_len), "--decode-tokens", str(args.decode_tokens)]
        if args.compile:
            command.append("--compile")
        if args.avx2_host:
            command.append("--avx2-host")
        engines[dtype] = subprocess.Popen(command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          stderr=subprocess.DEVNULL, text=True)

    def read(dtype: str, tag: str) -> str:
        for line in engines[dtype].stdout:
            if line.startswith(tag):
                return line[len(tag):]
        sys.exit(f"the {dtype} engine failed (run it alone with --engine {dtype} to see why)")

    for dtype in DTYPES:
        read(dtype, "READY")

    def generation(dtype: str, batch: int) -> tuple[float, float, int]:
        engines[dtype].stdin.write(f"{batch}\n")
        engines[dtype].stdin.flush()
        return tuple(json.loads(read(dtype, "TIMES ")))

    loads = []
    times = {(d, b): [] for d in DTYPES for b in args.batches}
    for batch in args.batches:
        for dtype in DTYPES:
            generation(dtype, batch)  # warm-up
        for _ in range(args.rounds):
            for dtype in DTYPES:
                times[dtype, batch].append(generation(dtype, batch))
                loads.append(os.getloadavg()[0])
                prefill, decode, tokens = times[dtype, batch][-1]
                print(f"B={batch} {dtype}: prefill {prefill:.2f} s, {tokens} decode tokens in {decode:.2f} s, "
                      f"load average {loads[-1]:.1f}", flush=True)
    for process in engines.values():
        process.stdin.close()
        process.wait()

    lines = [
        f"{stamp()}; {args.threads} threads; {'AVX2 kernels (plugin, vLLM, torch, oneDNN); ' if args.avx2_host else ''}"
        f"{MODEL_NAMES[args.model]} bf16, "
        f"{'torch.compile' if args.compile else 'eager'}, prompts of {args.prompt_len} tokens, "
        f"{args.decode_tokens} decode tokens; engines taking turns, median of {args.rounds} rounds, "
        f"load average {min(loads):.1f}-{max(loads):.1f} over the rounds",
        "",
        "| B | prefill tok/s nvfp4 | bf16 | nvfp4 / bf16 | decode tok/s nvfp4 | bf16 | nvfp4 / bf16 |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for batch in args.batches:
        prefill = {d: statistics.median(batch * args.prompt_len / t[0] for t in times[d, batch]) for d in DTYPES}
        decode = {d: statistics.median(t[2] / t[1] for t in times[d, batch]) for d in DTYPES}
        lines.append(f"| {batch} | {prefill['nvfp4']:.0f} | {prefill['bfloat16']:.0f} | "
                     f"{prefill['nvfp4'] / prefill['bfloat16']:.2f} | {decode['nvfp4']:.1f} | "
                     f"{decode['bfloat16']:.1f} | {decode['nvfp4'] / decode['bfloat16']:.2f} |")
    if args.note:
        lines.append(f"\n{args.note}")
    emit(lines, args.append)


if __name__ == "__main__":
    main()
