"""The GPU tier: every test here is marked ``gpu`` and skipped where no CUDA device exists.

Run by ``bench/gpu_check.sh`` on a machine with one CUDA GPU (``pytest -m gpu tests/gpu``); on CPU-only
machines (CI) the tests are collected and skipped with one reason.
"""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA device (bench/gpu_check.sh runs this tier on a GPU)")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/") and not torch.cuda.is_available():
            item.add_marker(skip)
