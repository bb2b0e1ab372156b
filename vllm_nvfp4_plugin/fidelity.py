"""Teacher-forced next-token fidelity of a quantized KV cache against a reference KV cache, in vLLM.

Both engines decode the SAME reference continuation: a logits processor records the model's full
next-token distribution at every step, then forces the reference token, so the two runs see identical
contexts and differ only by how the KV cache stores them. Measured are the decode steps (step >= 1 of
each continuation): a decode step's single query token attends to the whole context (prompt and
forced tokens) read back from the paged KV cache, so it measures the quantized cache itself, not a
prefill attending to its own unquantized keys. The first continuation token, predicted by the prefill
pass, is forced but not measured.

Per measured position: top-1 agreement (same argmax) and KL(reference || candidate) in nats.
The logits are read inside the engine, so the engines run in this process:
set `VLLM_ENABLE_V1_MULTIPROCESSING=0` before calling.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass

import torch
from vllm.v1.sample.logits_processor import LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

TEACHER_TOKENS = "nvfp4_teacher_tokens"  # SamplingParams.extra_args keys the processor reads
FIDELITY_KEY = "nvfp4_fidelity_key"


class TeacherForcingLogitsProcessor(LogitsProcessor):
    """Records each forced request's log-probabilities at decode steps through `sink`, then forces the
    next reference token. Requests without `TEACHER_TOKENS` in their extra_args pass untouched."""

    sink: Callable[[int, int, torch.Tensor], None] | None = None  # (prompt index, step, log-probs)

    def __init__(self, vllm_config, device, is_pin_memory):
        self.requests: dict[int, tuple[int, list[int], list[int]]] = {}  # batch row -> (key, teacher, outputs)

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update) -> None:
        process_dict_updates(self.requests, batch_update, self._new_request)

    @staticmethod
    def _new_request(params, prompt_tok_ids, output_tok_ids):
        extra = params.extra_args or {}
        if TEACHER_TOKENS not in extra:
            return None
        return extra[FIDELITY_KEY], extra[TEACHER_TOKENS], output_tok_ids

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row, (key, teacher, outputs) in self.requests.items():
            step = len(outputs)
            if outputs != teacher[:step]:
                raise RuntimeError(f"teacher forcing of prompt {key} diverged at step {step}")
            if step >= 1:
                type(self).sink(key, step, logits[row].float().log_softmax(-1))
            logits[row] = float("-inf")
            logits[row, teacher[step]] = 0.0
        return logits


@dataclass
class FidelityResult:
    kv_cache_dtype: str
    reference_kv_cache_dtype: str
    num_prompts: int
    num_positions: int  # measured decode positions over all prompts
    top1_agreement: float  # fraction of positions where both runs' argmax agree
    mean_kl: float  # mean KL(reference || candidate), nats
    max_kl: float


def teacher_forced_agreement(model: str, prompts: list[str], continuations: list[str], kv_cache_dtype: str = "nvfp4",
                             *, reference_kv_cache_dtype: str = "auto", max_continuation_tokens: int = 64,
                             **llm_kwargs) -> FidelityResult:
    """Compare `kv_cache_dtype` with `reference_kv_cache_dtype` on `model` (a path or name vLLM loads),
    teacher-forcing each prompt's continuation (its first `max_continuation_tokens` tokens, at least 2).

    `llm_kwargs` go to both `vllm.LLM(...)` engines (e.g. max_model_len, kv_cache_memory_bytes, dtype).
    """
    import vllm.envs as envs
    from vllm import LLM, SamplingParams

    if envs.VLLM_ENABLE_V1_MULTIPROCESSING:
        raise RuntimeError("teacher_forced_agreement reads logits inside the engine: "
                           "set VLLM_ENABLE_V1_MULTIPROCESSING=0 before importing vLLM")
    if len(prompts) != len(continuations) or not prompts:
        raise ValueError(f"prompts and continuations must be non-empty and of equal length, "
                         f"got {len(prompts)} and {len(continuations)}")
    if max_continuation_tokens < 2:
        raise ValueError(f"max_continuation_tokens must be >= 2 (step 0 is not measured), got {max_continuation_tokens}")

    def run(cache_dtype: str, sink) -> None:
        TeacherForcingLogitsProcessor.sink = sink
        llm = LLM(model, kv_cache_dtype=cache_dtype, logits_processors=[TeacherForcingLogitsProcessor],
                  **{"enforce_eager": True, **llm_kwargs})
        try:
            tokenizer = llm.get_tokenizer()
            params = []
            for i, text in enumerate(continuations):
                teacher = tokenizer.encode(text, add_special_tokens=False)[:max_continuation_tokens]
                if len(teacher) < 2:
                    raise ValueError(f"continuation {i} has fewer than 2 tokens: {text!r}")
                params.append(SamplingParams(temperature=0.0, max_tokens=len(teacher), ignore_eos=True,
                                             extra_args={TEACHER_TOKENS: teacher, FIDELITY_KEY: i}))
            llm.generate(prompts, params, use_tqdm=False)
        finally:
            TeacherForcingLogitsProcessor.sink = None
            del llm
            gc.collect()

    reference: dict[tuple[int, int], torch.Tensor] = {}
    run(reference_kv_cache_dtype, lambda key, step, logprobs: reference.__setitem__((key, step), logprobs.clone()))

    agree, kl = [], []

    def compare(key: int, step: int, logprobs: torch.Tensor) -> None:
        ref = reference.pop((key, step))
        agree.append(bool(ref.argmax() == logprobs.argmax()))
        p = ref.exp()
        support = p > 0  # tokens the reference rules out add nothing (and would give 0 * inf)
        kl.append(float((p[support] * (ref[support] - logprobs[support])).sum()))

    run(kv_cache_dtype, compare)
    if reference:
        raise RuntimeError(f"{len(reference)} reference positions were never reached by the {kv_cache_dtype} run")
    return FidelityResult(kv_cache_dtype, reference_kv_cache_dtype, len(prompts), len(agree),
                          sum(agree) / len(agree), sum(kl) / len(kl), max(kl))
