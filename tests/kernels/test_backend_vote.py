"""BinSGDM's worker math (``vote_threshold``, spec §5) of every fast backend against the reference.

The new momenta ``m_out, b_out`` and the vote probability ``theta`` must be bitwise the
reference's torch operations (NaN where the reference has NaN), over values spanning eleven
orders of magnitude, exact zeros (the ``0/0`` of ``eps = 0``) and non-finite inputs, at every
Triton tiling. The Triton backend runs under the interpreter on CPU (see tests/kernels/backends.py).
"""

from __future__ import annotations

import functools

import pytest
import torch

from hf_onebit.kernels import reference as ref
from tests.kernels.backends import BIG, BLOCKS, ON_DEVICE, assert_bitwise_equal, per_backend, through_device

VOTE_CASES = per_backend(
    "numel, beta, eps",
    cpu=[(numel, beta, eps) for numel in (0, 1, 7, 1000, BIG) for beta in (0.9, 0.5) for eps in (1e-8, 0.0)],
    triton=[(block, numel, beta, eps) for block in BLOCKS for numel in (0, 1, 7, 1000)
            for beta in (0.9, 0.5) for eps in (1e-8, 0.0)] + [(4096, BIG, 0.9, 1e-8), (4096, BIG, 0.9, 0.0)],
)


def vote_threshold(backend):
    """``backend``'s ``vote_threshold`` with its tuning (Triton's ``block``), on the GPU if asked."""
    fn = backend.module.vote_threshold
    if backend.name == "triton":
        fn = functools.partial(fn, **backend.kw)
        if ON_DEVICE:
            fn = through_device(fn)
    return fn


def make_state(numel: int, seed: int):
    """``m, b, g`` as training meets them: ``|m| <= b``, magnitudes 1e-8 .. 1e2, zeros, non-finites."""
    gen = torch.Generator().manual_seed(seed)

    def wide():
        return torch.randn(numel, generator=gen) * 10.0 ** torch.randint(-8, 3, (numel,), generator=gen).float()

    m, g = wide(), wide()
    b = m.abs() * (1 + torch.rand(numel, generator=gen) * 2)
    for t, k in ((m, 10), (b, 10), (g, 5)):  # coordinates that never had a gradient: 0/0 when eps == 0
        t[:k] = 0.0
    specials = ((g, 20, float("inf")), (g, 21, float("nan")), (m, 22, float("nan")), (b, 23, float("inf")),
                (g, 24, float("-inf")), (g, 25, -0.0))
    for t, i, v in specials:
        if i < numel:
            t[i] = v
    return m, b, g


@pytest.mark.parametrize(*VOTE_CASES)
def test_vote_threshold_is_bitwise_the_reference(backend, numel, beta, eps):
    m, b, g = make_state(numel, seed=numel)
    want = [torch.empty(numel) for _ in range(3)]
    ref.vote_threshold(m, b, g, beta=beta, eps=eps, m_out=want[0], b_out=want[1], theta=want[2])
    got = [torch.full((numel,), 12345.0) for _ in range(3)]  # garbage: every element must be written
    inputs = [t.clone() for t in (m, b, g)]
    vote_threshold(backend)(m, b, g, beta=beta, eps=eps, m_out=got[0], b_out=got[1], theta=got[2])
    for name, a, w in zip(("m_out", "b_out", "theta"), got, want):
        assert_bitwise_equal(a, w, name)
    for before, after in zip(inputs, (m, b, g)):
        assert_bitwise_equal(after, before, "an input was written")
    if numel >= 1000:  # the special values reached the outputs, and eps == 0 turned 0/0 into z = 0
        assert torch.isinf(got[1]).any() and torch.isnan(got[0]).any()
        assert bool(torch.isnan(got[2]).any()) == (eps != 0)
        if eps == 0:  # m = b = g = 0 in the first five coordinates: z = 0, a fair coin
            assert torch.equal(got[2][:5], torch.full((5,), 0.5))


@pytest.mark.parametrize(*per_backend("block", cpu=[(None,)], triton=[(64, 64)]))
def test_vote_threshold_writes_in_place_over_its_inputs(backend, block):
    """The optimizer may pass one buffer as input and output (``m_out`` over ``m``): elementwise,
    so the result is that of separate buffers."""
    m, b, g = make_state(300, seed=7)
    want = [torch.empty(300) for _ in range(3)]
    ref.vote_threshold(m, b, g, beta=0.9, eps=1e-8, m_out=want[0], b_out=want[1], theta=want[2])
    m2, b2, theta = m.clone(), b.clone(), torch.empty(300)
    vote_threshold(backend)(m2, b2, g, beta=0.9, eps=1e-8, m_out=m2, b_out=b2, theta=theta)
    for name, a, w in zip(("m_out", "b_out", "theta"), (m2, b2, theta), want):
        assert_bitwise_equal(a, w, name)


DRAW_CASES = per_backend(
    "seed, stream, step",
    cpu=[(0, 0, 1), (2**64 - 1, 2**32 + 3, 10**6), (123456789, 1, 7)],
    triton=[(rows, seed, stream, step) for rows in (1, 2, 128)
            for seed, stream, step in ((0, 0, 1), (2**64 - 1, 2**32 + 3, 10**6))],
)


@pytest.mark.parametrize(*DRAW_CASES)
def test_bucket_draws_are_numpys_philox_per_parameter(backend, seed, stream, step):
    """BinSGDM draws a whole bucket in one call (``vote_uniform``): each parameter's stretch must
    be bitwise what a fresh numpy Philox generator of its counter draws (the reference, and
    ``VoteStream.uniform_`` one parameter at a time), for stretches of every length modulo 8 (a
    Philox block gives 8 floats), empty ones included; nothing outside the stretches is written."""
    import numpy as np

    from hf_onebit.optim.vote_streams import VoteStream

    sizes = [0, 1, 7, 8, 9, 15, 16, 17, 1000, 3]
    indices = [5, 0, 2**40, 7, 1, 2, 3, 4, 9, 6]
    offsets = [3] + [3 + int(s) for s in np.cumsum(sizes)]  # starting at 3: a prefix nobody owns
    want = torch.full((offsets[-1] + 2,), -1.0)
    ref.vote_uniform(want, ref.vote_uniform_table(offsets, indices, "cpu"), seed=seed, stream=stream, step=step)
    one_by_one = VoteStream(seed, stream)
    for i, index in enumerate(indices):
        alone = one_by_one.uniform_(torch.empty(sizes[i]), step, index)
        assert_bitwise_equal(want[offsets[i]:offsets[i + 1]], alone, f"reference, parameter {i}")
    module = backend.module
    fn = module.vote_uniform
    if backend.name == "triton":
        fn = functools.partial(fn, rows=backend.kw["block"])
    got = torch.full_like(want, -1.0)
    if backend.name == "triton" and ON_DEVICE:
        there = got.cuda()
        fn(there, module.vote_uniform_table(offsets, indices, "cuda"), seed=seed, stream=stream, step=step)
        got = there.cpu()
    else:
        fn(got, module.vote_uniform_table(offsets, indices, "cpu"), seed=seed, stream=stream, step=step)
    assert_bitwise_equal(got, want, "draws")
    assert bool((got[3:-2] >= 0).all() and (got[3:-2] < 1).all())
    assert got[:3].eq(-1).all() and got[-2:].eq(-1).all()
