"""Test-wide setup, run by pytest before any test module is imported."""
import os

import torch

# the tests' tensors are tiny: a thread hand-off costs more than the op it splits
torch.set_num_threads(1)

# Triton reads TRITON_INTERPRET when @triton.jit decorates the kernel, i.e. when kernels.py is
# imported: set it here, before any test imports kernels
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
