"""Test-wide settings."""

import os

import torch

# Triton has no CPU backend: without a GPU, run Triton kernels in its interpreter. This must be
# set before triton is first imported anywhere in the test process.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
