"""The kernel contract (``hf_onebit.kernels.contract``), once for every backend.

Each backend module has every operation with the reference's signature (a backend may add
keyword-only tuning arguments with defaults), and refuses each malformed call with the same
exception and the same message. The Triton backend runs under the interpreter (conftest.py).
"""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch

from hf_onebit.kernels import contract
from hf_onebit.kernels import reference as ref

BACKENDS = ["reference", "cpu", "triton"]


def backend(name: str):
    if name == "triton":
        pytest.importorskip("triton")
    return importlib.import_module(f"hf_onebit.kernels.{name}")


@pytest.mark.parametrize("name", BACKENDS)
def test_every_operation_has_the_reference_signature(name):
    module = backend(name)
    for op in contract.OPERATIONS:
        fn = getattr(module, op, None)
        assert callable(fn), f"{name} has no {op}"
        want = inspect.signature(getattr(ref, op)).parameters
        got = inspect.signature(fn).parameters
        extra = [p for k, p in got.items() if k not in want]
        assert [k for k in got if k in want] == list(want), f"{name}.{op}: {list(got)} vs {list(want)}"
        assert all(p.kind is p.KEYWORD_ONLY and p.default is not p.empty for p in extra), f"{name}.{op}: {extra}"


def u8(*shape):
    return torch.zeros(shape, dtype=torch.uint8)


#: (call, exception, message): each a malformed call every backend must refuse the same way
BAD_CALLS = {
    "error not fp32": (lambda k: k.worker_scale(torch.zeros(3), torch.zeros(16, dtype=torch.float64)),
                       TypeError, "error must be torch.float32"),
    "error length": (lambda k: k.worker_scale(torch.zeros(3), torch.zeros(12)), ValueError, "multiple of 8"),
    "x too long": (lambda k: k.worker_scale(torch.zeros(17), torch.zeros(16)), ValueError, "more than the padded length"),
    "x not float": (lambda k: k.worker_scale(torch.zeros(3, dtype=torch.int64), torch.zeros(16)), TypeError, "floating-point"),
    "error strided": (lambda k: k.worker_pack(torch.zeros(3), torch.zeros(32)[::2], torch.ones(1), 0, u8(2)),
                      ValueError, "error must be contiguous"),
    "bits_out size": (lambda k: k.worker_pack(torch.zeros(3), torch.zeros(16), torch.ones(1), 0, u8(3)),
                      ValueError, "bits_out must hold 2 elements"),
    "rank": (lambda k: k.worker_pack(torch.zeros(3), torch.zeros(16), torch.ones(2), 2, u8(2)), ValueError, "rank 2 out of range"),
    "bits 1-D": (lambda k: k.server_average(u8(4), torch.ones(1)), ValueError, "2-D uint8"),
    "no rows": (lambda k: k.server_average(u8(0, 2), torch.ones(0)), ValueError, "at least one row"),
    "scales per row": (lambda k: k.server_average(u8(2, 2), torch.ones(3)), ValueError, "one per row"),
    "server_error size": (lambda k: k.server_scale(u8(2, 1), torch.ones(2), torch.zeros(16)),
                          ValueError, "server_error must hold 8 elements"),
    "server bits_out size": (lambda k: k.server_pack(u8(2, 1), torch.ones(2), torch.zeros(8), torch.ones(()), u8(2)),
                             ValueError, "bits_out must hold 1 elements"),
    "out too long": (lambda k: k.unpack_scaled(u8(2, 1), torch.ones(2), torch.zeros(17)), ValueError, "out has 17 elements"),
    "out not float": (lambda k: k.unpack_scaled(u8(2, 1), torch.ones(2), torch.zeros(8, dtype=torch.int32)),
                      TypeError, "floating-point"),
    # the b-bit exchange (spec §1b): the checks above, in terms of width-bit codes
    "q width 3": (lambda k: k.qworker_scale(torch.zeros(3), torch.zeros(16), width=3), ValueError, "width must be one of"),
    "q width True": (lambda k: k.qworker_scale(torch.zeros(3), torch.zeros(16), width=True),
                     ValueError, "width must be one of"),
    "q width 16": (lambda k: k.qserver_average(u8(2, 8), torch.ones(2), width=16), ValueError, "width must be one of"),
    "q width 1": (lambda k: k.qunpack_scaled(u8(2, 1), torch.ones(2), torch.zeros(8), width=1),
                  ValueError, "width must be one of"),
    "q width missing": (lambda k: k.qworker_scale(torch.zeros(3), torch.zeros(16)), TypeError, "width"),
    "q error not fp32": (lambda k: k.qworker_scale(torch.zeros(3), torch.zeros(16, dtype=torch.float64), width=8),
                         TypeError, "error must be torch.float32"),
    "q error length": (lambda k: k.qworker_scale(torch.zeros(3), torch.zeros(12), width=4), ValueError, "multiple of 8"),
    "q x too long": (lambda k: k.qworker_scale(torch.zeros(17), torch.zeros(16), width=8),
                     ValueError, "more than the padded length"),
    "q codes_out size 8": (lambda k: k.qworker_pack(torch.zeros(3), torch.zeros(16), torch.ones(1), 0, u8(2), width=8),
                           ValueError, "codes_out must hold 16 elements"),
    "q codes_out size 4": (lambda k: k.qworker_pack(torch.zeros(3), torch.zeros(16), torch.ones(1), 0, u8(16), width=4),
                           ValueError, "codes_out must hold 8 elements"),
    "q codes_out dtype": (lambda k: k.qworker_pack(torch.zeros(3), torch.zeros(16), torch.ones(1), 0,
                                                   torch.zeros(16, dtype=torch.int8), width=8),
                          TypeError, "codes_out must be torch.uint8"),
    "q rank": (lambda k: k.qworker_pack(torch.zeros(3), torch.zeros(16), torch.ones(2), 2, u8(16), width=8),
               ValueError, "rank 2 out of range"),
    "q codes 1-D": (lambda k: k.qserver_average(u8(4), torch.ones(1), width=8), ValueError, "codes must be a 2-D uint8"),
    "q codes not uint8": (lambda k: k.qserver_average(torch.zeros(2, 4, dtype=torch.int8), torch.ones(2), width=4),
                          ValueError, "codes must be a 2-D uint8"),
    "q no rows": (lambda k: k.qserver_average(u8(0, 2), torch.ones(0), width=8), ValueError, "at least one row"),
    "q scales per row": (lambda k: k.qserver_average(u8(2, 2), torch.ones(3), width=8), ValueError, "one per row of codes"),
    "q server_error size": (lambda k: k.qserver_scale(u8(2, 4), torch.ones(2), torch.zeros(4), width=4),
                            ValueError, "server_error must hold 8 elements"),
    "q server codes_out size": (lambda k: k.qserver_pack(u8(2, 8), torch.ones(2), torch.zeros(8), torch.ones(()), u8(4),
                                                         width=8),
                                ValueError, "codes_out must hold 8 elements"),
    "q out too long": (lambda k: k.qunpack_scaled(u8(2, 4), torch.ones(2), torch.zeros(17), width=4),
                       ValueError, "out has 17 elements"),
    "q out not float": (lambda k: k.qunpack_scaled(u8(2, 8), torch.ones(2), torch.zeros(8, dtype=torch.int32), width=8),
                        TypeError, "floating-point"),
    # BinSGDM's worker math: six flat fp32 buffers of one length
    "vote g not fp32": (lambda k: _vote(k, g=torch.zeros(8, dtype=torch.bfloat16)), TypeError, "g must be torch.float32"),
    "vote m_out strided": (lambda k: _vote(k, m_out=torch.zeros(16)[::2]), ValueError, "m_out must be contiguous"),
    "vote lengths": (lambda k: _vote(k, theta=torch.zeros(7)), ValueError, r"lengths differ: \[8, 8, 8, 8, 8, 7\]"),
    "draw offsets": (lambda k: k.vote_uniform_table([0, 8, 4], [1, 2], "cpu"), ValueError, "do not split"),
    "draw pieces": (lambda k: k.vote_uniform_table([0, 8], [1, 2], "cpu"), ValueError, "do not split"),
    "draw index": (lambda k: k.vote_uniform_table([0, 8], [-1], "cpu"), ValueError, r"indices must be in \[0, 2\*\*63\)"),
    "draw out short": (lambda k: k.vote_uniform(torch.zeros(7), k.vote_uniform_table([0, 8], [1], "cpu"), seed=0,
                                                stream=0, step=1), ValueError, "the pieces end at 8, out holds 7"),
    "draw seed": (lambda k: k.vote_uniform(torch.zeros(8), k.vote_uniform_table([0, 8], [1], "cpu"), seed=2**64,
                                           stream=0, step=1), ValueError, r"seed must be in \[0, 2\*\*64\)"),
}


def _vote(k, **bad):
    """``vote_threshold`` on eight-element buffers, with the named ones replaced by ``bad``."""
    t = {name: bad.get(name, torch.zeros(8)) for name in ("m", "b", "g", "m_out", "b_out", "theta")}
    k.vote_threshold(t["m"], t["b"], t["g"], beta=0.9, eps=1e-8, m_out=t["m_out"], b_out=t["b_out"], theta=t["theta"])


@pytest.mark.parametrize("case", list(BAD_CALLS))
@pytest.mark.parametrize("name", BACKENDS)
def test_malformed_calls_are_refused_alike(name, case):
    call, exc, message = BAD_CALLS[case]
    with pytest.raises(exc, match=message):
        call(backend(name))
