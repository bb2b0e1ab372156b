"""One vLLM engine run, in its own process, for the engine tests.

vLLM keeps process-wide state (plugins load once, environment variables are cached once an engine
starts), so every engine configuration gets a fresh interpreter:

    python tests/vllm_jobs.py '<json job>'   → prints one line "RESULT <json>"

A generation job: {"model": dir, "llm": {LLM kwargs}, "max_tokens": n, "batches": [[prompt, ...], ...]}.
Batches run one after another, so a later batch can hit the prefix cache an earlier one filled. A prompt
is a string, or a list of chat messages (run through the model's chat template).
Optional keys: "logprobs": k adds each generated token's k most likely tokens' log-probabilities,
"ignore_eos": true, and "plant_foreign_block_after": n makes the NVFP4 attention of request 0 read request 1's
pages from the n-th attention batch on (a deliberately wrong page, to prove the tests catch one).
When the job passes "disable_log_stats": false, the result also holds "counters", every vLLM counter metric
(vllm:num_preemptions, vllm:prefix_cache_hits, ...) summed over engines, and "num_preemptions" among them.
"env": {name: value} sets environment variables before vLLM is imported.
"decode_timing": {"batch": b, "tokens": n, "repeats": r, "lock": path} times decode steps after the batches: b
requests of n + 1 greedy tokens against the same requests of 1 token, median of r, under an exclusive lock on
`path` (engines started side by side time one at a time); the result's "decode_step_ms" is the difference / n.
Several workloads in one engine: "workloads": [{"batches": [...], "max_tokens": n}, ...] instead of "batches" and
"max_tokens". Before each workload after the first the prefix cache is reset, so none reads another's blocks; the
result then holds "workloads", per workload its "outputs", "counters" (what it added to them) and "num_preemptions".
A fidelity job: {"fidelity": {teacher_forced_agreement kwargs}} → the FidelityResult's fields; a comparison job:
{"comparison": {teacher_forced_comparison kwargs}} → {label: the FidelityResult's fields}.
"""

import json
import os
import subprocess
import sys
from pathlib import Path


def run_job(job: dict, env: dict[str, str], timeout: float) -> dict:
    """Run `job` in a fresh interpreter; returns its result, or raises with the tail of its log."""
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), json.dumps(job)], env=env,
                          capture_output=True, text=True, timeout=timeout)
    log = proc.stdout + proc.stderr
    results = [line[len("RESULT "):] for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not results:
        raise RuntimeError(f"vLLM job failed (exit {proc.returncode}):\n{log[-6000:]}")
    result = json.loads(results[-1])
    result["log"] = log
    return result


def main(job: dict) -> None:
    if "fidelity" in job:
        from dataclasses import asdict

        from vllm_nvfp4_plugin.tools.fidelity import teacher_forced_agreement

        print("RESULT " + json.dumps(asdict(teacher_forced_agreement(**job["fidelity"]))))
        return
    if "comparison" in job:
        from dataclasses import asdict

        from vllm_nvfp4_plugin.tools.fidelity import teacher_forced_comparison

        results = teacher_forced_comparison(**job["comparison"])
        print("RESULT " + json.dumps({label: asdict(result) for label, result in results.items()}))
        return

    os.environ.update(job.get("env", {}))
    from vllm import LLM

    if "plant_foreign_block_after" in job:
        plant_foreign_block(job["plant_foreign_block_after"])
    llm = LLM(job["model"], **job["llm"])
    cache = llm.llm_engine.vllm_config.cache_config
    stats = not job["llm"].get("disable_log_stats", True)
    workloads = job.get("workloads") or [{"batches": job["batches"], "max_tokens": job["max_tokens"]}]
    results = []
    for k, workload in enumerate(workloads):
        if k and not llm.reset_prefix_cache():
            raise RuntimeError("vLLM did not reset its prefix cache between workloads")
        before = counters(llm) if stats else None
        results.append({"outputs": generate(llm, workload["batches"], workload["max_tokens"], job)})
        if stats:
            after = counters(llm)
            results[-1]["counters"] = {name: value - before.get(name, 0) for name, value in after.items()}
            results[-1]["num_preemptions"] = results[-1]["counters"]["vllm:num_preemptions"]
    kv_tokens = cache.num_gpu_blocks * cache.block_size if cache.num_gpu_blocks else None
    result = {"kv_tokens": kv_tokens, "block_size": cache.block_size}
    if "decode_timing" in job:
        result["decode_step_ms"] = decode_step_ms(llm, **job["decode_timing"])
    if "workloads" in job:
        result["workloads"] = results
    else:
        result |= {"outputs": results[0]["outputs"], "counters": results[0].get("counters"),
                   "num_preemptions": results[0].get("num_preemptions")}
    print("RESULT " + json.dumps(result))


def generate(llm, batches: list, max_tokens: int, job: dict) -> list[dict]:
    """The batches one after another (a later one can hit the prefix cache an earlier one filled)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=job.get("logprobs"),
                            ignore_eos=job.get("ignore_eos", False))
    outputs = []
    for batch in batches:
        if isinstance(batch[0], str):
            results = llm.generate(batch, params, use_tqdm=False)
        else:
            results = llm.chat(batch, params, use_tqdm=False)
        outputs += [{"text": r.outputs[0].text, "token_ids": list(r.outputs[0].token_ids),
                     "prompt_len": len(r.prompt_token_ids), "num_cached_tokens": r.num_cached_tokens,
                     "logprobs": top_logprobs(r.outputs[0])}
                    for r in results]
    return outputs


def decode_step_ms(llm, batch: int, tokens: int, repeats: int, lock: str) -> float:
    """Milliseconds per decode step of `batch` requests (see the module's docstring)."""
    import fcntl
    import statistics
    import time

    from vllm import SamplingParams

    prompts = [f"Request {i}: list the rivers of region {i}, one per line." for i in range(batch)]

    def seconds(max_tokens: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    with open(lock, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        seconds(tokens + 1)  # warm-up
        steps = [(seconds(tokens + 1) - seconds(1)) / tokens for _ in range(repeats)]
    return 1e3 * statistics.median(steps)


def counters(llm) -> dict[str, float]:
    """Every vLLM counter metric, summed over engines."""
    from vllm.v1.metrics.reader import Counter

    totals = {}
    for metric in llm.get_metrics():
        if isinstance(metric, Counter):
            totals[metric.name] = totals.get(metric.name, 0) + metric.value
    return totals


def top_logprobs(completion) -> list[list[tuple[int, float]]] | None:
    """Per generated token, its candidates (token id, log-probability), most likely first."""
    if completion.logprobs is None:
        return None
    return [sorted(((t, lp.logprob) for t, lp in step.items()), key=lambda c: -c[1]) for step in completion.logprobs]


def plant_foreign_block(after_batches: int) -> None:
    """From the `after_batches`-th NVFP4 attention batch on, request 0 reads request 1's pages (engine in this
    process: VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    from vllm_nvfp4_plugin.vllm_adapter import cpu_backend

    build = cpu_backend.core_metadata
    batches = [0]

    def wrong_pages(common):
        metadata = build(common)
        batches[0] += 1
        if batches[0] >= after_batches and metadata.num_reqs >= 2:
            block_table = metadata.block_table.clone()
            block_table[0] = block_table[1]
            metadata.block_table = block_table
        return metadata

    cpu_backend.core_metadata = wrong_pages


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
