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

Per measured position: top-1 agreement (same argmax) and KL(reference || candidate) in nats.
The logits are read inside the engine, so the engines run in this process:
set `VLLM_ENABLE_V1_MULTIPROCESSING=0` before calling.
"""

from __future__ import annotations

import gc
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

    def run(cache_dtype: str, teachers: list[list[int] | None] | None, sink) -> list[list[int]]:
        """Decode every prompt, forced along its teacher (greedy where None; `teachers` None: tokenize
        `continuations`); returns each continuation's token ids."""
        TeacherForcingLogitsProcessor.sink = sink
        llm = LLM(model, kv_cache_dtype=cache_dtype, logits_processors=[TeacherForcingLogitsProcessor],
                  **{"enforce_eager": True, **llm_kwargs})
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

    reference: dict[tuple[int, int], torch.Tensor] = {}
    teachers = run(reference_kv_cache_dtype, None,
                   lambda key, step, logprobs: reference.__setitem__((key, step), logprobs.clone()))

    agree: list[list[bool]] = [[] for _ in prompts]
    kl: list[list[float]] = [[] for _ in prompts]

    def compare(key: int, step: int, logprobs: torch.Tensor) -> None:
        ref = reference.pop((key, step))
        agree[key].append(bool(ref.argmax() == logprobs.argmax()))
        p = ref.exp()
        support = p > 0  # tokens the reference rules out add nothing (and would give 0 * inf)
        kl[key].append(float((p[support] * (ref[support] - logprobs[support])).sum()))

    if run(kv_cache_dtype, teachers, compare) != teachers:
        raise RuntimeError(f"the {kv_cache_dtype} run did not follow the reference continuations")
    if reference:
        raise RuntimeError(f"{len(reference)} reference positions were never reached by the {kv_cache_dtype} run")
    all_agree = [a for prompt in agree for a in prompt]
    all_kl = [k for prompt in kl for k in prompt]
    if not all_agree:
        raise RuntimeError("no decode position was measured: every continuation ended after one token")
    return FidelityResult(kv_cache_dtype, reference_kv_cache_dtype, len(prompts), len(all_agree),
                          sum(all_agree) / len(all_agree), sum(all_kl) / len(all_kl), max(all_kl), teachers,
                          agree, kl)
