"""Teacher-forced next-token fidelity of a quantized KV cache against a reference KV cache, in vLLM.

Both engines decode the SAME continuation of each prompt: a logits processor records the model's full
next-token distribution at every step and forces the continuation's next token, so the two runs see
identical contexts and differ only by how the KV cache stores them. The continuation is either a given
text (e.g. a dataset's reference answer) or, by default, the reference engine's own greedy continuation
(recorded while it decodes freely; the candidate engine is then forced along it). Measured are the
decode steps (step >= 1 of each continuation): a decode step's single query token attends to the whole
context (prompt and continuation so far) read back from the paged KV cache, so it measures the quantized
cache itself, not a prefill attending to its own unquantized keys. The first continuation token,
predicted by the prefill pass, is forced but not measured.

Per measured position: top-1 agreement (same argmax), KL(reference || candidate) in nats, and each run's
negative log-likelihood of the continuation's token there (their exponentiated means are the perplexities of
the continuation under the reference and the candidate cache).
The logits are read inside the engine, so the engines run in this process:
set `VLLM_ENABLE_V1_MULTIPROCESSING=0` before calling.
"""

from __future__ import annotations

import gc
import math
import sys
from dataclasses import dataclass

import torch

from ..vllm_adapter.teacher_forcing import FIDELITY_KEY, TEACHER_TOKENS, TeacherForcingLogitsProcessor


@dataclass
class FidelityResult:
    kv_cache_dtype: str
    reference_kv_cache_dtype: str
    num_prompts: int
    num_positions: int  # measured decode positions over all prompts
    top1_agreement: float  # fraction of positions where both runs' argmax agree
    mean_kl: float  # mean KL(reference || candidate), nats
    max_kl: float
    continuations: list[list[int]]  # per prompt: the token ids it was continued with (forced or greedy)
    agreement: list[list[bool]]  # per prompt, per measured step: both argmaxes agree
    kl: list[list[float]]  # per prompt, per measured step: KL(reference || candidate), nats
    reference_perplexity: float  # exp(mean NLL of the continuation tokens at the measured positions), reference
    perplexity: float  # the same under the candidate cache


def teacher_forced_agreement(model: str, prompts: list[str], continuations: list[str | None] | None = None,
                             kv_cache_dtype: str = "nvfp4", *, reference_kv_cache_dtype: str = "auto",
                             max_continuation_tokens: int = 64, **llm_kwargs) -> FidelityResult:
    """Compare `kv_cache_dtype` with `reference_kv_cache_dtype` on `model` (a path or name vLLM loads).

    `continuations`, one per prompt (None: None for every prompt): a text is teacher-forced in both
    engines (its first `max_continuation_tokens` tokens, at least 2); None is the reference engine's
    greedy continuation (up to `max_continuation_tokens` tokens, ending early at EOS), then forced in
    the candidate engine. `llm_kwargs` go to both `vllm.LLM(...)` engines (e.g. max_model_len,
    kv_cache_memory_bytes, dtype).
    """
    return teacher_forced_comparison(model, prompts, {kv_cache_dtype: {"kv_cache_dtype": kv_cache_dtype}},
                                     continuations, reference_kv_cache_dtype=reference_kv_cache_dtype,
                                     max_continuation_tokens=max_continuation_tokens, **llm_kwargs)[kv_cache_dtype]


def teacher_forced_comparison(model: str, prompts: list[str], candidates: dict[str, dict],
                              continuations: list[str | None] | None = None, *, reference_kv_cache_dtype: str = "auto",
                              max_continuation_tokens: int = 64, on_engine_done=None,
                              **llm_kwargs) -> dict[str, FidelityResult]:
    """`teacher_forced_agreement` for several candidate engines against one reference run: `candidates` maps a
    label to the candidate engine's own `vllm.LLM` kwargs ("kv_cache_dtype" and e.g. "additional_config"), on
    top of `llm_kwargs`. `on_engine_done()` is called after each engine (progress)."""
    from vllm import LLM, SamplingParams, envs

    if envs.VLLM_ENABLE_V1_MULTIPROCESSING:
        raise RuntimeError("teacher_forced_agreement reads logits inside the engine: "
                           "set VLLM_ENABLE_V1_MULTIPROCESSING=0 before importing vLLM")
    continuations = [None] * len(prompts) if continuations is None else continuations
    if not prompts or len(prompts) != len(continuations):
        raise ValueError(f"prompts must be non-empty and continuations None or one per prompt, got "
                         f"{len(prompts)} prompts and {len(continuations)} continuations")
    if max_continuation_tokens < 2:
        raise ValueError(f"max_continuation_tokens must be >= 2 (step 0 is not measured), got {max_continuation_tokens}")
    if not candidates or any("kv_cache_dtype" not in c for c in candidates.values()):
        raise ValueError("candidates must map at least one label to LLM kwargs that include kv_cache_dtype")

    def run(engine_kwargs: dict, teachers: list[list[int] | None] | None, sink) -> list[list[int]]:
        """Decode every prompt, forced along its teacher (greedy where None; `teachers` None: tokenize
        `continuations`); returns each continuation's token ids."""
        TeacherForcingLogitsProcessor.sink = sink
        llm = LLM(model, logits_processors=[TeacherForcingLogitsProcessor],
                  **{"enforce_eager": True, **llm_kwargs, **engine_kwargs})
        try:
            if teachers is None:
                tokenizer = llm.get_tokenizer()
                teachers = [None if text is None
                            else tokenizer.encode(text, add_special_tokens=False)[:max_continuation_tokens]
                            for text in continuations]
                short = [i for i, teacher in enumerate(teachers) if teacher is not None and len(teacher) < 2]
                if short:
                    raise ValueError(f"continuation {short[0]} has fewer than 2 tokens: {continuations[short[0]]!r}")
            params = [SamplingParams(temperature=0.0, max_tokens=max_continuation_tokens, extra_args={FIDELITY_KEY: i})
                      if teacher is None else
                      SamplingParams(temperature=0.0, max_tokens=len(teacher), ignore_eos=True,
                                     extra_args={TEACHER_TOKENS: teacher, FIDELITY_KEY: i})
                      for i, teacher in enumerate(teachers)]
            outputs = llm.generate(prompts, params, use_tqdm=False)
            return [list(output.outputs[0].token_ids) for output in outputs]
        finally:
            TeacherForcingLogitsProcessor.sink = None
            del llm
            gc.collect()
            if on_engine_done is not None:
                on_engine_done()

    reference: dict[tuple[int, int], torch.Tensor] = {}
    teachers = run({"kv_cache_dtype": reference_kv_cache_dtype}, None,
                   lambda key, step, logprobs: reference.__setitem__((key, step), logprobs.clone()))
    return {label: _compare(run, engine_kwargs, label, teachers, reference, reference_kv_cache_dtype)
            for label, engine_kwargs in candidates.items()}


def _compare(run, engine_kwargs: dict, label: str, teachers: list[list[int]],
             reference: dict[tuple[int, int], torch.Tensor], reference_kv_cache_dtype: str) -> FidelityResult:
    agree: list[list[bool]] = [[] for _ in teachers]
    kl: list[list[float]] = [[] for _ in teachers]
    nll = {"reference": 0.0, "candidate": 0.0}
    unreached = set(reference)

    def compare(key: int, step: int, logprobs: torch.Tensor) -> None:
        ref = reference[(key, step)]
        unreached.discard((key, step))
        token = teachers[key][step]
        nll["reference"] -= float(ref[token])
        nll["candidate"] -= float(logprobs[token])
        agree[key].append(bool(ref.argmax() == logprobs.argmax()))
        p = ref.exp()
        support = p > 0  # tokens the reference rules out add nothing (and would give 0 * inf)
        kl[key].append(float((p[support] * (ref[support] - logprobs[support])).sum()))

    if run(engine_kwargs, teachers, compare) != teachers:
        raise RuntimeError(f"the {label} run did not follow the reference continuations")
    if unreached:
        raise RuntimeError(f"{len(unreached)} reference positions were never reached by the {label} run")
    all_agree = [a for prompt in agree for a in prompt]
    all_kl = [k for prompt in kl for k in prompt]
    if not all_agree:
        raise RuntimeError("no decode position was measured: every continuation ended after one token")
    return FidelityResult(label, reference_kv_cache_dtype, len(teachers), len(all_agree),
                          sum(all_agree) / len(all_agree), sum(all_kl) / len(all_kl), max(all_kl), teachers,
                          agree, kl, math.exp(nll["reference"] / len(all_agree)),
                          math.exp(nll["candidate"] / len(all_agree)))


def format_fidelity(model_dir, prompts: list[str], continuations: list[list[int]], *, eager: bool = False
                    ) -> tuple[list[list[bool]], list[list[float]]]:
    """What the NVFP4 format itself costs, without vLLM: Hugging Face transformers runs the model on each prompt
    and its continuation's token ids twice, with plain attention and with every key and value (after RoPE, as the
    cache stores them) rounded through the reference NVFP4 encode and decode (unit global scale). Returns, per
    prompt and measured step (continuation tokens 1 onward, as `teacher_forced_agreement`), top-1 agreement and
    KL(plain || rounded).

    Attention is torch's SDPA, or with `eager` the model's own eager attention (gpt-oss: SDPA cannot add sinks).
    The rounded variant is registered with the matching mask builder, so sliding windows stay as the model has
    them."""
    from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

    from .. import reference

    def rounded(x):
        return reference.nvfp4_decode(*reference.nvfp4_encode(x, 1.0), 1.0, x.dtype)

    def nvfp4_attention(module, query, key, value, attention_mask, **kwargs):
        attend = sys.modules[type(module).__module__].eager_attention_forward if eager else sdpa_attention_forward
        return attend(module, query, rounded(key), rounded(value), attention_mask, **kwargs)

    plain, simulated = ("eager", "nvfp4_eager") if eager else ("sdpa", "nvfp4_sdpa")
    AttentionInterface.register(simulated, nvfp4_attention)
    AttentionMaskInterface.register(simulated, eager_mask if eager else sdpa_mask)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    logprobs = {}
    for impl in (plain, simulated):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation=impl)
        logprobs[impl] = []
        for prompt, continuation in zip(prompts, continuations):
            prompt_ids = tokenizer(prompt).input_ids
            with torch.no_grad():
                logits = model(torch.tensor([prompt_ids + continuation])).logits[0].float()
            logprobs[impl].append(logits[len(prompt_ids):len(prompt_ids) + len(continuation) - 1].log_softmax(-1))
    agreement, kl = [], []
    for ref, sim in zip(logprobs[plain], logprobs[simulated]):
        agreement.append((ref.argmax(-1) == sim.argmax(-1)).tolist())
        kl.append((ref.exp() * (ref - sim)).sum(-1).tolist())
    return agreement, kl
