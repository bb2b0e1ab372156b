"""Shared pytest setup: the markers each test file carries, the `device` fixture, and skipping GPU cases.

Markers (registered in pyproject.toml):
- `gpu`: needs a CUDA device; skipped when none is available. Tests taking the `device` fixture run on "cpu"
  and, as a `gpu` case, on "cuda", so the CPU and CUDA kernels of an op are checked by the same cases.
- `vllm`: builds vLLM configs, layers or engines (the files in VLLM_FILES).
- `e2e`: runs a model end to end: engines, `vllm serve`, lm-eval, generation (E2E_FILES, E2E_TESTS); seconds to
  minutes each.
- `slow`: sweeps of every float through the E2M1 encoders, the hypothesis fuzzing of the ops, and re-runs of the
  op tests under each forced CPU instruction set (SLOW_FILES, SLOW_TESTS); tens of seconds each.

`bash scripts/test.sh --fast` runs `-m "not e2e and not slow"`: the ops, the reference, the attention and
indexer cores, the KV-cache spec and vLLM's layers with the plugin, in a few minutes. CI runs everything.
"""

from pathlib import Path

import pytest
import torch

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]

VLLM_FILES = {"test_cuda_backend.py", "test_indexer.py", "test_spec.py", "test_vllm_compat.py",
              "test_vllm_engine.py", "test_serving.py", "test_kv_fidelity.py", "test_tensor_parallel.py",
              "test_demo.py", "test_evals_e2e.py", "test_reliability.py", "test_model_coverage.py"}
E2E_FILES = {"test_vllm_engine.py", "test_serving.py", "test_kv_fidelity.py", "test_tensor_parallel.py",
             "test_demo.py", "test_evals_e2e.py", "test_reliability.py", "test_model_coverage.py"}
E2E_TESTS = {"test_smollm2_answers_a_question"}
SLOW_FILES = {"test_e2m1_exhaustive.py", "test_fuzz.py"}
SLOW_TESTS = {"test_avx512_e2m1_encoder_equals_reference_ladder_on_every_float",
              "test_lower_instruction_sets_match_reference", "test_default_instruction_set_matches_reference",
              "test_unknown_instruction_set_is_rejected", "test_instruction_set_variants_agree",
              "test_fuzz_against_reference"}


def pytest_collection_modifyitems(config, items):
    skip_gpu = None if torch.cuda.is_available() else pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        name = Path(str(item.fspath)).name
        if name in VLLM_FILES:
            item.add_marker(pytest.mark.vllm)
        if name in E2E_FILES or item.originalname in E2E_TESTS:
            item.add_marker(pytest.mark.e2e)
        if name in SLOW_FILES or item.originalname in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)
        if skip_gpu and "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    return request.param
