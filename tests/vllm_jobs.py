"""One vLLM engine run, in its own process, for the engine tests.

vLLM keeps process-wide state (plugins load once, environment variables are cached once an engine
starts), so every engine configuration gets a fresh interpreter:

    python tests/vllm_jobs.py '<json job>'   → prints one line "RESULT <json>"

A generation job: {"model": dir, "llm": {LLM kwargs}, "max_tokens": n, "batches": [[prompt, ...], ...]}.
Batches run one after another, so a later batch can hit the prefix cache an earlier one filled. A prompt
is a string, or a list of chat messages (run through the model's chat template).
A fidelity job: {"fidelity": {teacher_forced_agreement kwargs}} → the FidelityResult's fields.
"""

import json
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

    from vllm import LLM, SamplingParams

    llm = LLM(job["model"], **job["llm"])
    cache = llm.llm_engine.vllm_config.cache_config
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"])
    outputs = []
    for batch in job["batches"]:
        if isinstance(batch[0], str):
            results = llm.generate(batch, params, use_tqdm=False)
        else:
            results = llm.chat(batch, params, use_tqdm=False)
        outputs += [{"text": r.outputs[0].text, "token_ids": list(r.outputs[0].token_ids),
                     "prompt_len": len(r.prompt_token_ids), "num_cached_tokens": r.num_cached_tokens}
                    for r in results]
    kv_tokens = cache.num_gpu_blocks * cache.block_size if cache.num_gpu_blocks else None
    print("RESULT " + json.dumps({"kv_tokens": kv_tokens, "block_size": cache.block_size, "outputs": outputs}))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
