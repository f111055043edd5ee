"""What only the Triton backend has, run on CPU tensors through the Triton interpreter.

No host synchronisation (every decision about device values is taken on the device), the
``block`` tuning argument, its static piece tables, and the self-test that attach runs for
CUDA buckets. The operations it shares with the other backends are checked against the
reference for every backend in ``test_backend_*.py`` (how the interpreter is switched on:
:mod:`tests.kernels.backends`).
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.backends import load_triton, padded_length

T = load_triton()  # skips this module when triton is missing or cannot be interpreted


def forbid_host_reads(monkeypatch) -> None:
    """Make every method that reads a tensor's value on the host fail (a device sync on CUDA).

    (The interpreter itself reads memory through numpy, not through them.)
    """

    def forbidden(*args, **kwargs):
        raise AssertionError("host read of a tensor value (a device sync on CUDA)")

    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)


def test_no_host_sync(monkeypatch):
    """No wrapper reads a device value on the host (it would block on a CUDA stream)."""
    forbid_host_reads(monkeypatch)
    n, numel = 2, 50
    L = padded_length(numel, n)
    x, error, server_error = torch.randn(numel), torch.zeros(L), torch.zeros(L // n)
    scales = torch.stack([T.worker_scale(x, error), torch.ones(())])
    bits = torch.empty(L // 8, dtype=torch.uint8)
    T.worker_pack(x, error, scales, 0, bits)
    received = bits.view(n, -1)
    T.server_average(received, scales)
    t = T.server_scale(received, scales, server_error)
    out_bits = torch.empty(L // (8 * n), dtype=torch.uint8)
    T.server_pack(received, scales, server_error, t, out_bits)
    T.unpack_scaled(torch.stack([out_bits, out_bits]), torch.stack([t, t]), torch.empty(numel))
    monkeypatch.undo()
    assert error.abs().sum().item() > 0 and server_error.abs().sum().item() > 0


def test_pieces_no_host_sync(monkeypatch):
    """The piece variants read no device value on the host either (tables are built first)."""
    n, numel = 2, 50
    L = padded_length(numel, n)
    bounds, local, everything = [0, 16, 48, 64], [0, 16, 32], [0, 16, 48, 64]
    x, error, server_error = torch.randn(numel), torch.zeros(L), torch.zeros(L // n)
    for b, length in ((bounds, L), (local, L // n), (everything, L)):
        T._tables(b, length, T.DEFAULT_BLOCK, error.device)  # the static tables, built once
    forbid_host_reads(monkeypatch)
    own = T.worker_scale(x, error, bounds=bounds)
    scales = torch.stack([own, torch.ones(3)])
    bits = torch.empty(L // 8, dtype=torch.uint8)
    T.worker_pack(x, error, scales, 0, bits, bounds=bounds)
    received = bits.view(n, -1)
    chunk_scales = scales[:, :2].contiguous()
    t = T.server_scale(received, chunk_scales, server_error, bounds=local)
    out_bits = torch.empty(L // (8 * n), dtype=torch.uint8)
    T.server_pack(received, chunk_scales, server_error, t, out_bits, bounds=local)
    T.unpack_scaled(torch.stack([out_bits, out_bits]), torch.ones(3), torch.empty(numel), bounds=everything)
    monkeypatch.undo()
    assert error.abs().sum().item() > 0 and server_error.abs().sum().item() > 0


def test_block_must_be_a_power_of_two():
    with pytest.raises(ValueError, match="power of two"):
        T.worker_scale(torch.zeros(3), torch.zeros(16), block=100)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_self_test_passes_the_triton_kernels(monkeypatch, dtype):
    """What attach runs for CUDA buckets, here through the interpreter (the same kernels)."""
    from hf_onebit.kernels import selftest

    monkeypatch.setattr(selftest, "_PASSED", set())
    monkeypatch.setenv("HF_ONEBIT_KERNELS", "triton")
    assert selftest.self_test("cpu", dtype) == "triton"
