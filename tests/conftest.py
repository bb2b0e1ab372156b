"""Shared pytest setup: the `gpu` marker and the `device` fixture.

Tests marked `gpu` are skipped when no CUDA device is available (CI runs on a GPU-less machine). Tests
taking the `device` fixture run on "cpu" and, as a `gpu`-marked case, on "cuda", so the CPU and CUDA
kernels of an op are checked by the same cases.
"""

import pytest
import torch

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped when torch.cuda.is_available() is false")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    return request.param
