"""vLLM's logits-processor extension point, used by `tools.fidelity` to teacher-force a continuation and
record the model's next-token distribution at every decode step."""

from __future__ import annotations

from collections.abc import Callable

import torch
from vllm.v1.sample.logits_processor import LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

TEACHER_TOKENS = "nvfp4_teacher_tokens"  # SamplingParams.extra_args keys the processor reads
FIDELITY_KEY = "nvfp4_fidelity_key"


class TeacherForcingLogitsProcessor(LogitsProcessor):
    """Records each measured request's log-probabilities at decode steps through `sink`; forces the next
    teacher token where the request has `TEACHER_TOKENS`, lets greedy sampling choose it otherwise.
    Requests without `FIDELITY_KEY` in their extra_args pass untouched."""

    sink: Callable[[int, int, torch.Tensor], None] | None = None  # (prompt index, step, log-probs)

    def __init__(self, vllm_config, device, is_pin_memory):
        self.requests: dict[int, tuple[int, list[int] | None, list[int]]] = {}  # row -> (key, teacher, outputs)

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update) -> None:
        process_dict_updates(self.requests, batch_update, self._new_request)

    @staticmethod
    def _new_request(params, prompt_tok_ids, output_tok_ids):
        extra = params.extra_args or {}
        if FIDELITY_KEY not in extra:
            return None
        return extra[FIDELITY_KEY], extra.get(TEACHER_TOKENS), output_tok_ids

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row, (key, teacher, outputs) in self.requests.items():
            step = len(outputs)
            if teacher is not None and outputs != teacher[:step]:
                raise RuntimeError(f"teacher forcing of prompt {key} diverged at step {step}")
            if step >= 1:
                type(self).sink(key, step, logits[row].float().log_softmax(-1))
            if teacher is not None:
                logits[row] = float("-inf")
                logits[row, teacher[step]] = 0.0
        return logits
