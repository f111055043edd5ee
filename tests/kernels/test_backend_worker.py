"""The worker operations of every fast backend against the reference (spec §1).

``worker_scale`` (to 1e-6 relative) and ``worker_pack`` (bits and error buffer bitwise), over
successive error-feedback steps, for every input dtype; non-finite scales leave the error untouched.
"""

from __future__ import annotations

import math

import pytest
import torch

from hf_onebit.kernels import get_backend
from hf_onebit.kernels import reference as ref
from tests.kernels.backends import (
    BIG,
    BLOCKS,
    DTYPES,
    assert_bitwise_equal,
    assert_pack_like_reference,
    assert_scale_close,
    backends,
    make_scales,
    make_x,
    padded_length,
    per_backend,
)


@pytest.mark.parametrize("backend", backends())
def test_backend_selection(backend, monkeypatch):
    monkeypatch.delenv("HF_ONEBIT_KERNELS", raising=False)
    assert get_backend({"cpu": "cpu", "triton": "cuda"}[backend.name]) is backend.module
    assert set(ref.__all__) <= set(backend.module.__all__)


# numba: every length (2**20 + 3 crosses its 2048-element blocks) over 20 steps; Triton: every
# length up to 1000 at each block size, and the big buffer once per dtype at the largest block.
WORKER_CASES = per_backend(
    "numel, n, dtype",
    cpu=[(numel, n, dtype) for dtype in DTYPES for numel in (0, 1, 7, 8, 9, 1000, BIG) for n in (1, 2, 4)],
    triton=[(block, numel, n, dtype) for block in BLOCKS for dtype in DTYPES for numel in (0, 1, 7, 8, 9, 1000)
            for n in (1, 2, 4)] + [(4096, BIG, 4, dtype) for dtype in DTYPES],
)


@pytest.mark.parametrize(*WORKER_CASES)
def test_worker_ops_match_reference(backend, numel, n, dtype):
    """Successive scale+pack calls on one error buffer, reference and backend side by side.

    Both packs get the *same* scales (the reference's, as an all-gather would deliver them), so
    a one-ulp difference in a scale cannot flip a bit several steps later and bits and error
    must agree exactly; each side keeps feeding its own error back in.
    """
    # The big buffer gets fewer steps: the reference's allocations (and the interpreter) are slow.
    steps = {"cpu": 20, "triton": 3}[backend.name] if numel < BIG else {"cpu": 8, "triton": 2}[backend.name]
    L = padded_length(numel, n)
    e_ref = torch.zeros(L)
    e_got = torch.zeros(L)
    for step in range(steps):
        x = make_x(numel, dtype, seed=10 * numel + n + step, magnitude=1 + step)
        s_ref = ref.worker_scale(x, e_ref)
        s_got = backend.worker_scale(x, e_got)
        assert_scale_close(s_got, s_ref)
        if L:
            assert s_ref > 0
        rank = step % n
        scales = make_scales(n, step)  # the other ranks' scales
        scales[rank] = s_ref
        assert_pack_like_reference(backend, x, e_got, e_ref, scales, rank, f"at step {step}")
    if L:  # the error feedback actually did something (not trivially equal)
        assert e_got.abs().max() > 0


# Not Triton with bf16: the Triton 3.9 interpreter decodes bf16 subnormals wrongly (its
# _convert_float: 0x8001 loads as -0.0), which says nothing about the GPU's exact conversion.
@pytest.mark.parametrize(*per_backend(
    "dtype", cpu=[(torch.bfloat16,), (torch.float16,)], triton=[(4096, torch.float16)]))
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy on NaN inputs
def test_every_16_bit_input_pattern_is_decoded_exactly(backend, dtype):
    # With scale 0 the new error is y - (±0) = y = fp32(x) + 0: the decoded input, bitwise.
    x = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    error = torch.zeros(x.numel())
    bits = torch.empty(x.numel() // 8, dtype=torch.uint8)
    bits_ref = torch.empty_like(bits)
    backend.worker_pack(x, error, torch.zeros(1), 0, bits)
    ref.worker_pack(x, torch.zeros(x.numel()), torch.zeros(1), 0, bits_ref)
    assert_bitwise_equal(error, x.float() + 0.0)
    assert_bitwise_equal(bits, bits_ref)


@pytest.mark.parametrize(*per_backend(
    "layout", cpu=[("strided",), ("2-D",)],
    triton=[(64, "strided"), (64, "2-D")]))
def test_worker_inputs_of_other_layouts_and_dtypes(backend, layout):
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(2 * 1000 + 1, generator=gen, dtype=torch.float64)
    x = base[::2] if layout == "strided" else base[:1000].reshape(10, 100)  # float64 either way
    error = torch.randn(1008, generator=gen)
    e_ref = error.clone()
    assert_scale_close(backend.worker_scale(x, error), ref.worker_scale(x, e_ref))
    assert_pack_like_reference(backend, x, error, e_ref, torch.tensor([0.7]), 0)


@pytest.mark.parametrize("backend", backends())
def test_sign_conventions(backend):
    # zero -> bit 1 (+1), -0.0 -> bit 1, negative -> 0, NaN -> 0; MSB first.
    x = torch.tensor([0.0, -0.0, -1.0, float("nan"), 2.0, -3.0, 1e-30, -1e-30])
    bits = torch.empty(1, dtype=torch.uint8)
    backend.worker_pack(x, torch.zeros(8), torch.ones(1), 0, bits)
    assert bits.item() == 0b11001010


@pytest.mark.parametrize("backend", backends())
def test_worker_hand_computed(backend):
    """A case worked out by hand, so the test does not only trust the reference."""
    x = torch.tensor([1.0, -2.0, 0.0, -0.0, 3.0, -1.0, 2.0, -5.0, 4.0])
    error = torch.zeros(16)
    s = backend.worker_scale(x, error)
    expected_s = math.sqrt((1 + 4 + 9 + 1 + 4 + 25 + 16) / 16)
    assert s.item() == pytest.approx(expected_s, rel=1e-7)

    bits = torch.empty(2, dtype=torch.uint8)
    backend.worker_pack(x, error, s.reshape(1), 0, bits)
    # y >= 0 -> 1, MSB first: [1,0,1,1,1,0,1,0] = 0xBA; [4, then 7 zeros of padding] = 0xFF.
    assert bits.tolist() == [0xBA, 0xFF]
    y = torch.cat([x, torch.zeros(7)])
    expected_error = y - s * torch.where(y >= 0, 1.0, -1.0)
    assert_bitwise_equal(error, expected_error)


@pytest.mark.parametrize("backend", backends())
def test_worker_padding_only(backend):
    """x empty but L > 0: everything comes from the error buffer (the padding has an error too)."""
    e_ref = torch.randn(16)
    e_got = e_ref.clone()
    x = torch.empty(0, dtype=torch.float16)
    assert_scale_close(backend.worker_scale(x, e_got), ref.worker_scale(x, e_ref))
    assert_pack_like_reference(backend, x, e_got, e_ref, torch.tensor([0.7, 1.3]), 1)


@pytest.mark.parametrize("backend", backends())
def test_worker_scales_read_only_up_to_n(backend):
    """n = 3 (Triton pads its in-kernel arange to 4): the 4th value in memory must not be read."""
    storage = torch.tensor([0.5, 0.75, 1.25, float("nan")])
    scales = storage[:3]
    x = make_x(40, torch.float32, seed=5)
    L = padded_length(x.numel(), 3)
    e_ref = torch.randn(L)
    e_got = e_ref.clone()
    assert_pack_like_reference(backend, x, e_got, e_ref, scales, 2)
    assert not torch.equal(e_got, torch.zeros(L))


@pytest.mark.parametrize(*per_backend(
    "dtype", cpu=[(d,) for d in DTYPES], triton=[(block, d) for block in (64, 4096) for d in DTYPES]))
def test_nan_in_x_leaves_error_untouched(backend, dtype):
    x = make_x(1000, torch.float32, seed=3)
    x[123] = float("nan")
    x = x.to(dtype)
    L = padded_length(x.numel(), 2)
    error = torch.randn(L, generator=torch.Generator().manual_seed(2))
    before = error.clone()
    s = backend.worker_scale(x, error)
    assert torch.isnan(s) and torch.isnan(ref.worker_scale(x, before.clone()))
    scales = torch.stack([torch.tensor(0.9), s])  # this rank is 1, its scale is NaN
    b_ref, b_got = torch.empty(L // 8, dtype=torch.uint8), torch.empty(L // 8, dtype=torch.uint8)
    ref.worker_pack(x, before.clone(), scales, 1, b_ref)
    backend.worker_pack(x, error, scales, 1, b_got)
    assert_bitwise_equal(error, before)
    assert_bitwise_equal(b_got, b_ref)  # the bits are still written; NaN packs as 0
    assert (b_got[123 // 8] >> (7 - 123 % 8)) & 1 == 0


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("bad", (float("nan"), float("inf"), float("-inf")), ids=str)
@pytest.mark.parametrize("n, bad_rank, rank", ((2, 1, 0), (3, 2, 0), (3, 1, 0), (4, 0, 1)), ids=str)
def test_non_finite_scale_of_another_rank_leaves_error_untouched(backend, bad, n, bad_rank, rank):
    x = make_x(100, torch.float32, seed=4)
    L = padded_length(x.numel(), n)
    error = torch.randn(L, generator=torch.Generator().manual_seed(3))
    before = error.clone()
    scales = make_scales(n, 4)
    scales[bad_rank] = bad
    bits = torch.empty(L // 8, dtype=torch.uint8)
    bits_ref = torch.empty(L // 8, dtype=torch.uint8)
    backend.worker_pack(x, error, scales, rank, bits)
    ref.worker_pack(x, before.clone(), scales, rank, bits_ref)
    assert_bitwise_equal(error, before)
    assert_bitwise_equal(bits, bits_ref)
    assert_bitwise_equal(bits, ref.pack_signs(ref._padded(x, L) + before))
    # ... and with all scales finite the same call does update it
    scales[bad_rank] = 1.0
    backend.worker_pack(x, error, scales, rank, bits)
    assert not torch.equal(error, before)


@pytest.mark.parametrize("backend", backends())
def test_empty_buffer(backend):
    error = torch.zeros(0)
    bits = torch.empty(0, dtype=torch.uint8)
    s = backend.worker_scale(torch.empty(0, dtype=torch.bfloat16), error)
    assert s.dtype == torch.float32 and s.dim() == 0 and s.item() == 0.0
    backend.worker_pack(torch.zeros(0), error, torch.zeros(1), 0, bits)
    backend.worker_pack(torch.empty(0), torch.empty(0), torch.ones(2), 1, bits)  # launches nothing
    rows = torch.empty(2, 0, dtype=torch.uint8)
    assert backend.server_scale(rows, torch.ones(2), torch.zeros(0)).item() == 0.0
    backend.server_pack(rows, torch.ones(2), torch.zeros(0), torch.tensor(1.0), bits)
    assert backend.server_average(rows, torch.ones(2)).numel() == 0
    backend.unpack_scaled(rows, torch.ones(2), torch.empty(0))


@pytest.mark.parametrize("backend", backends())
def test_bad_arguments_are_refused(backend):
    x, error = torch.randn(16), torch.zeros(16)
    with pytest.raises(TypeError, match="error"):
        backend.worker_scale(x, torch.zeros(16, dtype=torch.float64))
    with pytest.raises(ValueError):
        backend.worker_pack(x, torch.zeros(32)[::2], torch.ones(1), 0, torch.empty(2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="bits_out"):
        backend.worker_pack(x, error, torch.ones(1), 0, torch.empty(3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="bits_out"):
        backend.worker_pack(torch.zeros(3), error, torch.ones(1), 0, torch.empty(3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="rank"):
        backend.worker_pack(torch.zeros(3), error, torch.ones(2), 2, torch.empty(2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="padded length"):
        backend.worker_scale(torch.randn(17), error)
    with pytest.raises(ValueError):
        backend.server_scale(torch.zeros(2, 2, dtype=torch.uint8), torch.ones(3), torch.zeros(16))
    with pytest.raises(ValueError, match="server_error"):
        backend.server_scale(torch.zeros(2, 1, dtype=torch.uint8), torch.ones(2), torch.zeros(16))
    with pytest.raises(ValueError, match="out has"):
        backend.unpack_scaled(torch.zeros(2, 2, dtype=torch.uint8), torch.ones(2), torch.empty(33))
    with pytest.raises(ValueError, match="out has"):
        backend.unpack_scaled(torch.zeros(2, 1, dtype=torch.uint8), torch.ones(2), torch.zeros(17))
