"""NVFP4 vs bf16 KV cache, teacher-forced, in vLLM: the harness, then SmolLM2 over GSM8K answers.

`vllm_nvfp4_plugin.fidelity.teacher_forced_agreement` decodes each reference answer token by token in
both engines (forcing the reference token, so both see the same context) and compares the next-token
distributions of the decode steps: each of those queries reads the whole context, question and answer
so far, back from the paged KV cache, so what differs between the runs is the cache's precision.

What NVFP4 itself costs is measured independently: Hugging Face transformers runs the same model on the
same tokens with every key and value (after RoPE, as the cache stores them) rounded through the
reference NVFP4 encode/decode of FORMATS.md. The plugin must match that simulation: an error of its own
(layout, store, gather, attention) would add to the format's, an unquantized read would remove it.
On SmolLM2-135M (unit global scales, as its checkpoint has none) the format itself costs ~16% of top-1
agreement: E2M1 leaves each element ~9% relative error, and this small model's large-norm keys turn
that into logit noise. Both the plugin and the simulation measure about 0.84.
"""

import json
from pathlib import Path

import pytest
import torch
from test_vllm_engine import engine_env
from vllm_jobs import run_job

from vllm_nvfp4_plugin import reference
from vllm_nvfp4_plugin.models import smollm2_path, tiny_llama_path

GSM8K = Path(__file__).resolve().parents[1] / "evals" / "data" / "test.jsonl"  # MIT, see evals/data/LICENSE
NUM_QUESTIONS = 20
ANSWER_TOKENS = 64


def fidelity_job(model, prompts, continuations, kv_cache_dtype, reference_kv_cache_dtype="auto"):
    return {"fidelity": {"model": str(model), "prompts": prompts, "continuations": continuations,
                         "kv_cache_dtype": kv_cache_dtype, "reference_kv_cache_dtype": reference_kv_cache_dtype,
                         "max_continuation_tokens": ANSWER_TOKENS, "max_model_len": 1024,
                         "kv_cache_memory_bytes": 256 << 20, "dtype": "bfloat16"}}


def gsm8k(n):
    rows = [json.loads(line) for line in GSM8K.read_text().splitlines()[:n]]
    return [f"Question: {row['question']}\nAnswer:" for row in rows], [" " + row["answer"] for row in rows]


def test_harness_sees_only_the_cache_dtype():
    """Same dtype twice: identical distributions. NVFP4: the decode steps see a different cache."""
    tiny = tiny_llama_path(head_dim=64)
    prompts, answers = gsm8k(4)
    same = run_job(fidelity_job(tiny, prompts, answers, "auto"), engine_env(), timeout=600)
    assert same["num_positions"] >= 4 * 40  # answers of 41 to 64 tokens, step 0 not measured
    assert same["top1_agreement"] == 1.0 and same["max_kl"] == 0.0
    nvfp4 = run_job(fidelity_job(tiny, prompts, answers, "nvfp4"), engine_env(), timeout=600)
    assert nvfp4["num_positions"] == same["num_positions"]
    assert nvfp4["mean_kl"] > 0


def simulated_nvfp4_fidelity(model_dir, prompts, continuations):
    """(top-1 agreement, mean KL) of transformers with NVFP4-rounded K/V against plain transformers,
    at the positions `teacher_forced_agreement` measures (continuation tokens 1..)."""
    from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def rounded(x):
        return reference.nvfp4_decode(*reference.nvfp4_encode(x, 1.0), 1.0, x.dtype)

    def nvfp4_attention(module, query, key, value, attention_mask, **kwargs):
        return sdpa_attention_forward(module, query, rounded(key), rounded(value), attention_mask, **kwargs)

    AttentionInterface.register("nvfp4_reference", nvfp4_attention)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    logprobs = {}
    for impl in ("sdpa", "nvfp4_reference"):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation=impl)
        logprobs[impl] = []
        for prompt, text in zip(prompts, continuations):
            prompt_ids = tokenizer(prompt).input_ids
            answer_ids = tokenizer.encode(text, add_special_tokens=False)[:ANSWER_TOKENS]
            with torch.no_grad():
                logits = model(torch.tensor([prompt_ids + answer_ids])).logits[0].float()
            logprobs[impl].append(logits[len(prompt_ids):len(prompt_ids) + len(answer_ids) - 1].log_softmax(-1))
    ref, sim = torch.cat(logprobs["sdpa"]), torch.cat(logprobs["nvfp4_reference"])
    agreement = (ref.argmax(-1) == sim.argmax(-1)).float().mean().item()
    kl = (ref.exp() * (ref - sim)).sum(-1).mean().item()
    return agreement, kl


@pytest.fixture(scope="module")
def smollm2():
    return smollm2_path()


def test_smollm2_nvfp4_cache_costs_what_the_format_costs(smollm2):
    prompts, answers = gsm8k(NUM_QUESTIONS)
    plugin = run_job(fidelity_job(smollm2, prompts, answers, "nvfp4"), engine_env(), timeout=1200)
    sim_agreement, sim_kl = simulated_nvfp4_fidelity(smollm2, prompts, answers)
    print(f"\nNVFP4 vs bf16 KV, SmolLM2-135M-Instruct, {plugin['num_prompts']} GSM8K answers, "
          f"{plugin['num_positions']} decode positions:\n"
          f"  plugin in vLLM:        top-1 agreement {plugin['top1_agreement']:.4f}, mean KL {plugin['mean_kl']:.4f} "
          f"nats (max {plugin['max_kl']:.3f})\n"
          f"  format (transformers): top-1 agreement {sim_agreement:.4f}, mean KL {sim_kl:.4f} nats")
    assert plugin["num_prompts"] == NUM_QUESTIONS and plugin["num_positions"] >= NUM_QUESTIONS * 40
    assert abs(plugin["top1_agreement"] - sim_agreement) <= 0.03
    assert 0.75 * sim_kl <= plugin["mean_kl"] <= 1.25 * sim_kl
