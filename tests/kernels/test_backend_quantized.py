"""The b-bit operations (``q*``, spec §1b) of every fast backend against the reference.

The b-bit results are defined exactly (max-abs scales, IEEE division, round half to even, fp32
products without fused multiply-adds, the server sum in rank order), so everything is compared
bitwise, scales included (NaN scales only as NaN: their payload is not part of the contract).
Widths 8 and 4, every input dtype, with and without pieces (``bounds``, with an empty piece);
non-finite inputs leave every error buffer untouched; an all-zero buffer and a hand-computed case
check the conventions without trusting the reference; every element's error is at most half a
quantisation step and equals ``y`` minus what :func:`qunpack_scaled` decodes.

Triton runs under its interpreter, at small sizes. Its ``q*`` functions get the ``block`` of the
test id only if they take one (``tests.kernels.backends.TUNED`` lists the 1-bit operations only).
"""

from __future__ import annotations

import functools
import inspect

import pytest
import torch

from hf_onebit.kernels import contract
from hf_onebit.kernels import reference as ref
from tests.kernels.backends import (
    DTYPES,
    ON_DEVICE,
    assert_bitwise_equal,
    backends,
    garbage_bytes,
    make_bits,
    make_bounds,
    make_scales,
    make_x,
    padded_length,
    per_backend,
    piece_x,
    through_device,
)

WIDTHS = contract.WIDTHS
F32, BF16, F16 = DTYPES


class QOps:
    """``backend``'s operations, with its tuning arguments (Triton's ``block``) passed to every
    function that takes them."""

    def __init__(self, backend) -> None:
        self.backend = backend

    def __getattr__(self, op: str):
        fn = getattr(self.backend.module, op)
        params = inspect.signature(fn).parameters
        kw = {k: v for k, v in self.backend.kw.items() if k in params}
        fn = functools.partial(fn, **kw) if kw else fn
        return through_device(fn) if ON_DEVICE and self.backend.name == "triton" else fn


def steps_for(backend) -> int:
    return {"cpu": 5, "triton": 3}[backend.name]


def code_bytes(numel: int, width: int) -> int:
    return numel * width // 8


def assert_scales_equal(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """fp32, same shape, bitwise equal; a NaN only has to be a NaN where the reference has one."""
    assert actual.dtype == torch.float32 and actual.shape == expected.shape, what
    nan_a, nan_e = torch.isnan(actual), torch.isnan(expected)
    assert torch.equal(nan_a, nan_e), f"{what}: NaN at {nan_a.nonzero().tolist()} vs {nan_e.nonzero().tolist()}"
    assert_bitwise_equal(torch.where(nan_a, 0.0, actual), torch.where(nan_e, 0.0, expected), what)


assert_values_equal = assert_scales_equal  # the same NaN-tolerant comparison, for any fp32 values


def wide_scales(count: int, seed: int) -> torch.Tensor:
    """Positive scales over orders of magnitude (1e-5 .. 10)."""
    return make_scales(count, seed) * 10.0 ** (torch.arange(count) % 7 - 5)


def expand(scales: torch.Tensor, bounds, length: int) -> torch.Tensor:
    """One scale per element (one scale for everything without ``bounds``)."""
    if bounds is None:
        return scales.reshape(()).expand(length)
    return ref._expand(scales.reshape(-1), bounds)


# --------------------------------------------------------------------------------------------
# Worker side
# --------------------------------------------------------------------------------------------

# numba: lengths across its blocks, n = 1, 2, 3, every dtype; Triton: a few small cases.
WORKER_CASES = per_backend(
    "numel, n, width, dtype, pieces",
    cpu=[(numel, n, width, dtype, pieces) for width in WIDTHS for dtype in DTYPES
         for numel in (0, 9, 1001, 2**13 + 3) for n in (1, 2, 3) for pieces in (False, True)],
    triton=[(64, numel, n, width, dtype, pieces) for width in WIDTHS
            for numel, n, dtype in ((9, 1, F32), (1001, 3, F32), (200, 2, BF16), (100, 3, F16))
            for pieces in (False, True)]
    + [(4096, 5000, 2, width, F32, True) for width in WIDTHS],
)


@pytest.mark.parametrize(*WORKER_CASES)
def test_qworker_ops_match_reference(backend, numel, n, width, dtype, pieces):
    """Successive scale+pack calls on one error buffer, reference and backend side by side, each
    feeding its own error back in; both packs get the same scales."""
    q = QOps(backend)
    L = padded_length(numel, n)
    bounds = make_bounds(L, numel + 7 * n, pieces=6) if pieces else None
    P = len(bounds) - 1 if pieces else 1
    e_ref, e_got = torch.zeros(L), torch.zeros(L)
    for step in range(steps_for(backend)):
        if pieces:
            x = piece_x(numel, bounds, dtype, seed=step)
        else:
            x = make_x(numel, dtype, seed=10 * numel + n + step, magnitude=1 + step)
        s_ref = ref.qworker_scale(x, e_ref, width=width, bounds=bounds)
        s_got = q.qworker_scale(x, e_got, width=width, bounds=bounds)
        assert_scales_equal(s_got, s_ref, f"scale at step {step}")
        assert s_got.shape == ((P,) if pieces else ())
        rank = step % n
        scales = wide_scales(n * P, step).reshape(n, P) if pieces else make_scales(n, step)
        scales[rank] = s_ref
        if step == 2:  # a smaller scale than max|y|/Q: levels beyond Q are clamped
            scales[rank] = s_ref * 0.37
        if step == 3 and pieces and P:
            scales[rank, 0] = 0.0  # a zero piece scale: q = 0, error = y
        c_ref = torch.empty(code_bytes(L, width), dtype=torch.uint8)
        c_got = garbage_bytes(code_bytes(L, width))
        ref.qworker_pack(x, e_ref, scales, rank, c_ref, width=width, bounds=bounds)
        q.qworker_pack(x, e_got, scales, rank, c_got, width=width, bounds=bounds)
        assert_bitwise_equal(c_got, c_ref, f"codes at step {step}")
        assert_bitwise_equal(e_got, e_ref, f"error at step {step}")
    if L:  # the error feedback did something (not trivially equal)
        assert e_got.abs().max() > 0


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("width", WIDTHS)
def test_qworker_hand_computed(backend, width):
    """Levels, codes and layout worked out by hand (not only trusting the reference)."""
    q = QOps(backend)
    Q = ref.levels(width)
    assert Q == {8: 127, 4: 7}[width]
    x = torch.tensor([Q, -Q, 2.5, 3.5, -2.5, 0.5, -0.5, 1.49, 0.0, -0.0, 6.5])
    y = torch.cat([x, torch.zeros(5)]) + 0.0  # padded to 16; + 0.0 as the kernels add the error (-0.0 -> +0.0)
    error = torch.zeros(16)
    s = q.qworker_scale(x, error, width=width)
    assert_bitwise_equal(s, torch.tensor(1.0))  # max|y| / Q, exact here
    for scale in (1.0, 0.5, 0.3):  # 0.5, 0.3: levels beyond Q are clamped
        e = torch.zeros(16)
        codes = garbage_bytes(code_bytes(16, width))
        q.qworker_pack(x, e, torch.tensor([scale, 9.0]), 0, codes, width=width)
        s32 = torch.tensor(scale, dtype=torch.float32)
        # Python's round() is round-half-even; y / s as one fp32 division
        levels = [max(-Q, min(Q, round((v / s32).item()))) for v in y]
        want = [lv + Q for lv in levels]
        if width == 4:  # two codes per byte, the first element in the high nibble
            want = [hi * 16 + lo for hi, lo in zip(want[0::2], want[1::2])]
        assert codes.tolist() == want, scale
        assert_bitwise_equal(e, y - s32 * torch.tensor(levels, dtype=torch.float32), f"error at {scale}")


@pytest.mark.parametrize(*per_backend(
    "width", cpu=[(w,) for w in WIDTHS], triton=[(64, w) for w in WIDTHS]))
def test_qworker_inputs_of_other_layouts_and_padding_only(backend, width):
    """A strided float64 ``x`` (one fp32 rounding, like the reference), and an empty ``x`` with
    ``L > 0`` (everything comes from the error buffer)."""
    q = QOps(backend)
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(2 * 1000 + 1, generator=gen, dtype=torch.float64)
    for x, L in ((base[::2], 1008), (base[:1000].reshape(10, 100), 1008), (torch.empty(0, dtype=F16), 16)):
        e_ref = torch.randn(L, generator=gen)
        e_got = e_ref.clone()
        s = ref.qworker_scale(x, e_ref, width=width)
        assert_scales_equal(q.qworker_scale(x, e_got, width=width), s)
        c_ref, c_got = torch.empty(code_bytes(L, width), dtype=torch.uint8), garbage_bytes(code_bytes(L, width))
        ref.qworker_pack(x, e_ref, torch.stack([torch.tensor(0.7), s]), 1, c_ref, width=width)
        q.qworker_pack(x, e_got, torch.stack([torch.tensor(0.7), s]), 1, c_got, width=width)
        assert_bitwise_equal(c_got, c_ref)
        assert_bitwise_equal(e_got, e_ref)


# --------------------------------------------------------------------------------------------
# Server side
# --------------------------------------------------------------------------------------------

# numba: up to 5000, across its 2048-element blocks at either width; Triton: small chunks.
SERVER_CASES = per_backend(
    "chunk, n, width, pieces",
    cpu=[(chunk, n, width, pieces) for chunk in (0, 8, 64, 5000) for n in (1, 2, 3)
         for width in WIDTHS for pieces in (False, True)],
    triton=[(64, chunk, n, width, pieces) for chunk, n in ((8, 1), (1000, 3), (200, 2)) for width in WIDTHS
            for pieces in (False, True)],
)


@pytest.mark.parametrize(*SERVER_CASES)  # n = 3: the division by n is not a power of two
def test_qserver_ops_match_reference(backend, chunk, n, width, pieces):
    q = QOps(backend)
    bounds = make_bounds(chunk, chunk + 11 * n) if pieces else None
    P = len(bounds) - 1 if pieces else 1
    se_ref, se_got = torch.zeros(chunk), torch.zeros(chunk)
    for step in range(steps_for(backend)):
        # every byte value: codes outside [0, 2Q] (255, a nibble of 15) decode as in the reference
        codes = make_bits(n, code_bytes(chunk, width), seed=chunk + n + step)
        scales = wide_scales(n * P, step).reshape(n, P) if pieces else make_scales(n, step) * (step + 1)
        if step == 1:
            scales[0] = 0.0  # ±0.0 terms: the +0.0 start of the sum matters bitwise
        avg = q.qserver_average(codes, scales, width=width, bounds=bounds)
        assert avg.dtype == torch.float32 and avg.shape == (chunk,)
        assert_bitwise_equal(avg, ref.qserver_average(codes, scales, width=width, bounds=bounds), f"average at {step}")

        t_ref = ref.qserver_scale(codes, scales, se_ref, width=width, bounds=bounds)
        t_got = q.qserver_scale(codes, scales, se_got, width=width, bounds=bounds)
        assert_scales_equal(t_got, t_ref, f"server scale at step {step}")
        if step == 2:  # a smaller scale than max|z|/Q: clamped levels
            t_ref = t_ref * 0.37

        o_ref = torch.empty(code_bytes(chunk, width), dtype=torch.uint8)
        o_got = garbage_bytes(code_bytes(chunk, width), 0x5A)
        ref.qserver_pack(codes, scales, se_ref, t_ref, o_ref, width=width, bounds=bounds)
        q.qserver_pack(codes, scales, se_got, t_ref, o_got, width=width, bounds=bounds)
        assert_bitwise_equal(o_got, o_ref, f"codes at step {step}")
        assert_bitwise_equal(se_got, se_ref, f"server error at step {step}")
    if chunk:
        assert se_got.abs().max() > 0


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("width", WIDTHS)
def test_qserver_average_hand_computed(backend, width):
    """``(s_0·q_0 + s_1·q_1 + s_2·q_2) / 3``, fp32, in rank order."""
    q = QOps(backend)
    Q = ref.levels(width)
    levels = torch.tensor([[Q, -Q, 0, 1, -1, 2, 3, -3],
                           [1, 1, -2, 0, 5 - Q, Q, -Q, 0],
                           [-1, 0, 0, Q, 1, -2, 2, 0]], dtype=torch.float32)
    codes = torch.stack([ref.pack_codes(row, width) for row in levels])
    scales = torch.tensor([0.1, 3.0, 0.7])
    acc = torch.zeros(8)
    for i in range(3):
        acc = acc + scales[i] * levels[i]
    assert_bitwise_equal(q.qserver_average(codes, scales, width=width), acc / 3)


# --------------------------------------------------------------------------------------------
# Unpack
# --------------------------------------------------------------------------------------------

UNPACK_CASES = per_backend(
    "n, width, dtype, pieces",
    cpu=[(n, width, dtype, pieces) for n in (1, 2, 3) for width in WIDTHS for dtype in DTYPES + (torch.float64,)
         for pieces in (False, True)],
    triton=[(64, n, width, dtype, pieces) for n in (1, 3) for width in WIDTHS for dtype in DTYPES
            for pieces in (False, True)],
)


@pytest.mark.parametrize(*UNPACK_CASES)
def test_qunpack_scaled_matches_reference(backend, n, width, dtype, pieces):
    """Every code's value, written bitwise like the reference's cast into every float dtype; ``out``
    cut anywhere (for width 4 also in the middle of a byte)."""
    q = QOps(backend)
    chunk = {"cpu": 1000, "triton": 200}[backend.name]
    total = n * chunk
    codes = make_bits(n, code_bytes(chunk, width), seed=40 + n + width)
    bounds = make_bounds(total, 40 + n, pieces=7) if pieces else None
    P = len(bounds) - 1 if pieces else n
    # 1/3, 0.1: not representable in bf16/fp16, so the cast must round like torch (RTNE)
    scales = make_scales(P, n) / 3
    scales[0] = 0.1
    if P > 2:
        scales[2] = 0.0
    for numel in sorted({k for k in (0, 1, 11, chunk - 3, total - 5, total) if 0 <= k <= total}):
        out = torch.full((numel,), 7.0, dtype=dtype)
        expected = torch.full((numel,), 7.0, dtype=dtype)
        q.qunpack_scaled(codes, scales, out, width=width, bounds=bounds)
        ref.qunpack_scaled(codes, scales, expected, width=width, bounds=bounds)
        assert_bitwise_equal(out, expected, f"numel={numel}")


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("width", WIDTHS)
def test_qunpack_into_other_layouts(backend, width):
    q = QOps(backend)
    codes = make_bits(2, code_bytes(64, width), seed=7)
    scales = torch.tensor([0.3, 1.7])
    for out in (torch.full((128, 2), 7.0)[:, 0], torch.full((8, 16), 7.0, dtype=BF16), torch.full((60,), 7.0)[::2]):
        expected = out.clone()
        q.qunpack_scaled(codes, scales, out, width=width)
        ref.qunpack_scaled(codes, scales, expected, width=width)
        assert_bitwise_equal(out, expected)


# --------------------------------------------------------------------------------------------
# Conventions and properties
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(*per_backend(
    "width, pieces", cpu=[(w, p) for w in WIDTHS for p in (False, True)],
    triton=[(64, w, p) for w in WIDTHS for p in (False, True)]))
def test_round_trip_error_is_at_most_half_a_step(backend, width, pieces):
    """``|y - s·q| <= s/2`` for every element (up to the rounding of ``y / s``: a few ulps of
    ``Q·s``), and the new error is exactly ``y`` minus the value every rank decodes."""
    q = QOps(backend)
    numel = {"cpu": 5000, "triton": 500}[backend.name]
    L = padded_length(numel, 2)
    bounds = make_bounds(L, 3, pieces=5) if pieces else None
    x = piece_x(numel, bounds, F32, seed=5) if pieces else make_x(numel, F32, seed=5, magnitude=3.0)
    error = torch.randn(L, generator=torch.Generator().manual_seed(6)) * 0.01
    y = ref._padded(x, L) + error  # what the kernels see
    s = q.qworker_scale(x, error, width=width, bounds=bounds)
    codes = garbage_bytes(code_bytes(L, width))
    q.qworker_pack(x, error, torch.stack([s, s + 1.0]), 0, codes, width=width, bounds=bounds)
    per_element = expand(s, bounds, L)
    slack = per_element * (2**-20 * ref.levels(width))
    assert (error.abs() <= per_element / 2 + slack).all()
    levels = ref.unpack_codes(codes, width)
    assert levels.abs().max() <= ref.levels(width)
    decoded = torch.empty(L)
    q.qunpack_scaled(codes.view(1, -1), s.reshape(-1) if pieces else s.reshape(1), decoded, width=width,
                     bounds=bounds)
    assert_bitwise_equal(error, y - decoded)
    assert_bitwise_equal(decoded, per_element * levels)


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("pieces", (False, True), ids=("one-scale", "pieces"))
def test_all_zero_buffer(backend, width, pieces):
    """Scale +0.0, every level 0 (codes ``Q``), errors stay +0.0; the server and the unpack too."""
    q = QOps(backend)
    Q = ref.levels(width)
    zero_code = Q if width == 8 else Q * 16 + Q
    x = torch.zeros(50)
    x[::3] = -0.0
    bounds = [0, 16, 16, 48, 64] if pieces else None
    error = torch.zeros(64)
    s = q.qworker_scale(x, error, width=width, bounds=bounds)
    assert_bitwise_equal(s, torch.zeros(4) if pieces else torch.tensor(0.0))
    codes = garbage_bytes(code_bytes(64, width))
    q.qworker_pack(x, error, torch.stack([s, s + 0.5]), 0, codes, width=width, bounds=bounds)
    assert codes.tolist() == [zero_code] * code_bytes(64, width)
    assert_bitwise_equal(error, torch.zeros(64))
    # the server: two ranks' zero codes at scale 0
    rows = torch.stack([codes, codes]).reshape(2, -1)
    scales = torch.stack([s, s])
    server_error = torch.zeros(64)
    assert_bitwise_equal(q.qserver_average(rows, scales, width=width, bounds=bounds), torch.zeros(64))
    t = q.qserver_scale(rows, scales, server_error, width=width, bounds=bounds)
    assert_bitwise_equal(t, s)
    out_codes = garbage_bytes(code_bytes(64, width))
    q.qserver_pack(rows, scales, server_error, t, out_codes, width=width, bounds=bounds)
    assert out_codes.tolist() == [zero_code] * code_bytes(64, width)
    assert_bitwise_equal(server_error, torch.zeros(64))
    for dtype in (F32, BF16):
        out = torch.full((64,), 7.0, dtype=dtype)
        q.qunpack_scaled(codes.view(1, -1), s.reshape(-1), out, width=width, bounds=bounds)
        assert_bitwise_equal(out, torch.zeros(64, dtype=dtype))


NON_FINITE = {"nan": (float("nan"),), "inf": (float("inf"),), "-inf": (float("-inf"),),
              "nan+inf": (float("nan"), float("inf"))}


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("bad", list(NON_FINITE))
@pytest.mark.parametrize("pieces", (False, True), ids=("one-scale", "pieces"))
@pytest.mark.parametrize("dtype", (F32, F16), ids=("float32", "float16"))
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # inf·0 in the interpreter
def test_non_finite_x_gives_a_non_finite_scale_and_leaves_errors_untouched(backend, width, bad, pieces, dtype):
    q = QOps(backend)
    x = make_x(100, F32, seed=3)
    for k, v in enumerate(NON_FINITE[bad]):
        x[37 + 5 * k] = v  # both in piece 1
    x = x.to(dtype)
    L = 112  # n = 2
    bounds = [0, 32, 64, 64, 112] if pieces else None
    bad_piece = slice(32, 64) if pieces else slice(0, L)
    error = torch.randn(L, generator=torch.Generator().manual_seed(2))
    before = error.clone()
    s = q.qworker_scale(x, error, width=width, bounds=bounds)
    assert_scales_equal(s, ref.qworker_scale(x, before.clone(), width=width, bounds=bounds))
    s_bad = s[1] if pieces else s
    assert torch.isnan(s_bad) if "nan" in bad else s_bad == float("inf")
    if pieces:  # the other pieces keep finite scales
        assert torch.isfinite(s[[0, 2, 3]]).all()
    scales = torch.stack([s, torch.full_like(s, 0.9)])  # this rank is 0, its (piece's) scale is bad
    c_ref = torch.empty(code_bytes(L, width), dtype=torch.uint8)
    c_got = garbage_bytes(code_bytes(L, width))
    ref.qworker_pack(x, before.clone(), scales, 0, c_ref, width=width, bounds=bounds)
    q.qworker_pack(x, error, scales, 0, c_got, width=width, bounds=bounds)
    assert_bitwise_equal(error, before)  # no error buffer is written
    assert_bitwise_equal(c_got, c_ref)  # the codes still are: level 0 at a non-finite scale
    assert (ref.unpack_codes(c_got, width)[bad_piece] == 0).all()
    # decoding this rank's codes: non-finite exactly where the scale is
    out = torch.empty(L)
    expected = torch.empty(L)
    q.qunpack_scaled(c_got.view(1, -1), s.reshape(-1), out, width=width, bounds=bounds)
    ref.qunpack_scaled(c_got.view(1, -1), s.reshape(-1), expected, width=width, bounds=bounds)
    assert_values_equal(out, expected)
    assert not torch.isfinite(out[bad_piece]).any()
    assert torch.isfinite(out[bad_piece.stop :]).all() and torch.isfinite(out[: bad_piece.start]).all()
    # another rank's bad scale also keeps this rank's error, though its own codes are normal
    scales = torch.stack([torch.full_like(s, 0.9), s])
    c_ref = torch.empty(code_bytes(L, width), dtype=torch.uint8)
    q.qworker_pack(x[:0], error, scales, 0, c_got, width=width, bounds=bounds)
    ref.qworker_pack(x[:0], before.clone(), scales, 0, c_ref, width=width, bounds=bounds)
    assert_bitwise_equal(error, before)
    assert_bitwise_equal(c_got, c_ref)


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("bad", (float("nan"), float("inf")), ids=str)
@pytest.mark.parametrize("pieces", (False, True), ids=("one-scale", "pieces"))
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # inf·0 in the interpreter
def test_non_finite_scales_on_the_server(backend, width, bad, pieces):
    """A rank's non-finite scale makes the average and the server scale non-finite: the server
    error is kept and the codes are all level 0. A non-finite server scale alone does the same."""
    q = QOps(backend)
    chunk = 64
    bounds = [0, 16, 16, 64] if pieces else None
    P = 3 if pieces else 1
    bad_piece = slice(16, 64) if pieces else slice(0, chunk)
    rows = make_bits(2, code_bytes(chunk, width), seed=5)
    scales = torch.tensor([[0.7] * P, [1.3] * P])
    scales[1, -1] = bad
    if not pieces:
        scales = scales.reshape(2)
    avg = q.qserver_average(rows, scales, width=width, bounds=bounds)
    assert_values_equal(avg, ref.qserver_average(rows, scales, width=width, bounds=bounds))
    assert not torch.isfinite(avg[bad_piece]).all()
    se = torch.randn(chunk, generator=torch.Generator().manual_seed(4))
    before = se.clone()
    t = q.qserver_scale(rows, scales, se, width=width, bounds=bounds)
    assert_scales_equal(t, ref.qserver_scale(rows, scales, before.clone(), width=width, bounds=bounds))
    assert not torch.isfinite(t.reshape(-1)[-1])
    for t_pack, rank_scales in ((t, scales), (t.clone().fill_(bad), scales.clone().fill_(0.5))):
        out, out_ref = garbage_bytes(code_bytes(chunk, width)), torch.empty(code_bytes(chunk, width), dtype=torch.uint8)
        q.qserver_pack(rows, rank_scales, se, t_pack, out, width=width, bounds=bounds)
        ref.qserver_pack(rows, rank_scales, before.clone(), t_pack, out_ref, width=width, bounds=bounds)
        assert_bitwise_equal(se, before)
        assert_bitwise_equal(out, out_ref)
        assert (ref.unpack_codes(out, width)[bad_piece] == 0).all()
    # finite scales everywhere: the same call does update it
    t = q.qserver_scale(rows, scales.clone().fill_(0.5), se, width=width, bounds=bounds)
    q.qserver_pack(rows, scales.clone().fill_(0.5), se, t, out, width=width, bounds=bounds)
    assert not torch.equal(se, before)


@pytest.mark.parametrize(*per_backend("width", cpu=[(w,) for w in WIDTHS], triton=[(64, w) for w in WIDTHS]))
def test_one_piece_is_the_single_scale(backend, width):
    q = QOps(backend)
    gen = torch.Generator().manual_seed(width)
    L = padded_length(1000, 2)
    e1 = torch.randn(L, generator=gen)
    e2 = e1.clone()
    x = torch.randn(1000, generator=gen)
    s = q.qworker_scale(x, e1, width=width)
    assert_bitwise_equal(q.qworker_scale(x, e2, width=width, bounds=[0, L]), s.reshape(1))
    c1, c2 = torch.empty(code_bytes(L, width), dtype=torch.uint8), torch.empty(code_bytes(L, width), dtype=torch.uint8)
    scales = torch.stack([s, torch.tensor(0.3)])
    q.qworker_pack(x, e1, scales, 0, c1, width=width)
    q.qworker_pack(x, e2, scales.reshape(2, 1), 0, c2, width=width, bounds=[0, L])
    assert_bitwise_equal(c1, c2)
    assert_bitwise_equal(e1, e2)
    # the server, and the unpack with the chunk boundaries as pieces
    rows = torch.stack([c1, c2]).reshape(2, -1)
    se1 = torch.randn(L, generator=gen)
    se2 = se1.clone()
    t = q.qserver_scale(rows, scales, se1, width=width)
    assert_bitwise_equal(q.qserver_scale(rows, scales.reshape(2, 1), se2, width=width, bounds=[0, L]), t.reshape(1))
    q.qserver_pack(rows, scales, se1, t, c1, width=width)
    q.qserver_pack(rows, scales.reshape(2, 1), se2, t.reshape(1), c2, width=width, bounds=[0, L])
    assert_bitwise_equal(c1, c2)
    assert_bitwise_equal(se1, se2)
    o1, o2 = torch.empty(2 * L - 5), torch.empty(2 * L - 5)
    q.qunpack_scaled(rows, scales, o1, width=width)
    q.qunpack_scaled(rows, scales, o2, width=width, bounds=[0, L, 2 * L])
    assert_bitwise_equal(o1, o2)


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("width", WIDTHS)
def test_empty_buffer(backend, width):
    q = QOps(backend)
    error = torch.zeros(0)
    codes = torch.empty(0, dtype=torch.uint8)
    s = q.qworker_scale(torch.empty(0, dtype=BF16), error, width=width)
    assert_bitwise_equal(s, torch.tensor(0.0))
    assert q.qworker_scale(torch.empty(0), error, width=width, bounds=[0]).shape == (0,)
    q.qworker_pack(torch.zeros(0), error, torch.zeros(1), 0, codes, width=width)
    q.qworker_pack(torch.zeros(0), error, torch.ones(2), 1, codes, width=width)
    rows = torch.empty(2, 0, dtype=torch.uint8)
    assert_bitwise_equal(q.qserver_scale(rows, torch.ones(2), torch.zeros(0), width=width), torch.tensor(0.0))
    q.qserver_pack(rows, torch.ones(2), torch.zeros(0), torch.tensor(1.0), codes, width=width)
    assert q.qserver_average(rows, torch.ones(2), width=width).numel() == 0
    q.qunpack_scaled(rows, torch.ones(2), torch.empty(0), width=width)


@pytest.mark.parametrize("backend", backends())
def test_bad_bounds_are_refused(backend):
    q = QOps(backend)
    x, error = torch.randn(16), torch.zeros(16)
    for bad in ([0, 4, 16], [0, 8], [8, 16], [0, 16, 8, 16]):
        with pytest.raises(ValueError):
            q.qworker_scale(x, error, width=8, bounds=bad)
    with pytest.raises(ValueError):  # 2 ranks x 2 pieces: there is no rank 2
        q.qworker_pack(x, error, torch.ones(2, 2), 2, torch.empty(16, dtype=torch.uint8), width=8, bounds=[0, 8, 16])
