"""The server operations of every fast backend against the reference (spec §1), and the whole
compressed all-reduce of ``n`` simulated ranks.

``server_average`` bitwise (its summation order is part of the spec), ``server_scale`` to 1e-6
relative, ``server_pack`` (bits and server error) bitwise over successive steps; a non-finite
scale leaves the server error untouched.
"""

from __future__ import annotations

import pytest
import torch

from hf_onebit.kernels import reference as ref
from tests.kernels.backends import (
    BLOCKS,
    DTYPES,
    assert_bitwise_equal,
    assert_scale_close,
    backends,
    dtype_id,
    garbage_bytes,
    make_bits,
    make_scales,
    make_x,
    padded_length,
    per_backend,
)

# Equal scales make many averages exactly 0 (sign⁺ must give +1 there); distinct ones with
# n = 3 make divisions that are inexact, where only an IEEE division matches the reference.
SCALE_KINDS = ("random", "equal")


def server_scales(n: int, kind: str, step: int) -> torch.Tensor:
    scales = make_scales(n, step) if kind == "random" else torch.full((n,), 0.375)
    scales *= step + 1
    if step == 1:
        scales[0] = 0.0  # ±0.0 terms: the +0.0 start of the sum matters bitwise
    return scales


# numba: chunks up to 2**17 + 8 (many of its 2048-element blocks). Triton: 4104 = one byte row
# more than the largest block (two programs even at block 4096), left out for the smallest block,
# where it only costs interpreter time (1000 is already 16 blocks).
SERVER_CASES = per_backend(
    "chunk, n, kind",
    cpu=[(chunk, n, kind) for chunk in (0, 8, 64, 8000, 2**17 + 8) for n in (1, 2, 3, 4) for kind in SCALE_KINDS],
    triton=[(block, chunk, n, kind) for chunk in (0, 8, 24, 1000, 4104) for block in BLOCKS
            if not (chunk == 4104 and block == 64) for n in (1, 2, 3, 4) for kind in SCALE_KINDS],
)


@pytest.mark.parametrize(*SERVER_CASES)  # n = 3: the division by n is not a power of two
def test_server_ops_match_reference(backend, chunk, n, kind):
    se_ref = torch.zeros(chunk)
    se_got = torch.zeros(chunk)
    for step in range({"cpu": 5, "triton": 3}[backend.name]):
        bits = make_bits(n, chunk // 8, seed=chunk + n + step)
        scales = server_scales(n, kind, step)
        avg = backend.server_average(bits, scales)
        assert avg.dtype == torch.float32 and avg.shape == (chunk,)
        assert_bitwise_equal(avg, ref.server_average(bits, scales), f"average at step {step}")

        t_ref = ref.server_scale(bits, scales, se_ref)
        t_got = backend.server_scale(bits, scales, se_got)
        assert_scale_close(t_got, t_ref)

        o_ref = torch.empty(chunk // 8, dtype=torch.uint8)
        o_got = garbage_bytes(chunk // 8, 0x5A)
        ref.server_pack(bits, scales, se_ref, t_ref, o_ref)
        backend.server_pack(bits, scales, se_got, t_ref, o_got)
        assert_bitwise_equal(o_got, o_ref, f"bits at step {step}")
        assert_bitwise_equal(se_got, se_ref, f"server error at step {step}")
    if chunk and n > 1:
        assert se_got.abs().max() > 0


@pytest.mark.parametrize("backend", backends())
def test_server_average_sums_in_rank_order(backend):
    # 1e8 + 1 - 1e8 in fp32 is 0, (1e8 - 1e8) + 1 would be 1: the order is observable.
    scales = torch.tensor([1e8, 1.0, 1e8])
    bits = torch.tensor([[0xFF], [0xFF], [0x00]], dtype=torch.uint8)
    avg = backend.server_average(bits, scales)
    assert_bitwise_equal(avg, ref.server_average(bits, scales))
    assert avg[0].item() == 0.0


@pytest.mark.parametrize("backend", backends())
def test_server_average_hand_computed(backend):
    # Row 0 (s = 1): + - + - + - + -    Row 1 (s = 0.5): + + + + - - - -
    bits = torch.tensor([[0b10101010], [0b11110000]], dtype=torch.uint8)
    scales = torch.tensor([1.0, 0.5])
    expected = torch.tensor([1.5, -0.5, 1.5, -0.5, 0.5, -1.5, 0.5, -1.5]) / 2
    assert_bitwise_equal(backend.server_average(bits, scales), expected)


@pytest.mark.parametrize("backend", backends(triton_blocks=(256,)))
@pytest.mark.parametrize("bad", (float("nan"), float("inf")), ids=str)
def test_server_pack_with_non_finite_scale_leaves_error_untouched(backend, bad):
    bits = make_bits(2, 125, seed=7)
    scales = make_scales(2, 7)
    se = torch.randn(1000, generator=torch.Generator().manual_seed(4))
    before = se.clone()
    out = torch.empty(125, dtype=torch.uint8)
    out_ref = torch.empty(125, dtype=torch.uint8)
    backend.server_pack(bits, scales, se, torch.tensor(bad), out)
    ref.server_pack(bits, scales, before.clone(), torch.tensor(bad), out_ref)
    assert_bitwise_equal(se, before)
    assert_bitwise_equal(out, out_ref)
    assert_bitwise_equal(out, ref.pack_signs(ref.server_average(bits, scales) + before))


@pytest.mark.parametrize("backend", backends())
def test_server_ops_with_a_non_finite_worker_scale(backend):
    gen = torch.Generator().manual_seed(5)
    bits = torch.randint(0, 256, (2, 16), dtype=torch.uint8, generator=gen)
    scales = torch.tensor([float("nan"), 1.0])
    err = torch.randn(128, generator=gen)
    before = err.clone()
    t = backend.server_scale(bits, scales, err)
    assert torch.isnan(t)
    out = torch.empty(16, dtype=torch.uint8)
    out_ref = torch.empty(16, dtype=torch.uint8)
    backend.server_pack(bits, scales, err, t, out)
    ref.server_pack(bits, scales, before.clone(), t, out_ref)
    assert_bitwise_equal(err, before)
    assert_bitwise_equal(out, out_ref)


# --------------------------------------------------------------------------------------------
# The whole compressed all-reduce, simulated for n ranks in one process
# --------------------------------------------------------------------------------------------


def compressed_all_reduce(backend, xs, worker_errors, server_errors, out_dtype):
    """Spec §1 with the all-to-all and all-gathers done by indexing. Returns rank 0's result."""
    n = len(xs)
    L = worker_errors[0].numel()
    scales = torch.stack([backend.worker_scale(x, e) for x, e in zip(xs, worker_errors)])
    sent = []
    for rank, (x, e) in enumerate(zip(xs, worker_errors)):
        bits = torch.empty(L // 8, dtype=torch.uint8)
        backend.worker_pack(x, e, scales, rank, bits)
        sent.append(bits.view(n, -1))  # row j goes to rank j
    server_bits, server_scales = [], []
    for j in range(n):
        received = torch.stack([sent[i][j] for i in range(n)])
        t = backend.server_scale(received, scales, server_errors[j])
        out_bits = torch.empty(L // (8 * n), dtype=torch.uint8)
        backend.server_pack(received, scales, server_errors[j], t, out_bits)
        server_bits.append(out_bits)
        server_scales.append(t)
    result = torch.empty(xs[0].numel(), dtype=out_dtype)
    backend.unpack_scaled(torch.stack(server_bits), torch.stack(server_scales), result)
    return scales, result


@pytest.mark.parametrize("backend", backends(triton_blocks=(256,)))
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("n", (2, 4), ids="n{}".format)
def test_compressed_all_reduce_pipeline(backend, n, dtype):
    numel = 1003
    L = padded_length(numel, n)
    state = {
        name: ([torch.zeros(L) for _ in range(n)], [torch.zeros(L // n) for _ in range(n)])
        for name in ("ref", "got")
    }
    for step in range(3):
        xs = [make_x(numel, dtype, seed=10 * step + i) for i in range(n)]
        s_ref, r_ref = compressed_all_reduce(ref, xs, *state["ref"], dtype)
        s_got, r_got = compressed_all_reduce(backend, xs, *state["got"], dtype)
        torch.testing.assert_close(s_got, s_ref, rtol=1e-6, atol=0.0)
        assert_bitwise_equal(r_got, r_ref, f"result at step {step}")
        for a, b in zip(state["got"][0] + state["got"][1], state["ref"][0] + state["ref"][1]):
            torch.testing.assert_close(a, b, rtol=0.0, atol=1e-6)
