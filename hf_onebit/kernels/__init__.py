"""1-bit compression kernels: one module per backend, each implementing one written contract
(:mod:`~hf_onebit.kernels.contract`: the operations, and the arguments every backend refuses alike).

* :mod:`~hf_onebit.kernels.reference`  plain torch, the definition (tests compare against it)
* :mod:`~hf_onebit.kernels.cpu`        numba loops for CPU tensors (gloo users)
* :mod:`~hf_onebit.kernels.triton`     Triton kernels for CUDA tensors

:func:`get_backend` picks one by device; ``HF_ONEBIT_KERNELS=reference|cpu|triton`` overrides it.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import torch

BACKENDS = ("reference", "cpu", "triton")
ENV_VAR = "HF_ONEBIT_KERNELS"  # forces a backend: reference | cpu | triton


def load_backend(name: str) -> ModuleType:
    """Import backend ``name`` (one of :data:`BACKENDS`)."""
    if name not in BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}; choose one of {', '.join(BACKENDS)}")
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as exc:
        if exc.name != "triton":
            raise
        # Never fall back to other kernels silently: the reference is ~100x slower on a GPU.
        raise ImportError(
            f"hf_onebit compresses CUDA tensors with Triton kernels, and triton cannot be imported ({exc})."
            " CUDA wheels of torch install the Triton they pin: reinstall your CUDA build of torch, or"
            " pip install the triton version `pip show torch` requires (3.4 or later); to run without it,"
            f" {ENV_VAR}=reference (slow)"
        ) from exc


def get_backend(device: torch.device | str) -> ModuleType:
    """The kernel module for tensors on ``device``.

    CPU tensors use the numba path, CUDA tensors the Triton kernels. The environment variable
    ``HF_ONEBIT_KERNELS`` forces a backend (e.g. ``reference`` to debug a suspected kernel bug).
    """
    forced = os.environ.get(ENV_VAR)
    if forced:
        return load_backend(forced)
    device = torch.device(device)
    if device.type == "cpu":
        return load_backend("cpu")
    if device.type == "cuda":
        return load_backend("triton")
    raise ValueError(
        f"hf_onebit has no compression kernels for device type {device.type!r} (cpu and cuda are"
        f" supported); set {ENV_VAR}=reference to run the slow reference kernels on it"
    )
