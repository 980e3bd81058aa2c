"""Test-wide setup, run by pytest before any test module is imported."""
import os

import torch

# small ops on this 2-core VM run ~50x slower with 2 threads (notes/toolchain.md §4)
torch.set_num_threads(1)

# Triton reads TRITON_INTERPRET when @triton.jit decorates the kernel, i.e. when kernels.py is
# imported: set it here, before any test imports kernels (notes/toolchain.md §2)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
