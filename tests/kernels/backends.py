"""What the backend suites (``test_backend_*.py``) share: the backends under test and the data.

Every fast backend (:mod:`hf_onebit.kernels.cpu`, numba; :mod:`hf_onebit.kernels.triton`, run on
CPU tensors through the Triton interpreter) must compute what :mod:`hf_onebit.kernels.reference`
computes (spec §1): bits, error buffers, server averages and unpacked values bitwise; scales
(float64 sums of squares accumulated in another order) to 1e-6 relative.

A test names the backends it runs for with :func:`backends` (one configuration each) or
:func:`per_backend` (each backend with its own cases: the interpreter is slow, so Triton runs
modest sizes, several tilings (``block``) and one large case at the largest block, while numba
runs its ``2**20``-element buffers over many steps). Test ids read ``cpu-…`` and
``triton-b64-…`` (``block=64``). Triton is skipped cleanly when it is not installed (an error
under ``CI=true``, see :mod:`tests.requirements`).

The interpreter must be on before triton is first imported (the ``triton.jit`` decorators read
``TRITON_INTERPRET``), hence the first lines below (tests/conftest.py sets it too when no GPU is
there).

``HF_ONEBIT_TEST_TRITON_DEVICE=cuda`` runs the same suites on a GPU instead: the Triton backend's
kernels are compiled for the device, and each call copies its tensor arguments there and every
argument (the in-place outputs) and the result back, so the tests, written for CPU tensors, check
the device's bits against the CPU reference unchanged. Run only the ``test_backend_*.py`` files so.
"""

from __future__ import annotations

import functools
import importlib
import math
import os

#: "cuda": the Triton backend runs compiled on the GPU (see above), not in the interpreter
ON_DEVICE = os.environ.get("HF_ONEBIT_TEST_TRITON_DEVICE") == "cuda"
if not ON_DEVICE:
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from hf_onebit.kernels import reference as ref  # noqa: E402

from tests.requirements import require  # noqa: E402

# 64: many programs even for small buffers; 4096: the largest, one program for most of them.
BLOCKS = (64, 256, 4096)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BIG = 2**20 + 3

_PARAM = type(pytest.param())  # what pytest.param returns

#: the operations that take Triton's keyword-only ``block``
TUNED = ("worker_scale", "worker_pack", "server_average", "server_scale", "server_pack", "unpack_scaled")


# --------------------------------------------------------------------------------------------
# The backends
# --------------------------------------------------------------------------------------------


def load_triton():
    """:mod:`hf_onebit.kernels.triton` with interpreted kernels, or skip the calling test."""
    require("triton", "triton is not installed: the Triton kernels cannot be tested")
    if ON_DEVICE:
        if not torch.cuda.is_available():
            pytest.skip("HF_ONEBIT_TEST_TRITON_DEVICE=cuda needs a GPU", allow_module_level=True)
        from hf_onebit.kernels import triton as T

        return T
    import triton
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(triton.language.sum, InterpretedFunction):
        # Triton's own helpers (tl.sum, ...) are built when triton is first imported; if that
        # happened earlier in this process without TRITON_INTERPRET=1, nothing can run here.
        pytest.skip(
            "triton was imported before TRITON_INTERPRET=1 was set; run this file on its own or"
            " export TRITON_INTERPRET=1 (or set it in a conftest.py) when no GPU is available",
            allow_module_level=True,
        )
    from hf_onebit.kernels import triton as T
    from hf_onebit.kernels import triton_kernels, triton_piece_kernels, triton_pieces, triton_votes

    if not isinstance(triton_kernels._worker_pack_kernel, InterpretedFunction):
        # The backend was imported earlier without the interpreter (while triton itself had it):
        # rebuild its kernels now, each module after the ones it imports from.
        for module in (triton_kernels, triton_piece_kernels, triton_pieces, triton_votes, T):
            importlib.reload(module)
    return T


def load(name: str):
    if name == "triton":
        return load_triton()
    return importlib.import_module(f"hf_onebit.kernels.{name}")


class Backend:
    """A backend module with fixed tuning arguments (Triton's ``block``), loaded on first use.

    ``backend.worker_pack(...)`` calls the module's function with the tuning arguments added.
    """

    def __init__(self, name: str, **kw) -> None:
        self.name = name
        self.kw = kw

    @property
    def id(self) -> str:
        return self.name + "".join(f"-b{v}" for v in self.kw.values())

    @property
    def module(self):
        return load(self.name)

    def __getattr__(self, op: str):
        if op.startswith("_"):
            raise AttributeError(op)
        fn = getattr(self.module, op)
        fn = functools.partial(fn, **self.kw) if op in TUNED else fn
        return through_device(fn) if ON_DEVICE and self.name == "triton" else fn

    def __repr__(self) -> str:
        return f"Backend({self.id})"


def through_device(fn):
    """``fn`` called on GPU copies of its tensor arguments; every argument is copied back (the
    in-place outputs: bits, error buffers) and so is the result."""

    def moved(value):
        if not isinstance(value, torch.Tensor):
            return value
        # the same strides (a strided view must stay one: the backend's layout checks see it)
        there = torch.empty_strided(value.size(), value.stride(), dtype=value.dtype, device="cuda")
        return there.copy_(value)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        dev_args = [moved(a) for a in args]
        dev_kwargs = {k: moved(v) for k, v in kwargs.items()}
        result = fn(*dev_args, **dev_kwargs)
        for here, there in [*zip(args, dev_args), *((kwargs[k], dev_kwargs[k]) for k in kwargs)]:
            if isinstance(here, torch.Tensor):
                here.copy_(there.cpu())
        return result.cpu() if isinstance(result, torch.Tensor) else result

    return call


CPU = Backend("cpu")


def triton_at(block: int) -> Backend:
    return Backend("triton", block=block)


def dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _fmt(name: str, value) -> str:
    if isinstance(value, torch.dtype):
        return dtype_id(value)
    if name in ("n", "chunk"):
        return f"{name}{value}"
    return str(value)


def _param(backend: Backend, names: list[str], values: tuple, marks=()):
    label = "-".join([backend.id] + [_fmt(k, v) for k, v in zip(names, values)])
    return pytest.param(backend, *values, id=label, marks=marks)


def backends(*, triton_blocks=(64,)) -> list:
    """``backend`` parameters: cpu, and Triton at each of ``triton_blocks``."""
    return [pytest.param(CPU, id=CPU.id)] + [pytest.param(triton_at(b), id=triton_at(b).id) for b in triton_blocks]


def per_backend(argnames: str, *, cpu, triton) -> tuple[str, list]:
    """``parametrize`` arguments for ``"backend, " + argnames``: ``cpu`` the value tuples for
    numba, ``triton`` the ``(block, *values)`` tuples for Triton (either may be a ``pytest.param``
    of such a tuple, to add marks)."""
    names = [a.strip() for a in argnames.split(",")]

    def split(case):
        if isinstance(case, _PARAM):
            return tuple(case.values), case.marks
        return tuple(case), ()

    params = [_param(CPU, names, *split(v)) for v in cpu]
    for case in triton:
        values, marks = split(case)
        params.append(_param(triton_at(values[0]), names, values[1:], marks))
    return "backend, " + argnames, params


# --------------------------------------------------------------------------------------------
# Comparisons
# --------------------------------------------------------------------------------------------


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """Equal dtype, shape and bytes (so the sign of zero counts too), NaN where the other has NaN.

    A NaN's payload is not part of the contract: a GPU's arithmetic and conversions return its
    canonical NaN where numpy and the interpreter carry the input's payload through.
    """
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    if actual.is_floating_point():
        nan_a, nan_e = torch.isnan(actual), torch.isnan(expected)
        assert torch.equal(nan_a, nan_e), f"{what}: NaN at {nan_a.nonzero()[:5].tolist()} vs {nan_e.nonzero()[:5].tolist()}"
        actual, expected = actual.masked_fill(nan_a, 0.0), expected.masked_fill(nan_e, 0.0)
    a = actual.contiguous().reshape(-1).view(torch.uint8)
    e = expected.contiguous().reshape(-1).view(torch.uint8)
    if not torch.equal(a, e):
        bad = (a != e).nonzero()[:5].reshape(-1).tolist()
        raise AssertionError(f"{what}: {(a != e).sum().item()} bytes differ, first at byte offsets {bad}")


def assert_scale_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == torch.float32 and actual.shape == ()
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=0.0)


# --------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------


def assert_pack_like_reference(backend, x: torch.Tensor, e_got: torch.Tensor, e_ref: torch.Tensor,
                                scales: torch.Tensor, rank: int, what: str = "") -> torch.Tensor:
    """``worker_pack`` by ``backend`` into ``e_got`` and by the reference into ``e_ref`` (two error
    buffers that must hold the same values): the bits and the new errors must be bitwise equal.
    The backend writes into garbage, so every byte must be written. Returns its bits."""
    length = e_ref.numel()
    b_ref = torch.empty(length // 8, dtype=torch.uint8)
    b_got = garbage_bytes(length // 8)
    ref.worker_pack(x, e_ref, scales, rank, b_ref)
    backend.worker_pack(x, e_got, scales, rank, b_got)
    assert_bitwise_equal(b_got, b_ref, f"bits {what}".strip())
    assert_bitwise_equal(e_got, e_ref, f"error {what}".strip())
    return b_got


def padded_length(numel: int, n: int) -> int:
    """The L of the spec: the next multiple of 8·n (0 stays 0)."""
    return math.ceil(numel / (8 * n)) * 8 * n


def make_x(numel: int, dtype: torch.dtype, seed: int, magnitude: float = 1.0) -> torch.Tensor:
    """Random values in ``dtype`` with a few exact zeros and negative zeros (sign⁺(0) = +1)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=g) * magnitude
    x[2::11] = 0.0
    x[5::13] = -0.0
    return x.to(dtype)


def make_scales(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + seed)
    return torch.rand(n, generator=g) + 0.5


def make_bits(n: int, row_bytes: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(2000 + seed)
    return torch.randint(0, 256, (n, row_bytes), generator=g, dtype=torch.uint8)


def garbage_bytes(count: int, value: int = 0xA5) -> torch.Tensor:
    """An output buffer of bits filled with garbage: every byte must be written."""
    return torch.full((count,), value, dtype=torch.uint8)


def make_bounds(length: int, seed: int, pieces: int = 5) -> list[int]:
    """Random piece bounds over ``length`` (multiples of 8), with an empty piece; [0] for length 0."""
    if length == 0:
        return [0]
    g = torch.Generator().manual_seed(3000 + seed)
    cuts = sorted((torch.randint(0, length // 8 + 1, (pieces - 1,), generator=g) * 8).tolist())
    return [0] + cuts + [cuts[-1]] + [length]  # the duplicate: an empty piece


def piece_x(numel: int, bounds: list[int], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """:func:`make_x` with magnitudes that differ by orders of magnitude (1e-6 .. 1e2) between pieces."""
    x = make_x(numel, torch.float32, seed)
    for p, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        x[lo:hi] *= 10.0 ** ((p * 7 + seed) % 9 - 6)
    return x.to(dtype)
