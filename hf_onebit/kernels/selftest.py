"""Compile a kernel backend and check it bit for bit against the reference, before training needs it.

The failure this prevents: Triton compiles a kernel the first time it runs, which for 1-bit Adam
is the first compressing backward, possibly hours into a run. A missing C compiler, a Triton/driver
mismatch or an out-of-memory there surfaced as a failed collective ("another rank has probably
died"). :func:`self_test` runs the five operations of ``get_backend(device)`` on a small buffer of
two simulated ranks, with one scale per chunk and with pieces, and compares every output with
:mod:`hf_onebit.kernels.reference`: bits, the server average (defined with its summation order)
and unpacked values exactly; scales and error buffers to fp32 rounding (the reference sums squares
in float64). The same for the five operations of the b-bit exchange at 8 and 4 bits,
whose results (codes, max-abs scales, errors, average, unpacked values) must all be bitwise equal,
and for BinSGDM's worker math (``vote_threshold``, with ``eps > 0`` and ``eps = 0``) and draws
(``vote_uniform``), bitwise too.
:func:`hf_onebit.attach` calls it for the CUDA buckets; ``hf-onebit check`` for whatever device is
there.
"""

from __future__ import annotations

import torch

from hf_onebit.kernels import ENV_VAR, get_backend
from hf_onebit.kernels import reference as ref

_PASSED: set[tuple[str, str, torch.dtype]] = set()


class KernelSelfTestError(RuntimeError):
    """The device's compression kernels failed to compile, to run, or to match the reference."""


def _case(device: torch.device, dtype: torch.dtype):
    """Two ranks' inputs: 200 elements (padding included), L = 256, chunks of C = 128, 2 pieces."""
    g = torch.Generator().manual_seed(0)
    xs = [(torch.randn(200, generator=g) * (1 + r)).to(dtype).to(device) for r in range(2)]
    errors = [(torch.randn(256, generator=g) * 0.1).to(device) for _ in range(2)]
    server_error = (torch.randn(128, generator=g) * 0.1).to(device)
    return xs, errors, server_error


def _run(kernels, device: torch.device, dtype: torch.dtype, bounds) -> dict:
    """The compressed all-reduce of two simulated ranks through ``kernels``; every intermediate."""
    xs, errors, server_error = _case(device, dtype)
    worker_bounds = None if bounds is None else [0, 64, 256]
    chunk_bounds = None if bounds is None else [0, 64, 128]
    scales = torch.stack([kernels.worker_scale(x, e, bounds=worker_bounds) for x, e in zip(xs, errors)])
    bits = []
    for r, (x, e) in enumerate(zip(xs, errors)):
        out = torch.empty(32, dtype=torch.uint8, device=device)
        kernels.worker_pack(x, e, scales, r, out, bounds=worker_bounds)
        bits.append(out)
    # the server of chunk 0 receives both ranks' first 16 bytes (128 elements); its pieces are
    # [0, 64) (the workers' piece 0) and [64, 128) (the start of their piece 1)
    rows = torch.stack([b[:16] for b in bits])
    row_scales = scales
    average = kernels.server_average(rows, row_scales, bounds=chunk_bounds)
    t = kernels.server_scale(rows, row_scales, server_error, bounds=chunk_bounds)
    packed = torch.empty(16, dtype=torch.uint8, device=device)
    kernels.server_pack(rows, row_scales, server_error, t, packed, bounds=chunk_bounds)
    out = torch.empty(128, dtype=dtype, device=device)
    kernels.unpack_scaled(packed.reshape(1, 16), t.reshape(-1), out, bounds=chunk_bounds)
    return {"worker scales": scales, "worker bits": torch.stack(bits), "worker errors": torch.stack(errors),
            "server average": average, "server scale": t, "server bits": packed, "server error": server_error, "unpacked": out}


def _qrun(kernels, device: torch.device, dtype: torch.dtype, bounds, width: int) -> dict:
    """:func:`_run` for the b-bit exchange at ``width`` bits; keys name the width."""
    xs, errors, server_error = _case(device, dtype)
    worker_bounds = None if bounds is None else [0, 64, 256]
    chunk_bounds = None if bounds is None else [0, 64, 128]
    scales = torch.stack([kernels.qworker_scale(x, e, width=width, bounds=worker_bounds) for x, e in zip(xs, errors)])
    codes = []
    for r, (x, e) in enumerate(zip(xs, errors)):
        out = torch.empty(256 * width // 8, dtype=torch.uint8, device=device)
        kernels.qworker_pack(x, e, scales, r, out, width=width, bounds=worker_bounds)
        codes.append(out)
    # the server of chunk 0 receives both ranks' codes of their first 128 elements
    row = 128 * width // 8
    rows = torch.stack([c[:row] for c in codes])
    average = kernels.qserver_average(rows, scales, width=width, bounds=chunk_bounds)
    t = kernels.qserver_scale(rows, scales, server_error, width=width, bounds=chunk_bounds)
    packed = torch.empty(row, dtype=torch.uint8, device=device)
    kernels.qserver_pack(rows, scales, server_error, t, packed, width=width, bounds=chunk_bounds)
    # every rank unpacks two chunks (this one twice, the second at half the scale) into 200 elements
    gathered = torch.stack([packed, packed])
    two = torch.cat([t.reshape(-1), t.reshape(-1) * 0.5])
    out = torch.empty(200, dtype=dtype, device=device)
    kernels.qunpack_scaled(gathered, two, out, width=width, bounds=None if bounds is None else [0, 64, 128, 192, 256])
    return {f"{width}-bit {what}": value for what, value in (
        ("worker scales", scales), ("worker codes", torch.stack(codes)), ("worker errors", torch.stack(errors)),
        ("server average", average), ("server scale", t), ("server codes", packed), ("server error", server_error),
        ("unpacked", out))}


def _vote_run(kernels, device: torch.device) -> dict:
    """BinSGDM's worker math on 200 elements (fp32 whatever the bucket dtype: BinSGDM unscales
    into fp32 first), with ``eps > 0`` and with ``eps = 0`` (whose ``0/0`` the first 8 make)."""
    g = torch.Generator().manual_seed(1)
    m = torch.randn(200, generator=g)
    b = m.abs() * (1 + torch.rand(200, generator=g))
    grad = torch.randn(200, generator=g) * 10.0 ** torch.randint(-6, 3, (200,), generator=g).float()
    m[:8], b[:8], grad[:8] = 0.0, 0.0, 0.0
    m, b, grad = m.to(device), b.to(device), grad.to(device)
    got = {}
    for eps in (1e-8, 0.0):
        outs = [torch.empty(200, device=device) for _ in range(3)]
        kernels.vote_threshold(m, b, grad, beta=0.9, eps=eps, m_out=outs[0], b_out=outs[1], theta=outs[2])
        got.update({f"vote {what} (eps={eps})": t for what, t in zip(("m", "b", "theta"), outs)})
    # the draws: numpy's Philox per piece, pieces of 5, 0 and 195 elements, counters past 32 bits
    draws = torch.full((200,), -1.0, device=device)
    table = kernels.vote_uniform_table([0, 5, 5, 200], [3, 0, 2**40], device)
    kernels.vote_uniform(draws, table, seed=2**64 - 1, stream=2**32 + 1, step=9)
    got["vote draws"] = draws
    return got


def _identical(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (the b-bit results are all defined exactly)."""
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


def _everything(kernels, device: torch.device, dtype: torch.dtype, bounds) -> dict:
    got = _run(kernels, device, dtype, bounds)
    for width in (8, 4):
        got.update(_qrun(kernels, device, dtype, bounds, width))
    if bounds is None:  # the vote has no pieces: once per dtype is enough
        got.update(_vote_run(kernels, device))
    return got


def self_test(device: torch.device | str, dtype: torch.dtype = torch.float32) -> str:
    """Check ``get_backend(device)`` against the reference for ``dtype`` inputs; returns its name.

    Raises :class:`KernelSelfTestError` naming the way out (``HF_ONEBIT_KERNELS=reference``). A
    backend that passed once for a (device, dtype) is not run again in this process.
    """
    device = torch.device(device)
    kernels = get_backend(device)
    name = kernels.__name__.rsplit(".", 1)[-1]
    key = (name, str(device), dtype)
    if name == "reference" or key in _PASSED:
        return name
    way_out = (f"Set {ENV_VAR}=reference to train with the slow reference kernels while you fix it, or run"
               " `hf-onebit check` for a report.")
    for bounds in (None, "pieces"):
        try:
            got = _everything(kernels, device, dtype, bounds)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        except Exception as exc:  # noqa: BLE001 - re-raised with what to do
            raise KernelSelfTestError(
                f"hf_onebit: the {name} compression kernels failed to compile or run on {device} for {dtype}"
                f" buffers: {type(exc).__name__}: {exc}. Triton needs a working C compiler and a Triton"
                f" that matches the driver. {way_out}"
            ) from exc
        want = _everything(ref, device, dtype, bounds)
        for what, a in got.items():
            b = want[what]
            if what.startswith(("8-bit ", "4-bit ", "vote ")):  # the b-bit exchange and the vote: all exact
                same = _identical(a, b)
            elif what.endswith("bits") or what in ("server average", "unpacked"):  # defined exactly
                same = torch.equal(a, b)
            else:
                same = torch.allclose(a.float(), b.float(), rtol=1e-5, atol=1e-6)
            if not same:
                raise KernelSelfTestError(
                    f"hf_onebit: the {name} compression kernels disagree with the reference on {device} for"
                    f" {dtype} buffers ({what}, {'one scale per chunk' if bounds is None else 'pieces'}):"
                    f" a kernel bug or a miscompilation, please report it with `hf-onebit check`'s output."
                    f" {way_out}"
                )
    _PASSED.add(key)
    return name
