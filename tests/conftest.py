"""Shared test configuration: GPU tests skip cleanly where there is no CUDA/cuDNN."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("KERAS_BACKEND", "torch")


def _gpu_available() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if _gpu_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU with cuDNN 9 (run on the device machine with -m gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
