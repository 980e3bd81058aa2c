"""Test-wide setup, run by pytest before any test module is imported."""
import os

import pytest
import torch

# the tests' tensors are tiny: a thread hand-off costs more than the op it splits
torch.set_num_threads(1)

# Triton reads TRITON_INTERPRET when @triton.jit decorates the kernel, i.e. when kernels.py is
# imported: set it here, before any test imports kernels
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    """`gpu`-marked tests run the compiled kernel on CUDA tensors: skipped without CUDA, and under
    the interpreter (which replaces the compiled kernel for the whole process)."""
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        return
    skip = pytest.mark.skip(reason="needs CUDA and the compiled Triton kernel")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)
