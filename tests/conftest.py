"""Test-wide settings."""

import os

import torch

# Triton has no CPU backend: without a GPU, run Triton kernels in its interpreter. This must be
# set before triton is first imported anywhere in the test process.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Keep gloo ranks alive between tests (tests/distributed.py): spawning them costs more than most
# tests. HF_ONEBIT_TEST_FRESH_RANKS=1 spawns new ranks for every call instead (to rule the pool out).
from tests import distributed  # noqa: E402

distributed.KEEP_WORKERS = os.environ.get("HF_ONEBIT_TEST_FRESH_RANKS") != "1"


def pytest_sessionfinish(session, exitstatus):
    distributed.close_pools()
