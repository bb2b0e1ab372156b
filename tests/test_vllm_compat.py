"""The vLLM version range and the shims for what differs between supported versions (vllm_adapter/compat.py)."""

import dataclasses
import logging

import pytest
import vllm

from vllm_nvfp4_plugin.vllm_adapter import compat


@pytest.mark.parametrize("version, inside", [("0.32.0+cpu", True), ("0.33.0", True), ("0.33.5.dev3", True),
                                             ("0.31.2", False), ("0.34.0", False), ("1.0.0", False)])
def test_version_outside_the_tested_range_warns_naming_it(monkeypatch, caplog, version, inside):
    monkeypatch.setattr(vllm, "__version__", version)
    with caplog.at_level(logging.WARNING, logger="vllm.nvfp4_plugin"):
        assert compat.check_vllm_version() is inside
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    if inside:
        assert warnings == []
    else:
        assert len(warnings) == 1 and compat.SUPPORTED_VLLM in warnings[0] and version.split("+")[0] in warnings[0]


def test_installed_vllm_is_inside_the_range():
    assert compat.check_vllm_version()


def test_prefill_chunk_fields_follow_the_class():
    import torch

    @dataclasses.dataclass
    class Before:
        cu_seqlen_ks: torch.Tensor

    @dataclasses.dataclass
    class After(Before):
        max_seqlen_k: int

    ks, ke = torch.tensor([0, 0, 5], dtype=torch.int32), torch.tensor([3, 4, 12], dtype=torch.int32)
    assert compat.prefill_chunk_extra_fields(Before, ks, ke) == {}
    assert compat.prefill_chunk_extra_fields(After, ks, ke) == {"max_seqlen_k": 7}
    empty = torch.zeros(0, dtype=torch.int32)
    assert compat.prefill_chunk_extra_fields(After, empty, empty) == {"max_seqlen_k": 0}


def test_cpu_backend_accepts_nvfp4_without_avx512(monkeypatch):
    """vLLM 0.33's CPU platform asks the backend's `supports_kv_cache_dtype`, whose vLLM version refuses every
    quantized dtype on hosts without AVX-512/AMX; the plugin's kernels need neither."""
    import torch

    from vllm_nvfp4_plugin.vllm_adapter.cpu_backend import NVFP4CPUAttentionBackend

    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert NVFP4CPUAttentionBackend.supports_kv_cache_dtype("nvfp4")
    assert NVFP4CPUAttentionBackend.supports_kv_cache_dtype("auto")
    assert not NVFP4CPUAttentionBackend.supports_kv_cache_dtype("turboquant_k8v4")
