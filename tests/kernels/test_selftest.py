"""The kernel self-test: passes for a correct backend, names the way out for a broken one."""

from __future__ import annotations

import pytest
import torch

from hf_onebit.kernels import cpu, selftest
from hf_onebit.kernels.selftest import KernelSelfTestError, self_test


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setattr(selftest, "_PASSED", set())
    monkeypatch.delenv("HF_ONEBIT_KERNELS", raising=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_cpu_kernels_pass_for_every_bucket_dtype(dtype):
    assert self_test("cpu", dtype) == "cpu"
    assert ("cpu", "cpu", dtype) in selftest._PASSED


def test_a_kernel_that_flips_a_bit_is_caught_with_the_way_out(monkeypatch):
    real = cpu.server_pack

    def one_bit_off(bits, scales, server_error, scale, bits_out, *, bounds=None):
        real(bits, scales, server_error, scale, bits_out, bounds=bounds)
        bits_out[3] ^= 4

    monkeypatch.setattr(cpu, "server_pack", one_bit_off)
    with pytest.raises(KernelSelfTestError, match=r"disagree with the reference.*server bits.*HF_ONEBIT_KERNELS=reference"):
        self_test("cpu")
    assert not selftest._PASSED


def test_a_kernel_that_cannot_compile_is_reported_as_such(monkeypatch):
    def no_compiler(*args, **kwargs):
        raise RuntimeError("Failed to find C compiler. Please specify via CC environment variable.")

    monkeypatch.setattr(cpu, "worker_scale", no_compiler)
    with pytest.raises(KernelSelfTestError, match=r"failed to compile or run on cpu.*C compiler.*HF_ONEBIT_KERNELS=reference"):
        self_test("cpu")


def test_the_reference_needs_no_test(monkeypatch):
    monkeypatch.setenv("HF_ONEBIT_KERNELS", "reference")
    monkeypatch.setattr(cpu, "worker_scale", None)  # would fail if called
    assert self_test("cpu") == "reference"


def test_a_vote_threshold_one_ulp_off_is_caught(monkeypatch):
    real = cpu.vote_threshold

    def one_ulp_off(m, b, g, *, beta, eps, m_out, b_out, theta):
        real(m, b, g, beta=beta, eps=eps, m_out=m_out, b_out=b_out, theta=theta)
        theta[17] = torch.nextafter(theta[17], torch.tensor(2.0))

    monkeypatch.setattr(cpu, "vote_threshold", one_ulp_off)
    with pytest.raises(KernelSelfTestError, match=r"disagree with the reference.*vote theta"):
        self_test("cpu")
